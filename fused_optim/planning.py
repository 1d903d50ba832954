"""A fused optimizer's plans: its params split into buckets, each bound once to its backend.

A group's *plan* splits its params with grads into buckets by
:func:`multi_tensor.plan.bucket_key` (device, param dtype, grad dtype, masters or not, step,
shard layout), names each bucket's lists (:class:`multi_tensor.schema.AdamLists`), checks them
once against the op table (:func:`multi_tensor.schema.check_adam_lists`, which raises naming the
tensor) and binds them to the backend that runs them (``Backend.prepare_bucket``). At each step
every bucket's ``bind(grads)`` checks cheaply that the grads (and the state) still fit and takes
them; only when a bind fails, when the set of params with grads changes, or after
``load_state_dict`` / ``add_param_group``, is the plan built afresh. Every bucket is bound before
any runs, and a refused plan puts back any state it created, so a rejected step changes nothing.
A step after which nothing but the grads changed (the same option objects, no GradScaler, no
clipping, every plan taking its grads) binds and runs the buckets directly
(:meth:`PlanningMixin._steady_step`).

A group's options are checked when one is replaced (:meth:`PlanningMixin._ensure_checked`), and
what they mean for the step is worked out then, once (:class:`_GroupOptions`).

Per-parameter ``state[p]["step"]`` is a float32 scalar tensor, as in ``torch.optim``. Params
that step together share one step tensor, advanced once per step; a param that misses a step
gets its own tensor again at the next plan, so skipped params never advance.

Complex params (``_supports_complex``) run as ``torch.view_as_real`` views of the param, its
grad and its state, as ``torch.optim`` does; the state itself stays complex.

Sharded params (DTensor, as FSDP2's ``fully_shard`` makes them) keep DTensor state in
``optimizer.state`` (``zeros_like``/``clone`` of a param are sharded alike), and their buckets
run on the local shards: the bucket key includes the device mesh and placements, the params'
and state's local tensors are bound when the bucket is built and the grads' in ``bind``, so the
native kernels run them (uneven and empty shards included; the update is elementwise, so the
bits are those of the full tensors). A bucket is rebuilt when FSDP2 gives a param a new local
tensor.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional

import torch

from multi_tensor import plan, rules, schema, tensor_facts
from multi_tensor.bucketing import is_dtensor, local_shard, shard_layout

from . import ema_schedules


class _Bucket:
    """One engine call per step: params of one device/dtype/step, their bound state, their step.

    ``device_steps``: the backend keeps the step counter on the device and computes the step's
    scalars there (``prepared.run_device_step``: :mod:`multi_tensor.backends.contract`), reading
    GradScaler's ``found_inf`` there too, so a step needs no host sync; the host's ``step`` then
    counts the steps attempted. The device counter is float64 (``device_step``: exact to 2**53;
    float32 stops counting at 2**24), or the backend's ``device_step_dtype`` (the NPU, without
    fp64: int64), and ``step_tensor``, the float32 ``state["step"]`` that torch's optimizers
    present, is a copy of it made on the device after each step.

    ``ema_free``: with ``ema_update_every = k > 1``, the bucket's lists without the EMA bound to
    the op without it, which runs the steps that do not update the EMA
    (:func:`fused_optim.ema_schedules.updates_at`), so those steps move no EMA bytes.
    """

    __slots__ = ("rows", "params", "prepared", "step", "step_tensor", "device_step", "device",
                 "complex",
                 "device_steps", "grads", "ema_free", "every", "active", "layout",
                 "local_params", "_step_host", "_flag_optional")

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
        # float64 unless the backend counts in another dtype (the NPU, which has no fp64: int64,
        # the CANN operator's step tensor)
        self.device_step = (torch.full((), step, device=self.device,
                                       dtype=prepared.device_step_dtype)
                            if device_steps else None)
        # the host step tensor's memory as a numpy scalar: writing it costs a tenth of fill_'s
        # dispatch, in every step's fixed cost (None without numpy, which torch does not need)
        self._step_host = None
        if not device_steps:
            try:
                self._step_host = self.step_tensor.numpy()
            except (RuntimeError, TypeError):
                pass
        self.grads: Optional[List[torch.Tensor]] = None
        self.ema_free = ema_free
        self.every = every
        self.active = prepared        # what this step runs: prepared, or ema_free
        # a host-step bucket whose backend takes noop_flag=None gets None: the optimizer never
        # sets its flag, and a flag would be read on the host at every step
        self._flag_optional = prepared.noop_flag_optional

    def exact_step(self) -> int:
        """The number of updates done (the device counter's, which skipped steps do not
        advance, or the host's); reads the device."""
        return int(self.device_step.item()) if self.device_step is not None else self.step

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
        self.active = (self.prepared if self.every == 1
                       or ema_schedules.updates_at(self.step + 1, self.every) else self.ema_free)
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
        if grad_scale is None or (grad_scale.device.type == "cpu" and self.active.host_grad_scale):
            scale = grad_scale  # a backend that takes a host scale as a kernel scalar
        else:
            scale = grad_scale.to(self.device)
        if self.device_steps:
            if skip_flag is not None:
                flag = skip_flag.to(self.device)
            else:  # nothing can cancel the step: a backend that may take None gets None
                flag = None if self._flag_optional else noop_flag
            self.active.run_device_step(self.device_step, hyper, flag, scale, lr=lr)
            self.step_tensor.copy_(self.device_step)
            self.step += 1
        else:
            self.active.run(None if self._flag_optional else noop_flag,
                            rules.step_scalars(hyper, self.step + 1), scale, False)
            self.step += 1
            if self._step_host is not None:
                self._step_host[()] = self.step
            else:
                self.step_tensor.fill_(self.step)
        self.grads = None


class _GroupOptions:
    """What a param group's options mean for its steps, worked out once per change of an option
    (when :meth:`FusedOptimizerBase._ensure_checked` checks them), not at every step.

    ``key``: the ids of the option values checked, and ``values`` the values themselves, kept
    alive so that no other object takes one of those ids; ``signature``: what the bound lists
    depend on (a change re-plans); ``hyper``: the group's
    :class:`~multi_tensor.rules.AdamHyper`, the same at every step, or None where it depends on
    the step (an EMA schedule) and is made per step.
    """

    __slots__ = ("key", "values", "signature", "hyper")

    def __init__(self, key: tuple, values: tuple, signature, hyper: Optional[rules.AdamHyper]):
        self.key = key
        self.values = values
        self.signature = signature
        self.hyper = hyper


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
        for bucket in self.buckets:
            if not bucket.bind(grads):
                return False
        return True


def _present(grads) -> tuple:
    return tuple(i for i, g in enumerate(grads) if g is not None)


def _local_lists(owner: str, layout, rows: List[int], lists: schema.AdamLists) -> schema.AdamLists:
    """A DTensor bucket's lists as local shards; every tensor must be sharded like the params
    (state made by ``zeros_like``/``clone`` of a param, or loaded by DCP, is)."""
    for list_name, tensors in lists.present():
        for i, t in zip(rows, tensors):
            if shard_layout(t) != layout:
                what = "a plain tensor" if not is_dtensor(t) else (
                    f"a DTensor on {t.device_mesh} with placements {tuple(t.placements)}")
                raise TypeError(
                    f"{owner}: the {list_name} tensor of param {i} is {what}, but the param is a "
                    f"DTensor on {layout[0]} with placements {layout[1]}; optimizer state and "
                    f"grads of a sharded param must be sharded like it (load a sharded "
                    f"checkpoint with torch.distributed.checkpoint's set_optimizer_state_dict)")
    return lists.map(local_shard)


def _changes_in_place(value) -> bool:
    """Whether a group option may change without being replaced and is checked at every step:
    a list, or a CPU tensor (alone or in a tuple)."""
    if isinstance(value, tuple):
        return any(_changes_in_place(v) for v in value)
    return isinstance(value, list) or (isinstance(value, torch.Tensor) and value.device.type == "cpu")


def _holds_tensor(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v) for v in value)
    return isinstance(value, torch.Tensor)


def _real_view(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


class PlanningMixin:
    """The plans of :class:`fused_optim.base.FusedOptimizerBase` (see the module docstring)."""

    def _bound_buckets(self, group: Dict[str, Any]) -> List[_Bucket]:
        """A group's buckets for this step: options checked (the plan depends on them), planned,
        grads bound."""
        # one native pass (tensor_facts.grads_of). The list is not kept past the step (its
        # identity would let the next step skip a pass, but it would keep grads that the user
        # set to None alive through the next forward and backward)
        grads = tensor_facts.grads_of(group["params"])
        options = self._ensure_checked(group) if any(g is not None for g in grads) else None
        return self._plan(group, grads, options).buckets

    def _steady_step(self) -> bool:
        """The step when nothing but the grads changed since the last one: every group's
        options are the objects checked (and its hyperparameters the same at every step), no
        GradScaler and no clipping, and every group's plan takes its grads (``_GroupPlan.bind``:
        the same binds as a full step). Then the full step would only bind, note the
        hyperparameters and run the buckets, which this does without building its work lists,
        hyperparameter memo and undo journal. Returns False, having run nothing, when any of
        that does not hold; the full step then runs (re-binding is harmless)."""
        if (self.max_grad_norm is not None or getattr(self, "found_inf", None) is not None
                or getattr(self, "grad_scale", None) is not None):
            return False
        bound = []
        for group in self.param_groups:
            options = self._checked_groups.get(id(group))
            group_plan = self._plans.get(id(group))
            if (options is None or options.hyper is None or group_plan is None
                    or not tensor_facts.same_objects(tuple(group.values()), options.values)
                    or not group_plan.bind(group["params"], options.signature,
                                           tensor_facts.grads_of(group["params"]))):
                return False
            bound.append((group, options.hyper, group_plan.buckets))
        for index, (_, hyper, buckets) in enumerate(bound):  # every note before any run
            for bucket in buckets:
                self._note_hyper(index, bucket.step + 1, hyper)
        for _, hyper, buckets in bound:
            for bucket in buckets:
                bucket.run(hyper, plan.noop_flag(bucket.device), None, None)
        return True

    def _ensure_checked(self, group: Dict[str, Any]) -> Optional[_GroupOptions]:
        """Check a group's options unless none was replaced since the last check (a scheduler
        assigns a new lr object). CPU tensor options can change in place, so they are checked at
        every step; a tensor on an accelerator only when it is replaced, as torch checks it only
        when it is set: reading its value would sync the device (and break a captured step).

        The options are told apart by identity (``id``), which is cheap and never compares
        tensors or lists by value; an id names one object only while it lives (CPython gives a
        freed address to the next object: ``lr = 0.5`` then ``lr = nan`` may reuse it), so the
        checked values and the group itself are kept alive beside their ids.

        Returns the group's :class:`_GroupOptions` (None for options that change in place, which
        are worked out at every step)."""
        values = tuple(group.values())
        checked = self._checked_groups.get(id(group))
        # (the checked values are kept alive, so the same objects are the same ids)
        if checked is not None and tensor_facts.same_objects(values, checked.values):
            return checked
        self._check_group(group)
        mutable = any(_changes_in_place(v) for k, v in group.items() if k != "params")
        if mutable:
            self._checked_groups[id(group)] = None
            return None
        step_dependent = self._step_dependent(group)
        # a tensor option (an lr on the device) is read at every step, as torch reads it
        constant = not step_dependent and not any(
            _holds_tensor(v) for k, v in group.items() if k != "params")
        # the values are kept alive, so no other object takes their ids: a new group that gets
        # a freed group's id still differs from it in its params list (a value of its own)
        values = tuple(group.values())  # (as checked)
        options = _GroupOptions(tuple(map(id, values)), values,
                                (self._plan_signature(group), step_dependent),
                                self._hyper(group, 1) if constant else None)
        self._checked_groups[id(group)] = options
        return options

    def _plan(self, group: Dict[str, Any], grads: List[Optional[torch.Tensor]],
              options: Optional[_GroupOptions] = None) -> _GroupPlan:
        """The group's plan for these grads, every bucket bound (see the module docstring)."""
        params = group["params"]
        signature = (options.signature if options is not None
                     else (self._plan_signature(group), self._step_dependent(group)))
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
        if not isinstance(step, torch.Tensor):
            return int(step)
        # a bucket's float32 step is a rounded copy of its exact count (float32 is exact only
        # to 2**24): a new plan continues from the count, unless the tensor was written since
        bucket = self._step_owners().get(step)
        if bucket is not None:
            value = bucket.exact_step()
            if float(torch.tensor(float(value), dtype=torch.float32)) == float(step.item()):
                return value
        return int(step.item())

    def _step_owners(self) -> "weakref.WeakKeyDictionary":
        """``state["step"]`` tensor -> the bucket whose count it presents."""
        table = self.__dict__.get("_step_owner_of")
        if table is None:
            table = self.__dict__["_step_owner_of"] = weakref.WeakKeyDictionary()
        return table

    def _build_buckets(self, group: Dict[str, Any], present: tuple, grads) -> List[_Bucket]:
        """:meth:`_checked_buckets`, changing no state when it raises.

        Building a bucket creates and casts state (``_init_state``: moments, masters, EMA; a
        loaded fp32 moment cast to an fp16 param's dtype) before a later bucket's check may refuse
        the plan, so the state entries of the params it touches are saved first (shallow copies:
        ``_init_state`` replaces entries, it never writes a tensor in place) and put back on any
        error. The step records what it saved, so a later group's refusal undoes this one too.
        """
        params = group["params"]
        touched = {id(params[i]): params[i] for i in present}
        if len(touched) != len(present):
            self._refuse_duplicates(group, present)
        saved = {key: dict(self.state[p]) for key, p in touched.items() if p in self.state}
        try:
            buckets = self._checked_buckets(group, present, grads)
        except BaseException:
            self._restore_state(touched, saved)
            raise
        journal = self.__dict__.get("_plan_journal")
        if journal is not None:
            journal.append((group, touched, saved))
        return buckets

    def _refuse_duplicates(self, group: Dict[str, Any], present: tuple) -> None:
        """A param listed twice in a group (torch.optim only warns) would be updated twice in
        one step, with results that depend on the backend: refused, naming both entries."""
        params = group["params"]
        gi = next(k for k, g in enumerate(self.param_groups) if g is group)
        first: Dict[int, int] = {}
        for i in present:
            j = first.setdefault(id(params[i]), i)
            if j != i:
                raise ValueError(
                    f"{type(self).__name__}: param_groups[{gi}]['params'][{i}] is the same tensor "
                    f"as param_groups[{gi}]['params'][{j}]; a param may appear only once (it "
                    f"would be updated twice in one step): remove the duplicate")

    def _restore_state(self, touched: Dict[int, torch.Tensor], saved: Dict[int, dict]) -> None:
        """Put the state entries of ``touched`` params back as ``saved`` (the same dict objects,
        which callers may hold), removing the entries that did not exist."""
        for key, p in touched.items():
            if key in saved:
                entry = self.state[p]
                entry.clear()
                entry.update(saved[key])
            else:
                self.state.pop(p, None)

    def _checked_buckets(self, group: Dict[str, Any], present: tuple, grads) -> List[_Bucket]:
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
        rows_params = [params[i] for i in present]
        split = plan.split_buckets(rows_params, [grads[i] for i in present],
                                   [self._uses_master(p, group) for p in rows_params],
                                   steps=[self._step_of(p) for p in rows_params],
                                   layouts=[shard_layout(p) for p in rows_params])
        checked = []
        for key, rows in split.items():
            rows = [present[k] for k in rows]
            bucket_params = [params[i] for i in rows]
            for p in bucket_params:
                self._init_state(p, group, self.state[p])
            lists = self._state_lists(bucket_params, group).with_grads([grads[i] for i in rows])
            layout = key[-1]
            if layout is not None:
                lists = _local_lists(name, layout, rows, lists)
            if bucket_params[0].is_complex():
                lists = lists.map(_real_view)
            variants = [(1, spec, lists)]
            skipping = self._ema_skipping(group, lists)
            if skipping is not None:
                variants.append(skipping)
            bound = []
            for every, op, op_lists in variants:
                schema.check_adam_lists(op, op_lists)
                bound.append((every, op, op_lists.state(),
                              plan.backend_for_lists(op, op_lists.present())))
            checked.append((rows, bucket_params, bound, layout))
        buckets = []
        for rows, bucket_params, bound, layout in checked:
            capturable = bool(group.get("capturable"))
            prepared = [backend.prepare_bucket(op.name, state, self._chunk_size,
                                               capturable=capturable)
                        for _, op, state, backend in bound]
            all_rows = len(rows) == len(params) and rows == list(range(len(params)))
            device_steps = prepared[0].device_steps and not self._step_dependent(group)
            if capturable:
                self._check_capturable(group, bucket_params[0], bound[0][3], prepared[0],
                                       device_steps)
            bucket = _Bucket(None if all_rows else rows, bucket_params, prepared[0],
                             self._step_of(bucket_params[0]), device_steps,
                             ema_free=prepared[-1], every=bound[-1][0], layout=layout)
            for p in bucket_params:
                self.state[p]["step"] = bucket.step_tensor
            self._step_owners()[bucket.step_tensor] = bucket
            buckets.append(bucket)
        return buckets

    def _check_capturable(self, group: Dict[str, Any], p: torch.Tensor, backend, prepared,
                          device_steps: bool) -> None:
        """A capturable group's bucket keeps its steps on the device and reads a tensor lr
        there; raise naming the param group and param where it cannot."""
        backend_steps = prepared.device_steps
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        where = f"param_groups[{gi}]['params'][{next(i for i, q in enumerate(group['params']) if q is p)}]"
        why_not = prepared.capturable_refusal()
        if why_not is not None:
            raise ValueError(
                f"{type(self).__name__}: capturable=True needs steps without a host read, but "
                f"{where} ({p.device}, {p.dtype}) cannot have them: {why_not}")
        if not device_steps:
            why = ("the group's EMA decay depends on the step (an ema_schedule other than "
                   "'constant', ema_start_step > 0 or ema_update_every > 1)" if backend_steps else
                   f"the {backend.name!r} backend that runs these tensors keeps steps on the host "
                   f"(the Triton backend on CUDA keeps them on the device)")
            raise ValueError(
                f"{type(self).__name__}: capturable=True needs the step counters and the per-step "
                f"scalars on the device, but {where} ({p.device}, {p.dtype}) cannot have them: {why}")
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and not prepared.reads_tensor_lr:
            raise ValueError(
                f"{type(self).__name__}: capturable=True with a tensor lr, but {where} "
                f"({p.device}) runs on the {backend.name!r} backend, whose operator takes lr as "
                f"a host value (reading the tensor would sync): give the group a float lr "
                f"(an LR scheduler sets floats)")
        if isinstance(lr, torch.Tensor) and lr.device != p.device:
            raise ValueError(
                f"{type(self).__name__}: capturable=True reads a tensor lr on the params' device, "
                f"but the lr of param_groups[{gi}] is on {lr.device} and {where} on {p.device}: "
                f"create it there, e.g. torch.tensor(lr, device={str(p.device)!r})")
