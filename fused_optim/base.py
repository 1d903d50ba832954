"""The machinery every fused optimizer shares: plans, the step, AMP and exact state dicts.

A fused optimizer is a ``torch.optim.Optimizer`` whose ``step`` makes one engine call per
bucket. ``step()`` reads as a straight line::

    grads  = [p.grad for p in group["params"]]          # collect, per group
    plan   = self._plan(group, grads)                   # cached; checked and bound
    scalars = per bucket, from the group's hyperparameters (every group checked first)
    run every bucket; advance its step

A group's *plan* splits its params into buckets by ``(device, param dtype, grad dtype, step,
master or not)`` and binds each bucket's state lists once to the backend that runs it
(``Backend.prepare_bucket``). At each step every bucket's ``bind(grads)`` checks cheaply that
the grads still fit (same count, dtypes, shapes, device) and takes them; only when a bind fails,
when the set of params with grads changes, or after ``load_state_dict`` / ``add_param_group``,
is the plan built afresh, with the full check of the op table (:mod:`multi_tensor.schema`),
which raises naming the tensor. Every bucket is bound before any runs, so a rejected step
changes nothing.

Per-parameter ``state[p]["step"]`` is a float32 scalar tensor, as in ``torch.optim``. Params
that step together share one step tensor, advanced once per step; a param that misses a step
gets its own tensor again at the next plan, so skipped params never advance.

Subclasses define:

* ``_op(group)``: the op (:class:`multi_tensor.schema.OpSpec`) of a group's buckets;
* ``_init_state(p, group, state)``: create missing state entries for ``p``;
* ``_state_lists(params, group)``: the op's lists after the grads, for one bucket;
* ``_hyper(group, step)``: the group's :class:`multi_tensor.rules.AdamHyper` at ``step``;
* ``_check_group(group)``: the group's option checks (run when added and before every step).

Complex params (``_supports_complex``) run as ``torch.view_as_real`` views of the param, its
grad and its state, as ``torch.optim`` does; the state itself stays complex.

Sharded params (DTensor, as FSDP2's ``fully_shard`` makes them) keep DTensor state in
``optimizer.state`` (``zeros_like``/``clone`` of a param are sharded alike), and their buckets
run on the local shards: the bucket key includes the device mesh and placements, the params'
and state's local tensors are bound when the bucket is built and the grads' in ``bind``, so the
native kernels run them (uneven and empty shards included; the update is elementwise, so the
bits are those of the full tensors). ``max_grad_norm`` sums the squared local norms over the
ranks holding the shards (an all-reduce per sharded bucket). A bucket is rebuilt when FSDP2
gives a param a new local tensor.

``init_state()`` creates the state without stepping. ``torch.distributed.checkpoint``'s
``get/set_optimizer_state_dict`` initialise an optimizer without state by calling ``step()``
with every lr 0 and zero grads; a first ``step()`` that sees exactly that (no state, every lr
zero, every param that requires grad has a grad, all of them zero over all shards) runs
``init_state()`` instead of an update, so no step is counted and no EMA moves. Only a first
step can be such a call, so later steps pay nothing for the check.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from multi_tensor import multi_tensor_applier, rules, schema, validation
from multi_tensor.backends import registry
from multi_tensor.bucketing import group_indices, is_dtensor, local_shard, shard_layout

from . import ema_schedules


LOW_PRECISION = validation.LOW_PRECISION
COMPLEX_DTYPES = (torch.complex64, torch.complex128)


class _Bucket:
    """One engine call per step: params of one device/dtype/step, their bound state, their step.

    ``device_steps``: the backend keeps the step counter on the device and computes the step's
    scalars there (``prepared.run_device_step``), reading GradScaler's ``found_inf`` there too,
    so a step needs no host sync; the host's ``step`` then counts the steps attempted.

    ``ema_free``: with ``ema_update_every = k > 1``, the bucket's lists without the EMA bound to
    the op without it, which runs the steps that do not update the EMA
    (:func:`fused_optim.ema_schedules.updates_at`), so those steps move no EMA bytes.
    """

    __slots__ = ("rows", "params", "prepared", "step", "step_tensor", "device", "complex",
                 "device_steps", "grads", "ema_free", "every", "active", "layout",
                 "local_params")

    def __init__(self, rows: Optional[List[int]], params, prepared, step: int, device_steps: bool,
                 ema_free=None, every: int = 1, layout=None):
        self.rows = rows              # indices into the group's params; None: all, in order
        self.params = params
        # DTensor buckets: (mesh, placements), and the local shards the kernel was bound to
        self.layout = layout
        self.local_params = None if layout is None else [local_shard(p) for p in params]
        self.prepared = prepared
        self.step = step
        self.device = params[0].device
        self.complex = params[0].is_complex()
        self.device_steps = device_steps
        self.step_tensor = torch.full((), float(step), dtype=torch.float32,
                                      device=self.device if device_steps else "cpu")
        self.grads: Optional[List[torch.Tensor]] = None
        self.ema_free = ema_free
        self.every = every
        self.active = prepared        # what this step runs: prepared, or ema_free

    def bind(self, grads: List[Optional[torch.Tensor]]) -> bool:
        """Take this step's grads (real views for complex params) if they fit the bucket."""
        mine = grads if self.rows is None else [grads[i] for i in self.rows]
        if self.layout is not None:
            mine = self._local_grads(mine)
            if mine is None:
                return False
        if self.complex:
            mine = [None if g is None else _real_view(g) for g in mine]
        self.grads = mine
        self.active = (self.prepared if ema_schedules.updates_at(self.step + 1, self.every)
                       else self.ema_free)
        return self.active.bind(mine)

    def _local_grads(self, grads):
        """The grads' local shards, or None when a grad is not sharded like its param, or when
        the sharding owner (FSDP2 after ``model.to()`` or ``load_state_dict(assign=True)``)
        gave a param a new local tensor: the plan is then rebuilt on the new shards."""
        mesh, placements = self.layout
        local = []
        for p, held, g in zip(self.params, self.local_params, grads):
            if g is None or not is_dtensor(g) or p._local_tensor is not held:
                return None
            spec = g._spec
            if spec.placements != placements or (spec.mesh is not mesh and spec.mesh != mesh):
                return None
            local.append(g._local_tensor)
        return local

    def run(self, hyper: rules.AdamHyper, noop_flag: torch.Tensor,
            skip_flag: Optional[torch.Tensor], grad_scale: Optional[torch.Tensor],
            lr: Optional[torch.Tensor] = None) -> None:
        """One update; ``skip_flag``: a device flag (found_inf) that cancels it on the device;
        ``lr``: a device tensor the kernel reads in place of ``hyper.lr`` (capturable)."""
        scale = None if grad_scale is None else grad_scale.to(self.device)
        if self.device_steps:
            flag = noop_flag if skip_flag is None else skip_flag.to(self.device)
            self.active.run_device_step(self.step_tensor, hyper, flag, scale, lr=lr)
            self.step += 1
        else:
            self.active.run(noop_flag, rules.step_scalars(hyper, self.step + 1), scale, False)
            self.step += 1
            self.step_tensor.fill_(self.step)
        self.grads = None


class _GroupPlan:
    __slots__ = ("params", "count", "signature", "present", "buckets")

    def __init__(self, params, signature, present, buckets):
        self.params = params          # the group's own list object, to notice a replaced list
        self.count = len(params)
        self.signature = signature
        self.present = present        # indices of the params with grads; None: all of them
        self.buckets = buckets

    def bind(self, params, signature, grads) -> bool:
        """Whether this plan still serves ``grads``; if so every bucket has taken its grads."""
        if self.params is not params or self.count != len(params) or self.signature != signature:
            return False
        if self.present is not None and self.present != _present(grads):
            return False
        return all(b.bind(grads) for b in self.buckets)


def _present(grads) -> tuple:
    return tuple(i for i, g in enumerate(grads) if g is not None)


def _local_lists(owner: str, spec: schema.OpSpec, layout, rows: List[int], lists):
    """A DTensor bucket's lists as local shards; every tensor must be sharded like the params
    (state made by ``zeros_like``/``clone`` of a param, or loaded by DCP, is)."""
    form = spec.form(len(lists))
    names = form.names if form is not None else tuple(f"list{i}" for i in range(len(lists)))
    for tensors, list_name in zip(lists, names):
        for i, t in zip(rows, tensors):
            if shard_layout(t) != layout:
                what = "a plain tensor" if not is_dtensor(t) else (
                    f"a DTensor on {t.device_mesh} with placements {tuple(t.placements)}")
                raise TypeError(
                    f"{owner}: the {list_name} tensor of param {i} is {what}, but the param is a "
                    f"DTensor on {layout[0]} with placements {layout[1]}; optimizer state and "
                    f"grads of a sharded param must be sharded like it (load a sharded "
                    f"checkpoint with torch.distributed.checkpoint's set_optimizer_state_dict)")
    return [[local_shard(t) for t in tensors] for tensors in lists]


def _sum_over_shards(square: torch.Tensor, layout) -> torch.Tensor:
    """The sum of a local squared norm over the ranks holding the other shards: an all-reduce
    over each mesh dimension the grads are sharded along (replicated dimensions hold copies),
    as ``clip_grad_norm_`` reduces the norm of DTensor grads. Every rank runs the same buckets
    in the same order, so the collectives match."""
    import torch.distributed as dist

    mesh, placements = layout
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            dist.all_reduce(square, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        elif not placement.is_replicate():
            raise NotImplementedError(
                f"max_grad_norm: grads with placement {placement} (only Shard and Replicate)")
    return square


def _is_zero(lr) -> bool:
    return bool(lr == 0) if isinstance(lr, torch.Tensor) else lr == 0


def _all_zero(grads: List[torch.Tensor]) -> bool:
    """Whether every element of every grad is zero, over all shards of sharded grads: ranks
    decide together (one all-reduce per device mesh), so no rank takes a step the others skip."""
    nonzero = bool(torch.stack([local_shard(g).ne(0).any().to(grads[0].device)
                                for g in grads]).any())  # one host read
    meshes = []
    for g in grads:
        layout = shard_layout(g)
        if layout is not None and all(m is not layout[0] for m in meshes):
            meshes.append(layout[0])
    if not meshes:
        return not nonzero
    import torch.distributed as dist

    flag = torch.tensor([int(nonzero)], dtype=torch.int32, device=grads[0].device)
    for mesh in meshes:
        for dim in range(mesh.ndim):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return not bool(flag.item())


def _changes_in_place(value) -> bool:
    """Whether a group option may change without being replaced and is checked at every step:
    a list, or a CPU tensor (alone or in a tuple)."""
    if isinstance(value, tuple):
        return any(_changes_in_place(v) for v in value)
    return isinstance(value, list) or (isinstance(value, torch.Tensor) and value.device.type == "cpu")


def _device_lr(group: Dict[str, Any]) -> Optional[torch.Tensor]:
    """A capturable group's tensor ``lr``, which its kernels read on the device."""
    lr = group["lr"]
    return lr if group.get("capturable") and isinstance(lr, torch.Tensor) else None


def _real_view(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


class FusedOptimizerBase(torch.optim.Optimizer):
    """Base class of the fused multi-tensor optimizers (see the module docstring).

    Options every fused optimizer takes:

        fused_unscale: ``True`` (default): ``torch.amp.GradScaler`` leaves the unscale to the
            kernel (no extra pass). ``False``: the scaler unscales the grads itself before
            ``step()``, for code that clips or inspects grads in between (Lightning's
            ``gradient_clip_val``).
        max_grad_norm: clip the grads to this global L2 norm (of the unscaled grads, over every
            param with a grad, as ``torch.nn.utils.clip_grad_norm_``): one multi-tensor l2norm
            launch per bucket, and the clip factor folded into the kernel's grad multiplier (no
            extra pass over the grads). A non-finite norm skips the step. ``last_grad_norm``
            holds the norm of the last step.
        chunk_size: elements per unit of parallel work (never changes a result).
    """

    _step_supports_amp_scaling = True
    _supports_complex = False  # complex64/complex128 params, run as real views

    def __init__(self, params, defaults: Dict[str, Any], chunk_size: int = multi_tensor_applier.chunk_size,
                 fused_unscale: bool = True, max_grad_norm: Optional[float] = None):
        validation.check_chunk_size(type(self).__name__, chunk_size)
        if max_grad_norm is not None and not validation.real(
                type(self).__name__, "max_grad_norm", max_grad_norm) > 0.0:
            raise ValueError(f"{type(self).__name__}: max_grad_norm must be > 0, got {max_grad_norm!r}")
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.last_grad_norm: Optional[torch.Tensor] = None
        self._checked_groups: Dict[int, Optional[tuple]] = {}
        self._chunk_size = chunk_size
        if not fused_unscale:
            # GradScaler then unscales the grads itself before step() (what frameworks that clip
            # gradients between unscale and step, e.g. Lightning's gradient_clip_val, require)
            self._step_supports_amp_scaling = False
        self._plans: Dict[int, _GroupPlan] = {}
        super().__init__(params, defaults)
        self._check_params()

    # --- subclass hooks -----------------------------------------------------------------------
    def _op(self, group: Dict[str, Any]) -> schema.OpSpec:
        raise NotImplementedError

    def _init_state(self, p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _state_lists(self, params: List[torch.Tensor], group: Dict[str, Any]) -> List[List[torch.Tensor]]:
        raise NotImplementedError

    def _hyper(self, group: Dict[str, Any], step: int) -> rules.AdamHyper:
        raise NotImplementedError

    def _check_group(self, group: Dict[str, Any]) -> None:
        """Raise if a group option is invalid (before any tensor is modified)."""

    def _plan_signature(self, group: Dict[str, Any]) -> Any:
        """Group options the bound lists depend on; when they change, the plan is rebuilt."""
        return None

    def _ema_skipping(self, group: Dict[str, Any], state_lists) -> Optional[tuple]:
        """``(k, op, state lists)`` when the group updates its EMA only every ``k > 1`` steps: the
        op and lists (without the EMA) of the steps in between; None otherwise."""
        return None

    def _step_dependent(self, group: Dict[str, Any]) -> bool:
        """Whether the group's hyperparameters depend on the step number beyond the bias
        corrections (an EMA schedule): then its buckets keep their step on the host."""
        return False

    def _before_step(self) -> None:
        """Called at the start of every step, before anything is checked or modified."""

    # --- param groups -------------------------------------------------------------------------
    def _check_params(self) -> None:
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.is_floating_point() or (self._supports_complex and p.dtype in COMPLEX_DTYPES):
                    continue
                supported = "floating-point" + (" and complex64/complex128"
                                                if self._supports_complex else "")
                raise TypeError(
                    f"{type(self).__name__}: param_groups[{gi}]['params'][{pi}] is {p.dtype}; "
                    f"only {supported} params can be optimized")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a group; a rejected one (bad option or param) does not stay in ``param_groups``."""
        count = len(self.param_groups)
        try:
            super().add_param_group(param_group)
            self._check_group(self.param_groups[-1])
            if hasattr(self, "_plans"):
                self._check_params()
        except Exception:
            del self.param_groups[count:]
            raise
        if hasattr(self, "_plans"):
            self._plans.clear()

    # What an instance keeps outside its param groups and state, and so what copy.deepcopy and
    # pickle must carry besides torch's defaults/state/param_groups; subclasses add their own
    # (every class in the MRO is read). Not part of state_dict(): these are the options of the
    # optimizer that loads a state dict, kept as they are, like its chunk_size.
    _instance_attrs = ("max_grad_norm", "last_grad_norm", "_chunk_size",
                       "_step_supports_amp_scaling")

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        for cls in type(self).__mro__:
            for key in cls.__dict__.get("_instance_attrs", ()):
                if key in self.__dict__:  # _step_supports_amp_scaling: only when fused_unscale=False
                    state[key] = self.__dict__[key]
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # torch's __setstate__ adds "differentiable" to the defaults; an optimizer whose
        # constructor has no such option must not then copy it into every group (a loaded
        # state dict would no longer equal the saved one)
        defaults = state.get("defaults", self.__dict__.get("defaults", {}))
        had_differentiable = "differentiable" in defaults
        super().__setstate__(state)
        if not had_differentiable:
            self.defaults.pop("differentiable", None)
        self.__dict__.setdefault("_plans", {})
        self.__dict__.setdefault("_chunk_size", multi_tensor_applier.chunk_size)
        self.__dict__.setdefault("max_grad_norm", None)
        self.__dict__.setdefault("last_grad_norm", None)
        self.__dict__["_checked_groups"] = {}
        self._plans.clear()
        for group in self.param_groups:  # options added since the state was saved (as torch)
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    # --- step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One update of every param that has a grad. Returns ``closure()``'s loss, if given.

        Under ``torch.amp.GradScaler`` the scaler sets ``grad_scale`` and ``found_inf`` on the
        optimizer: grads are unscaled inside the kernel, and when ``found_inf`` is set nothing
        changes (params, masters, moments, EMA and step). With ``max_grad_norm`` the global norm
        of the unscaled grads is taken first and the clip factor joins the unscale factor.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():  # traced by torch.compile: fused_optim/compiled.py
            from . import compiled  # imported here: it needs torch._dynamo (about 1 s to import)
            compiled.step(self)
            return loss
        self._before_step()
        if not self.state and self._is_state_init_call():
            self.init_state()
            return loss
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and found_inf.device.type == "cpu" and bool(found_inf.item() != 0):
            return loss  # before planning: a skipped first step creates no state either
        work = [(group, bucket) for group in self.param_groups
                for bucket in self._bound_buckets(group)]
        skip, skip_flag = self._overflow(found_inf, work)
        if not skip:
            skip, grad_scale = self._unscale_factor(work)
        if skip:
            for _, bucket in work:
                bucket.grads = None
            return loss
        hypers = self._hypers(work)
        for (group, bucket), hyper in zip(work, hypers):
            bucket.run(hyper, self._noop_flag(bucket.device), skip_flag, grad_scale,
                       _device_lr(group))
        return loss

    def _init_group(self, *lists):
        """What dynamo runs eagerly when it compiles ``step()`` (see fused_optim/compiled.py)."""
        from . import compiled
        return compiled.init_group(self, *lists)

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the state of every param that requires grad, without stepping.

        ``step`` is 0, moments are zero, the EMA (and fp32 master) equals the param: exactly the
        state a first ``step()`` starts from, so a step after it continues as if it had not
        run. Entries that exist are kept. Sharded params get sharded state (``zeros_like`` /
        ``clone`` of a DTensor are DTensors sharded alike).
        """
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._init_state(p, group, self.state[p])

    def _is_state_init_call(self) -> bool:
        """Whether this first ``step()`` is a state-initialisation call, as
        ``torch.distributed.checkpoint.state_dict`` makes one (``_init_optim_state``: on an
        optimizer without state, every lr set to 0 and every param that requires grad given a
        zero grad) rather than an update. Asked only while ``state`` is empty. A first step with
        lr 0 and real grads (a linear warm-up from 0) is an update: it counts."""
        if any(not _is_zero(group.get("lr", 0.0)) for group in self.param_groups):
            return False
        grads = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads.append(p.grad)
                elif p.requires_grad:
                    return False
        return bool(grads) and _all_zero(grads)

    def _bound_buckets(self, group: Dict[str, Any]) -> List[_Bucket]:
        """A group's buckets for this step: options checked (the plan depends on them), planned,
        grads bound."""
        grads = [p.grad for p in group["params"]]
        if any(g is not None for g in grads):
            self._ensure_checked(group)
        return self._plan(group, grads).buckets

    def _hypers(self, work) -> List[rules.AdamHyper]:
        """Every bucket's hyperparameters, once per (group, step), before any bucket runs (an
        EMA schedule that raises changes nothing)."""
        memo: Dict[tuple, rules.AdamHyper] = {}
        out = []
        for group, bucket in work:
            key = (id(group), bucket.step + 1)
            if key not in memo:
                memo[key] = self._hyper(group, bucket.step + 1)
            out.append(memo[key])
        return out

    @staticmethod
    def _overflow(found_inf: Optional[torch.Tensor], work) -> tuple:
        """``(skip now, device flag)`` from GradScaler's ``found_inf`` on an accelerator.

        Read on the host, except when every bucket reads it on the device (device steps): then
        it is handed to the kernels and nothing syncs.
        """
        if found_inf is None or found_inf.device.type == "cpu" or not work:
            return False, None
        if all(b.device_steps for _, b in work):
            return False, found_inf
        return bool(found_inf.item() != 0), None

    def _unscale_factor(self, work) -> tuple:
        """``(skip, grad scale)``: the scale the kernels divide the grads by is GradScaler's,
        with the clip factor folded in when clipping (``scale / clip`` in double, rounded once
        to fp32); a non-finite grad norm skips the step."""
        grad_scale = getattr(self, "grad_scale", None)
        if self.max_grad_norm is None or not work:
            return False, grad_scale
        norm = self._grad_norm(work)
        if grad_scale is not None:
            norm = norm / grad_scale.to(device=norm.device, dtype=torch.float64)
        self.last_grad_norm = norm
        if not bool(torch.isfinite(norm)):  # one host read per step when clipping
            return True, None
        clip = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        scale = 1.0 if grad_scale is None else grad_scale.to(device=norm.device,
                                                               dtype=torch.float64)
        return False, (scale / clip).to(torch.float32)

    def _grad_norm(self, work) -> torch.Tensor:
        """The global L2 norm of the bound grads (as they are, scaled or not), in fp64: one
        multi-tensor l2norm launch per bucket."""
        squares = []
        for _, bucket in work:
            backend = registry.backend_for(
                "l2norm", bucket.device,
                tensor_subclasses=validation.storageless([bucket.grads], ("grads",)) is not None)
            # a flag of its own: l2norm sets it on a non-finite grad, and the step's noop flag
            # must stay clear
            flag = torch.zeros(1, dtype=torch.int32, device=bucket.device)
            total, _ = backend.ops["l2norm"](self._chunk_size, flag, [bucket.grads], False)
            square = total.to(dtype=torch.float64).square()
            if bucket.layout is not None:
                square = _sum_over_shards(square, bucket.layout)
            squares.append(square.to(device=work[0][1].device))
        return torch.stack(squares).sum().sqrt()

    def _ensure_checked(self, group: Dict[str, Any]) -> None:
        """Check a group's options unless none was replaced since the last check (a scheduler
        assigns a new lr object). CPU tensor options can change in place, so they are checked at
        every step; a tensor on an accelerator only when it is replaced, as torch checks it only
        when it is set: reading its value would sync the device (and break a captured step)."""
        key = tuple(map(id, group.values()))
        if self._checked_groups.get(id(group)) != key:
            self._check_group(group)
            mutable = any(_changes_in_place(v) for k, v in group.items() if k != "params")
            self._checked_groups[id(group)] = None if mutable else key

    # --- plans --------------------------------------------------------------------------------
    def _plan(self, group: Dict[str, Any], grads: List[Optional[torch.Tensor]]) -> _GroupPlan:
        """The group's plan for these grads, every bucket bound (see the module docstring)."""
        params = group["params"]
        signature = (self._plan_signature(group), self._step_dependent(group))
        plan = self._plans.get(id(group))
        if plan is not None and plan.bind(params, signature, grads):
            return plan
        present = _present(grads)
        plan = _GroupPlan(params, signature, None if len(present) == len(params) else present,
                          self._build_buckets(group, present, grads))
        self._plans[id(group)] = plan
        for bucket in plan.buckets:
            if not bucket.bind(grads):
                raise RuntimeError(
                    f"{type(self).__name__}: the backend refused grads that passed the op check")
        return plan

    def _step_of(self, p: torch.Tensor) -> int:
        step = self.state[p].get("step")
        if step is None:
            return 0
        return int(step.item()) if isinstance(step, torch.Tensor) else int(step)

    def _build_buckets(self, group: Dict[str, Any], present: tuple, grads) -> List[_Bucket]:
        """Check the params with grads against the op table and bind their buckets."""
        params = group["params"]
        name = type(self).__name__
        for i in present:
            g = grads[i]
            if g.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients")
            if params[i].is_complex() and not g.is_complex():
                raise TypeError(f"{name}: param of dtype {params[i].dtype} has a grad of dtype "
                                f"{g.dtype}; a complex param needs a complex grad")
        spec = self._op(group)
        # a DTensor's (mesh, placements) is part of the key: a bucket runs on local shards cut alike
        keys = [(params[i].device, params[i].dtype, grads[i].dtype, self._step_of(params[i]),
                 shard_layout(params[i])) for i in present]
        checked = []
        for key, rows in group_indices(keys).items():
            rows = [present[k] for k in rows]
            bucket_params = [params[i] for i in rows]
            for p in bucket_params:
                self._init_state(p, group, self.state[p])
            lists = [[grads[i] for i in rows]] + self._state_lists(bucket_params, group)
            layout = key[-1]
            if layout is not None:
                lists = _local_lists(name, spec, layout, rows, lists)
            if bucket_params[0].is_complex():
                lists = [[_real_view(t) for t in tensors] for tensors in lists]
            variants = [(1, spec, lists[1:])]
            skipping = self._ema_skipping(group, lists[1:])
            if skipping is not None:
                variants.append(skipping)
            bound = []
            for every, op, state_lists in variants:
                form = schema.check_lists(op, lists[:1] + state_lists)
                bound.append((every, op, state_lists,
                              schema.backend_for_lists(op, lists[:1] + state_lists, form)))
            checked.append((rows, bucket_params, bound, layout))
        buckets = []
        for rows, bucket_params, bound, layout in checked:
            prepared = [backend.prepare_bucket(op.name, state_lists, self._chunk_size)
                        for _, op, state_lists, backend in bound]
            all_rows = len(rows) == len(params) and rows == list(range(len(params)))
            device_steps = (hasattr(prepared[0], "run_device_step")
                            and not self._step_dependent(group))
            if group.get("capturable"):
                self._check_capturable(group, bucket_params[0], bound[0][3],
                                       hasattr(prepared[0], "run_device_step"), device_steps)
            bucket = _Bucket(None if all_rows else rows, bucket_params, prepared[0],
                             self._step_of(bucket_params[0]), device_steps,
                             ema_free=prepared[-1], every=bound[-1][0], layout=layout)
            for p in bucket_params:
                self.state[p]["step"] = bucket.step_tensor
            buckets.append(bucket)
        return buckets

    def _check_capturable(self, group: Dict[str, Any], p: torch.Tensor, backend,
                          backend_steps: bool, device_steps: bool) -> None:
        """A capturable group's bucket keeps its steps on the device and reads a tensor lr
        there; raise naming the param group and param where it cannot."""
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        where = f"param_groups[{gi}]['params'][{next(i for i, q in enumerate(group['params']) if q is p)}]"
        if not device_steps:
            why = ("the group's EMA decay depends on the step (an ema_schedule other than "
                   "'constant', ema_start_step > 0 or ema_update_every > 1)" if backend_steps else
                   f"the {backend.name!r} backend that runs these tensors keeps steps on the host "
                   f"(the Triton backend on CUDA keeps them on the device)")
            raise ValueError(
                f"{type(self).__name__}: capturable=True needs the step counters and the per-step "
                f"scalars on the device, but {where} ({p.device}, {p.dtype}) cannot have them: {why}")
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.device != p.device:
            raise ValueError(
                f"{type(self).__name__}: capturable=True reads a tensor lr on the params' device, "
                f"but the lr of param_groups[{gi}] is on {lr.device} and {where} on {p.device}: "
                f"create it there, e.g. torch.tensor(lr, device={str(p.device)!r})")

    def _noop_flag(self, device: torch.device) -> torch.Tensor:
        """A zero flag per device (the optimizer never asks a kernel to set it)."""
        flags = self.__dict__.setdefault("_noop_flags", {})
        flag = flags.get(device)
        if flag is None:
            flag = flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return flag

    # --- state dict ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim.Optimizer.state_dict()``, with a step tensor of its own for every param.

        Params that step together share one step tensor here; a saved dict must not carry that
        sharing (a ``torch.optim`` optimizer loading it would advance the shared tensor once per
        param), so each param's entry gets its own copy of ``step``. Everything else is returned
        by reference, as torch does. Options kept on the instance (``max_grad_norm``,
        ``fused_unscale``, ...) are not in it: they stay those of the optimizer that loads it.
        """
        state_dict = super().state_dict()
        # entries that are not a param's (a state_dict pre-hook may add any) pass through, as torch's
        state_dict["state"] = {
            pid: ({**entry, "step": entry["step"].clone()}
                  if isinstance(entry, dict) and isinstance(entry.get("step"), torch.Tensor)
                  else entry)
            for pid, entry in state_dict["state"].items()
        }
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load state, keeping every saved state tensor's dtype.

        ``torch.optim.Optimizer`` casts floating state to the param's dtype; fp32 masters, moments
        and EMA of fp16/bf16 params must stay fp32, so they are restored from the saved copy
        (moved to the param's device) after the base class has loaded everything else.

        A ``torch.optim`` Adam/AdamW/RAdam state dict loads too (see :mod:`fused_optim.compat`):
        moments and steps are taken over, masters and EMA start from the params. Group options a
        saved dict lacks keep their current values.
        """
        from . import compat

        state_dict, from_torch = compat.adapt_state_dict(self, state_dict)
        saved_state = state_dict["state"]
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            for key, value in saved_state.get(pid, {}).items():
                if isinstance(value, torch.Tensor) and key != "step" and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, copy=True)
                elif key == "step" and isinstance(value, torch.Tensor):
                    self.state[p][key] = value.detach().to(device="cpu", dtype=torch.float32, copy=True)
        if from_torch:
            compat.complete_loaded_state(self)
        self._plans.clear()

    def torch_state_dict(self, torch_cls=None) -> Dict[str, Any]:
        """A state dict the matching ``torch.optim`` optimizer (AdamW/Adam/RAdam) loads and continues.

        See :func:`fused_optim.compat.torch_state_dict` (EMA and masters are not part of it).
        """
        from . import compat

        return compat.torch_state_dict(self, torch_cls)
