"""An independent IEEE oracle of the update rules: numpy, one correctly rounded operation per line.

numpy's float32/float64 arithmetic and ``np.sqrt`` are the hardware's IEEE operations (round to
nearest even, no contraction), so this is what every backend must equal bit for bit. It reads
:class:`multi_tensor.rules.StepScalars` (the scalars are the contract's input) but none of the
package's arithmetic. :func:`scalars` computes the scalars themselves from the documented
formulas, for an oracle that reads nothing of the package (tests/test_fuzz.py).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import torch


def _np(t: torch.Tensor, dtype) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy().astype(dtype)


def adam_update(c, grad, w, m, v, s=None, *, dtype=np.float32, inv_scale=None):
    """One update of arrays in ``dtype`` (the math type). Returns new ``(w, m, v, s)``."""
    k = dtype
    g = grad.astype(k)
    if inv_scale is not None:
        g = g * k(inv_scale)
    if c.maximize:
        g = -g
    if c.l2:
        g = g + k(c.l2_wd) * w
    m = k(c.beta1) * m + k(c.omb1) * g
    v = k(c.beta2) * v + (k(c.omb2) * g) * g
    u = m / (np.sqrt(v) * k(c.isb2) + k(c.eps)) if c.use_denom else m
    wn = w - k(c.lr_wd) * w if c.decoupled else w
    wn = wn - k(c.step_size) * u
    if c.ema:
        s = s + k(c.ema_w) * (wn - s)
    return wn, m, v, s


def as_numpy(t: torch.Tensor, dtype=np.float32) -> np.ndarray:
    return _np(t, dtype)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 round to nearest even, as fp32 values (integer ops; NaN kept quiet)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), np.float32(np.nan), out)


# --- the per-step scalars, from the formulas (README "The update", rules.py's docstring) -------
# Written here from the documents, not taken from multi_tensor.rules, so that an oracle built on
# them checks the scalars too. Every value is a double formed by correctly rounded + - * / sqrt
# in the documented order; the math type's rounding happens in adam_update (k(...)).

def power(x: float, n: int) -> float:
    """``x ** n`` by binary exponentiation (the documented fixed chain of multiplications)."""
    result, base = 1.0, float(x)
    while n:
        if n & 1:
            result *= base
        base *= base
        n >>= 1
    return result


def radam_rho(beta2: float, n: int) -> float:
    """rho_t = 2 K / G - 1, ``G = sum(beta2**m)``, ``K = sum((m + 1) beta2**m)`` over m < n,
    summed by doubling runs: a run of length a then b has ``G = G_a + beta2**a G_b`` and
    ``K = K_a + beta2**a (K_b + a G_b)``."""
    p, g, k, length = 1.0, 0.0, 0.0, 0.0      # the sum so far: beta2**len, G, K, len
    rp, rg, rk, rl = float(beta2), 1.0, 1.0, 1.0  # the run of length 2**i
    while n:
        if n & 1:
            k = k + p * (rk + length * rg)
            g = g + p * rg
            p = p * rp
            length = length + rl
        rk = rk + rp * (rk + rl * rg)
        rg = rg + rp * rg
        rp = rp * rp
        rl = rl + rl
        n >>= 1
    return 2.0 * k / g - 1.0


def scalars(*, rule: str, lr: float, beta1: float, beta2: float, eps: float, step: int,
            weight_decay: float = 0.0, decoupled: bool = True, bias_correction: bool = True,
            maximize: bool = False, ema_decay=None) -> SimpleNamespace:
    """The scalars :func:`adam_update` reads (``rule``: "adam" or "radam"), in double."""
    wd = float(weight_decay)
    use_denom = True
    if rule == "radam":  # torch.optim.RAdam: always bias-corrected, rectified when rho_t > 5
        bc1, bc2 = 1.0 - power(beta1, step), 1.0 - power(beta2, step)
        rho_inf = 2.0 / (1.0 - beta2) - 1.0
        rho_t = radam_rho(beta2, step)
        isb2 = 1.0
        if rho_t > 5.0:
            rect = math.sqrt((rho_t - 4.0) * (rho_t - 2.0) * rho_inf
                             / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t))
            step_size = lr * rect * math.sqrt(bc2) / bc1
        else:
            use_denom = False
            step_size = lr / bc1
    else:
        bc1, bc2 = ((1.0 - power(beta1, step), 1.0 - power(beta2, step)) if bias_correction
                    else (1.0, 1.0))
        isb2 = 1.0 / math.sqrt(bc2)
        step_size = lr / bc1
    return SimpleNamespace(
        beta1=float(beta1), omb1=1.0 - beta1, beta2=float(beta2), omb2=1.0 - beta2,
        l2_wd=wd, lr_wd=lr * wd, isb2=isb2, eps=float(eps), step_size=step_size,
        ema_w=1.0 - ema_decay if ema_decay is not None else 0.0,
        l2=wd != 0.0 and not decoupled, decoupled=wd != 0.0 and decoupled,
        use_denom=use_denom, maximize=bool(maximize), ema=ema_decay is not None)
