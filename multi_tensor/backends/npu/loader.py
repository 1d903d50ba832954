r"""Loading CANN's fused EMA-Adam operator for the NPU backend, and deciding whether it can serve.

:func:`load_device_op` returns the operator as a Python callable (MindSpeed's binding, else this
package's, ``csrc/npu/fused_ema_adam.cpp``, compiled on first use by
:mod:`multi_tensor.backends.npu.builder`). :class:`DeviceOp` holds it for one backend and answers,
per device, "the callable" or "``None`` and why": the chip must be one CANN ships the operator
for, the operator must load, and a one-element call of a loaded operator (the probe) must run
(a callable given by the caller, the CPU stand-ins', is used as given). Every failure on that
way is an answer, never an exception, so the bucket takes the exact path for that step (the NPU
backend logs each reason once at debug level) instead of raising out of ``step()``.

Chips (:data:`SUPPORTED_CHIPS`). ops-nn's ``optim/apply_fused_ema_adam/op_host/
apply_fused_ema_adam_def.cpp`` registers the AI Core kernel for the SoC families ``ascend910b``
(Atlas A2), ``ascend910_93`` (Atlas A3) and ``ascend950`` (``this->AICore().AddConfig(...)``).
The names ``torch_npu.npu.get_device_name()`` returns for them (``aclrtGetSocName``) are listed in
torch_npu's ``torch_npu/csrc/core/npu/NpuVariables.cpp`` (``socVersionMap``: ``Ascend910B1`` ..
``Ascend910B4``, ``Ascend910B2C``, ``Ascend910B4-1``, ``Ascend910_9391`` .. ``Ascend910_9363``) and,
for the 950 family, in CANN's SoC tables (``Ascend910_950x/y/z``, ``Ascend910_957x``,
``Ascend910_958x``, ``Ascend910_959x``, grouped there as ``ascend910_95``). The bare name
``Ascend910B`` is the first-generation Ascend 910 (CANN maps ``ascend910b`` to the ``ascend910``
family), which has no such kernel: it is not matched.

MindSpeed. With ``MULTI_TENSOR_NPU_BINDING=auto`` (the default) MindSpeed's op is used when
MindSpeed imports; if its op builder fails (MindSpeed compiles its binding on first use), the
built-in binding is tried (warned once). ``mindspeed`` insists on MindSpeed (its errors raise into
:class:`DeviceOp`, which reports them), ``builtin`` skips it.
"""
from __future__ import annotations

import os
import re
import threading
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch

SUPPORTED_CHIPS = re.compile(
    r"^(Ascend910B[1-4]"        # Atlas A2: Ascend910B1..B4, Ascend910B2C, Ascend910B4-1
    r"|Ascend910_93\w*"         # Atlas A3: Ascend910_9391, _9392, _9381, _9382, _9372, _9362, _9363
    r"|Ascend910_95\w*"         # Ascend 950: Ascend910_950z, _9579, _957b, _9581, _9589, _9599, ...
    r"|Ascend950\w*)")
"""``torch_npu.npu.get_device_name()`` of chips with ``aclnnApplyFusedEmaAdam`` (module docstring)."""

SUPPORTED_CHIP_PREFIXES = ("Ascend910B1", "Ascend910B2", "Ascend910B3", "Ascend910B4",
                           "Ascend910_93", "Ascend910_95", "Ascend950")
"""The same set as name prefixes (``str.startswith``): :data:`SUPPORTED_CHIPS` is what is matched."""

_warned: set = set()


def chip_has_operator(name: str) -> bool:
    """Whether a chip of this SoC name has CANN's fused EMA-Adam kernel."""
    return SUPPORTED_CHIPS.match(str(name)) is not None


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _ensure_torch_npu() -> None:
    import torch_npu  # noqa: F401  (only ever for tensors on an npu device)


def _device_name(device: torch.device) -> str:
    import torch_npu

    index = device.index if device.index is not None else torch_npu.npu.current_device()
    return str(torch_npu.npu.get_device_name(index))


def _builtin_op() -> Tuple[Callable, str]:
    from . import builder as npu_builder

    module = npu_builder.FusedEmaAdamBuilder().load()
    return module.npu_apply_fused_ema_adamw, f"multi_tensor ({npu_builder.FusedEmaAdamBuilder.NAME})"


def load_device_op() -> Tuple[Callable, str]:
    """CANN's fused EMA-Adam operator as a Python callable, and where it came from.

    ``fn(grad, var, m, v, s, step, lr, ema_decay, beta1, beta2, eps, mode, bias_correction,
    weight_decay) -> (var, m, v, s)``, in place (MindSpeed's signature). MindSpeed's op when
    MindSpeed is installed and its builder succeeds (``MULTI_TENSOR_NPU_BINDING=auto``, the
    default, or ``mindspeed``), else this package's binding, compiled on first use (``builtin``).
    """
    _ensure_torch_npu()
    which = os.environ.get("MULTI_TENSOR_NPU_BINDING", "auto") or "auto"
    if which not in ("auto", "mindspeed", "builtin"):
        raise ValueError(f"MULTI_TENSOR_NPU_BINDING={which!r}: choose auto, mindspeed or builtin")
    if which in ("auto", "mindspeed"):
        try:
            import importlib

            module = importlib.import_module("mindspeed.ops.npu_apply_fused_ema_adamw")
        except Exception as exc:  # importing it registers torch ops and may import torchair
            if which == "mindspeed":
                raise
            if not isinstance(exc, ImportError):
                _warn_once("mindspeed-import", f"multi_tensor NPU backend: importing MindSpeed's "
                           f"npu_apply_fused_ema_adamw failed ({type(exc).__name__}: {exc}); "
                           f"trying this package's binding")
        else:
            builder = getattr(module, "fused_ema_adamw_op_builder", None)
            try:
                if builder is not None:  # MindSpeed compiles on first call: do it now, to fail here
                    builder.load()
                return module.npu_apply_fused_ema_adamw, "mindspeed"
            except Exception as exc:
                if which == "mindspeed":
                    raise
                _warn_once("mindspeed-build", f"multi_tensor NPU backend: MindSpeed's "
                           f"npu_apply_fused_ema_adamw did not build ({type(exc).__name__}: "
                           f"{exc}); trying this package's binding")
    return _builtin_op()


def _synchronize(device: torch.device) -> None:
    if device.type == "npu":  # a launch fails asynchronously: its error surfaces at a sync
        import torch_npu

        torch_npu.npu.synchronize()


def probe(fn: Callable, device: torch.device) -> None:
    """Run ``fn`` once on one-element fp32 tensors on ``device``; raise if it fails.

    ``grad = 1, var = 1, m = v = 0, s = 1``, step 1, lr 0.5, bias correction off, no decay: the
    operator must return finite values with ``var`` moved down (any correct Adam step does).
    """
    def one(x):
        return torch.full((1,), x, dtype=torch.float32, device=device)

    grad, var, m, v, s = one(1.0), one(1.0), one(0.0), one(0.0), one(1.0)
    step = torch.ones(1, dtype=torch.int64, device=device)
    result = fn(grad, var, m, v, s, step, 0.5, 0.5, 0.9, 0.999, 1e-8, 1, False, 0.0)
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor):
        var = result[0]
    _synchronize(device)
    got = float(var.detach().reshape(-1)[0].cpu())
    if not got < 1.0 or got != got:
        raise RuntimeError(f"a one-element probe returned var = {got!r} (expected < 1)")


class DeviceOp:
    """The device operator of one backend, loaded and probed on first use per device.

    ``fn``: a given callable (the CPU stand-in's, used as given), else :func:`load_device_op` on
    first use, probed once per device (:func:`probe`). :meth:`get` returns ``(fn, None)`` or
    ``(None, why)``; it never raises.
    """

    def __init__(self, fn: Optional[Callable] = None):
        self._fn = fn
        self.source = "given" if fn is not None else None
        self._error: Optional[str] = None
        self._chips: Dict[Optional[int], Optional[str]] = {}
        self._probed: Dict[Tuple[str, Optional[int]], Optional[str]] = {}
        self._lock = threading.Lock()

    def _chip_reason(self, device: torch.device) -> Optional[str]:
        if device.index not in self._chips:
            try:
                name = _device_name(device)
            except Exception as exc:
                self._chips[device.index] = f"the chip name is unknown ({type(exc).__name__}: {exc})"
            else:
                self._chips[device.index] = (
                    None if chip_has_operator(name) else
                    f"{name} has no aclnnApplyFusedEmaAdam (Atlas A2/A3 and Ascend 950 only)")
        return self._chips[device.index]

    def get(self, device: torch.device) -> Tuple[Optional[Callable], Optional[str]]:
        with self._lock:
            if device.type == "npu":
                why = self._chip_reason(device)
                if why is not None:
                    return None, why
            if self._fn is None and self._error is None:
                try:
                    self._fn, self.source = load_device_op()
                except Exception as exc:  # no MindSpeed and the binding did not build, ...
                    self._error = f"{type(exc).__name__}: {exc}"
            if self._fn is None:
                return None, f"the CANN operator did not load ({self._error})"
            key = (device.type, device.index)
            if self.source == "given":  # a caller's callable (the stand-ins): used as given
                return self._fn, None
            if key not in self._probed:
                try:
                    probe(self._fn, device)
                    self._probed[key] = None
                except Exception as exc:  # a missing symbol, a failing launch, wrong results
                    self._probed[key] = (f"the CANN operator ({self.source}) failed its probe "
                                         f"call ({type(exc).__name__}: {exc})")
            why = self._probed[key]
            return (None, why) if why is not None else (self._fn, None)
