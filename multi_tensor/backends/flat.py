"""Flat buckets: one contiguous buffer per kind of tensor, per-tensor views into it.

Megatron's ``ParamAndGradBuffer``, apex's ``DistributedFusedAdam`` and DeepSpeed ZeRO keep the
optimizer state of a bucket in one buffer per kind with a view per param. A *per-tensor* device
operator (CANN's ``aclnnApplyFusedEmaAdam`` is one) then covers the whole bucket in one launch
over the buffers. This module is the device-agnostic part of that: the layout, the buffers, and
the three ways a list of tensors can sit in one.

* :class:`FlatLayout`: where each tensor of a bucket lives in the flat buffers (element offsets;
  the same layout for every kind, so element ``i`` of every buffer belongs to the same param
  element). :meth:`FlatLayout.packed` packs in list order with every view starting at a multiple
  of :data:`ALIGN_BYTES`; :meth:`FlatLayout.of_views` reads the layout off tensors that already
  tile one buffer without gaps (Megatron-style params), so that buffer is used as is.
* :class:`FlatList`: one kind (say the ``exp_avg`` of every param of the bucket) in one buffer:

  - ``alias``: the tensors already *are* the views (nothing to copy, ever). Either they tile a
    region of someone's buffer without gaps (safe to write: it holds exactly these tensors), or
    they sit in a buffer this module allocated with exactly this layout (its gaps are our
    padding): re-preparing a bucket whose state was flattened before copies nothing;
  - re-pointed, then ``alias``: the tensors are plain tensors this process owns (optimizer
    state); their values are copied into a new buffer once and each tensor object is re-pointed
    at its view (``Tensor.set_``), so ``optimizer.state`` keeps the same objects, now views;
  - ``staged``: tensors that cannot be re-pointed (autograd views such as ``view_as_real`` of
    complex state, tensor subclasses, tensors that require grad, a caller's tensors in a
    one-shot functional call) are copied in before and out after every run.

Decision: this is an engine *capability*, not an NPU detail: nothing here knows about a device,
an op or a rule, and any backend may call it. It is used only by the NPU backend
(:mod:`multi_tensor.backends.npu`) and deliberately *not* wired into the CPU or GPU backends:
their kernels take a table of tensor addresses and already cover any number of tensors in one
launch, so flattening would buy them nothing and cost them a grad gather per step (one more read
and write of every grad) and the re-pointing below. A backend whose device operator is
per-tensor, or that wants zero-copy Megatron-style grads, opts in by using this module.

Costs, documented where users meet them (docs/npu.md):

* State tensors become views of shared storage. ``state_dict()`` still returns one tensor per
  param and entry (the format does not change) and ``torch.save`` of the whole dict writes each
  buffer once; ``torch.save`` of a *single* state tensor writes its whole buffer (as for any
  view). ``load_state_dict`` replaces the state tensors and clears the optimizer's plans, so the
  next step flattens again.
* Re-flattening (a param without a grad this step makes a smaller bucket) copies the bucket's
  state into new buffers; the state of the params left out stays in the old buffer, which lives
  until none of its views is left.
* Padding: each view starts at a multiple of :data:`ALIGN_BYTES` (512 bytes: 128 fp32 elements),
  so a packed buffer is at most ``ALIGN_BYTES`` per tensor larger than the tensors. Padding is
  zero-filled once and, with zero grads, stays finite under an Adam update.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

try:  # a weak reference to a storage, that knows when the storage is gone
    from torch.multiprocessing.reductions import StorageWeakRef
except ImportError:  # pragma: no cover - torch builds without multiprocessing
    StorageWeakRef = None

ALIGN_BYTES = 512
"""Every packed view starts at a multiple of this many bytes from the buffer's start.

512 bytes is the Ascend caching allocator's block alignment (so each view is as aligned as a
tensor allocated on its own) and a multiple of the 32-byte unit Ascend vector instructions load;
it is 128 fp32 / 256 fp16 or bf16 / 64 fp64 elements.
"""

_EXACT_CONVERSIONS = {
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float64), (torch.bfloat16, torch.float64),
    (torch.float32, torch.float64),
}


def converts_exactly(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every ``src`` value (inf and NaN included) is representable in ``dst``."""
    return src == dst or (src, dst) in _EXACT_CONVERSIONS


def align_elements(dtypes: Sequence[torch.dtype], align_bytes: int = ALIGN_BYTES) -> int:
    """The element alignment that puts every view of every buffer on ``align_bytes``.

    All buffers of a bucket share one layout in elements, so the narrowest dtype decides.
    """
    itemsize = min(torch.empty((), dtype=d).element_size() for d in dtypes)
    return max(1, align_bytes // itemsize)


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a bucket lives in its flat buffers (offsets in elements).

    ``total`` covers every view (and the padding). Offsets need not be increasing in list order
    (Megatron lays params out in reverse), but views never overlap.
    """

    shapes: Tuple[torch.Size, ...]
    offsets: Tuple[int, ...]
    total: int

    @property
    def numels(self) -> Tuple[int, ...]:
        return tuple(_numel(s) for s in self.shapes)

    @property
    def gap_free(self) -> bool:
        """Whether the views tile ``[0, total)`` exactly (no padding, no foreign data)."""
        return sum(self.numels) == self.total

    @staticmethod
    def packed(shapes: Sequence[torch.Size], align: int = 1) -> "FlatLayout":
        """Tensors one after another in list order, each view starting at a multiple of ``align``."""
        offsets, pos = [], 0
        for shape in shapes:
            pos = _round_up(pos, align)
            offsets.append(pos)
            pos += _numel(shape)
        return FlatLayout(tuple(torch.Size(s) for s in shapes), tuple(offsets), _round_up(pos, align))

    @staticmethod
    def of_views(tensors: Sequence[torch.Tensor]) -> Optional["FlatLayout"]:
        """The layout of tensors that tile one region of one storage without gaps, else None.

        Every tensor must be contiguous, of one dtype and device, and the union of their element
        ranges must be one contiguous range (any order). Empty tensors sit anywhere (offset 0).
        """
        if not tensors:
            return None
        first = tensors[0]
        filled = [(t.storage_offset(), t.numel(), i) for i, t in enumerate(tensors) if t.numel()]
        if not filled:
            return None
        ptr = tensors[filled[0][2]].untyped_storage().data_ptr()
        for t in tensors:
            if t.dtype != first.dtype or t.device != first.device or t.layout != torch.strided:
                return None
            if t.numel() and (not t.is_contiguous() or t.untyped_storage().data_ptr() != ptr):
                return None
        filled.sort()
        start = pos = filled[0][0]
        for off, n, _ in filled:
            if off != pos:
                return None
            pos += n
        offsets = [0] * len(tensors)
        for off, _, i in filled:
            offsets[i] = off - start
        return FlatLayout(tuple(t.shape for t in tensors), tuple(offsets), pos - start)

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Each tensor's view of ``flat`` (a 1-D tensor of ``total`` elements)."""
        return [flat.narrow(0, off, _numel(shape)).view(shape)
                for off, shape in zip(self.offsets, self.shapes)]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align if align > 1 else n


# --- buffers this module allocated ------------------------------------------------------------
# storage id -> (weak reference, layout, element offset of the layout's start). A storage found
# here with the same layout is one of ours: its gaps are padding, safe to write.
_owned: Dict[int, Tuple[object, FlatLayout, int]] = {}
_owned_lock = threading.Lock()


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def allocate(layout: FlatLayout, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled flat buffer for ``layout``, remembered as ours (see :func:`alias`)."""
    flat = torch.zeros(layout.total, dtype=dtype, device=device)
    if StorageWeakRef is not None and layout.total:
        with _owned_lock:
            for key in [k for k, (ref, _, _) in _owned.items() if ref.expired()]:
                del _owned[key]
            _owned[_storage_key(flat)] = (StorageWeakRef(flat.untyped_storage()), layout, 0)
    return flat


def _is_owned(t: torch.Tensor, layout: FlatLayout, base: int) -> bool:
    with _owned_lock:
        entry = _owned.get(_storage_key(t))
    if entry is None:
        return False
    ref, owned_layout, owned_base = entry
    return not ref.expired() and owned_layout == layout and owned_base == base


def owned_layout(tensors: Sequence[torch.Tensor]) -> Optional[FlatLayout]:
    """The layout of the buffer this module allocated that ``tensors`` are views of, else None.

    A bucket prepared earlier over the same state (e.g. the EMA and the EMA-free op of one
    optimizer bucket, whose dtypes may ask for different alignments) left the state in such a
    buffer; preparing again on that layout aliases it instead of moving the state elsewhere.
    """
    filled = [t for t in tensors if t.numel()]
    if not filled:
        return None
    with _owned_lock:
        entry = _owned.get(_storage_key(filled[0]))
    if entry is None:
        return None
    ref, layout, _ = entry
    if ref.expired() or layout.shapes != tuple(t.shape for t in tensors):
        return None
    return layout


def alias(tensors: Sequence[torch.Tensor], layout: FlatLayout, dtype: torch.dtype,
          device: torch.device, *, writable: bool = True) -> Optional[torch.Tensor]:
    """The flat tensor whose views (in ``layout``) ``tensors`` already are, else None.

    Every tensor must be a contiguous view of one storage at its layout offset from one common
    base. With gaps in the layout the region also holds whatever is in the gaps, so it is
    returned only when the storage is one :func:`allocate` made for this very layout (the gaps
    are its padding), or when ``writable`` is False and the caller only reads the region.
    """
    filled = [i for i, t in enumerate(tensors) if t.numel()]
    if not tensors or not filled or layout.total == 0:
        return None
    ref = tensors[filled[0]]
    if ref.dtype != dtype or ref.device != device:
        return None
    ptr = ref.untyped_storage().data_ptr()
    base = ref.storage_offset() - layout.offsets[filled[0]]
    if base < 0:
        return None
    for i in filled:
        t = tensors[i]
        if (t.dtype != dtype or t.device != device or t.layout != torch.strided
                or t.shape != layout.shapes[i] or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != ptr
                or t.storage_offset() - layout.offsets[i] != base):
            return None
    for i, t in enumerate(tensors):  # empty ones: only their dtype and device matter
        if t.dtype != dtype or t.device != device or t.shape != layout.shapes[i]:
            return None
    if (base + layout.total) * ref.element_size() > ref.untyped_storage().nbytes():
        return None
    if writable and not layout.gap_free and not _is_owned(ref, layout, base):
        return None
    return ref.detach().as_strided((layout.total,), (1,), base)


def can_repoint(t: torch.Tensor) -> bool:
    """Whether ``t`` may be re-pointed at a view of a new buffer (:func:`repoint`)."""
    return (type(t) is torch.Tensor and not t.requires_grad and not t._is_view()
            and t.layout == torch.strided and not t.is_meta)


def repoint(tensors: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> None:
    """Make each tensor object use its view's storage, offset, shape and strides."""
    with torch.no_grad():
        for t, v in zip(tensors, views):
            t.set_(v.untyped_storage(), v.storage_offset(), v.shape, v.stride())


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair, as one multi-tensor copy (converting dtypes)."""
    if dsts:
        torch._foreach_copy_(list(dsts), list(srcs))


class FlatList:
    """One kind of tensor of a bucket (say every ``exp_avg``) in one flat buffer.

    ``flat``: the 1-D buffer; ``views``: each tensor's view of it; ``staged``: the tensors are
    not the views and are copied in (:meth:`stage_in`) and out (:meth:`stage_out`) per run.
    ``copied``: whether setting it up copied the tensors into a new buffer.
    """

    __slots__ = ("tensors", "flat", "views", "staged", "copied")

    def __init__(self, tensors, flat, views, staged, copied):
        self.tensors = tensors
        self.flat = flat
        self.views = views
        self.staged = staged
        self.copied = copied

    @classmethod
    def adopt(cls, tensors: Sequence[torch.Tensor], layout: FlatLayout, dtype: torch.dtype,
              device: torch.device, *, repoint_ok: bool) -> "FlatList":
        """Put ``tensors`` in one buffer: alias if they are views already, else re-point, else stage."""
        tensors = list(tensors)
        flat = alias(tensors, layout, dtype, device)
        if flat is not None:
            return cls(tensors, flat, layout.views(flat), False, False)
        flat = allocate(layout, dtype, device)
        views = layout.views(flat)
        if repoint_ok and all(can_repoint(t) for t in tensors) and _distinct(tensors):
            copy_all(views, tensors)
            repoint(tensors, views)
            return cls(tensors, flat, views, False, True)
        return cls(tensors, flat, views, True, True)

    def stage_in(self) -> None:
        if self.staged:
            copy_all(self.views, self.tensors)

    def stage_out(self) -> None:
        if self.staged:
            copy_all(self.tensors, self.views)


def _distinct(tensors: Sequence[torch.Tensor]) -> bool:
    return len({id(t) for t in tensors}) == len(tensors)
