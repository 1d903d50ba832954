"""The CANN stand-in (``npu_standin.cann_device_op``) against independent oracles, and the
tolerances ``tools/npu_check.py`` derives from it.

* the operator line by line against a numpy float32 transcription of ops-nn's kernel (every
  operation rounded once in fp32), fp32 and bf16 (inputs widened, the four outputs rounded to
  nearest even from the fp32 values, the EMA read from the unrounded ``var'``);
* the kernel's complements ``1 - fp32(beta)`` against exact rational arithmetic, and how far the
  double complement ``fp32(1 - beta)`` (what a stand-in rounding from double would use) is from
  them: 111 ulp of the coefficient at beta = 0.999, so such a stand-in does not match;
* ``d + (1 - d)`` is exactly 1 for the kernel's complement of every ``d`` in [0.5, 1];
* the stand-in path (the NPU backend with the emulation, folded bias correction and the lerp, or
  the operator's own EMA) stays within ``npu_check.cann_bounds`` for a table of hyperparameter
  sets, warm-ups and dtypes.
"""
from __future__ import annotations

import math
import os
import sys
from fractions import Fraction

import pytest
import torch

from multi_tensor.testing import npu_standin

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import npu_check  # noqa: E402

sys.path.pop(0)


def np32():
    np = pytest.importorskip("numpy")
    return np, np.float32


def numpy_kernel(grad, var, m, v, s, lr, d, b1, b2, eps, mode, wd):
    """ops-nn's apply_fused_ema_adam_f32.h:124-184 in numpy float32, bias correction off."""
    np, f = np32()
    g, w, mm, vv, ss = (np.asarray(x, dtype=f) for x in (grad, var, m, v, s))
    lr, d, b1, b2, eps, wd = (f(x) for x in (lr, d, b1, b2, eps, wd))
    one = f(1.0)
    omb1, omb2, omd = one - b1, one - b2, one - d
    rbc1 = rbc2 = one / one
    if mode == 0:
        g = (w * wd) + g
    m_out = (mm * b1) + (g * omb1)
    v_out = ((g * g) * omb2) + (vv * b2)
    denom = np.sqrt(v_out * rbc2) + eps
    u = (m_out * rbc1) / denom
    if mode == 1:
        u = u + (w * wd)
    w_new = w - (u * lr)
    s_new = (ss * d) + (w_new * omd)
    return w_new, m_out, v_out, s_new


OPS = [  # lr, ema_decay, beta1, beta2, eps, mode, weight_decay
    (1e-3, 0.9999, 0.9, 0.999, 1e-8, 1, 0.01),
    (3e-2, 0.99, 0.8, 0.95, 1e-6, 0, 0.1),
    (1.7e-4, 0.5, 0.5, 0.99999, 1e-12, 1, 0.0),
]


@pytest.mark.parametrize("hp", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_operator_matches_a_numpy_transcription_of_the_kernel(hp, dtype):
    lr, d, b1, b2, eps, mode, wd = hp
    gen = torch.Generator().manual_seed(5)
    n = 4096
    t = [(torch.randn(n, generator=gen) * sc).to(dtype) for sc in (1e-2, 0.3, 1e-3, 1e-3, 0.3)]
    t[3] = t[3].abs() * 1e-2  # v >= 0
    grad, var, m, v, s = t
    # numpy sees the attributes as the kernel does: each double rounded once to fp32
    want = numpy_kernel(*(x.float().numpy() for x in t), lr, d, b1, b2, eps, mode, wd)
    ours = [x.clone() for x in (var, m, v, s)]
    npu_standin.cann_device_op(grad, *ours, torch.ones(1, dtype=torch.int64), lr, d, b1, b2, eps,
                               mode, False, wd)
    for name, got, w in zip(("var", "m", "v", "s"), ours, want):
        expect = torch.from_numpy(w).to(dtype)  # the fp32 result rounded once (nearest even)
        assert got.dtype == dtype
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           expect.view(torch.int16 if dtype != torch.float32 else torch.int32)), name


def exact_ulp_distance(a: float, b: float) -> Fraction:
    """|a - b| in ulps of the fp32 value b, exactly."""
    e = math.floor(math.log2(abs(b)))
    return abs(Fraction(a) - Fraction(b)) / Fraction(2) ** (e - 23)


@pytest.mark.parametrize("beta", [0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.999, 0.9999, 0.99999])
def test_the_kernels_complement_is_one_minus_fp32_beta(beta):
    dev = npu_standin.device_complement(beta)
    assert Fraction(dev) == 1 - Fraction(npu_standin.f32(beta))  # exact (Sterbenz)
    assert Fraction(npu_standin.f32(beta)) + Fraction(dev) == 1  # d + (1 - d) == 1 exactly
    old = npu_standin.f32(1.0 - beta)  # the complement rounded from double
    rel = abs(Fraction(dev) - Fraction(old)) / Fraction(old)
    assert math.isclose(npu_check.gap_units(beta), float(rel) * 2 ** 24, rel_tol=1e-12)


def test_a_double_complement_standin_would_not_match():
    """beta2 = 0.999: the two complements are 111 ulp of the coefficient apart, and the operator's
    v' after one step from v = 0 with g = 1 is the kernel's complement, not the double one."""
    beta2 = 0.999
    dev, old = npu_standin.device_complement(beta2), npu_standin.f32(1.0 - beta2)
    exact_dev = 1 - Fraction(npu_standin.f32(beta2))
    exact_old_ulps = abs(exact_dev - Fraction(old)) / Fraction(2) ** (
        math.floor(math.log2(old)) - 23)
    assert exact_old_ulps == exact_ulp_distance(dev, old) and exact_old_ulps > 100
    one = torch.ones(1)
    var, m, v, s = one.clone(), 0 * one, 0 * one, 0 * one
    npu_standin.cann_device_op(one.clone(), var, m, v, s, torch.ones(1, dtype=torch.int64), 0.0,
                               0.9999, 0.9, beta2, 1e-8, 1, False, 0.0)
    assert float(v) == dev and float(v) != old
    assert float(s) == npu_standin.device_complement(0.9999)
    assert float(m) == npu_standin.device_complement(0.9)


@pytest.mark.parametrize("bits", [0x3F000000, 0x3F19999A, 0x3F7FBE77, 0x3F7FF972, 0x3F7FFF58,
                                  0x3F7FFFFF])
def test_the_literal_emas_coefficients_sum_to_one(bits):
    d = float(torch.tensor([bits], dtype=torch.int32).view(torch.float32))  # d in [0.5, 1)
    omd = npu_standin.device_complement(d)
    assert Fraction(d) + Fraction(omd) == 1


# the stand-in path within npu_check's derived bounds: (hyperparameter set, warm-up, dtype+masters)
CASES = [(0, 0, False), (0, 5, True), (1, 1, False), (3, 0, False), (4, 5, False), (5, 1, True),
         (6, 40, False)]


@pytest.mark.parametrize("literal", [False, True], ids=["cann", "cann_literal"])
@pytest.mark.parametrize("hp_index,warm,master", CASES)
def test_standin_stays_within_the_derived_tolerances(hp_index, warm, master, literal):
    hp = npu_check.DERIVE_HYPERS[hp_index]
    dtype = torch.bfloat16 if master else torch.float32
    with npu_standin.standin_backend(npu_standin.cann_device_op, name="npu_standin_tol"):
        before, g, after, ours, *_, c, launches = npu_check.one_cann_step(
            torch.device("cpu"), "npu_standin_tol", lambda: None, hp, dtype, master, warm,
            seed=77 + hp_index, literal=literal, n=3000)
    assert launches == 1
    tol = npu_check.cann_bounds(before, g, after, c, literal)
    for q in "mvws":
        err = (ours[q] - after[q]).abs()
        assert bool((err <= tol[q]).all()), (q, float((err / tol[q].clamp_min(1e-300)).max()))
    # the bounds can fail: with the rounding allowances at zero the same run is outside them
    zero = npu_check.cann_bounds(before, g, after, c, literal,
                                 rounding={k: 0.0 for k in npu_check.ROUNDING})
    assert any(bool(((ours[q] - after[q]).abs() > zero[q]).any()) for q in "mvws")
