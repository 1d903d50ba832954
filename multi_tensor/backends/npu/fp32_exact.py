r"""Correctly rounded (IEEE-754, round to nearest even) fp32 ``sqrt`` and ``div`` from fp32 ops only.

For devices without fp64 arithmetic (the Ascend AI Core): the reference backend computes fp32
sqrt through fp64, which such a device cannot run, and trusts the device's fp32 division, which
CANN does not document as correctly rounded. Here both are built from operations every such
device has and that IEEE-754 makes exact or correctly rounded: fp32 multiplication, addition,
subtraction, comparison, ``where`` and ``abs``. The device's own fp32 ``sqrt`` and division are
used only as a first approximation, which may be off by up to :data:`APPROX_ULPS` ulp (a
faithful result needs 1; see "Why 64" below). No fp64, no fused multiply-add, no integer bit
manipulation.

Each function takes a list of fp32 tensors and returns a list (the ``torch._foreach_*``
convention). The work runs on one flat tensor: a one-element list (the NPU backend's flat bucket)
is used as is; a longer list is concatenated once (one launch) and the results are views of one
output. So the number of launches per call is a constant, independent of the number of tensors:
74 elementwise ops for ``sqrt`` and 172 for ``div`` on a list (one fewer each, the
concatenation, on a one-element list; :data:`OP_COUNTS`), each one pass over the flat tensor.

The tools (all exact in fp32 when nothing under- or overflows):

* Veltkamp split by ``4097 = 2^12 + 1``: ``a = hi + lo`` exactly, each half of at most 12
  significant bits; Dekker's product ``a*b = p + e`` exactly with ``p = fl(a*b)`` and
  ``e = ((ah*bh - p) + ah*bl + al*bh) + al*bl`` (every partial sum is exact; Dekker 1971).
* Successor / predecessor without bit tricks (Rump, Zimmermann, Boldo, Melquiond 2009):
  ``e = fl(c * phi)`` with ``phi = 2^-24 (1 + 2^-23)``; for a positive normal ``c`` with
  ``c*phi`` normal, ``fl(c + e) = succ(c)`` and ``fl(c - e) = pred(c)``.
* Sterbenz: ``x - y`` is exact when ``y/2 <= x <= 2y``.
* Power-of-two scaling is exact while the result is a normal number.

``sqrt(x)``, ``x > 0`` finite (others: ``+-0 -> +-0``, ``+inf -> +inf``, negative or NaN ``-> NaN``):

1. Scale into ``[2^-64, 2^64)``: ``x < 2^-64`` times ``2^100`` (subnormals included),
   ``x >= 2^64`` times ``2^-64``; the result is scaled back by the square root of the factor,
   exactly (sqrt of a positive fp32 is always a normal number, so no subnormal output).
2. ``r0`` = the device's sqrt, within N ulp. One Newton step with an exact residual:
   ``r0^2 = p + e`` (Dekker), ``x - p`` exact (Sterbenz), ``r1 = r0 + fl((x - p) - e) / (2 r0)``.
   Then ``|r1 - sqrt(x)| <= 1/2 ulp + (N^2 2^-22) ulp < 1 ulp`` for ``N <= 2^10``: the correct
   result is ``pred(r1)``, ``r1`` or ``succ(r1)``.
3. Tuckerman's test picks it. With ``r+ = succ(r)``, the midpoint ``m = (r + r+)/2`` has
   ``m^2 = r r+ + (r+ - r)^2/4``; ``x`` and ``r r+`` are multiples of ``ulp(r)^2`` while the
   last term is a quarter of it, so ``sqrt(x) > m`` iff ``x > r r+``. Likewise, with
   ``r- = pred(r)``, ``sqrt(x) < (r- + r)/2`` iff ``x <= r- r`` (``x = r- r`` can happen when
   ``r`` is a power of two). Both products are formed exactly (Dekker: ``p + e``) and compared
   as ``x - p`` (exact, Sterbenz) against ``e``. No ties: a midpoint has 25 significant bits,
   its square cannot be an fp32.

``div(a, b)``, both finite and nonzero (any other pair: the device's own ``a / b``, whose values
there are the exact special values 0, inf, NaN with IEEE signs; ``tools/npu_check.py`` checks
the device on them). On ``|a|``, ``|b|``, the sign applied at the end (exact):

1. Scale each operand into ``[2^-32, 2^32)`` by two rounds of ``* 2^64`` (below ``2^-32``) or
   ``* 2^-64`` (from ``2^32``), counting the rounds: ``a' = a 2^(64 ka)``, ``b' = b 2^(64 kb)``,
   ``q = q' 2^(64 D)`` with ``D = kb - ka`` in ``[-4, 4]`` and ``q' = a'/b'`` in ``(2^-64, 2^64)``,
   where every product below is exact.
2. ``q0`` = the device's ``a'/b'``, within N ulp; one Newton step with the exact residual:
   ``b' q0 = p + e``, ``q1 = q0 + fl((a' - p) - e) / b'``, within ``1/2 ulp + (N^2 2^-22) ulp``.
3. The grid the result lives on: ``ulp`` of ``q'``, or, when ``q`` is subnormal, the subnormal
   grid ``G = 2^-149`` scaled by ``2^(-64 D)``: ``c`` = ``q1`` rounded to ``G`` (``(q1 + C) - C``,
   ``C = 2^23 G``, exact) where ``q1 < 2^23 G``, else ``q1``. The correct result is ``c`` or a
   grid neighbour: ``c + U+`` or ``c - U-`` (``U+ = max(succ(c) - c, G)``,
   ``U- = max(c - pred(c), G)``).
4. The residual ``t = a' - b' c`` is exact in fp32 (for a faithful ``c``, Boldo and Daumas; on
   the subnormal grid: an integer rounding, where ``|t| <= 0.6 b' U`` and ``t`` is a multiple of
   ``ulp(b') U``, or ``c`` is 0 or one grid step and Sterbenz applies): Dekker gives
   ``b' c = p + e``, then ``t = fl((a' - p) - e)``. Up iff ``t > b' U+/2``; down iff
   ``t < -b' U-/2``; a tie (possible on the subnormal grid only) goes to the even multiple of
   ``G``. The thresholds are exact (a power-of-two multiple of ``b'``).
5. Scale back by ``2^(64 D)``: four exact steps of ``2^+-64``; overflow rounds to inf exactly as
   RNE does (the scaled result was already rounded to 24 bits, and ``2^128`` is where RNE
   overflows), and a subnormal result is already on its grid, so every step is exact.
   ``D = -4`` means ``|q| < 2^-192``: zero.

Why 64 (:data:`APPROX_ULPS`): after the Newton step the error is ``1/2 ulp`` (its rounding) plus
``N^2 2^-22`` ulp (the square of the first error, and the device's division error on the
correction), below 1 ulp for N up to about 2^10; the tests perturb the approximation by up to
64 ulp (and the exhaustive tool by one), with margin. Without the Newton step N would be 1.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

APPROX_ULPS = 64
"""The device's fp32 sqrt and division may be this many ulp off: the results stay exact."""

OP_COUNTS = {"sqrt": 74, "div": 172}
"""Elementwise ops (launches on a device) per call on a list, each over the whole flat tensor,
as ``tests/test_fp32_exact.py`` counts them (views and host scalars are not launches)."""

_SPLIT = 4097.0                       # 2^12 + 1: Veltkamp's constant for a 24-bit significand
_PHI = 2.0 ** -24 + 2.0 ** -47        # u (1 + 2u), u = 2^-24 (exactly an fp32)
_TWO23 = 2.0 ** 23

Approx = Callable[..., torch.Tensor]


# --- error-free pieces -----------------------------------------------------------------------

def _split(a: torch.Tensor):
    """Veltkamp: ``a = hi + lo`` exactly, ``hi`` and ``lo`` of at most 12 significant bits."""
    t = a * _SPLIT
    hi = t - (t - a)
    return hi, a - hi


def _prod_err(ah, al, bh, bl, p):
    """Dekker: the exact ``a*b - p`` for ``p = fl(a*b)``, from the two splits."""
    return ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _neighbours(c: torch.Tensor):
    """``(succ(c), pred(c))`` for a positive normal ``c`` with ``c * phi`` normal."""
    e = c * _PHI
    return c + e, c - e


# --- flat in, list out -----------------------------------------------------------------------

def _flat(tensors: List[torch.Tensor]) -> torch.Tensor:
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(out: torch.Tensor, like: List[torch.Tensor]) -> List[torch.Tensor]:
    if len(like) == 1:
        return [out.view(like[0].shape)]
    views, pos = [], 0
    for t in like:
        n = t.numel()
        views.append(out.narrow(0, pos, n).view(t.shape))
        pos += n
    return views


def _check(name: str, tensors: List[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        if t.dtype != torch.float32:
            raise TypeError(f"fp32_exact.{name}: tensors[{i}] is {t.dtype}; only float32")


# --- sqrt ------------------------------------------------------------------------------------

def _sqrt_newton(xs: torch.Tensor, r0: torch.Tensor, approx_div: Approx) -> torch.Tensor:
    """One Newton step from the device's ``r0`` on the exact residual ``xs - r0^2``."""
    h, lo = _split(r0)
    p = r0 * r0
    e = ((h * h - p) + (h * lo) * 2.0) + lo * lo
    return r0 + approx_div((xs - p) - e, r0 * 2.0)


def _div_newton(xs, ys, yh, yl, q0, approx_div: Approx) -> torch.Tensor:
    """One Newton step from the device's ``q0`` on the exact residual ``xs - ys q0``."""
    qh, ql = _split(q0)
    p = ys * q0
    return q0 + approx_div((xs - p) - _prod_err(yh, yl, qh, ql, p), ys)


def sqrt_flat(x: torch.Tensor, approx_sqrt: Approx = torch.sqrt,
              approx_div: Approx = torch.div) -> torch.Tensor:
    """The correctly rounded sqrt of one fp32 tensor (see the module docstring)."""
    small = x < 2.0 ** -64
    big = x >= 2.0 ** 64
    xs = torch.where(small, x * 2.0 ** 100, torch.where(big, x * 2.0 ** -64, x))
    r1 = _sqrt_newton(xs, approx_sqrt(xs), approx_div)
    # Tuckerman's test against both neighbours
    up, dn = _neighbours(r1)
    h1, l1 = _split(r1)
    hu, lu = _split(up)
    pu = r1 * up
    go_up = (xs - pu) > _prod_err(h1, l1, hu, lu, pu)
    hd, ld = _split(dn)
    pd = dn * r1
    go_dn = (xs - pd) <= _prod_err(hd, ld, h1, l1, pd)
    r = torch.where(go_up, up, torch.where(go_dn, dn, r1))
    r = torch.where(small, r * 2.0 ** -50, torch.where(big, r * 2.0 ** 32, r))
    regular = (x > 0.0) & (x < float("inf"))
    # masked_fill, not where: a Python scalar in where is a tensor made on the device (a launch)
    return torch.where(regular, r, x.masked_fill(x < 0.0, float("nan")))


def sqrt(tensors: List[torch.Tensor], approx_sqrt: Approx = torch.sqrt,
         approx_div: Approx = torch.div) -> List[torch.Tensor]:
    """Correctly rounded sqrt of a list of fp32 tensors (``torch._foreach_sqrt``'s form)."""
    if not tensors:
        return []
    _check("sqrt", tensors)
    return _unflat(sqrt_flat(_flat(tensors), approx_sqrt, approx_div), tensors)


# --- div -------------------------------------------------------------------------------------

def _into_range(x: torch.Tensor):
    """``x`` (positive) scaled into ``[2^-32, 2^32)`` by two rounds of ``2^+-64``, and the
    number of ``2^64`` factors applied (a small integer-valued fp32 tensor)."""
    k = None
    for _ in range(2):
        lo = x < 2.0 ** -32
        hi = x >= 2.0 ** 32
        x = torch.where(lo, x * 2.0 ** 64, torch.where(hi, x * 2.0 ** -64, x))
        step = lo.to(x.dtype) - hi.to(x.dtype)
        k = step if k is None else k + step
    return x, k


def div_flat(a: torch.Tensor, b: torch.Tensor, approx_div: Approx = torch.div) -> torch.Tensor:
    """The correctly rounded ``a / b`` of fp32 tensors (broadcast; see the module docstring)."""
    a, b = torch.broadcast_tensors(a, b)
    regular = torch.isfinite(a) & torch.isfinite(b) & (a != 0.0) & (b != 0.0)
    xs, ka = _into_range(a.abs())
    ys, kb = _into_range(b.abs())
    d = kb - ka
    # 1. the device's approximation, one Newton step on the exact residual
    yh, yl = _split(ys)
    q1 = _div_newton(xs, ys, yh, yl, approx_div(xs, ys), approx_div)
    # 2. the grid: ulp(q1), or the subnormal grid scaled by 2^(-64 D) where it is coarser
    # (filled in place: a Python scalar in where is a tensor made on the device, a launch)
    grid, inv_grid = torch.zeros_like(q1), torch.zeros_like(q1)
    for k, g, inv in ((-3.0, 2.0 ** 43, 2.0 ** -43), (-2.0, 2.0 ** -21, 2.0 ** 21),
                      (-1.0, 2.0 ** -85, 2.0 ** 85)):
        at = d == k
        grid.masked_fill_(at, g)
        inv_grid.masked_fill_(at, inv)
    big_c = grid * _TWO23
    c = torch.where(q1 < big_c, (q1 + big_c) - big_c, q1)
    up, dn = _neighbours(c)
    u_up = torch.maximum(up - c, grid)
    u_dn = torch.maximum(c - dn, grid)
    # 3. the exact residual t = a' - b' c, against the half-steps to the neighbours
    ch, cl = _split(c)
    p = ys * c
    t = (xs - p) - _prod_err(yh, yl, ch, cl, p)
    half_up = ys * u_up * 0.5
    half_dn = ys * u_dn * 0.5
    n_half = c * inv_grid * 0.5          # on the subnormal grid: c / G / 2, an integer iff even
    odd = ((n_half + _TWO23) - _TWO23) != n_half
    go_up = (t > half_up) | ((t == half_up) & odd)
    go_dn = (t < -half_dn) | ((t == -half_dn) & odd)
    q = torch.where(go_up, c + u_up, torch.where(go_dn, c - u_dn, c))
    # 4. back to the operands' scale: 2^(64 D) in four exact steps
    for j in (1.0, 2.0, 3.0, 4.0):
        q = torch.where(d >= j, q * 2.0 ** 64, torch.where(d <= -j, q * 2.0 ** -64, q))
    q = torch.where((a < 0.0) != (b < 0.0), -q, q)
    return torch.where(regular, q, approx_div(a, b))


def div(numerators: List[torch.Tensor], denominators: List[torch.Tensor],
        approx_div: Approx = torch.div) -> List[torch.Tensor]:
    """Correctly rounded ``numerators[i] / denominators[i]`` (``torch._foreach_div``'s form),
    fp32 tensors of matching shapes."""
    if not numerators:
        return []
    _check("div", numerators)
    _check("div", denominators)
    if len(numerators) != len(denominators):
        raise ValueError(f"fp32_exact.div: {len(numerators)} numerators, "
                         f"{len(denominators)} denominators")
    for i, (n, m) in enumerate(zip(numerators, denominators)):
        if n.shape != m.shape:
            raise ValueError(f"fp32_exact.div: numerators[{i}] has shape {tuple(n.shape)}, "
                             f"denominators[{i}] {tuple(m.shape)}")
    out = div_flat(_flat(numerators), _flat(denominators), approx_div)
    return _unflat(out, numerators)


def scalar_div(numerator: torch.Tensor, denominator: torch.Tensor,
               approx_div: Optional[Approx] = None) -> torch.Tensor:
    """Correctly rounded division of fp32 tensors that broadcast (e.g. a 0-dim scale)."""
    return div_flat(numerator, denominator, approx_div or torch.div)
