"""multi_tensor.backends.npu.fp32_exact: correctly rounded fp32 sqrt/div from fp32 ops, bitwise.

Oracles (independent of the code under test): numpy's float32 ``sqrt`` / ``divide`` (the
hardware's IEEE instructions) and the float64 result rounded once to float32 (exact for both:
53 >= 2*24 + 2 bits). Each case also runs with the "device" approximation perturbed at random by
up to 1 and up to ``APPROX_ULPS`` ulp (an emulated inexact device): the results must stay exact.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from multi_tensor.backends.npu import fp32_exact as fe

F32, I32 = torch.float32, torch.int32
CHUNK = 1 << 22


def from_bits(ints) -> torch.Tensor:
    return torch.as_tensor(np.asarray(ints, dtype=np.int64).astype(np.uint32).view(np.int32)).view(F32)


def mismatches(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    both_nan = torch.isnan(got) & torch.isnan(want)
    return ~((got.view(I32) == want.view(I32)) | both_nan)


def perturbed(fn, ulps: int, seed: int):
    """``fn`` with each finite nonzero result moved by a random number of ulps in [-ulps, ulps]."""
    gen = torch.Generator().manual_seed(seed)

    def approx(*args):
        r = fn(*args)
        if ulps == 0:
            return r
        k = torch.randint(-ulps, ulps + 1, r.shape, generator=gen, dtype=I32)
        moved = (r.view(I32) + k).view(F32)  # same sign: a move in magnitude by |k| ulp
        ok = torch.isfinite(r) & (r != 0) & torch.isfinite(moved) & (moved.sign() == r.sign())
        return torch.where(ok, moved, r)
    return approx


def sqrt_oracles(x):
    a = x.numpy()
    with np.errstate(all="ignore"):
            return (torch.from_numpy(np.sqrt(a)),
                torch.from_numpy(np.sqrt(a.astype(np.float64)).astype(np.float32)))


def div_oracles(a, b):
    with np.errstate(all="ignore"):
        return (torch.from_numpy(np.divide(a.numpy(), b.numpy())),
                torch.from_numpy((a.numpy().astype(np.float64) / b.numpy().astype(np.float64))
                                 .astype(np.float32)))


def binade(lo_bits: int, hi_bits: int) -> torch.Tensor:
    return torch.arange(lo_bits, hi_bits, dtype=I32).view(F32)


def rng(seed):
    return np.random.default_rng(seed)


def _random_bits(n, seed, positive):
    r = rng(seed).integers(0, 2 ** 32 if not positive else 2 ** 31, n, dtype=np.int64)
    return from_bits(r)


def _perfect_squares():
    k = np.arange(1, 4097, dtype=np.float64)
    base = np.concatenate([k * k * 2.0 ** e for e in (-140, -100, -60, -20, 0, 20, 60, 100)])
    base = base[(base > 0) & (base < 3.4e38)].astype(np.float32)
    bits = base.view(np.int32).astype(np.int64)
    return from_bits(np.concatenate([bits + d for d in range(-3, 4)]))


SQRT_CASES = {
    "binade [1,2)": lambda: binade(0x3F800000, 0x40000000),
    "binade [2,4)": lambda: binade(0x40000000, 0x40800000),
    "subnormals (all)": lambda: binade(1, 0x00800000),
    "smallest normals": lambda: binade(0x00800000, 0x00900000),
    "largest finite": lambda: binade(0x7F700000, 0x7F800000),
    "powers of two and neighbours": lambda: from_bits(
        np.concatenate([np.arange(1, 255) * 2 ** 23 + d for d in (-2, -1, 0, 1, 2)])),
    "perfect squares and ulp neighbours": _perfect_squares,
    "random 10^6 positive": lambda: _random_bits(10 ** 6, 1, True),
    "specials": lambda: torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -1.0,
                                      -1e-45, -3.4e38, 1e-45, 3.4028235e38]),
}


def _div_exact_quotients():
    g = rng(2)
    b = (g.integers(2 ** 11, 2 ** 12, 20000) * 2.0 ** g.integers(-60, 40, 20000))
    q = (g.integers(2 ** 11, 2 ** 12, 20000) * 2.0 ** g.integers(-60, 40, 20000))
    a = (b * q).astype(np.float32)  # 12 x 12 bits: exact
    abits = a.view(np.int32).astype(np.int64)
    aa = np.concatenate([abits + d for d in (-2, -1, 0, 1, 2)])
    bb = np.tile(b.astype(np.float32).view(np.int32).astype(np.int64), 5)
    return from_bits(aa), from_bits(bb)


def _div_subnormal_ties():
    g = rng(3)
    m = g.integers(2 ** 23, 2 ** 24, 30 * 400) | 1   # odd significands
    j = np.repeat(np.arange(1, 31), 400)
    a = (m * 2.0 ** -149 * 2.0 ** 23).astype(np.float32)  # odd multiples of 2^-126 ... 2^-103
    b = (2.0 ** j).astype(np.float32)
    a = torch.from_numpy(a)
    b = torch.from_numpy(b)
    return torch.cat([a, -a, a * 3.0]), torch.cat([b, b, b * 3.0])


def _div_specials():
    vals = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, -1.0, 1e-45,
                         -1e-45, 3.4028235e38, 1.1754944e-38, 3.0])
    a, b = torch.meshgrid(vals, vals, indexing="ij")
    return a.reshape(-1), b.reshape(-1)


def _div_extremes():
    g = rng(4)
    n = 200000
    big = from_bits(g.integers(0x7E000000, 0x7F800000, n))
    small = from_bits(g.integers(1, 0x01000000, n))
    mid = from_bits(g.integers(0x3F000000, 0x40000000, n))
    return torch.cat([big, small, mid, small, big]), torch.cat([small, big, big, mid, mid])


def _ones_over(b):
    return torch.cat([torch.ones_like(b), -torch.ones_like(b)]), torch.cat([b, b])


DIV_CASES = {
    "random 10^6 pairs": lambda: (_random_bits(10 ** 6, 5, False), _random_bits(10 ** 6, 6, False)),
    "exact quotients and ulp neighbours": _div_exact_quotients,
    "subnormal results and ties": _div_subnormal_ties,
    "overflow and underflow": _div_extremes,
    "specials": _div_specials,
    "one by powers of two and odd numbers": lambda: _ones_over(torch.cat([
        2.0 ** torch.arange(-149, 128, dtype=torch.float64),
        torch.arange(1, 2 ** 16, 2, dtype=torch.float64)]).to(F32)),
}

ULPS = (0, 1, fe.APPROX_ULPS)


def _check_sqrt(x, ulps, seed=0):
    approx_sqrt = perturbed(torch.sqrt, ulps, seed)
    approx_div = perturbed(torch.div, ulps, seed + 1)
    for part in x.split(CHUNK):
        got = fe.sqrt_flat(part, approx_sqrt, approx_div)
        for want in sqrt_oracles(part):
            bad = mismatches(got, want)
            assert not bad.any(), (f"{int(bad.sum())} wrong, e.g. sqrt({part[bad][:4].tolist()}) = "
                                   f"{got[bad][:4].tolist()}, want {want[bad][:4].tolist()}")


@pytest.mark.parametrize("ulps", ULPS)
@pytest.mark.parametrize("case", sorted(SQRT_CASES))
def test_sqrt_bitwise(case, ulps):
    _check_sqrt(SQRT_CASES[case](), ulps)


@pytest.mark.parametrize("ulps", ULPS)
@pytest.mark.parametrize("case", sorted(DIV_CASES))
def test_div_bitwise(case, ulps):
    a, b = DIV_CASES[case]()
    approx = perturbed(torch.div, ulps, 7)
    for pa, pb in zip(a.split(CHUNK), b.split(CHUNK)):
        got = fe.div_flat(pa, pb, approx)
        for want in div_oracles(pa, pb):
            bad = mismatches(got, want)
            assert not bad.any(), (f"{int(bad.sum())} wrong, e.g. {pa[bad][:3].tolist()} / "
                                   f"{pb[bad][:3].tolist()} = {got[bad][:3].tolist()}, "
                                   f"want {want[bad][:3].tolist()}")


def test_lists_and_shapes():
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(s, generator=g) * 10 for s in ((3, 4), (0,), (7,), (2, 1, 5))]
    ys = [torch.rand(t.shape, generator=g) + 0.5 for t in xs]
    for got, x in zip(fe.sqrt(xs), xs):
        assert got.shape == x.shape and not mismatches(got, sqrt_oracles(x.reshape(-1))[0].view(x.shape)).any()
    for got, x, y in zip(fe.div(xs, ys), xs, ys):
        assert got.shape == x.shape and torch.equal(got, x / y)
    assert fe.sqrt([]) == [] and fe.div([], []) == []
    one = fe.scalar_div(torch.ones(()), torch.tensor(3.0))
    assert one.shape == () and one.item() == np.float32(1) / np.float32(3)


@pytest.mark.parametrize("call,error", [
    (lambda: fe.sqrt([torch.ones(2, dtype=torch.float64)]), TypeError),
    (lambda: fe.div([torch.ones(2)], [torch.ones(2, dtype=torch.float16)]), TypeError),
    (lambda: fe.div([torch.ones(2)], [torch.ones(3)]), ValueError),
    (lambda: fe.div([torch.ones(2)], []), ValueError),
])
def test_bad_input(call, error):
    with pytest.raises(error):
        call()


# --- the tests can fail ----------------------------------------------------------------------

def test_the_perturbed_approximation_alone_is_not_exact():
    x = binade(0x3F800000, 0x3F900000)
    got = perturbed(torch.sqrt, 1, 0)(x)
    assert mismatches(got, sqrt_oracles(x)[0]).float().mean() > 0.3
    a, b = DIV_CASES["random 10^6 pairs"]()
    got = perturbed(torch.div, 1, 0)(a, b)
    assert mismatches(got, div_oracles(a, b)[0]).float().mean() > 0.3


REMOVED = {  # a correction step replaced by "keep the value", and the error that then shows
    "sqrt neighbour test, 1 ulp": ("_neighbours", lambda c: (c, c), "sqrt", 1),
    "sqrt Newton step, 64 ulp": ("_sqrt_newton", lambda xs, r0, div: r0, "sqrt", fe.APPROX_ULPS),
    "div neighbour test, 1 ulp": ("_neighbours", lambda c: (c, c), "div", 1),
    "div Newton step, 64 ulp": ("_div_newton", lambda xs, ys, yh, yl, q0, div: q0, "div",
                                fe.APPROX_ULPS),
}


@pytest.mark.parametrize("removed", sorted(REMOVED))
def test_removing_a_correction_step_is_caught(monkeypatch, removed):
    name, stub, op, ulps = REMOVED[removed]
    monkeypatch.setattr(fe, name, stub)
    with pytest.raises(AssertionError):
        if op == "sqrt":
            _check_sqrt(binade(0x3F800000, 0x3F880000), ulps)
        else:
            test_div_bitwise("random 10^6 pairs", ulps)


# --- launches --------------------------------------------------------------------------------

FREE = ("view", "alias", "slice", "expand", "scalar_tensor")  # metadata, or a host scalar


class CountOps(TorchDispatchMode):
    """The aten ops that launch work on a device, and the dtypes they produce."""

    def __init__(self):
        super().__init__()
        self.ops, self.dtypes = [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(word in str(func) for word in FREE):
            self.ops.append(func)
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.dtypes.add(t.dtype)
        return out


@pytest.mark.parametrize("name", ["sqrt", "div"])
def test_launches_per_call_are_few_and_independent_of_the_number_of_tensors(name):
    def run(n):
        xs = [torch.rand(5) + 0.5 for _ in range(n)]
        with CountOps() as mode:
            fe.sqrt(xs) if name == "sqrt" else fe.div(xs, xs)
        return mode

    one, two, many = run(1), run(2), run(40)
    assert len(two.ops) == len(many.ops) and len(one.ops) <= len(two.ops) <= len(one.ops) + 2
    assert len(many.ops) <= fe.OP_COUNTS[name]
    assert many.dtypes <= {torch.float32, torch.bool}
