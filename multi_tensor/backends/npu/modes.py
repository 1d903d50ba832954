"""The NPU backend's settings: which path a bucket runs (``MULTI_TENSOR_NPU_OP``), whether the
exact path trusts the device's sqrt and division, whether grads are kept flat, and the operator's
folded per-step arguments. Process-wide, read at each step.

The modes: ``cann`` (the default: CANN's fused EMA-Adam operator with ``ema_decay=1``, then one
``lerp_`` for the unbiased EMA), ``cann_literal`` (the operator's own biased EMA, one launch
less; its fp32 EMA of a constant drifts past the package's 1e-5 bound, docs/npu.md), ``exact``
(the reference's operation order, bitwise; ``torch`` is its old name, still accepted). Where the
operator cannot serve a bucket, the bucket runs the exact path and says why
(``FlatAdamBucket.last_reason``, :func:`fallback_reasons`, ``python -m multi_tensor.env``), logged
once per reason at debug level."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Dict, Iterator, List

import torch

from ...rules import StepScalars
from . import fp32_exact
from . import ops as npu_ops

OP_MODES = ("cann", "cann_literal", "exact")
DEFAULT_MODE = "cann"
MODE_ALIASES = {"torch": "exact"}
"""Other names of a mode (``torch`` for ``exact``: scripts that set it keep working)."""
CANN_OPS = ("fused_ema_adamw",)
CANN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLAT_GRADS_ENV = "MULTI_TENSOR_NPU_FLAT_GRADS"
"""``0``: an optimizer's NPU buckets leave ``.grad`` alone (gathered per step, ``zero_grad`` as
torch's); ``1`` or unset (the default): grads become views of one flat buffer per bucket."""

IEEE_ENV = "MULTI_TENSOR_NPU_IEEE_SQRT_DIV"
"""``1``: the exact path takes the device's own fp32 sqrt and division (set it only where
``tools/npu_check.py`` reports both correctly rounded on this CANN version); ``0`` or unset (the
default): both built correctly rounded from fp32 ops (:mod:`fp32_exact`)."""

_mode_lock = threading.Lock()
_mode: List[str] = [os.environ.get("MULTI_TENSOR_NPU_OP", "") or DEFAULT_MODE]
_fallbacks: Dict[str, None] = {}  # the reasons buckets fell back to the exact path, in order
log = logging.getLogger("multi_tensor.backends.npu")


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "") or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: choose 1 or 0")
    return value == "1"


_device_sqrt_div: List[bool] = [_env_flag(IEEE_ENV)]


def device_sqrt_div() -> bool:
    """Whether the exact path uses the device's own fp32 sqrt and division (:data:`IEEE_ENV`)."""
    return _device_sqrt_div[0]


def set_device_sqrt_div(trusted: bool) -> None:
    """Use the device's own fp32 sqrt and division on the exact path (``trusted``), or the
    correctly rounded ones built from fp32 ops (the default). Only where ``tools/npu_check.py``
    has shown the device's correctly rounded: otherwise the path is no longer bitwise."""
    with _mode_lock:
        _device_sqrt_div[0] = bool(trusted)


def _sqrt_div() -> tuple:
    """The exact path's sqrt and division (lists in, lists out)."""
    if _device_sqrt_div[0]:
        return npu_ops.device_sqrt, npu_ops.device_div
    return fp32_exact.sqrt, fp32_exact.div


def _check_mode(mode: str) -> str:
    mode = MODE_ALIASES.get(mode, mode)
    if mode not in OP_MODES:
        raise ValueError(f"multi_tensor NPU backend: unknown op mode {mode!r} "
                         f"(MULTI_TENSOR_NPU_OP or set_op_mode); choose one of {OP_MODES}")
    return mode


def get_op_mode() -> str:
    """The current path: ``"cann"`` (the default), ``"cann_literal"`` or ``"exact"``."""
    return _check_mode(_mode[0])


def set_op_mode(mode: str) -> None:
    """Choose the path for every NPU bucket from the next step on (see the module docstring)."""
    with _mode_lock:
        _mode[0] = _check_mode(mode)


@contextlib.contextmanager
def op_mode(mode: str) -> Iterator[None]:
    """Within the block, use ``mode`` (``set_op_mode``), then restore the previous one."""
    with _mode_lock:
        previous = _mode[0]
        _mode[0] = _check_mode(mode)
    try:
        yield
    finally:
        with _mode_lock:
            _mode[0] = previous


def flat_grads_enabled() -> bool:
    """Whether optimizer buckets keep their grads in flat buffers (:data:`FLAT_GRADS_ENV`)."""
    value = os.environ.get(FLAT_GRADS_ENV, "") or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{FLAT_GRADS_ENV}={value!r}: choose 1 (grads as views of one flat "
                         f"buffer per bucket, the default) or 0 (grads left as they are)")
    return value == "1"


def note_fallback(reason: str) -> None:
    """A bucket runs the exact path because the operator cannot serve it (``reason``): kept for
    :func:`fallback_reasons` and logged once per reason at debug level (a fallback is the
    documented behaviour, not a fault)."""
    if reason not in _fallbacks:
        _fallbacks[reason] = None
        log.debug("multi_tensor NPU backend: the exact path runs instead of CANN's operator: %s",
                  reason)


def fallback_reasons() -> List[str]:
    """Why buckets of this process ran the exact path in a ``cann`` mode, each reason once."""
    return list(_fallbacks)


# --- the per-step scalars, folded into the operator's arguments --------------------------------

def fold_scalars(c: StepScalars) -> Dict[str, float]:
    """The operator's ``lr, eps, weight_decay, mode`` for one step, bias correction folded in.

    The operator is called with ``bias_correction=False`` (so its step is irrelevant) and::

        lr' = step_size / isb2 = lr * sqrt(bc2) / bc1      eps' = eps / isb2 = eps * sqrt(bc2)
        weight_decay' = lr_wd / lr'   (AdamW)              weight_decay' = l2_wd   (Adam, L2)

    so that ``var - lr' * (m / (sqrt(v) + eps') + wd' * var)`` is, in exact arithmetic, the
    reference's ``var - lr_wd * var - step_size * m / (sqrt(v) * isb2 + eps)``.
    """
    lr = c.step_size / c.isb2
    if c.l2:
        wd, mode = c.l2_wd, 0
    else:
        wd, mode = (c.lr_wd / lr if c.decoupled and lr != 0.0 else 0.0), 1
    return {"lr": float(lr), "eps": float(c.eps / c.isb2), "weight_decay": float(wd),
            "mode": int(mode)}
