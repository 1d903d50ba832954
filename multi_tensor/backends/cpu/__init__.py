"""The native CPU backend: C++ kernels (SIMD + at::parallel_for) for every multi-tensor op.

The extension is built three times from ``csrc/cpu`` (``multi_tensor._C_avx512``, ``_C_avx2``,
``_C_default``); at import this module loads the best one that
``torch.backends.cpu.get_cpu_capability()`` allows (so ``ATEN_CPU_CAPABILITY=avx2`` or
``=default`` also selects ours), falling back down the list, and registers it for device type
``cpu`` above the reference backend. Results are bitwise identical to the reference backend
(multi_tensor/rules.py gives the operation order both follow).

A package installed without prebuilt extensions (plain ``pip install .``) compiles the best one on
first import into a cache (:mod:`multi_tensor.build`; ``FUSED_OPTIM_NO_JIT=1`` turns that off).
If no extension loads, a single warning says why and how to build it, nothing is registered and
the reference backend runs everything. ``MULTI_TENSOR_DISABLE_NATIVE=1`` skips loading silently.

Attributes: ``loaded_module`` (the extension module or None), ``load_error`` (why not, or None),
``capability`` ("AVX512", "AVX2", "DEFAULT" or None), ``BACKEND`` (the registered Backend).
"""
from __future__ import annotations

import importlib
import os
import warnings
from typing import Optional

import torch

from ... import build, rules, schema, tensor_facts
from .. import reference
from ..contract import Backend, Bucket
from ..registry import register_backend

BUILD_COMMAND = "python -m multi_tensor.build (or pip install --no-build-isolation .)"

# Best first; each entry: (module suffix, capability name, capabilities that allow it).
_CANDIDATES = (
    ("_C_avx512", "AVX512", ("AVX512",)),
    ("_C_avx2", "AVX2", ("AVX512", "AVX2")),
    ("_C_default", "DEFAULT", ("AVX512", "AVX2", "DEFAULT")),
)

loaded_module = None
load_error: Optional[str] = None
capability: Optional[str] = None
BACKEND: Optional[Backend] = None
_warned = False


def _cpu_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability()).upper()
    except Exception:  # pragma: no cover - very old torch
        return "DEFAULT"


def _layout_error(mod) -> Optional[str]:
    """Why ``mod`` cannot run this rules.py's scalars (built from an older StepScalars), or None."""
    fields = tuple(getattr(mod, "step_scalar_fields", ()))
    if fields == rules.SCALAR_FIELDS:
        return None
    return (f"built for the StepScalars fields {fields}, not multi_tensor/rules.py's "
            f"{rules.SCALAR_FIELDS} (a stale build; rebuild it: python setup.py build_ext "
            f"--inplace, or pip install --no-build-isolation .)")


def _load():
    """The best allowed extension module: prebuilt (installed with the package), else built on
    first use into the cache (:mod:`multi_tensor.build`). Returns (module, capability, error)."""
    cpu_cap = _cpu_capability()
    allowed = [(suffix, cap) for suffix, cap, allowed_by in _CANDIDATES if cpu_cap in allowed_by]
    errors = []
    for suffix, cap in allowed:
        try:
            mod = importlib.import_module(f"multi_tensor.{suffix}")
        except ModuleNotFoundError:
            continue  # not built ahead of time
        except Exception as exc:  # an ABI mismatch surfacing as ImportError/OSError etc.
            errors.append(f"multi_tensor.{suffix}: {type(exc).__name__}: {exc}")
            continue
        stale = _layout_error(mod)
        if stale is None:
            return mod, cap, None
        errors.append(f"multi_tensor.{suffix}: {stale}")
    if any("stale build" in e for e in errors):
        # a first-use build of the same module name cannot be loaded into this process any more
        return None, None, "; ".join(errors)
    if not allowed:
        return None, None, f"no extension module is usable for CPU capability {cpu_cap}"
    suffix, cap = allowed[0]
    if os.environ.get("FUSED_OPTIM_NO_JIT", "0") not in ("", "0"):
        errors.append(f"multi_tensor.{suffix} is not built and FUSED_OPTIM_NO_JIT is set")
        return None, None, "; ".join(errors)
    isa = suffix[len("_C_"):]
    try:
        mod = build.load(isa, build.build(isa))
        stale = _layout_error(mod)
        if stale is None:
            return mod, cap, None
        errors.append(f"first-use build of multi_tensor.{suffix}: {stale}")
        return None, None, "; ".join(errors)
    except Exception as exc:  # BuildError, or a built module that does not load
        errors.append(f"first-use build of multi_tensor.{suffix}: {type(exc).__name__}: {exc}")
        return None, None, "; ".join(errors)


def _warn_once(reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        "multi_tensor: the native CPU extension did not load, so every multi-tensor op runs on the "
        f"slower pure-PyTorch reference backend. Reason: {reason}. Build it with: {BUILD_COMMAND}. "
        "Set MULTI_TENSOR_DISABLE_NATIVE=1 to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )


def _make_backend(mod) -> Backend:
    remainders = bool(getattr(mod, "param_remainders", False))

    class CpuBucket(mod.AdamBucket, Bucket):
        """The extension's ``AdamBucket`` (bind and run in C++) with the contract's defaults."""
        __slots__ = ()

    def prepare(op, lists, chunk_size, once=False):
        if lists.has_remainder and not remainders:
            # an extension built before master remainders: the reference runs those buckets
            return reference.prepare(op, lists, chunk_size, once)
        return CpuBucket(lists, chunk_size)

    def scale(chunk_size, noop_flag, tensor_lists, scale):
        if not mod.scale(chunk_size, noop_flag, tensor_lists, scale):
            # a dtype the kernel does not handle (e.g. float8): the reference does it
            reference.scale(chunk_size, noop_flag, tensor_lists, scale)

    def l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
        out = mod.l2norm(chunk_size, noop_flag, tensor_lists, per_tensor)
        if out is None:
            return reference.l2norm(chunk_size, noop_flag, tensor_lists, per_tensor)
        return out

    return Backend(
        name="native_cpu",
        device_types=("cpu",),
        priority=10,
        ops={"scale": scale, "l2norm": l2norm},
        prepare=prepare,
        adam_ops=schema.ADAM_OPS,
        description=f"C++ {mod.capability} SIMD kernels + at::parallel_for "
                    f"(multi_tensor.{mod.__name__.rsplit('.', 1)[-1]})",
    )


def _init() -> None:
    global loaded_module, load_error, capability, BACKEND
    if os.environ.get("MULTI_TENSOR_DISABLE_NATIVE", "0") not in ("", "0"):
        load_error = "disabled by MULTI_TENSOR_DISABLE_NATIVE"
        return
    mod, cap, err = _load()
    if mod is None:
        load_error = err
        _warn_once(err)
        return
    loaded_module, capability = mod, cap
    tensor_facts.use_native(mod)
    BACKEND = register_backend(_make_backend(mod))


_init()
