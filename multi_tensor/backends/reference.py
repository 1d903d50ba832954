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
same update without the EMA line. ``radam`` (torch.optim.RAdam, optional EMA) is in :func:`radam`.

These ops read ``noop_flag`` on the host (``.item()``): free on the CPU, one sync elsewhere.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .. import validation
from .registry import ANY_DEVICE, Backend, register_backend

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


class _AdamFamilyCall:
    """The parts every adam-family op shares: checked lists, opmath copies, prepared grads.

    ``lists_key`` names the list forms (:data:`validation.ADAM_FAMILY_LIST_NAMES`). ``ready`` is
    False when the call must change nothing (empty lists, ``noop_flag`` set, or non-finite grads
    under ``check_finite``, which also sets ``noop_flag``). Otherwise ``g`` holds the grads in
    opmath, unscaled (``g * (1 / grad_scale)``) and negated under ``maximize``; ``p``, ``m``, ``v``
    are opmath versions of the weights (the masters when present), exp_avgs and exp_avg_sqs.
    """

    def __init__(self, lists_key: str, noop_flag, tensor_lists, step, has_ema: bool,
                 grad_scale: Optional[torch.Tensor], maximize: bool, check_finite: bool):
        names = validation.check_adam_family_lists(lists_key, tensor_lists)
        self.step = validation.check_step(lists_key, step)
        self.ready = False
        if not tensor_lists[0] or _noop_is_set(noop_flag):
            return
        if check_finite and any_nonfinite(tensor_lists[0]):
            noop_flag.fill_(1)
            return
        self.ready = True
        self.has_master = names[-1] == "masters"
        self.has_ema = has_ema
        grads, self.params, self.exp_avgs, self.exp_avg_sqs = tensor_lists[:4]
        self.emas = tensor_lists[4] if has_ema else None
        self.weights = tensor_lists[-1] if self.has_master else self.params
        opmath = self.opmath = _opmath_dtype(self.weights[0].dtype)

        g = [t.to(opmath) for t in grads] if grads[0].dtype != opmath else list(grads)
        self.p = _as_opmath(self.weights, opmath)
        self.m = _as_opmath(self.exp_avgs, opmath)
        self.v = _as_opmath(self.exp_avg_sqs, opmath)
        if grad_scale is not None:
            inv_scale = grad_scale.reshape(()).to(device=self.p[0].device, dtype=opmath).reciprocal()
            g = torch._foreach_mul(g, inv_scale)
        if maximize:
            g = torch._foreach_neg(g)
        self.g = g

    def finish(self, m_new, v_new, p_new, ema_decay: Optional[float]) -> None:
        """Store m, v, the EMA of ``p_new`` (if any), the weights and the rounded params."""
        _store(self.exp_avgs, m_new)
        _store(self.exp_avg_sqs, v_new)
        if self.has_ema:
            s = _as_opmath(self.emas, self.opmath)
            s_new = torch._foreach_add(torch._foreach_mul(s, ema_decay),
                                          torch._foreach_mul(p_new, 1.0 - ema_decay))
            _store(self.emas, s_new)
        _store(self.weights, p_new)
        if self.has_master:
            _store(self.params, p_new)


def adam_family(op: str, chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float,
                beta1: float, beta2: float, eps: float, step: int, mode: int,
                bias_correction: bool, weight_decay: float, ema_decay: Optional[float], *,
                grad_scale: Optional[torch.Tensor] = None, maximize: bool = False,
                check_finite: bool = False) -> None:
    """Adam/AdamW with an optional EMA (``ema_decay`` None: no EMA list) on opmath copies."""
    del chunk_size  # the update is elementwise: chunking cannot change a result
    call = _AdamFamilyCall(op, noop_flag, tensor_lists, step, ema_decay is not None, grad_scale,
                           maximize, check_finite)
    if not call.ready:
        return
    g, p, m, v = call.g, call.p, call.m, call.v
    if mode == 0 and weight_decay != 0.0:
        g = torch._foreach_add(g, torch._foreach_mul(p, weight_decay))
    bc1, bc2 = bias_corrections(beta1, beta2, call.step, bias_correction)

    m_new = torch._foreach_add(torch._foreach_mul(m, beta1), torch._foreach_mul(g, 1.0 - beta1))
    v_new = torch._foreach_add(
        torch._foreach_mul(v, beta2),
        torch._foreach_mul(torch._foreach_mul(g, 1.0 - beta2), g),
    )
    denom = torch._foreach_add(torch._foreach_sqrt(torch._foreach_div(v_new, bc2)), eps)
    update = torch._foreach_div(torch._foreach_div(m_new, bc1), denom)
    if mode == 1 and weight_decay != 0.0:
        update = torch._foreach_add(update, torch._foreach_mul(p, weight_decay))
    p_new = torch._foreach_sub(p, torch._foreach_mul(update, lr))
    call.finish(m_new, v_new, p_new, ema_decay)


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


def radam_scalars(beta1: float, beta2: float, step: int):
    """RAdam's per-step scalars, in double, with ``torch.optim.RAdam``'s exact expressions.

    Returns ``(bc1, bc2, rho_t, rect)``; ``rect`` is None when ``rho_t <= 5`` (un-rectified step).
    """
    step = float(step)  # torch evaluates these with the step as a Python float
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * (beta2 ** step) / bias_correction2
    if not rho_t > 5.0:
        return bias_correction1, bias_correction2, rho_t, None
    rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
    return bias_correction1, bias_correction2, rho_t, rect


def _opmath_round(value: float, opmath: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=torch.float64).to(opmath).item())


def radam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, weight_decay,
          decoupled_weight_decay, ema_decay=None, *, grad_scale=None, maximize=False,
          check_finite=False):
    r"""``multi_tensor_radam``: ``torch.optim.RAdam`` with an optional fused EMA, in place.

    List forms; ``ema_decay`` tells the two five-list forms apart (None: no EMA)::

        ema_decay is None:  [grads, params, exp_avgs, exp_avg_sqs]
                            [grads, params, exp_avgs, exp_avg_sqs, masters]
        ema_decay a float:  [grads, params, exp_avgs, exp_avg_sqs, emas]
                            [grads, params, exp_avgs, exp_avg_sqs, emas, masters]

    Host scalars, in double, exactly as ``torch.optim.radam._single_tensor_radam`` (t = step)::

        bc1 = 1 - beta1**t;  bc2 = 1 - beta2**t
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * t * (beta2**t) / bc2
        rectified = rho_t > 5
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf
                / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
        sbc2 = bc2 ** 0.5
        w = 1 - beta1                                     # the lerp weight of m
        small = |opmath(w)| < 0.5;  w1 = opmath(1) - opmath(w)   (opmath subtraction)

    Every scalar enters the element math rounded once to opmath (fp32; fp64 for fp64 tensors),
    written ``S`` below. Per element, every operation is one rounded opmath operation, in this
    order (no fused multiply-add; the order is torch's op order)::

        g  = grad * S(1 / grad_scale)         # only with grad_scale (the reciprocal is opmath)
        g  = -g                               # only with maximize
        p  = p * S(1 - lr * weight_decay)     # decoupled_weight_decay and weight_decay != 0
        g  = g + p * S(weight_decay)          # not decoupled and weight_decay != 0 (L2)
        d  = g - m                            # m.lerp_(g, w):
        m  = m + d * S(w)                     #   small
        m  = g - d * w1                       #   not small
        v  = v * S(beta2) + (g * S(1 - beta2)) * g    # the product first, then the sum
        mh = m / S(bc1)
        rectified:      a = (1 / (sqrt(v) + S(eps))) * S(sbc2)     # reciprocal, then product
                        u = ((mh * S(lr)) * a) * S(rect)
        not rectified:  u = mh * S(lr)
        p  = p - u
        s  = s * S(ema_decay) + p * S(1 - ema_decay)   # only with an EMA; the new, unrounded p

    With masters, ``p`` above is the fp32 master and the param receives ``round(p)`` once;
    stored m, v, s, p are rounded once to their dtype. torch's CPU kernels may fuse
    ``lerp``/``add(alpha=)`` into an FMA on vector lanes, so torch can differ from this by an ulp.
    """
    del chunk_size  # elementwise: chunking cannot change a result
    has_ema = ema_decay is not None
    call = _AdamFamilyCall(validation.radam_lists_key(ema_decay), noop_flag, tensor_lists, step,
                           has_ema, grad_scale, maximize, check_finite)
    if not call.ready:
        return
    g, p, m, v, opmath = call.g, call.p, call.m, call.v, call.opmath
    if weight_decay != 0.0:
        if decoupled_weight_decay:
            p = torch._foreach_mul(p, 1 - lr * weight_decay)
        else:
            g = torch._foreach_add(g, torch._foreach_mul(p, weight_decay))
    bc1, bc2, _, rect = radam_scalars(beta1, beta2, call.step)

    w = 1 - beta1
    w_op = _opmath_round(w, opmath)
    d = torch._foreach_sub(g, m)
    if abs(w_op) < 0.5:
        m_new = torch._foreach_add(m, torch._foreach_mul(d, w))
    else:
        w1 = float((torch.tensor(1.0, dtype=opmath) - torch.tensor(w_op, dtype=opmath)).item())
        m_new = torch._foreach_sub(g, torch._foreach_mul(d, w1))
    v_new = torch._foreach_add(
        torch._foreach_mul(v, beta2),
        torch._foreach_mul(torch._foreach_mul(g, 1 - beta2), g),
    )
    mh = torch._foreach_div(m_new, bc1)
    if rect is not None:
        a = torch._foreach_mul(
            torch._foreach_reciprocal(torch._foreach_add(torch._foreach_sqrt(v_new), eps)),
            bc2 ** 0.5)
        u = torch._foreach_mul(torch._foreach_mul(torch._foreach_mul(mh, lr), a), rect)
    else:
        u = torch._foreach_mul(mh, lr)
    p_new = torch._foreach_sub(p, u)
    call.finish(m_new, v_new, p_new, ema_decay)


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
    ops={"fused_ema_adamw": fused_ema_adamw, "adam": adam, "radam": radam, "scale": scale,
         "l2norm": l2norm},
    description="pure PyTorch tensor ops (any device)",
))
