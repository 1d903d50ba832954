"""The reference backend: every op in plain PyTorch tensor ops, on any device.

It defines the exact arithmetic every other backend reproduces bit for bit. Math runs in fp32
("opmath"; fp64 for fp64 tensors): low-precision tensors are upcast, every intermediate below is
one rounded fp32 operation in exactly this order, and each result is rounded once to its storage
dtype (round-to-nearest-even). Scalars are computed in double and rounded to opmath once.

AdamW + EMA, one element (seed formula, SPEC section 2)::

    g  = grad * inv_scale                          # only with a grad_scale; inv_scale = 1 / scale
    g  = -g                                        # only with maximize
    g  = g + weight_decay * p                      # mode 0 (Adam, L2) and weight_decay != 0
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + ((1 - beta2) * g) * g
    u  = (m / bc1) / (sqrt(v / bc2) + eps)         # bc = 1 - beta**step, or 1 without correction
    u  = u + weight_decay * p                      # mode 1 (AdamW) and weight_decay != 0 (old p)
    p  = p - lr * u
    s  = ema_decay * s + (1 - ema_decay) * p       # the EMA takes the new, unrounded p

With master weights p is the fp32 master and the model param receives round(p). ``adam`` is the
same update without the EMA line.

These ops read ``noop_flag`` on the host (``.item()``): free on the CPU, one sync elsewhere.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from .. import validation
from .registry import ANY_DEVICE, Backend, register_backend

_foreach = torch


def _opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_opmath(tensors: List[torch.Tensor], dtype: torch.dtype) -> List[torch.Tensor]:
    """fp32 (or fp64) versions; tensors already in that dtype are returned as they are."""
    return [t if t.dtype == dtype else t.to(dtype) for t in tensors]


def _store(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    """Write results back, rounding once to each destination's dtype."""
    for d, s in zip(dst, src):
        if d is not s:
            d.copy_(s)


def _noop_is_set(noop_flag: Optional[torch.Tensor]) -> bool:
    return noop_flag is not None and noop_flag.numel() > 0 and bool(noop_flag.reshape(-1)[0].item() != 0)


def bias_corrections(beta1: float, beta2: float, step: int, bias_correction: bool):
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 - beta1 ** step, 1.0 - beta2 ** step


def any_nonfinite(tensors: List[torch.Tensor]) -> bool:
    return any(t.numel() and not bool(torch.isfinite(t).all()) for t in tensors)


def adam_family(op: str, chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float,
                beta1: float, beta2: float, eps: float, step: int, mode: int,
                bias_correction: bool, weight_decay: float, ema_decay: Optional[float], *,
                grad_scale: Optional[torch.Tensor] = None, maximize: bool = False,
                check_finite: bool = False) -> None:
    """Adam/AdamW with an optional EMA (``ema_decay`` None: no EMA list) on opmath copies."""
    del chunk_size  # the update is elementwise: chunking cannot change a result
    names = validation.check_adam_family_lists(op, tensor_lists)
    step = validation.check_step(op, step)
    if not tensor_lists[0] or _noop_is_set(noop_flag):
        return
    if check_finite and any_nonfinite(tensor_lists[0]):
        noop_flag.fill_(1)
        return
    has_master = names[-1] == "masters"
    has_ema = ema_decay is not None
    grads, params, exp_avgs, exp_avg_sqs = tensor_lists[:4]
    emas = tensor_lists[4] if has_ema else None
    weights = tensor_lists[-1] if has_master else params
    opmath = _opmath_dtype(weights[0].dtype)

    g = [t.to(opmath) for t in grads] if grads[0].dtype != opmath else list(grads)
    p = _as_opmath(weights, opmath)
    m = _as_opmath(exp_avgs, opmath)
    v = _as_opmath(exp_avg_sqs, opmath)

    if grad_scale is not None:
        inv_scale = grad_scale.to(device=p[0].device, dtype=opmath).reciprocal()
        g = _foreach._foreach_mul(g, inv_scale)
    if maximize:
        g = _foreach._foreach_neg(g)
    if mode == 0 and weight_decay != 0.0:
        g = _foreach._foreach_add(g, _foreach._foreach_mul(p, weight_decay))
    bc1, bc2 = bias_corrections(beta1, beta2, step, bias_correction)

    m_new = _foreach._foreach_add(_foreach._foreach_mul(m, beta1), _foreach._foreach_mul(g, 1.0 - beta1))
    v_new = _foreach._foreach_add(
        _foreach._foreach_mul(v, beta2),
        _foreach._foreach_mul(_foreach._foreach_mul(g, 1.0 - beta2), g),
    )
    denom = _foreach._foreach_add(_foreach._foreach_sqrt(_foreach._foreach_div(v_new, bc2)), eps)
    update = _foreach._foreach_div(_foreach._foreach_div(m_new, bc1), denom)
    if mode == 1 and weight_decay != 0.0:
        update = _foreach._foreach_add(update, _foreach._foreach_mul(p, weight_decay))
    p_new = _foreach._foreach_sub(p, _foreach._foreach_mul(update, lr))

    _store(exp_avgs, m_new)
    _store(exp_avg_sqs, v_new)
    if has_ema:
        s = _as_opmath(emas, opmath)
        s_new = _foreach._foreach_add(_foreach._foreach_mul(s, ema_decay),
                                      _foreach._foreach_mul(p_new, 1.0 - ema_decay))
        _store(emas, s_new)
    _store(weights, p_new)
    if has_master:
        _store(params, p_new)


def fused_ema_adamw(chunk_size, noop_flag, tensor_lists, lr, ema_decay, beta1, beta2, eps, step,
                    mode, bias_correction, weight_decay, *, grad_scale=None, maximize=False,
                    check_finite=False):
    """``multi_tensor_fused_ema_adamw`` (SPEC section 3) in tensor ops."""
    adam_family("fused_ema_adamw", chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step,
                mode, bias_correction, weight_decay, ema_decay, grad_scale=grad_scale,
                maximize=maximize, check_finite=check_finite)


def adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, mode, bias_correction,
         weight_decay, *, grad_scale=None, maximize=False, check_finite=False):
    """apex ``multi_tensor_adam``: ``[grads, params, exp_avgs, exp_avg_sqs(, masters)]``."""
    adam_family("adam", chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, mode,
                bias_correction, weight_decay, None, grad_scale=grad_scale, maximize=maximize,
                check_finite=check_finite)


def scale(chunk_size, noop_flag, tensor_lists, scale_factor):
    """apex ``multi_tensor_scale``: ``dst = src * scale``; sets ``noop_flag`` on a non-finite src.

    The product is formed in fp32 (fp64 for fp64 sources) and rounded once to dst's dtype.
    """
    del chunk_size
    op = "multi_tensor_scale"
    if len(tensor_lists) != 2:
        raise ValueError(f"{op}: tensor_lists must be [srcs, dsts], got {len(tensor_lists)} lists")
    validation.check_rows(op, tensor_lists, ("srcs", "dsts"), ref_list=0)
    srcs, dsts = tensor_lists
    if not srcs:
        return
    if any_nonfinite(srcs):
        noop_flag.fill_(1)
    for src, dst in zip(srcs, dsts):
        opmath = _opmath_dtype(src.dtype if src.dtype == torch.float64 else dst.dtype)
        dst.copy_(src.to(opmath) * scale_factor)


def l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """apex ``multi_tensor_l2norm``: ``(total_norm, per_tensor_norms)`` as fp32 tensors.

    Sums of squares accumulate in fp64, so the result does not depend on chunking or threads.
    Sets ``noop_flag`` if any input holds a non-finite value. ``per_tensor_norms`` is an empty
    tensor unless ``per_tensor``.
    """
    del chunk_size
    op = "multi_tensor_l2norm"
    if len(tensor_lists) != 1:
        raise ValueError(f"{op}: tensor_lists must be [tensors], got {len(tensor_lists)} lists")
    tensors = tensor_lists[0]
    validation.check_rows(op, tensor_lists, ("tensors",), ref_list=0)
    device = tensors[0].device if tensors else noop_flag.device
    if any_nonfinite(tensors):
        noop_flag.fill_(1)
    sq = [t.detach().to(torch.float64).square().sum() for t in tensors]
    per = torch.stack(sq) if sq else torch.zeros(0, dtype=torch.float64, device=device)
    total = per.sum().sqrt().to(torch.float32)
    per_norms = per.sqrt().to(torch.float32) if per_tensor else torch.zeros(0, device=device)
    return total, per_norms


REFERENCE = register_backend(Backend(
    name="reference",
    device_types=(ANY_DEVICE,),
    priority=0,
    ops={"fused_ema_adamw": fused_ema_adamw, "adam": adam, "scale": scale, "l2norm": l2norm},
    description="pure PyTorch tensor ops (any device)",
))
