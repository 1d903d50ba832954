"""An independent float64 model of the seed operator, plus tensor-comparison helpers for the tests.

``seed_update`` transcribes ``npu_apply_fused_ema_adamw`` from the seed
(``shared/seeds/000_e6d522f61ebe1ddf.txt``) line by line, in float64 with Python-float
hyperparameters. It does not import or mirror the package: it is what the package is checked
against. Two documented extensions of the package's op are modelled in front of the seed formula,
on the gradient only: ``grad_scale`` (the grad is divided by it, GradScaler's unscale) and
``maximize`` (the grad is negated).
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional, Sequence

import torch

F64 = torch.float64


def _f64(t) -> torch.Tensor:
    return torch.as_tensor(t).detach().to(device="cpu", dtype=F64).clone()


def seed_update(grad, var, m, v, s, step, lr=1e-3, ema_decay=0.9999, beta1=0.9, beta2=0.999,
                eps=1e-8, mode=1, bias_correction=True, weight_decay=0.0, *,
                grad_scale: Optional[float] = None, maximize: bool = False):
    """One step of the seed operator in float64. Returns new ``(var, m, v, s)`` float64 tensors.

    The inputs are read (converted exactly to float64), never modified.
    """
    grad, var, m, v, s = (_f64(t) for t in (grad, var, m, v, s))
    if isinstance(step, torch.Tensor):
        step = int(step.reshape(-1)[0].item())
    if grad_scale is not None:
        grad = grad / float(grad_scale)
    if maximize:
        grad = -grad
    bc = 1.0 if bias_correction else 0.0
    # --- the seed, transcribed ---
    beta1_correction = 1 - math.pow(beta1, step) * bc
    beta2_correction = 1 - math.pow(beta2, step) * bc
    grad_ = grad + weight_decay * var * (1 - mode)
    m_ = beta1 * m + (1 - beta1) * grad_
    v_ = beta2 * v + (1 - beta2) * grad_ * grad_
    next_m = m_ / beta1_correction
    next_v = v_ / beta2_correction
    denom = torch.pow(next_v, 0.5) + eps
    update = next_m / denom + weight_decay * var * mode
    var_ = var - lr * update
    s_ = ema_decay * s + (1 - ema_decay) * var_
    return var_, m_, v_, s_


class SeedParamState:
    """Float64 state of one param under the seed update, with its own step counter."""

    def __init__(self, param: torch.Tensor):
        self.var = _f64(param)
        self.m = torch.zeros_like(self.var)
        self.v = torch.zeros_like(self.var)
        self.s = self.var.clone()
        self.step = 0

    def update(self, grad, *, lr, betas, eps, weight_decay, ema_decay, adam_w_mode=True,
               bias_correction=True, grad_scale=None, maximize=False) -> None:
        self.step += 1
        self.var, self.m, self.v, self.s = seed_update(
            grad, self.var, self.m, self.v, self.s, self.step, lr, ema_decay, betas[0], betas[1],
            eps, 1 if adam_w_mode else 0, bias_correction, weight_decay,
            grad_scale=grad_scale, maximize=maximize)


# --------------------------------------------------------------------------------------------
# comparison helpers

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern (an integer tensor), for exact comparisons (NaN-safe)."""
    t = t.detach()
    if t.is_sparse:
        t = t.to_dense()
    t = t.contiguous()
    return t.view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{msg}: shape {actual.shape} != {expected.shape}"
    if actual.device.type == "meta" or expected.device.type == "meta":
        return
    a, e = bits(actual), bits(expected)
    if not torch.equal(a, e):
        diff = (a != e).sum().item()
        raise AssertionError(f"{msg}: {diff} of {a.numel()} elements differ bitwise")


def snapshot(tensors: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def assert_unchanged(tensors: Sequence[torch.Tensor], saved: Sequence[torch.Tensor], what: str = "") -> None:
    assert len(tensors) == len(saved)
    for i, (t, s) in enumerate(zip(tensors, saved)):
        assert_bitwise_equal(t, s, f"{what}[{i}] changed")


def assert_close64(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float,
                   msg: str = "") -> None:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise, computed in float64."""
    a = actual.detach().to(device="cpu", dtype=F64)
    e = expected.detach().to(device="cpu", dtype=F64)
    assert a.shape == e.shape, f"{msg}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    if a.numel() == 0:
        return
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    bad = ~(err <= bound)
    if bool(bad.any()):
        worst = (err - bound).argmax()
        raise AssertionError(
            f"{msg}: {int(bad.sum())} of {a.numel()} elements out of tolerance "
            f"(rtol={rtol}, atol={atol}); worst: actual={a.reshape(-1)[worst].item()!r} "
            f"expected={e.reshape(-1)[worst].item()!r}")


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: float, msg: str = "") -> None:
    """``actual`` (a float tensor) within ``ulps`` units in the last place of its dtype of ``expected``."""
    finfo = torch.finfo(actual.dtype)
    e = expected.detach().to(device="cpu", dtype=F64)
    # spacing of actual's dtype at |expected|: eps * 2**floor(log2|e|), at least the smallest normal's
    mag = e.abs().clamp_min(finfo.tiny)
    spacing = finfo.eps * torch.exp2(torch.floor(torch.log2(mag)))
    a = actual.detach().to(device="cpu", dtype=F64)
    err = (a - e).abs()
    bad = ~(err <= ulps * spacing)
    if bool(bad.any()):
        worst = (err / spacing).argmax()
        raise AssertionError(
            f"{msg}: {int(bad.sum())} of {a.numel()} elements more than {ulps} ulp away; worst "
            f"actual={a.reshape(-1)[worst].item()!r} expected={e.reshape(-1)[worst].item()!r} "
            f"({(err / spacing).reshape(-1)[worst].item():.2f} ulp)")
