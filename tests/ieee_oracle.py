"""An independent IEEE oracle of the update rules: numpy, one correctly rounded operation per line.

numpy's float32/float64 arithmetic and ``np.sqrt`` are the hardware's IEEE operations (round to
nearest even, no contraction), so this is what every backend must equal bit for bit. It reads
:class:`multi_tensor.rules.StepScalars` (the scalars are the contract's input) but none of the
package's arithmetic.
"""
from __future__ import annotations

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
