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

* Params: :func:`can_repoint_param` / :func:`repoint_params` move autograd params into one flat
  buffer (``p.data = view``, the same object keeps its identity, ``requires_grad`` and hooks),
  as torch_npu's combined-buffer fused optimizers do (``npu_combine_tensors``, which re-points
  each tensor with ``npu_change_data_ptr``: torch_npu/optim/npu_fused_optim_base.py). Only a
  contiguous leaf param whose storage nothing else holds (or that is in a buffer of ours) is
  moved: a param that shares its storage with another tensor (Megatron's buffers, a tensor made
  from its ``.data``, a held ``state_dict()``) would stop sharing it.
* Grads: :class:`FlatGrads` makes every param's ``.grad`` a view of one flat grad buffer.
  Backward's ``AccumulateGrad`` adds in place into a ``.grad`` that exists (``grad += new``
  outside ``create_graph``), so the views survive backward and the buffer *is* the bucket's flat
  grad; the optimizer's ``zero_grad`` zeroes the buffer and keeps the views. Which params
  received a grad since then is marked on the host by a post-accumulate-grad hook per param.

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
* Moved params and kept grads are views too: ``torch.save`` of one param (or of one grad)
  writes its whole buffer; ``p.grad`` after the optimizer's ``zero_grad`` is a zero view, not
  None (the optimizer still skips a param that received no grad since). A param left out of a
  re-built plan keeps its grad view in the old grad buffer, which lives until no param keeps it.
* Padding: each view starts at a multiple of :data:`ALIGN_BYTES` (512 bytes: 128 fp32 elements),
  so a packed buffer is at most ``ALIGN_BYTES`` per tensor larger than the tensors. Padding is
  zero-filled once and, with zero grads, stays finite under an Adam update.
"""
from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ... import tensor_facts

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


def is_ours(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in a buffer :func:`allocate` made that is still alive."""
    with _owned_lock:
        entry = _owned.get(_storage_key(t))
    return entry is not None and not entry[0].expired()


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _sole_owner(t: torch.Tensor) -> bool:
    """Whether no tensor but ``t`` holds its storage (False where torch cannot tell)."""
    if _storage_use_count is None:
        return False
    storage = t.untyped_storage()
    return _storage_use_count(storage._cdata) <= 2  # t's reference and ``storage``'s own


def can_repoint_param(p: torch.Tensor) -> bool:
    """Whether the param ``p`` may be moved into a flat buffer (:func:`repoint_params`).

    An autograd leaf that requires grad (a DTensor's local shard, a real view of a complex
    param, a tensor subclass do not qualify), contiguous (a param in channels-last keeps its
    strides), whose storage nothing else holds, or that already lives in a buffer of ours.
    """
    return (type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_leaf and p.requires_grad
            and not p._is_view() and p.layout == torch.strided and not p.is_meta
            and p.is_contiguous() and (_sole_owner(p) or is_ours(p)))


def repoint_params(params: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> None:
    """Copy every param's values into its view (once), then make the param use the view."""
    with torch.no_grad():
        copy_all(views, params)
        for p, v in zip(params, views):
            p.data = v


# param -> [FlatGrads or None, index]: the buffer view its grad hook attaches. One hook per param
# for the life of the process; a new FlatGrads taking the param re-aims the cell.
_grad_cells = WeakIdKeyDictionary()
# storage key of a FlatGrads buffer -> the FlatGrads (found again by a re-built plan's bucket)
_keepers: "weakref.WeakValueDictionary[int, FlatGrads]" = weakref.WeakValueDictionary()


def _attach(cell: list, param_ref, grad: torch.Tensor) -> None:
    """The param's grad hook, run by backward before the grad is accumulated: a param without a
    ``.grad`` gets its (zeroed) view back, so that autograd accumulates into the flat buffer in
    place instead of allocating a new tensor. ``zero_grad(set_to_none=True)`` leaves ``.grad``
    None, as torch does; this puts the view back only when a grad arrives."""
    keeper, index = cell
    p = param_ref()
    if keeper is None or p is None or p.grad is not None:
        return None
    view = keeper.views[index]
    if not _fits(p, view):
        cell[0] = None  # reallocated with another shape, dtype or device: let go
        return None
    if not keeper.zeroed[index]:  # cleared by someone else (module.zero_grad): stale values
        view.zero_()
    keeper.zeroed[index] = 0
    p.grad = view
    return None


def _claim(p: torch.Tensor, keeper: "FlatGrads", index: int) -> list:
    cell = _grad_cells.get(p)
    if cell is None:
        cell = [keeper, index]
        p.register_hook(functools.partial(_attach, cell, weakref.ref(p)))
        _grad_cells[p] = cell
    else:
        cell[0], cell[1] = keeper, index
    return cell


class FlatGrads:
    """The ``.grad`` of every param of a bucket as a view of one flat buffer (see the module
    docstring).

    Made from the bucket's params and their current grads (one dtype, the values copied in
    once); ``buffer`` then holds every grad backward accumulates. :meth:`zero` zeroes the buffer
    and, with ``set_to_none=True``, sets every ``.grad`` to None as torch does; each param's grad
    hook (:func:`_attach`) gives it its view back when backward brings it a grad, so a param
    that receives none keeps ``None`` and is skipped by ``step()`` exactly as in torch.
    ``zeroed[i]``: view ``i`` is known to hold zeros (zeroed and not attached since).
    """

    __slots__ = ("params", "layout", "buffer", "views", "zeroed", "_cells", "__weakref__")

    def __init__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 layout: FlatLayout):
        self.params = list(params)
        self.layout = layout
        self.buffer = allocate(layout, grads[0].dtype, grads[0].device)
        self.views = layout.views(self.buffer)
        with torch.no_grad():
            copy_all(self.views, grads)
        self.zeroed = bytearray(len(self.params))
        for p, v in zip(self.params, self.views):
            p.grad = v
        self._cells = [_claim(p, self, i) for i, p in enumerate(self.params)]
        with _owned_lock:
            _keepers[_storage_key(self.buffer)] = self

    @staticmethod
    def eligible(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
        """Whether ``grads`` (each param's own ``.grad``) may become views of one buffer: the
        params are autograd leaves (backward accumulates into their ``.grad``), the grads plain
        dense tensors of their own, or views of a buffer of ours (never someone else's grad
        buffer: DDP's bucket views, Megatron's buffers stay as they are)."""
        if not params:
            return False
        for p, g in zip(params, grads):
            if not (type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_leaf
                    and p.requires_grad and not p._is_view() and p.grad is g):
                return False
            if not (type(g) is torch.Tensor and g.layout == torch.strided
                    and not g.requires_grad and (not g._is_view() or is_ours(g))):
                return False
        return True

    @staticmethod
    def of(grads: Sequence[torch.Tensor], layout: FlatLayout) -> Optional["FlatGrads"]:
        """The FlatGrads whose views ``grads`` are, in ``layout``, else None."""
        if not grads:
            return None
        with _owned_lock:
            keeper = _keepers.get(_storage_key(grads[0]))
        if keeper is not None and keeper.layout == layout and keeper.serves(grads):
            return keeper
        return None

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    def serves(self, grads: Sequence[torch.Tensor]) -> bool:
        """Whether ``grads`` are exactly this buffer's views (identity, no tensor is read)."""
        return tensor_facts.same_objects(grads, self.views)

    def take(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """The buffer, holding ``grads`` (of its dtype): grads that are not its views (a
        ``.grad`` assigned by the user) are copied into their views, one multi-tensor copy."""
        if not self.serves(grads):
            pairs = [(v, g) for v, g in zip(self.views, grads) if g is not v]
            copy_all([v for v, _ in pairs], [g for _, g in pairs])
        return self.buffer

    def owns(self) -> List[torch.Tensor]:
        """The params whose grad this buffer keeps (a later FlatGrads may have taken some)."""
        return [p for p, cell in zip(self.params, self._cells) if cell[0] is self]

    def zero(self, set_to_none: bool = True) -> List[torch.Tensor]:
        """Zero the buffer (one launch); then every param it keeps has ``.grad`` None
        (``set_to_none``: its hook attaches the zero view when backward brings a grad) or its
        zero view, as torch's ``zero_grad`` leaves them.

        Returns the params kept. A param that no longer fits its view (reallocated with another
        shape, dtype or device) is let go: the caller clears its grad as torch would, and the
        next plan takes it again."""
        self.buffer.zero_()
        kept = []
        for p, v, cell in zip(self.params, self.views, self._cells):
            if cell[0] is not self:
                continue
            if not _fits(p, v):
                cell[0] = None
                continue
            p.grad = None if set_to_none else v
            kept.append(p)
        self.zeroed[:] = b"\x01" * len(self.zeroed)
        return kept


def _fits(p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``grad`` may be assigned as ``p.grad`` (torch's own check of the assignment)."""
    return (p.shape == grad.shape and p.device == grad.device
            and (p.dtype == grad.dtype or getattr(p, "grad_dtype", None) == grad.dtype))
