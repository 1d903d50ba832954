"""The Triton backend: every multi-tensor op on CUDA devices (ROCm torch reports "cuda" too).

Registered at import for device type ``cuda`` as backend ``"triton"`` (priority 20, above the
reference) **without importing triton**: the kernels (:mod:`multi_tensor.backends.triton.kernels`,
launched by :mod:`multi_tensor.backends.triton.host`) are imported when the first CUDA bucket is
prepared or the first CUDA op is called. When triton
cannot be imported, one ``RuntimeWarning`` says why and every op of this backend runs on the
reference backend instead (the results are the same bits, slower, with host syncs).

What runs where:

* Adam family (``fused_ema_adamw``, ``adam``, ``radam``, ``radam_ema``, with or without fp32
  masters): params fp32/fp16/bf16/fp64, grads fp32/fp16/bf16 (fp64 for fp64), the EMA in the
  state dtype or bf16 (its storage dtype is a constexpr of its own), one launch per bucket
  (plus one scan launch when ``check_finite``). The same bits as the reference backend
  (:mod:`multi_tensor.rules`' operation order, IEEE division and sqrt, no FMA contraction,
  bf16/fp16 rounded to nearest even once). Master remainders (bf16 params): the kernel joins
  each param's bits and remainder into the fp32 master and splits the result back
  (:func:`multi_tensor.rules.join_master` / ``split_master``, integer operations), in the
  same pass.
* ``scale``: one launch per (src dtype, dst dtype) pair present; the same bits as the reference.
* ``l2norm``: fixed 4096-element blocks summed in fp64, then per tensor and in total in a fixed
  order (one launch per input dtype + two small ones): deterministic, independent of chunk size,
  equal to the reference's fp64 sums up to their rounding order (the fp32 results agree except
  in the rare case of an fp64 sum within an ulp of an fp32 rounding boundary).

Prepared buckets (the optimizers' hot path) also offer ``run_device_step``: the step counter,
the skip flag (GradScaler's ``found_inf``) and the per-step scalars stay on the device, so an
optimizer step needs no host sync and can be captured in a CUDA graph
(see :class:`multi_tensor.backends.triton.host.AdamBucket`).

Attributes: ``load_error`` (why triton could not be imported, or None), ``BACKEND``.
"""
from __future__ import annotations

import threading
import warnings
from typing import Optional

from ... import schema
from .. import reference
from ..contract import Backend
from ..registry import PreparedOp, register_backend

TRITON_VERSION = "3.6.0"  # what tools/bootstrap.sh --test installs and the tests were run with
INSTALL_HINT = f"pip install triton=={TRITON_VERSION}"

load_error: Optional[str] = None
_kernels = None
_lock = threading.Lock()
_warned = False


def host_module():
    """The host module of the kernels (imports triton on first use), or None when triton is
    unavailable. (Not named ``kernels``: importing the submodule of that name sets the package's
    attribute ``kernels`` to it.)"""
    global _kernels, load_error
    if _kernels is not None or load_error is not None:
        return _kernels
    with _lock:
        if _kernels is None and load_error is None:
            try:
                from . import host as triton_host
            except Exception as exc:  # ImportError, or a broken triton install
                load_error = f"{type(exc).__name__}: {exc}"
            else:
                _kernels = triton_host
    if _kernels is None:
        _warn_once()
    return _kernels


def _warn_once() -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        "multi_tensor: triton could not be imported, so CUDA multi-tensor ops run on the slower "
        f"pure-PyTorch reference backend (same results, host syncs). Reason: {load_error}. "
        f"Install it with: {INSTALL_HINT}",
        RuntimeWarning, stacklevel=4)


def scale(chunk_size, noop_flag, tensor_lists, scale_factor):
    k = host_module()
    if k is None or not k.scale(chunk_size, noop_flag, tensor_lists, scale_factor):
        reference.scale(chunk_size, noop_flag, tensor_lists, scale_factor)


def l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    k = host_module()
    out = None if k is None else k.l2norm(chunk_size, noop_flag, tensor_lists, per_tensor)
    if out is None:
        return reference.l2norm(chunk_size, noop_flag, tensor_lists, per_tensor)
    return out


def prepare(op: str, lists, chunk_size: int, once: bool = False):
    """A bucket bound to its state lists: the Triton bucket, or the reference without triton."""
    k = host_module()
    if k is None:
        return PreparedOp(reference.adam_family, lists, chunk_size)
    _warn_no_native_once()
    return k.AdamBucket(op, lists, chunk_size)


_warned_native = False


def _warn_no_native_once() -> None:
    """A bucket's per-step host work (collecting and checking every grad's and state tensor's
    identity and address) runs in the native CPU extension; without it the Python twins of
    :mod:`multi_tensor.tensor_facts` do it, several times slower for thousands of tensors:
    said once, with how to build it."""
    global _warned_native
    from ... import tensor_facts
    from .. import cpu as native_cpu
    if _warned_native or tensor_facts.native_module() is not None:
        return
    _warned_native = True
    warnings.warn(
        "multi_tensor: the native CPU extension is not loaded, so the Triton backend's per-step "
        "host work (checking every grad and state tensor) runs in Python, several times slower "
        f"for thousands of tensors (reason: {native_cpu.load_error}). Build it with: "
        f"{native_cpu.BUILD_COMMAND}",
        RuntimeWarning, stacklevel=4)


BACKEND = register_backend(Backend(
    name="triton",
    device_types=("cuda",),
    priority=20,
    ops={"scale": scale, "l2norm": l2norm},
    prepare=prepare,
    adam_ops=schema.ADAM_OPS,
    description="Triton JIT kernels, one launch per bucket (triton imported on first CUDA use)",
))
