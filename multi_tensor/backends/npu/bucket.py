"""The NPU backend's bucket: an Adam-family op over flat buffers (the package docstring,
:mod:`multi_tensor.backends.npu`, describes the layout and the paths)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ... import schema, tensor_facts
from ...rules import StepScalars
from .. import reference, registry
from ..contract import Bucket
from . import flat
from . import ops as npu_ops
from .loader import DeviceOp, _ensure_torch_npu
from .modes import (CANN_DTYPES, CANN_OPS, _sqrt_div, flat_grads_enabled, fold_scalars,
                    get_op_mode, note_fallback)

MAX_LAUNCH_NUMEL = 2 ** 30
"""Elements per operator launch; larger buckets take several launches over slices (a guard: CANN
documents no size limit, this keeps any 32-bit element index inside the kernel safe)."""

SKIP_SLICE = 2 ** 26
"""Elements per slice of a capturable step that may be cancelled (bounds its scratch: 16 bytes
per element of it, 1 GiB for fp32 state)."""

TORCH_PATH_SLICE = 2 ** 26
"""Elements per slice on the exact path (bounds its temporaries; elementwise, so exact)."""


class FlatAdamBucket(Bucket):
    """One bucket of an Adam-family op in flat buffers (see the module docstring).

    ``lists``: a :class:`~multi_tensor.schema.AdamLists` without grads. ``repoint``: re-point
    the state tensors, the params and their grads at views of flat buffers (the optimizer's
    plans); False copies the caller's tensors in and out per run (a one-shot functional call).

    Diagnostics: ``last_path`` ("exact"/"cann"/"cann_literal"/None when nothing ran),
    ``last_reason`` (why the exact path ran in a cann mode), ``stats`` (counters),
    ``grad_keeper`` (the :class:`~multi_tensor.backends.npu.flat.FlatGrads` of the params' grads, or
    None).
    """

    noop_flag_optional = True
    """``run`` takes ``noop_flag=None`` (nothing can cancel the step): the optimizer, whose flag
    is never set, passes None, so that its steps read nothing on the host."""

    host_grad_scale = True
    """``run`` takes a ``grad_scale`` on the CPU as it is: a clip factor worked out on the host
    (fused_optim/clipping.py) then reaches the device as a kernel scalar, not as a copy (a
    host-to-device copy from pageable memory waits for the device)."""

    quick_norm_min = npu_ops.QUICK_MIN
    """Below it a :meth:`quick_grad_norm`'s squares may have underflowed (the caller then
    recomputes with the range-safe ``l2norm``)."""

    @torch.no_grad()
    def __init__(self, op: str, lists, chunk_size: int, device_op: DeviceOp, *,
                 repoint: bool = True):
        self.op = op
        self.chunk_size = chunk_size
        self.ema = lists.has_ema
        self.params: List[torch.Tensor] = list(lists.params)
        self.has_master = lists.has_master
        # bf16 params whose fp32 masters are int16 remainders (multi_tensor/rules.py): the
        # remainders are one more flat state buffer, and only the exact torch path runs them
        # (CANN's operator has no form that reads a param and a remainder)
        self.has_remainder = lists.has_remainder
        # the state lists, in AdamLists' field order: exp_avgs, exp_avg_sqs(, emas)(, masters)
        # (, remainders)
        state_names = [name for name, _ in lists.present() if name not in ("grads", "params")]
        self.device_op = device_op
        params = self.params
        self.device = params[0].device if params else torch.device("cpu")
        if self.device.type == "npu":
            _ensure_torch_npu()
        self.param_dtype = params[0].dtype if params else torch.float32
        self.work_dtype = (torch.float32 if self.has_master or self.has_remainder
                           else self.param_dtype)
        self.math_dtype = reference.math_dtype(self.work_dtype)
        self._grad_dtypes = schema.grad_dtypes(self.param_dtype)
        self.shapes = [p.shape for p in params]
        self._grads_check = registry.GradsCheck(self.shapes, self.device, self._grad_dtypes)
        # the EMA's storage: the state dtype, or bf16 (schema.REDUCED_EMA_DTYPE)
        emas = lists.emas or []
        self.ema_dtype = emas[0].dtype if emas else self.work_dtype
        dtypes = [self.work_dtype, self.param_dtype, self.ema_dtype]
        list_dtypes = [self.ema_dtype if name == "emas" else torch.int16
                       if name == "remainders" else self.work_dtype for name in state_names]

        adopted = flat.FlatLayout.of_views(params) if params else None
        self.layout = (adopted or flat.owned_layout(lists.exp_avgs) or flat.owned_layout(params)
                       or flat.FlatLayout.packed(self.shapes, flat.align_elements(dtypes)))
        # params that tile one buffer (Megatron's, or ours from an earlier plan): that buffer
        # (read and written in place / in one copy)
        self.param_region = (flat.alias(params, self.layout, self.param_dtype, self.device)
                             if params else None)
        self.stats = {"runs": 0, "skipped": 0, "exact": 0, "cann": 0, "launches": 0,
                      "grad_gathers": 0, "grad_alias": 0, "param_copies": 0, "prepare_copies": 0}
        if (self.param_region is None and repoint and params and flat._distinct(params)
                and all(flat.can_repoint_param(p) for p in params)):
            region = flat.allocate(self.layout, self.param_dtype, self.device)
            flat.repoint_params(params, self.layout.views(region))
            self.param_region = region
            self.stats["param_copies"] += 1
        # (one native pass at every bind: a param reallocated leaves the flat buffer)
        self._param_addr = (tensor_facts.addresses(params) if self.param_region is not None
                            else None)
        moments = [flat.FlatList.adopt(getattr(lists, name), self.layout, dt, self.device,
                                       repoint_ok=repoint)
                   for name, dt in zip(state_names, list_dtypes)]
        named = dict(zip(state_names, moments))
        self.exp_avg, self.exp_avg_sq = named["exp_avgs"], named["exp_avg_sqs"]
        self.ema_list = named.get("emas")
        self.masters = named.get("masters")
        self.remainders = named.get("remainders")
        self.state = moments
        if self.has_master:
            self.weights = self.masters
        elif self.param_region is not None:  # the params (with remainders: their high halves)
            self.weights = flat.FlatList(params, self.param_region,
                                         self.layout.views(self.param_region), False, False)
        else:
            self.weights = flat.FlatList.adopt(params, self.layout, self.work_dtype, self.device,
                                               repoint_ok=False)
        self._grad_buffers: Dict[torch.dtype, Tuple[torch.Tensor, List[torch.Tensor]]] = {}
        # the grads' flat buffer, made (or found) at the first run; only for the optimizer's
        # buckets, whose params' .grad it may re-point
        self.grad_keeper: Optional[flat.FlatGrads] = None
        self._keeps_grads = repoint and flat_grads_enabled()
        self._step_one: Optional[torch.Tensor] = None
        self._op_step: Optional[torch.Tensor] = None
        self._scratch: Optional[List[torch.Tensor]] = None
        self._grads = None
        self.last_path: Optional[str] = None
        self.last_reason: Optional[str] = None
        self.stats["prepare_copies"] = sum(1 for fl in moments if fl.copied)

    # --- per step -----------------------------------------------------------------------------
    def bind(self, grads) -> bool:
        """Whether ``grads`` fit the bucket (count, one allowed dtype, shapes, device, dense)."""
        self._grads = None
        if not self._grads_check.fits(grads):
            return False
        if self._param_addr is not None and tensor_facts.addresses(self.params) != self._param_addr:
            return False  # a param was reallocated: it no longer lives in the flat buffer
        self._grads = list(grads)
        return True

    @torch.no_grad()
    def run(self, noop_flag, scalars: StepScalars, grad_scale=None, check_finite=False) -> None:
        grads, self._grads = self._grads, None
        if grads is None:
            raise RuntimeError("FlatAdamBucket.run() without a successful bind()")
        self.last_path = None
        if not grads or self.layout.total == 0:
            return
        path, reason = self._choose(scalars, grad_scale, self._grad_dtype(grads[0].dtype))
        # an apex call's noop_flag (the optimizer passes None): read on the host, once; the
        # CANN path's finite check reads it together with its own result instead
        if (noop_flag is not None and not (check_finite and path != "exact")
                and reference._noop_is_set(noop_flag)):
            self.stats["skipped"] += 1
            return
        g_flat, owned = self._gather(grads)
        if not self.has_master:  # masters are in self.state
            self.weights.stage_in()
        for fl in self.state:
            fl.stage_in()
        if path == "exact":
            ran = self._run_exact(g_flat, scalars, grad_scale, check_finite, noop_flag)
        else:
            ran = self._run_cann(g_flat, owned, scalars, grad_scale, check_finite, noop_flag,
                                 literal=path == "cann_literal")
        if not ran:
            self.stats["skipped"] += 1
            return
        self._write_back()
        self.stats["runs"] += 1
        self.stats["exact" if path == "exact" else "cann"] += 1
        self.last_path, self.last_reason = path, reason

    def _write_back(self) -> None:
        """The state out of staging, and the params from the update's weights."""
        for fl in self.state:
            fl.stage_out()
        if self.has_master:  # the param gets the master rounded once
            if self.param_region is not None:
                self.param_region.copy_(self.masters.flat)
            else:
                flat.copy_all(self.params, self.masters.views)
        else:
            self.weights.stage_out()

    def _grads_buffer(self, grads) -> Optional[torch.Tensor]:
        """One tensor whose norm is the grads' norm: our grad buffer (zero between the views:
        allocated zeroed, and backward, ``zero_grad`` and the grad hooks write only views) or a
        gap-free buffer the grads are views of; None otherwise (the first step, before the grad
        buffer exists, and grads assigned by hand)."""
        keeper = self.grad_keeper
        if keeper is not None and keeper.serves(grads):
            buf = keeper.buffer
        elif self.layout.gap_free:
            buf = flat.alias(grads, self.layout, grads[0].dtype, self.device, writable=False)
        else:
            return None
        return None if buf is None or buf.dtype == torch.float64 else buf

    def grad_norm(self, noop_flag: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The bound grads' fp32 norm on the device, range-safe (``npu_ops.norm_flat`` over
        their flat buffer: no concatenation); None where the grads are not one buffer (the
        caller then runs the ``l2norm`` op). A non-finite grad gives a non-finite norm, which
        is what the clipped step tests; ``noop_flag`` is left alone (setting it would cost two
        launches that nobody reads)."""
        buf = self._bound_grads_buffer("grad_norm")
        return None if buf is None else npu_ops.norm_flat(buf)

    def quick_grad_norm(self) -> Optional[torch.Tensor]:
        """The bound grads' fp32 norm in one read of their flat buffer
        (:func:`~multi_tensor.backends.npu.ops.quick_norm`: trusted only when finite and at least
        ``npu_ops.QUICK_MIN``; the caller reads it and recomputes with ``l2norm`` otherwise).
        None when the grads are not (yet) one buffer: the first step, before the grad buffer
        exists, and grads assigned by hand. The padding between views of our grad buffer is
        zero (allocated zeroed; backward, ``zero_grad`` and the grad hooks write only views),
        so the buffer's norm is the grads' norm."""
        buf = self._bound_grads_buffer("quick_grad_norm")
        return None if buf is None else npu_ops.quick_norm(buf)

    def _bound_grads_buffer(self, caller: str) -> Optional[torch.Tensor]:
        """The bound grads' flat buffer, or None where there are none or they are not one
        buffer (:meth:`_grads_buffer`)."""
        grads = self._grads
        if grads is None:
            raise RuntimeError(f"FlatAdamBucket.{caller}() without a successful bind()")
        if not grads or self.layout.total == 0:
            return None
        return self._grads_buffer(grads)

    # --- pieces -------------------------------------------------------------------------------
    def _host_scale(self, grad_scale) -> Optional[float]:
        """``grad_scale``'s value when it lives on the host and the bucket does not (a clip
        factor from fused_optim/clipping.py), else None: reading it is no device sync."""
        if grad_scale is None or grad_scale.device.type != "cpu" or self.device.type == "cpu":
            return None
        # in the math dtype first, as the device path's ``.to(dtype=dt)`` rounds it
        return float(grad_scale.reshape(()).to(self.math_dtype).item())

    def _grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.work_dtype if flat.converts_exactly(dtype, self.work_dtype) else dtype

    def _grad_buffer(self, dtype: torch.dtype) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        buf = self._grad_buffers.get(dtype)
        if buf is None:
            flat_g = flat.allocate(self.layout, dtype, self.device)
            buf = self._grad_buffers[dtype] = (flat_g, self.layout.views(flat_g))
        return buf

    def _gather(self, grads) -> Tuple[torch.Tensor, bool]:
        """The flat grads in the update's dtype: ``(tensor, owned)``; owned buffers may be written."""
        dtype = self._grad_dtype(grads[0].dtype)
        region = self._grad_region(grads)
        if region is not None:
            if region.dtype == dtype:
                self.stats["grad_alias"] += 1
                return region, False
            buf, _ = self._grad_buffer(dtype)  # one buffer, one converting copy
            buf.copy_(region)
            self.stats["grad_gathers"] += 1
            return buf, True
        buf, views = self._grad_buffer(dtype)
        flat.copy_all(views, grads)
        self.stats["grad_gathers"] += 1
        return buf, True

    def _grad_region(self, grads) -> Optional[torch.Tensor]:
        """One flat tensor holding ``grads`` without a copy per param, else None.

        The optimizer's buckets: the grads' :class:`~multi_tensor.backends.npu.flat.FlatGrads`
        buffer, made at the first run (the grads' values copied in once, each ``.grad``
        re-pointed at its view) or found again (a re-built plan, the EMA-free twin of an
        ``ema_update_every`` bucket); grads a user assigned since are copied into it, one copy of
        one dtype. Otherwise a gap-free buffer the grads already are views of (Megatron's).
        """
        keeper = self.grad_keeper
        if keeper is None and self._keeps_grads:
            keeper = flat.FlatGrads.of(grads, self.layout)
            if keeper is None and flat.FlatGrads.eligible(self.params, grads):
                keeper = flat.FlatGrads(self.params, grads, self.layout)  # copies them in
                self.stats["grad_gathers"] += 1
                grads = keeper.views
            self._keeps_grads = keeper is not None
            self.grad_keeper = keeper
        if keeper is not None and keeper.dtype == grads[0].dtype:
            if not keeper.serves(grads):
                self.stats["grad_gathers"] += 1
            return keeper.take(grads)
        if self.layout.gap_free:
            return flat.alias(grads, self.layout, grads[0].dtype, self.device, writable=False)
        return None

    def _choose(self, c: StepScalars, grad_scale, grad_dtype) -> Tuple[str, Optional[str]]:
        mode = get_op_mode()
        if mode == "exact":
            return "exact", None
        reason = None
        if self.has_remainder:
            reason = "master remainders (the operator reads no param + remainder pair)"
        elif self.op not in CANN_OPS:
            reason = f"op {self.op} (the operator serves fused_ema_adamw only)"
        elif c.maximize:
            reason = "maximize"
        elif self.work_dtype not in CANN_DTYPES:
            reason = f"{self.work_dtype} (the operator takes fp16, bf16, fp32)"
        elif self.ema_dtype != self.work_dtype:
            reason = (f"a {self.ema_dtype} EMA beside {self.work_dtype} state (the operator takes "
                      f"its five tensors in one dtype)")
        elif grad_dtype != self.work_dtype:
            reason = f"{grad_dtype} grads do not convert exactly into {self.work_dtype}"
        elif grad_scale is not None and self.work_dtype != torch.float32:
            reason = f"a grad scale with {self.work_dtype} state (unscaled grads would round)"
        else:
            fn, why = self.device_op.get(self.device)
            if fn is None:
                reason = why
        if reason is not None:
            note_fallback(reason)
            return "exact", reason
        return mode, None

    def _run_exact(self, g_flat, c, grad_scale, check_finite, noop_flag) -> bool:
        """The reference's own code on the flat buffers: bitwise what the reference computes."""
        if check_finite and not bool(torch.isfinite(g_flat).all()):
            noop_flag.fill_(1)
            return False
        # the weights (masters, or the params' region) are the params of the reference's call
        flat_lists = schema.AdamLists(
            grads=[g_flat], params=[self.weights.flat], exp_avgs=[self.exp_avg.flat],
            exp_avg_sqs=[self.exp_avg_sq.flat],
            emas=[self.ema_list.flat] if self.ema else None,
            remainders=[self.remainders.flat] if self.has_remainder else None)
        total = self.layout.total
        if grad_scale is not None and grad_scale.device != self.device:
            grad_scale = grad_scale.to(self.device)  # once, not once per slice
        sqrt, div = _sqrt_div()
        for start in range(0, total, TORCH_PATH_SLICE):
            n = min(TORCH_PATH_SLICE, total - start)
            # no fp64 on the device: sqrt and division correctly rounded from fp32 ops
            reference.adam_family(self.chunk_size, None,
                                  flat_lists.map(lambda t: t.narrow(0, start, n)), c, grad_scale,
                                  False, sqrt=sqrt, div=div)
        return True

    def _run_cann(self, g_flat, owned, c, grad_scale, check_finite, noop_flag, *,
                  literal: bool) -> bool:
        fn, _ = self.device_op.get(self.device)
        g = g_flat
        if check_finite and not owned:
            buf, _ = self._grad_buffer(g_flat.dtype)  # never unscale the caller's grads in place
            buf.copy_(g_flat)
            g, owned = buf, True
        if grad_scale is not None or check_finite:
            dt = self.math_dtype
            host = self._host_scale(grad_scale)
            if host is not None:  # fp32(1) / scale on the host: IEEE, as the reference's
                inv = reference.rounded(1.0 / host, dt) if host != 0.0 else float("inf")
            else:
                inv = self._device_inverse(grad_scale)
            if check_finite:  # one launch: check and unscale; the one host read of the step
                if not isinstance(inv, torch.Tensor):
                    inv = torch.full((), inv, dtype=dt, device=self.device)
                found = torch.zeros(1, dtype=torch.float32, device=self.device)
                if noop_flag is not None and noop_flag.numel():  # the apex flag, read with it
                    found.copy_(noop_flag.reshape(-1)[:1])
                torch._amp_foreach_non_finite_check_and_unscale_([g], found, inv.reshape(1))
                if bool(found.item() != 0):
                    if noop_flag is not None:
                        noop_flag.fill_(1)
                    return False
            else:
                g = self._scaled(g, owned, inv)
        if self._step_one is None:
            self._step_one = torch.ones(1, dtype=torch.int64, device=self.device)
        args = fold_scalars(c)
        self._launch(fn, g, self._step_one, args["lr"], args["eps"], args["weight_decay"],
                     args["mode"], False, c, literal)
        return True

    def _device_inverse(self, grad_scale) -> torch.Tensor:
        """``1 / grad_scale`` in the math dtype on the device (0-dim; None: 1)."""
        one = torch.ones((), dtype=self.math_dtype, device=self.device)
        if grad_scale is None:
            return one
        return one / grad_scale.reshape(()).to(device=self.device, dtype=self.math_dtype)

    def _scaled(self, g: torch.Tensor, owned: bool, factor) -> torch.Tensor:
        """``g * factor``: in place on our buffer, never on the caller's grads (the product
        goes into our buffer instead)."""
        if owned:
            return g.mul_(factor)
        buf, _ = self._grad_buffer(g.dtype)
        torch.mul(g, factor, out=buf)
        return buf

    def _launch(self, fn, g, step, lr, eps, weight_decay, mode, bias_correction, c, literal,
                skip: Optional[torch.Tensor] = None) -> None:
        """The operator over the bucket (slices of :data:`MAX_LAUNCH_NUMEL`), then the unbiased
        EMA's ``lerp_`` (``literal``: the operator's own EMA). ``skip`` (a 0-dim bool device
        tensor): the step is cancelled on the device when it is set. The operator has no skip
        input, so each slice's var, m, v and s are copied into scratch first (one
        ``_foreach_copy_``) and selected back afterwards (one ``where`` each): nothing is read
        on the host, at 80 bytes per element more; slices of :data:`SKIP_SLICE` elements bound
        the scratch."""
        ema_decay = float(1.0 - c.ema_w) if literal else 1.0
        w, m, v, s = (self.weights.flat, self.exp_avg.flat, self.exp_avg_sq.flat,
                      self.ema_list.flat)
        total = self.layout.total
        size = MAX_LAUNCH_NUMEL if skip is None else min(SKIP_SLICE, MAX_LAUNCH_NUMEL)
        scratch = None if skip is None else self._skip_scratch(min(size, total))
        for start in range(0, total, size):
            n = min(size, total - start)
            outs = (w.narrow(0, start, n), m.narrow(0, start, n), v.narrow(0, start, n),
                    s.narrow(0, start, n))
            if scratch is not None:
                saved = [t.narrow(0, 0, n) for t in scratch]
                torch._foreach_copy_(saved, outs)
            result = fn(g.narrow(0, start, n), *outs, step, lr, ema_decay, float(c.beta1),
                        float(c.beta2), eps, mode, bias_correction, weight_decay)
            _take_results(result, outs)
            self.stats["launches"] += 1
            if not literal and c.ema_w != 0.0:
                outs[3].lerp_(outs[0], float(c.ema_w))  # the unbiased EMA, one launch
            if scratch is not None:
                for dst, old in zip(outs, saved):
                    torch.where(skip, old, dst, out=dst)

    def _skip_scratch(self, n: int) -> List[torch.Tensor]:
        """Four buffers of ``n`` elements in the state dtype, kept (fixed addresses, so that a
        captured graph finds them again)."""
        scratch = self._scratch
        if scratch is None or scratch[0].numel() < n:
            scratch = self._scratch = [torch.empty(n, dtype=self.work_dtype, device=self.device)
                                       for _ in range(4)]
        return scratch


def _take_results(result, outs) -> None:
    """The operator works in place; if a binding returned new tensors, copy them back."""
    if not isinstance(result, (tuple, list)):
        return
    for got, want in zip(result, outs):
        if isinstance(got, torch.Tensor) and got.data_ptr() != want.data_ptr():
            want.copy_(got)
