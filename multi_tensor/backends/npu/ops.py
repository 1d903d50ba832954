r"""The NPU backend's ``scale`` and ``l2norm``: fp32 only, a fixed number of launches per call.

apex's helpers as :mod:`multi_tensor.backends.reference` defines them, for a device without fp64
(the Ascend AI Core) and without host reads: the non-finite check sets ``noop_flag`` on the
device (``masked_fill_``), nothing is read back.

Where the tensors are views of one buffer without gaps (the NPU backend's flat grad buffers,
:mod:`multi_tensor.backends.npu.flat`), the op runs on that buffer as one tensor; otherwise on the
list, with ``torch._foreach_*`` ops (``scale``) or one concatenation (``l2norm``), so the launches
do not grow with the number of tensors.

``scale``: ``dst = src * scale``, the product formed in fp32 (the factor rounded once to fp32,
as the reference's ``src.to(fp32) * scale`` does) and rounded once into ``dst``: bitwise the
reference. On a flat fp32 buffer: the product (one launch, written into ``dst``) and the flag
(``isfinite``, ``all``, ``logical_not``, ``masked_fill_``: four launches).

``l2norm``: the fp32 norm of the flat vector ``x`` (the buffer, or the list concatenated in list
order), deterministic and independent of how ``x`` is split into tensors:

1. ``amax = max |x|`` (NaN propagates): the non-finite check, and a power-of-two scale ``S``
   (``2^-80`` if ``amax > 2^40``, ``2^120`` if ``amax < 2^-90``, ``2^60`` if ``amax < 2^-30``,
   else 1) that keeps every square of ``y = S x`` and their sum inside the fp32 range for up to
   2^31 elements, and the sum at least ``2^-80`` (exact: a power of two).
2. The squares ``y*y`` (one rounding each) summed by a fixed tree of three levels whose shape
   depends only on ``n`` (:func:`_tree_sum`): blocks of ``B = max(BLOCK, ceil(n^(1/3)))``
   elements (a ``(n // B, B)`` view summed along its rows, the tail as one more block, maybe of
   no element), the block sums summed again the same way, then what is left (at most ``B + 1``
   values) in one sum. Always the same seven launches, so a capturable step's launches do not
   depend on the bucket's size.
3. ``norm = sqrt(sum) / S``.

Error bound (against the exact norm of the fp32 inputs). The terms are nonnegative, so a sum of
``k`` of them computed in any order is within ``gamma_(k-1)`` (``gamma_j = j u / (1 - j u)``,
``u = 2^-24``) of its exact value, relative. With ``d`` the most additions on one path of the
tree (:func:`norm_bound`: at most ``3 (B - 1) + 1``), the computed sum of squares is within
``gamma_(d + 1)`` (the squares' own rounding included), and the norm within half that, plus the
sqrt's error (``APPROX_ULPS`` ulp at most: the device's sqrt), plus ``2^-38`` for squares of
terms far below ``amax`` lost to underflow (the sum is at least ``2^-80``, each lost square under
``2^-149``), plus one rounding of the result when it is subnormal. For ``n <= 2^20``
(``d <= 2047``) that is ``6.9e-5`` relative; the reference's fp64 sum is exact to ``1e-16``. The
bound holds whatever order the device sums a block in (CPU torch sums pairwise, so measured
errors are orders of magnitude smaller).

``per_tensor=True`` adds each tensor's norm by the same blocked sum over that tensor (a loop over
the tensors: launches grow with their number, unlike the total).

``quick_norm``: the norm in one read of ``x``, for a caller that reads the result on the host
anyway (the clipped step, whose non-finite norm skips the step) and can recompute with
``norm_flat`` when it is not trusted. The device's fp32 vector norm of each ``BLOCK``-element
block (``linalg_vector_norm`` over the ``(n // BLOCK, BLOCK)`` view, the tail as one more block:
no temporary the size of ``x``), then ``sqrt`` of the blocked sum of the squared block norms.
Unscaled, so a square or a sum may overflow (the result is then inf) or squares may underflow
(the result is then small): the result is trusted when it is finite and at least
:data:`QUICK_MIN`. A NaN result means a NaN in ``x`` (squares, sums and square roots of values
that are not NaN are never NaN). Bound of a trusted result, with ``L`` levels of the blocked sum
over the ``n // BLOCK + 1`` block norms (the tail's, maybe of no element, always one of them):
each block's sum of squares within ``gamma_BLOCK``, the square of its norm one rounding more,
the tree ``L (BLOCK - 1)`` more, so the sum within ``gamma_((L + 1)(BLOCK - 1) + 2)``; the norm
within half that, plus two device square roots (``APPROX_ULPS`` ulp each: the blocks' and the
last), plus ``2^-38`` for the squares lost to underflow (at most ``2^31`` of them, each under
``2^-149``, against a sum of at least ``2^-80``). For ``n < 2^20`` (``L = 1``) that is
``7.6e-5`` relative (:func:`quick_bound`). It assumes the device's block norm sums the fp32
squares of a block in some order and takes an fp32 square root (inf on overflow, as the AI
Core's default INF/NaN mode gives).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .. import reference
from . import flat

BLOCK = 1024
"""Elements per block of the blocked sum (the tree's fan-in)."""

QUICK_MIN = 2.0 ** -40
"""The smallest :func:`quick_norm` result that is trusted (its square is at least ``2^-80``)."""

_U = 2.0 ** -24
_APPROX_ULPS = 64  # fp32_exact.APPROX_ULPS: the device's fp32 sqrt may be this many ulp off

_BIG, _SMALL, _TINY = 2.0 ** 40, 2.0 ** -30, 2.0 ** -90
_DOWN, _UP, _UP_MORE = 2.0 ** -80, 2.0 ** 60, 2.0 ** 120


def device_sqrt(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """The device's own fp32 sqrt (one launch): the ``torch`` path's where it is known to be
    correctly rounded (:data:`multi_tensor.backends.npu.IEEE_ENV`)."""
    return torch._foreach_sqrt(tensors)


def device_div(a: List[torch.Tensor], b: List[torch.Tensor]) -> List[torch.Tensor]:
    """The device's own fp32 division (one launch), as :func:`device_sqrt`."""
    return torch._foreach_div(a, b)


def _refuse_fp64(op: str, lists) -> None:
    for name, tensors in lists:
        for i, t in enumerate(tensors):
            if t.dtype == torch.float64:
                raise TypeError(f"multi_tensor_{op} on the NPU backend: {name}[{i}] is float64, "
                                f"and the Ascend AI Core has no fp64 arithmetic")


def _one_buffer(tensors: List[torch.Tensor], *, writable: bool) -> Optional[torch.Tensor]:
    """The 1-D buffer ``tensors`` tile without gaps (in its storage order), else None."""
    if not tensors:
        return None
    layout = flat.FlatLayout.of_views(tensors)
    if layout is None or not layout.gap_free:
        return None
    t = tensors[0]
    return flat.alias(tensors, layout, t.dtype, t.device, writable=writable)


def _flag_unless(noop_flag: torch.Tensor, finite: torch.Tensor) -> None:
    """``noop_flag = 1`` where ``finite`` (a 0-dim bool tensor) is False, on the device."""
    noop_flag.masked_fill_(finite.logical_not(), 1)


# --- scale -----------------------------------------------------------------------------------

def scale(chunk_size, noop_flag, tensor_lists, scale_factor):
    """apex ``multi_tensor_scale`` (see the module docstring): bitwise the reference's."""
    del chunk_size
    srcs, dsts = list(tensor_lists[0]), list(tensor_lists[1])
    if not srcs:
        return
    _refuse_fp64("scale", (("srcs", srcs), ("dsts", dsts)))
    s = reference.rounded(float(scale_factor), torch.float32)
    src = _one_buffer(srcs, writable=False)
    dst = None if src is None else flat.alias(dsts, flat.FlatLayout.of_views(srcs), dsts[0].dtype,
                                              dsts[0].device)
    if src is not None and dst is not None:
        _flag_unless(noop_flag, torch.isfinite(src).all())
        if src.dtype == torch.float32 and dst.dtype == torch.float32:
            torch.mul(src, s, out=dst)
        else:
            dst.copy_(src.to(torch.float32) * s)
        return
    filled = [t for t in srcs if t.numel()]  # the max norm of an empty tensor is undefined
    if filled:
        peak = torch.stack(torch._foreach_norm(filled, float("inf"))).to(torch.float32)
        _flag_unless(noop_flag, torch.isfinite(peak).all())
    wide = [t if t.dtype == torch.float32 else t.to(torch.float32) for t in srcs]
    flat.copy_all(dsts, torch._foreach_mul(wide, s))


# --- l2norm ----------------------------------------------------------------------------------

def _blocked_sum(v: torch.Tensor) -> torch.Tensor:
    """The sum of a 1-D fp32 tensor by a fixed tree of ``BLOCK``-element sums (0-dim result)."""
    while v.numel() > BLOCK:
        n = v.numel()
        main = n - n % BLOCK
        sums = v.narrow(0, 0, main).view(-1, BLOCK).sum(dim=1)
        if main < n:
            sums = torch.cat([sums, v.narrow(0, main, n - main).sum().reshape(1)])
        v = sums
    return v.sum()


def _tree_block(n: int) -> int:
    """The block of :func:`_tree_sum` over ``n`` values: ``BLOCK``, or the cube root of ``n``
    rounded up where that is larger (three levels cover ``n``)."""
    b = max(BLOCK, round(n ** (1.0 / 3.0)))
    while b ** 3 < n:
        b += 1
    return b


def _tree_levels(n: int) -> List[int]:
    """How many values each of :func:`_tree_sum`'s three sums adds up, the block's size bounding
    the first two."""
    b = _tree_block(n)
    sizes = []
    for _ in range(2):
        sizes.append(min(n, b))
        n = n // b + 1
    return sizes + [n]


def _tree_sum(v: torch.Tensor) -> torch.Tensor:
    """The sum of a 1-D fp32 tensor by a fixed three-level tree (0-dim result; the module
    docstring): seven launches whatever its size."""
    b = _tree_block(v.numel())
    for _ in range(2):
        n = v.numel()
        main = n - n % b
        sums = v.narrow(0, 0, main).view(main // b, b).sum(dim=1)
        v = torch.cat([sums, v.narrow(0, main, n - main).sum().reshape(1)])
    return v.sum()


def norm_bound(n: int) -> float:
    """The relative error bound of :func:`norm_flat` over ``n`` elements (module docstring)."""
    adds = sum(max(k - 1, 0) for k in _tree_levels(n))
    return 0.5 * _gamma(adds + 1) + _APPROX_ULPS * 2.0 ** -23 + 2.0 ** -38


_RANGES: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}


def _ranges(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The scale's lookup tables on ``device``, made once (no host-to-device copy per step, and
    none inside a captured graph after the first use).

    ``bounds``: ``amax < bounds`` holds for ``count`` of them, ``count`` = 0 (inf, NaN), 1
    (above ``2^40``: ``2^40``'s successor is the first bound, so ``amax = 2^40`` itself counts
    2), 2 (the middle), 3 (below ``2^-30``), 4 (below ``2^-90``). ``scales[:, count]``: ``S``
    and ``1/S``, exact powers of two."""
    found = _RANGES.get(device)
    if found is None:
        above_big = float(torch.nextafter(torch.tensor(_BIG, dtype=torch.float32),
                                          torch.tensor(float("inf"))))
        bounds = torch.tensor([_TINY, _SMALL, above_big, float("inf")], dtype=torch.float32)
        scales = torch.tensor([[1.0, _DOWN, 1.0, _UP, _UP_MORE],
                               [1.0, 1.0 / _DOWN, 1.0, 1.0 / _UP, 1.0 / _UP_MORE]],
                              dtype=torch.float32)
        found = _RANGES[device] = (bounds.to(device), scales.to(device))
    return found


def norm_flat(x: torch.Tensor, noop_flag: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp32 L2 norm of the 1-D tensor ``x`` (0-dim), setting ``noop_flag`` if it holds a
    non-finite value (see the module docstring). The scale is chosen on the device in a fixed
    three launches (:func:`_ranges`: a comparison with four bounds, their count, a lookup), the
    flag in two more (a test of the count and a fill; none without a flag: a non-finite value
    gives a non-finite norm), none of them a host read; the sum in seven (:func:`_tree_sum`)."""
    x = x if x.dtype == torch.float32 else x.to(torch.float32)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    bounds, scales = _ranges(x.device)
    amax = torch.linalg.vector_norm(x, float("inf"))  # max |x| in one read (NaN propagates)
    count = torch.lt(amax, bounds).sum()
    if noop_flag is not None:
        noop_flag.masked_fill_(count == 0, 1)
    s, s_inv = scales.index_select(1, count.reshape(1)).unbind(0)
    y = x * s
    return torch.sqrt(_tree_sum(y * y)) * s_inv.reshape(())


def _gamma(k: int) -> float:
    return k * _U / (1 - k * _U)


def quick_bound(n: int) -> float:
    """The relative error bound of a trusted :func:`quick_norm` of ``n`` elements."""
    blocks, levels = n // BLOCK + 1, 1
    while blocks > BLOCK:
        blocks, levels = -(-blocks // BLOCK), levels + 1
    return (0.5 * _gamma((levels + 1) * (BLOCK - 1) + 2) + 2 * _APPROX_ULPS * 2.0 ** -23
            + 2.0 ** -38)


def quick_norm(x: torch.Tensor) -> torch.Tensor:
    """The fp32 L2 norm of the 1-D tensor ``x`` (any float dtype but fp64) in one read, not
    range-safe: trusted only when finite and at least :data:`QUICK_MIN` (see the module
    docstring). Always the same ops whether or not ``n`` is a multiple of ``BLOCK``, so the
    launches depend only on the number of levels of the sum."""
    n = x.numel()
    main = n - n % BLOCK
    blocks = torch.linalg.vector_norm(x.narrow(0, 0, main).view(-1, BLOCK), dim=1,
                                      dtype=torch.float32)
    tail = torch.linalg.vector_norm(x.narrow(0, main, n - main), dtype=torch.float32)
    b = torch.cat([blocks, tail.reshape(1)])
    return torch.sqrt(_blocked_sum(b * b))


def l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """apex ``multi_tensor_l2norm``: ``(total_norm, per_tensor_norms)`` as fp32 tensors (see the
    module docstring for the sum and its error bound)."""
    del chunk_size
    tensors = [t.detach() for t in tensor_lists[0]]
    device = tensors[0].device if tensors else noop_flag.device
    _refuse_fp64("l2norm", (("tensors", tensors),))
    if not tensors:
        return (torch.zeros((), dtype=torch.float32, device=device),
                torch.zeros(0, dtype=torch.float32, device=device))
    x = _one_buffer(tensors, writable=False)
    if x is None:
        x = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
    total = norm_flat(x, noop_flag)
    if per_tensor:
        per = torch.stack([norm_flat(t.reshape(-1)) for t in tensors])
    else:
        per = torch.zeros(0, dtype=torch.float32, device=device)
    return total, per
