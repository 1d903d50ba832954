"""The reference backend: every op in plain PyTorch tensor ops, on any device.

It computes :mod:`multi_tensor.rules`' operation order with one torch op per line: each
multiplication, addition, subtraction and division is one correctly rounded IEEE operation in
the math type (fp32; fp64 for fp64 buckets), every scalar is rounded once to that type before use,
and no op that could fuse a multiply-add (``addcmul``, ``lerp``, ``add(alpha=)``) is used. sqrt is
the one operation torch does not round correctly on every device (on CPU builds with MKL,
``torch.sqrt`` is off by an ulp for about 17% of fp32 inputs), so :func:`ieee_sqrt` computes it
exactly: fp32 through fp64 (exact after one rounding back to fp32), fp64 on the CPU through
numpy (the hardware instruction), fp64 elsewhere with ``torch.sqrt`` (CUDA's is correctly
rounded).

Because it only uses torch ops it also runs tensors without real storage (DTensors, fake and
meta tensors). It reads ``noop_flag`` on the host (``.item()``): free on the CPU, one sync on an
accelerator.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from .. import schema
from ..rules import StepScalars, join_master, rounded, split_master
from .contract import ANY_DEVICE, Backend
from .registry import PreparedOp, register_backend


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def ieee_sqrt(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """Correctly rounded sqrt of fp32 or fp64 tensors."""
    if not tensors:
        return []
    if tensors[0].dtype == torch.float32:
        wide = torch._foreach_sqrt([t.to(torch.float64) for t in tensors])
        return [t.to(torch.float32) for t in wide]
    return [_sqrt_fp64(t) for t in tensors]


def _sqrt_fp64(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu" and type(t) is torch.Tensor:
        try:
            import numpy as np
        except ImportError:  # pragma: no cover - numpy is installed with the package's tools
            return torch.sqrt(t)
        return torch.from_numpy(np.asarray(np.sqrt(t.contiguous().numpy())))
    return torch.sqrt(t)


def _noop_is_set(noop_flag: Optional[torch.Tensor]) -> bool:
    return noop_flag is not None and noop_flag.numel() > 0 and bool(noop_flag.reshape(-1)[0].item() != 0)


def any_nonfinite(tensors: List[torch.Tensor]) -> bool:
    return any(t.numel() and not bool(torch.isfinite(t).all()) for t in tensors)


def _as(tensors: List[torch.Tensor], dtype: torch.dtype) -> List[torch.Tensor]:
    return [t if t.dtype == dtype else t.to(dtype) for t in tensors]


def _store(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    """Write results back, rounding once to each destination's dtype."""
    for d, s in zip(dst, src):
        if d is not s:
            d.copy_(s)


def adam_family(chunk_size: int, noop_flag: torch.Tensor, lists, c: StepScalars,
                grad_scale: Optional[torch.Tensor] = None, check_finite: bool = False, *,
                sqrt: Callable = ieee_sqrt, div: Callable = torch._foreach_div) -> None:
    """Every Adam-family op on one bucket's :class:`~multi_tensor.schema.AdamLists`.

    ``sqrt(list)`` and ``div(list, list)``: the correctly rounded sqrt and division used (for
    the step's denominator and the grad scale's reciprocal); a device without fp64 passes
    :mod:`multi_tensor.backends.npu.fp32_exact`'s.
    """
    del chunk_size  # elementwise: chunking cannot change a result
    grads, params, exp_avgs, exp_avg_sqs = lists.grads, lists.params, lists.exp_avgs, lists.exp_avg_sqs
    emas, has_master, remainders = lists.emas, lists.has_master, lists.remainders
    if not grads or _noop_is_set(noop_flag):
        return
    if check_finite and any_nonfinite(grads):
        noop_flag.fill_(1)
        return
    # with remainders the weights are the fp32 masters joined from the params and remainders
    weights = (lists.weights if remainders is None
               else [join_master(p, r) for p, r in zip(params, remainders)])
    dt = math_dtype(weights[0].dtype)

    def k(value: float) -> float:
        return rounded(value, dt)

    g = [t.to(dt) for t in grads]  # always a copy: the grads are never modified
    w = _as(weights, dt)
    m = _as(exp_avgs, dt)
    v = _as(exp_avg_sqs, dt)
    if grad_scale is not None:
        scale = grad_scale.reshape(()).to(device=w[0].device, dtype=dt)
        g = torch._foreach_mul(g, div([torch.ones((), dtype=dt, device=scale.device)], [scale])[0])
    if c.maximize:
        g = torch._foreach_neg(g)
    if c.l2:
        g = torch._foreach_add(g, torch._foreach_mul(w, k(c.l2_wd)))
    m = torch._foreach_add(torch._foreach_mul(m, k(c.beta1)), torch._foreach_mul(g, k(c.omb1)))
    v = torch._foreach_add(torch._foreach_mul(v, k(c.beta2)),
                           torch._foreach_mul(torch._foreach_mul(g, k(c.omb2)), g))
    if c.use_denom:
        denom = torch._foreach_add(torch._foreach_mul(sqrt(v), k(c.isb2)), k(c.eps))
        u = div(m, denom)
    else:
        u = m
    w_new = torch._foreach_sub(w, torch._foreach_mul(w, k(c.lr_wd))) if c.decoupled else w
    w_new = torch._foreach_sub(w_new, torch._foreach_mul(u, k(c.step_size)))
    _store(exp_avgs, m)
    _store(exp_avg_sqs, v)
    if emas is not None:
        s = _as(emas, dt)
        s = torch._foreach_add(s, torch._foreach_mul(torch._foreach_sub(w_new, s), k(c.ema_w)))
        _store(emas, s)
    if remainders is not None:
        for p, r, w in zip(params, remainders, w_new):
            p_new, r_new = split_master(w)
            p.copy_(p_new)
            r.copy_(r_new)
        return
    _store(weights, w_new)
    if has_master:
        _store(params, w_new)


def scale(chunk_size, noop_flag, tensor_lists, scale_factor):
    """apex ``multi_tensor_scale``: ``dst = src * scale``; sets ``noop_flag`` on a non-finite src.

    The product is formed in fp32 (fp64 when src or dst is fp64) and rounded to dst's dtype.
    """
    del chunk_size
    srcs, dsts = tensor_lists
    if not srcs:
        return
    if any_nonfinite(srcs):
        noop_flag.fill_(1)
    for src, dst in zip(srcs, dsts):
        dt = math_dtype(src.dtype if src.dtype == torch.float64 else dst.dtype)
        dst.copy_(src.to(dt) * scale_factor)


def l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """apex ``multi_tensor_l2norm``: ``(total_norm, per_tensor_norms)`` as fp32 tensors.

    Sums of squares accumulate in fp64, so the result does not depend on chunking or threads.
    Sets ``noop_flag`` if any input holds a non-finite value. ``per_tensor_norms`` is an empty
    tensor unless ``per_tensor``.
    """
    del chunk_size
    tensors = tensor_lists[0]
    device = tensors[0].device if tensors else noop_flag.device
    if any_nonfinite(tensors):
        noop_flag.fill_(1)
    sq = [t.detach().to(torch.float64).square().sum() for t in tensors]
    per = torch.stack(sq) if sq else torch.zeros(0, dtype=torch.float64, device=device)
    total = per.sum().sqrt().to(torch.float32)
    per_norms = per.sqrt().to(torch.float32) if per_tensor else torch.zeros(0, device=device)
    return total, per_norms


def prepare(op: str, lists, chunk_size: int, once: bool = False) -> PreparedOp:
    """A bucket of the reference: :func:`adam_family` on its lists, grads bound per step."""
    return PreparedOp(adam_family, lists, chunk_size)


REFERENCE = register_backend(Backend(
    name="reference",
    device_types=(ANY_DEVICE,),
    priority=0,
    ops={"scale": scale, "l2norm": l2norm},
    prepare=prepare,
    adam_ops=schema.ADAM_OPS,
    tensor_subclasses=True,
    description="pure PyTorch tensor ops (any device)",
))
