"""The host side of the ``triton`` backend: pointer tables, prepared buckets, launches.

The kernels are :mod:`multi_tensor.backends.triton.kernels` (whose docstring describes the
pointer table, the exactness rules and the device-side steps); this module builds what they
read and launches them: :class:`AdamBucket` (the Adam family's prepared bucket), :func:`scale`
and :func:`l2norm`. Each launch's ``ALIGN`` mode is chosen here from the tensors' addresses
(every one 16-byte aligned, some, none), with each list's base a tensor at an aligned address.
Imported only through :mod:`multi_tensor.backends.triton` (it imports triton).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from ... import rules, schema, tensor_facts
from ..contract import Bucket
from .kernels import (ALIGN_ALL, ALIGN_CHUNK, ALIGN_NONE, COMPILE_OPTIONS, DTYPE_CODE, F32,
                      F64, LAUNCHES, NORM_BLOCK, _adam_kernel, _nonfinite_kernel,
                      _rowsum_kernel, _scale_kernel, _step_scalars_kernel, _sumsq_kernel,
                      _total_kernel)


_ptr = torch.Tensor.data_ptr


def _launch(kernel, grid, device: torch.device, *args, **constexprs):
    """Launch ``kernel`` with the warps and fixed constexprs of its row of
    :data:`~.kernels.LAUNCHES` (what the ahead-of-time checks compile) and the per-launch
    ``constexprs``."""
    launch = LAUNCHES[kernel.__name__]
    _run(kernel, grid, device, args, {**launch.constexprs, **constexprs}, launch.num_warps)


def _run(kernel, grid, device: torch.device, args, constexprs, num_warps: int):
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return kernel[grid](*args, **constexprs, num_warps=num_warps, **COMPILE_OPTIONS)
    return kernel[grid](*args, **constexprs, num_warps=num_warps, **COMPILE_OPTIONS)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def to_device(host: torch.Tensor, out: Optional[torch.Tensor], device: torch.device,
              what: str = "table") -> torch.Tensor:
    """Copy a host tensor to ``device`` without a host sync (pinned memory, non-blocking).

    Writes into ``out`` when given (same shape and dtype), else returns a new device tensor.
    """
    if _capturing(device):
        raise RuntimeError(
            f"multi_tensor triton: the {what} of a bucket had to be rewritten during CUDA graph "
            "capture (grads, hyperparameters or tensors changed); run the step once outside the "
            "capture first (warm-up), and keep them fixed while capturing")
    if device.type == "cuda":
        host = host.pin_memory()
        if out is None:
            return host.to(device, non_blocking=True)
        out.copy_(host, non_blocking=True)
        return out
    if out is None:
        return host.clone()
    out.copy_(host)
    return out


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill ``numel`` consecutive slots from data_ptr."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _layout_of(shape, strides) -> tuple:
    """The element -> memory map of a dense tensor (strides of the dims of size > 1)."""
    return tuple(st for sz, st in zip(shape, strides) if sz != 1)


def _layout(t: torch.Tensor) -> tuple:
    return _layout_of(t.shape, t.stride())


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for size in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def _base_view(t: torch.Tensor) -> torch.Tensor:
    """What the kernel receives as a list's base pointer (bf16 as its int16 bits)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _chunks(numels: Sequence[int], chunk: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row of each chunk, start offset of each chunk, chunks per row); empty rows have none."""
    numel = np.asarray(numels, dtype=np.int64)
    counts = (numel + chunk - 1) // chunk
    rows = np.repeat(np.arange(len(numel), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    starts = (np.arange(len(rows), dtype=np.int64) - np.repeat(first, counts)) * chunk
    return rows, starts, counts


def _deltas(ptrs: np.ndarray, base_ptr: int, esize: int) -> np.ndarray:
    return (ptrs - np.int64(base_ptr)) // esize


def _flag(noop_flag: Optional[torch.Tensor], device: torch.device, spare: List) -> torch.Tensor:
    """The flag a kernel reads (and may set): the noop flag itself, or a zeroed spare."""
    if noop_flag is not None and noop_flag.numel() > 0:
        flag = noop_flag.as_strided((1,), (1,))  # its first element, always a view
        if flag.dtype == torch.bool:
            flag = flag.view(torch.uint8)
        return flag
    if not spare:
        spare.append(torch.zeros(1, dtype=torch.int32, device=device))
    else:
        spare[0].zero_()
    return spare[0]


# ---------------------------------------------------------------------------------------------
# the prepared Adam-family bucket

class _Staged:
    """A tensor the kernel cannot address in place, and the dense copy it runs on."""

    __slots__ = ("orig", "copy", "written")

    def __init__(self, orig: torch.Tensor, strides: tuple, written: bool):
        self.orig = orig
        self.copy = torch.empty_strided(orig.shape, strides, dtype=orig.dtype, device=orig.device)
        self.written = written


class AdamBucket(Bucket):
    """One Adam-family op bound to a bucket's state lists (``prepare``'s result).

    ``bind(grads)`` checks the grads cheaply (the same objects as last time, compared by
    identity at C speed, at the same addresses: one pass over ``data_ptr``, which also sees a
    grad re-pointed in place by ``g.data = new``; else count, dtype, shape, device, layout) and
    rewrites the grads' row of the pointer table only when an address changed. It also checks,
    at every bind, that the params and the state tensors still have the addresses the table
    holds (:meth:`state_moved`; ``p.data = new``, ``state.data = new`` move them): if not it
    refuses, and the caller prepares a new bucket (the optimizers re-plan). The bucket keeps
    the storage it bound alive, so the kernel never writes to freed memory.
    ``run`` launches one kernel.

    CUDA graphs: a launch made while the current stream is capturing marks the bucket captured
    (:meth:`mark_captured`): the graph holds the addresses of its pointer table, scalar buffers
    and base pointers. A later eager re-bind to grads at new addresses then writes a *fresh*
    table (and fresh scalar buffers) and keeps the captured ones alive and unchanged, so
    replaying the graph still reads the grads it was captured with; rewriting the captured table
    would make the replay read the old grads' base at the new grads' offsets.

    Streams: the persistent buffers (table, scalars, spare flag, staged copies) are written and
    read on the current stream of each call; when a call runs on a stream other than the one
    they were made on, they are ``record_stream``-ed on it once, so the caching allocator does
    not hand their memory out while that stream may still use it.

    Layouts: a row whose tensors are dense (contiguous, channels_last, ...) with the param's
    strides runs in place. A tensor that is not dense, or whose strides differ from its param's,
    runs on a persistent dense copy: copied in before the launch and, for written lists, back
    after it (two extra copies per such tensor; rare: the optimizers create their state with
    the params' layout).
    """

    device_steps = True  # run_device_step: the step and its scalars on the device

    def __init__(self, op: str, lists, chunk_size: int):
        self.op = op
        self.ema = lists.has_ema
        self.master = lists.has_master
        # master remainders: the kernel joins them with the params' bits into fp32 masters
        self.remainder = lists.has_remainder
        # the pointer table's rows: the grads, then the state lists in AdamLists' field order
        # (params, exp_avgs, exp_avg_sqs, emas, masters or remainders: the order _adam_kernel
        # reads them in)
        self.list_names = [name for name, _ in lists.present() if name != "grads"]
        self.state_lists = [list(getattr(lists, name)) for name in self.list_names]
        self.chunk = int(chunk_size)
        params = self.state_lists[0]
        self.n = len(params)
        self.device = params[0].device if params else torch.device("cpu")
        self.p_dt = DTYPE_CODE[params[0].dtype] if params else F32
        self.s_dt = F32 if self.master or self.remainder else self.p_dt
        # the EMA's storage: the state dtype, or bf16 (schema.REDUCED_EMA_DTYPE)
        emas = lists.emas or []
        self.e_dt = DTYPE_CODE[emas[0].dtype] if emas else self.s_dt
        self.math = torch.float64 if self.p_dt == F64 else torch.float32
        self._grad_dtypes = schema.grad_dtypes(params[0].dtype if params else None)
        self._spare: List[torch.Tensor] = []
        self._grads = None
        self._g_objs = None
        self._g_addr = None
        self._g_dtype = None
        self._g_base = None
        self._g_col = None
        self._g_staged: List[_Staged] = []
        self._g_stage_rows = {}
        self._hyper = None
        # row layouts and the state lists' addresses
        self._strides = []  # each row's layout: its param's if dense, else contiguous
        self._row_contiguous = []
        self._layouts = []
        self._staged: List[_Staged] = []
        numels = []
        for p in params:
            strides = tuple(p.stride()) if _dense(p) else _contiguous_strides(p.shape)
            self._strides.append(strides)
            self._layouts.append(_layout_of(p.shape, strides))
            self._row_contiguous.append(self._layouts[-1] == _layout_of(
                p.shape, _contiguous_strides(p.shape)))
            numels.append(p.numel())
        self._numels = np.asarray(numels, dtype=np.int64)
        self._live = self._numels > 0
        self._rows, starts, _ = _chunks(numels, self.chunk)
        self.n_chunks = len(self._rows)
        nl = 1 + len(self.state_lists)
        # rows: the grads, the state lists, numel, start, and the chunks' misalignment (bit li:
        # list li's offset is not a multiple of its vector width, 16 bytes; bit nl: the start
        # is not a multiple of 16; the grads' bit 0 is tested in the kernel, as they move)
        host = np.zeros((nl + 3, self.n_chunks), dtype=np.int64)
        self._bases = []
        modes = [ALIGN_ALL]
        for li, tensors in enumerate(self.state_lists):
            eff = []
            for i, t in enumerate(tensors):
                if t.numel() and not self._fits(t, i):
                    st = _Staged(t, self._strides[i], written=True)
                    self._staged.append(st)
                    t = st.copy
                eff.append(t)
            base, col, mode = self._column(eff)
            self._bases.append(base)
            host[li + 1] = col
            if eff:
                width = 16 // eff[0].element_size()
                host[nl + 2] |= (col % width != 0).astype(np.int64) << (li + 1)
            modes.append(mode)
        host[nl] = self._numels[self._rows]
        host[nl + 1] = starts
        host[nl + 2] |= (starts % 16 != 0).astype(np.int64) << nl
        misaligned = host[nl + 2] != 0
        # the state lists' part of the launch's ALIGN mode (the grads' part: their bind)
        self._state_align = (ALIGN_NONE if min(modes) == ALIGN_NONE or bool(np.all(misaligned))
                             else ALIGN_ALL if not np.any(misaligned) else ALIGN_CHUNK)
        self._nl = nl
        self._table = (to_device(torch.from_numpy(host), None, self.device)
                       if self.n_chunks else None)
        self._g_aligned = ALIGN_ALL
        self._scal = torch.zeros(rules.N_SCALARS, dtype=self.math, device=self.device)
        self._hyp = torch.zeros(rules.N_HYPER, dtype=torch.float64, device=self.device)
        # the state tensors as bound, and their addresses (bind refuses when one moved)
        self._s_objs = [t for tensors in self.state_lists for t in tensors]
        self._s_addr = tensor_facts.addresses(self._s_objs)
        self._params = params
        self._shapes = tensor_facts.describe(params).shapes if params else b""
        self._all_rows_contiguous = all(self._row_contiguous)
        # their storage as bound, kept alive: no other tensor can take these addresses, so an
        # equal address in bind is this storage (a moved tensor's old storage is not reused
        # under the kernel)
        self._s_keep = [t.detach() for t in self._s_objs]
        # the grads last bound followed by the state tensors, and all their addresses: the
        # steady state's check is one native pass over them (:meth:`_unchanged`)
        self._gs_objs = None
        self._gs_addr = None
        self.captured = False
        self._norm: Optional[_NormPlan] = None  # the grads' l2norm tables (grad_norm)
        self._retired: List[torch.Tensor] = []  # buffers a captured graph still reads
        self._streams = set()  # CUDA streams the buffers are recorded on (beyond their own)
        self._home = (torch.cuda.current_stream(self.device)
                      if self.device.type == "cuda" else None)

    def _column(self, tensors, ptrs: Optional[np.ndarray] = None
                ) -> Tuple[Optional[torch.Tensor], np.ndarray, int]:
        """A list's base pointer, its row of the table (per chunk) and its alignment: ALIGN_ALL
        (every address 16-byte aligned), ALIGN_CHUNK (some; the base is one of them, so an
        offset that is a multiple of the vector width is an aligned address) or ALIGN_NONE.
        ``ptrs``: the tensors' addresses, when the caller has them."""
        if ptrs is None:
            ptrs = np.asarray(list(map(_ptr, tensors)), dtype=np.int64)
        live = self._live
        if not live.any():
            return None, np.zeros(self.n_chunks, dtype=np.int64), ALIGN_ALL
        # the first live tensor at an aligned address is the base, else the first live one
        aligned = np.flatnonzero(live & (ptrs % 16 == 0))
        b = int(aligned[0]) if len(aligned) else int(np.flatnonzero(live)[0])
        base = tensors[b]
        ptrs = np.where(live, ptrs, ptrs[b])
        col = _deltas(ptrs, int(ptrs[b]), base.element_size())[self._rows]
        ok = ptrs % 16 == 0
        mode = ALIGN_ALL if ok.all() else ALIGN_CHUNK if ok.any() else ALIGN_NONE
        return _base_view(base), col, mode

    def align_mode(self) -> int:
        """The ALIGN mode of the next launch: ALIGN_ALL when every chunk is aligned (no
        branch), ALIGN_NONE when none can be, else ALIGN_CHUNK (the kernel decides per chunk)."""
        return min(self._state_align, self._g_aligned)

    def chunk_misalignment(self) -> np.ndarray:
        """Per chunk, what keeps it from the 128-bit path (0: aligned), as the kernel reads it:
        the table's misalignment row (bit li: list li's offset, bit ``nl``: the start) and bit
        0 for the bound grads' offset. Reads the device table back (a host sync): for tests and
        debugging, not for the step."""
        if self._g_dtype is None:
            raise RuntimeError("multi_tensor triton: chunk_misalignment() before a bind()")
        if not self.n_chunks:
            return np.zeros(0, dtype=np.int64)
        table = self._table.cpu().numpy()
        g_width = 16 // torch.empty(0, dtype=self._g_dtype).element_size()
        return table[self._nl + 2] | (table[0] % g_width != 0).astype(np.int64)

    # --- grads ---------------------------------------------------------------------------------
    def _fits(self, t: torch.Tensor, row: int) -> bool:
        return t.numel() <= 1 or (_dense(t) and _layout(t) == self._layouts[row])

    def mark_captured(self) -> None:
        """The bucket's buffers are read by a captured CUDA graph: never rewrite them."""
        self.captured = True

    def _fork(self) -> None:
        """Fresh buffers for a rewrite after a capture; the captured ones stay as they are
        (and alive: the graph holds their addresses)."""
        self._retired.extend(t for t in (self._table, self._scal, self._hyp) if t is not None)
        if self._table is not None:
            self._table = self._table.clone()
        self._scal = self._scal.clone()
        self._hyp = self._hyp.clone()
        for stream in self._streams:
            for t in (self._table, self._scal, self._hyp):
                if t is not None:
                    t.record_stream(stream)
        self.captured = False

    def _on_stream(self) -> None:
        """Record the persistent buffers on the current stream when it is not their own."""
        if self._home is None:
            return
        stream = torch.cuda.current_stream(self.device)
        if stream == self._home or stream in self._streams:
            return
        self._streams.add(stream)
        bufs = [self._table, self._scal, self._hyp] + self._spare
        bufs += self._norm.buffers() if self._norm is not None else []
        bufs += [st.copy for st in self._staged] + [st.copy for st in self._g_staged]
        for t in bufs:
            if t is not None:
                t.record_stream(stream)

    def state_moved(self) -> bool:
        """Whether a param or a state tensor no longer has the address the table holds: one
        native pass over their addresses (:func:`multi_tensor.tensor_facts.addresses`), at
        every bind."""
        return self._s_addr is None or not tensor_facts.addresses_match(self._s_objs,
                                                                         self._s_addr)

    def _unchanged(self, grads) -> bool:
        """The grads last bound (the same objects, compared by identity at C speed: no tensor
        is compared by value) with those grads, the params and every state tensor at the
        addresses bound: one native pass over the grads and the state."""
        objs = self._g_objs
        if objs is None or not tensor_facts.same_objects(grads, objs):
            return False
        return tensor_facts.addresses_match(self._gs_objs, self._gs_addr)

    def bind_unchanged(self, grads) -> bool:
        """``bind`` for the grads last bound, unchanged (the same objects at the same
        addresses) with the params and every state tensor unmoved; False (nothing bound)
        otherwise. (For callers that skip the list checks on True: it checks all the state.)"""
        self._grads = None
        if not self._unchanged(grads):
            return False
        self._grads = self._g_objs
        return True

    def bind(self, grads) -> bool:
        """Take this step's grads. The steady state (the grads last bound, the params and state
        where they were) costs one identity pass over the grads and one native pass over the
        grads' and the state's addresses; anything else goes through :meth:`_bind_slow`."""
        self._grads = None
        if self._unchanged(grads):
            self._grads = self._g_objs
            return True
        if len(grads) != self.n:
            return False
        if not self.n:
            self._grads = []
            return True
        return self._bind_slow(list(grads))

    def _bind_slow(self, grads) -> bool:
        """Grads that are new objects (every step after ``zero_grad(set_to_none=True)``) or
        moved: every state tensor's address (the params' included), then the grads' count,
        dtype, layout, device and shape, and the params' shapes, each list in one native pass
        (:mod:`multi_tensor.tensor_facts`: no tensor compared by value), and the grads' row
        rewritten only when an address changed."""
        if self.state_moved():
            return False
        facts = tensor_facts.describe(grads)  # (None: not all strided tensors with addresses)
        if (facts is None or facts.dtype not in self._grad_dtypes or facts.device != self.device
                or facts.shapes != self._shapes):
            return False
        dtype = facts.dtype
        device = self.device
        # a param reshaped in place (``p.data = p.data.view(...)``) no longer fits its state
        params = tensor_facts.describe(self._params)
        if params is None or params.shapes != self._shapes:
            return False
        ptrs = tensor_facts.as_array(facts.addresses)
        stage_rows = {}
        eff = list(grads)
        contiguous = facts.contiguous
        if 0 in contiguous or not self._all_rows_contiguous:
            ptrs = ptrs.copy()
            for i, g in enumerate(grads):
                if contiguous[i] and self._row_contiguous[i]:
                    continue  # the common case
                if g.numel() and not self._fits(g, i):
                    st = self._g_stage_rows.get(i)
                    if st is None or st.copy.dtype != dtype:
                        st = _Staged(g, self._strides[i], written=False)
                    st.orig = g
                    stage_rows[i] = st
                    eff[i] = st.copy
                    ptrs[i] = st.copy.data_ptr()
        self._g_stage_rows = stage_rows
        self._g_staged = list(stage_rows.values())
        base, col, aligned = self._column(eff, ptrs)
        # the norm table holds the grads' offsets from their first one, as the grads' row does
        if self._norm is not None and (self._g_col is None or dtype != self._g_dtype
                                       or not np.array_equal(col, self._g_col)):
            if self.captured:
                self._retired.extend(self._norm.buffers())
            self._norm = None
        if self.n_chunks and (self._g_col is None or not np.array_equal(col, self._g_col)):
            # new addresses (not just new tensor objects): rewrite the grads' row only (of a
            # fresh table when a captured graph reads this one)
            if self.captured:
                self._fork()
            to_device(torch.from_numpy(np.ascontiguousarray(col)), self._table[0], device,
                      "grads' row of the pointer table")
            self._g_col = col
        self._g_aligned = aligned
        self._g_base = base
        self._g_dtype = dtype
        self._g_objs = grads
        self._g_addr = facts.addresses
        self._gs_objs = grads + self._s_objs
        self._gs_addr = facts.addresses + self._s_addr
        self._grads = grads
        return True

    def grad_norm(self, flag: torch.Tensor) -> Optional[torch.Tensor]:
        """The bound grads' global L2 norm (fp32 device tensor, as :func:`l2norm`'s total; sets
        ``flag`` on a non-finite grad), from a norm table kept while the grads stay where they
        are: a clipped step rebuilds nothing, and the launches can be captured. None when some
        grad runs on a staged copy (the caller uses :func:`l2norm`)."""
        grads = self._grads
        if grads is None:
            raise RuntimeError("multi_tensor triton: grad_norm() without a successful bind()")
        if self._g_staged or not self.n:
            return None
        if self._norm is None:
            self._norm = _NormPlan(grads, self.device)
            for stream in self._streams:
                for t in self._norm.buffers():
                    t.record_stream(stream)
        else:
            self._on_stream()
        if _capturing(self.device):
            self.mark_captured()
        return self._norm.run(grads, flag, False)[0]

    # --- run -----------------------------------------------------------------------------------
    def run(self, noop_flag, scalars: rules.StepScalars, grad_scale=None,
            check_finite: bool = False) -> None:
        """One update with the host's scalars (copied to the device buffer, no sync)."""
        grads, self._grads = self._grads, None
        if grads is None:
            raise RuntimeError("multi_tensor triton: run() without a successful bind()")
        if not self.n_chunks:
            return
        self._on_stream()
        if self.captured:
            self._fork()
        to_device(rules.pack(scalars, self.math), self._scal, self.device, "scalars")
        self._hyper = None  # a later device step rewrites its step-independent scalars
        self._launch(_flag(noop_flag, self.device, self._spare), grad_scale, check_finite)

    def run_device_step(self, step: torch.Tensor, hyper: rules.AdamHyper, noop_flag=None,
                        grad_scale=None, lr: Optional[torch.Tensor] = None) -> None:
        """One update whose step and scalars live on the device (sync-free, graph-capturable).

        ``step``: a float32 or float64 scalar tensor on the bucket's device holding the number
        of updates done (float64 counts exactly past 2**24; the optimizers keep a float64
        counter and present a float32 copy as ``state["step"]``); it is advanced by one unless
        ``noop_flag`` (e.g. GradScaler's ``found_inf``) is nonzero, in which case nothing
        changes. ``hyper``: the step-independent
        hyperparameters (the host rewrites the device copy only when they change). ``lr``: an
        optional device tensor read at run time instead of ``hyper.lr`` (capturable lr).
        """
        grads, self._grads = self._grads, None
        if grads is None:
            raise RuntimeError("multi_tensor triton: run_device_step() without a successful bind()")
        self._on_stream()
        key = (hyper, lr is not None)
        if key != self._hyper:
            if self.captured:
                self._fork()
            self._write_hyper(hyper)
            self._hyper = key
        flag = _flag(noop_flag, self.device, self._spare)
        if _capturing(self.device):
            self.mark_captured()
        _launch(_step_scalars_kernel, (1,), self.device, self._hyp, step, flag,
                lr if lr is not None else self._hyp, self._scal, LR_TENSOR=lr is not None)
        if self.n_chunks:
            self._launch(flag, grad_scale, False)

    def _write_hyper(self, h: rules.AdamHyper) -> None:
        # the step-independent fields (the kernel rewrites the step-dependent ones every step)
        to_device(rules.pack(rules.step_scalars(h, 1), self.math), self._scal, self.device,
                  "scalars")
        to_device(rules.pack(rules.device_hyper(h)), self._hyp, self.device, "hyperparameters")

    def _launch(self, flag: torch.Tensor, grad_scale, check_finite: bool) -> None:
        if _capturing(self.device):
            self.mark_captured()
        for st in self._staged:
            st.copy.copy_(st.orig)
        for st in self._g_staged:
            st.copy.copy_(st.orig)
        g_dt = DTYPE_CODE[self._g_dtype]
        if check_finite:
            _launch(_nonfinite_kernel, (self.n_chunks,), self.device, self._table, self.n_chunks,
                    self.chunk, self._g_base, flag, NL=self._nl, G_DT=g_dt,
                    ALIGN=(ALIGN_CHUNK if self._g_aligned == ALIGN_ALL and self.chunk % 16
                           else self._g_aligned))
        gscale = self._scal
        if grad_scale is not None:
            gscale = grad_scale.reshape(-1)[:1].to(device=self.device, dtype=self.math)
        b = dict(zip(self.list_names, self._bases))
        p_base = b["params"]
        _launch(_adam_kernel, (self.n_chunks,), self.device, self._table, self.n_chunks,
                self.chunk, self._g_base, p_base, b["exp_avgs"], b["exp_avg_sqs"],
                b.get("emas", p_base), b.get("masters", b.get("remainders", p_base)),
                self._scal, flag, gscale, G_DT=g_dt, P_DT=self.p_dt, S_DT=self.s_dt,
                E_DT=self.e_dt, EMA=self.ema, MASTER=self.master, REM=self.remainder,
                HAS_SCALE=grad_scale is not None, ALIGN=self.align_mode())
        for st in self._staged:
            st.orig.copy_(st.copy)


# ---------------------------------------------------------------------------------------------
# scale

def _aligned_base(ptrs: np.ndarray) -> int:
    """The index of a list's base: its first tensor at a 16-byte aligned address (so an offset
    that is a multiple of the vector width is an aligned address), else its first."""
    aligned = np.flatnonzero(ptrs % 16 == 0)
    return int(aligned[0]) if len(aligned) else 0


def _align_of(vec: np.ndarray) -> int:
    """The ALIGN mode of a launch whose chunks (or blocks) can take the 128-bit path where
    ``vec``: every one (no branch), none, or some (the kernel decides per chunk)."""
    return ALIGN_ALL if vec.all() else ALIGN_NONE if not vec.any() else ALIGN_CHUNK


def scale(chunk_size, noop_flag, tensor_lists, scale_factor) -> bool:
    """multi_tensor_scale; returns False (nothing done) for dtypes the kernel does not handle.
    One launch per (src, dst) dtype pair, each list read from a base at an aligned address
    where it has one; a chunk moves in 128-bit vectors when both its tensors are 16-byte
    aligned and its start a multiple of 16 (ALIGN_CHUNK: decided per chunk in the kernel)."""
    srcs, dsts = tensor_lists
    if not srcs:
        return True
    if any(t.dtype not in DTYPE_CODE for t in srcs) or any(t.dtype not in DTYPE_CODE for t in dsts):
        return False
    device = srcs[0].device
    flag = _flag(noop_flag, device, [])
    factor = to_device(torch.tensor([float(scale_factor)], dtype=torch.float64), None, device,
                       "scale factor")
    chunk = int(chunk_size)
    groups = {}
    copy_back = []
    for s, d in zip(srcs, dsts):
        if not s.numel():
            continue
        if not (_dense(s) and _dense(d) and (s.numel() <= 1 or _layout(s) == _layout(d))):
            s = s.contiguous()
            if not (d.is_contiguous()):
                tmp = torch.empty_like(s, dtype=d.dtype)
                copy_back.append((d, tmp))
                d = tmp
        groups.setdefault((s.dtype, d.dtype), []).append((s, d))
    for (sdt, ddt), pairs in groups.items():
        rows, starts, _ = _chunks([s.numel() for s, _ in pairs], chunk)
        sp = np.asarray([s.data_ptr() for s, _ in pairs], dtype=np.int64)
        dp = np.asarray([d.data_ptr() for _, d in pairs], dtype=np.int64)
        si, di = _aligned_base(sp), _aligned_base(dp)
        s0, d0 = pairs[si][0], pairs[di][1]
        host = np.stack([_deltas(sp, int(sp[si]), s0.element_size())[rows],
                         _deltas(dp, int(dp[di]), d0.element_size())[rows],
                         np.asarray([s.numel() for s, _ in pairs], dtype=np.int64)[rows], starts])
        vec = (sp % 16 == 0)[rows] & (dp % 16 == 0)[rows] & (starts % 16 == 0)
        table = to_device(torch.from_numpy(np.ascontiguousarray(host)), None, device)
        _launch(_scale_kernel, (len(rows),), device, table, len(rows), chunk, _base_view(s0),
                _base_view(d0), factor, flag, S_DT=DTYPE_CODE[sdt], D_DT=DTYPE_CODE[ddt],
                ALIGN=_align_of(vec))
    for d, tmp in copy_back:
        d.copy_(tmp)
    return True


# ---------------------------------------------------------------------------------------------
# l2norm

class _NormPlan:
    """The tables of one l2norm over a list of tensors (their dtypes, sizes and addresses):
    fixed NORM_BLOCK blocks per tensor, grouped by dtype, each group read from a base at an
    aligned address where it has one (a block moves in 128-bit vectors when its tensor is
    16-byte aligned: ALIGN_CHUNK decides per block in the kernel), and the scratch the phases
    write (the blocks' fp64 sums, the tensors' fp64 sums, their norms when not asked for).
    Built once and reused while the tensors stay where they are (a prepared bucket's grads),
    so a clipped step rebuilds and allocates nothing but its results, and the launches can be
    captured."""

    __slots__ = ("device", "n", "n_blocks", "groups", "rows_t", "first", "counts", "partial",
                 "per64", "per32")

    def __init__(self, tensors, device: torch.device):
        self.device = device
        n = self.n = len(tensors)
        counts = [(t.numel() + NORM_BLOCK - 1) // NORM_BLOCK for t in tensors]
        self.counts = counts
        self.first = first = (np.cumsum([0] + counts[:-1]).astype(np.int64) if n
                              else np.zeros(0, np.int64))
        self.n_blocks = int(sum(counts))
        by_dtype = {}
        for i, t in enumerate(tensors):
            if t.numel():
                by_dtype.setdefault(t.dtype, []).append((i, t))
        # (dtype, the index of the group's base tensor, table, launches, ALIGN mode: for the
        # addresses the plan was built on, which hold while the base stays aligned)
        self.groups = []
        for dtype, items in by_dtype.items():
            numels = [t.numel() for _, t in items]
            rows, starts, _ = _chunks(numels, NORM_BLOCK)
            ptrs = np.asarray([t.data_ptr() for _, t in items], dtype=np.int64)
            b = _aligned_base(ptrs)
            t0 = items[b][1]
            out = (first[np.asarray([i for i, _ in items], dtype=np.int64)][rows]
                   + starts // NORM_BLOCK)
            host = np.stack([_deltas(ptrs, int(ptrs[b]), t0.element_size())[rows],
                             np.asarray(numels, dtype=np.int64)[rows], starts, out])
            table = to_device(torch.from_numpy(np.ascontiguousarray(host)), None, device,
                              "l2norm table")
            # (the blocks' starts are multiples of NORM_BLOCK, so of 16)
            self.groups.append((dtype, items[b][0], table, len(rows),
                                _align_of((ptrs % 16 == 0)[rows])))
        self.rows_t = None
        if n:
            rows_host = np.stack([first, np.asarray(counts, dtype=np.int64)])
            self.rows_t = to_device(torch.from_numpy(np.ascontiguousarray(rows_host)), None,
                                    device, "l2norm table")
        # every block's sum is written by its launch, every tensor's by the row sums: no zeroing
        self.partial = torch.empty(max(self.n_blocks, 1), dtype=torch.float64, device=device)
        self.per64 = torch.empty(max(n, 1), dtype=torch.float64, device=device)
        self.per32 = torch.empty(max(n, 1), dtype=torch.float32, device=device)

    def buffers(self) -> list:
        return ([g[2] for g in self.groups] + ([self.rows_t] if self.rows_t is not None else [])
                + [self.partial, self.per64, self.per32])

    def run(self, tensors, flag: torch.Tensor, per_tensor: bool):
        """(total, per-tensor norms) of ``tensors`` (those the plan was built on, or tensors of
        the same dtypes and sizes at the same relative addresses): fresh tensors, the scratch
        is the plan's."""
        device, n = self.device, self.n
        for dtype, i0, table, n_rows, align in self.groups:
            base = tensors[i0]
            # the same relative addresses from a misaligned base: no offset means an aligned
            # address any more
            if base.data_ptr() % 16:
                align = ALIGN_NONE
            _launch(_sumsq_kernel, (n_rows,), device, table, n_rows, _base_view(base),
                    self.partial, flag, DT=DTYPE_CODE[dtype], ALIGN=align)
        total = torch.zeros((), dtype=torch.float32, device=device)
        per32 = torch.zeros(n, dtype=torch.float32, device=device) if per_tensor else self.per32
        if n:
            _launch(_rowsum_kernel, (n,), device, self.partial, self.rows_t, n, self.per64,
                    per32)
            _launch(_total_kernel, (1,), device, self.per64, n, total)
        if not per_tensor:
            per32 = torch.zeros(0, dtype=torch.float32, device=device)
        return total, per32


def l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """multi_tensor_l2norm: (total, per-tensor norms) as fp32 device tensors, or None for
    dtypes the kernel does not handle. Fixed NORM_BLOCK blocks (independent of chunk_size),
    each summed in fp64, then each tensor's blocks in index order, then the tensors in order."""
    del chunk_size
    tensors = tensor_lists[0]
    device = tensors[0].device if tensors else noop_flag.device
    if any(t.dtype not in DTYPE_CODE for t in tensors):
        return None
    flag = _flag(noop_flag, device, [])
    tensors = [t if not t.numel() or _dense(t) else t.contiguous() for t in tensors]
    return _NormPlan(tensors, device).run(tensors, flag, per_tensor)
