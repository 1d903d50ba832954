"""The machinery every fused optimizer shares: plans, steps, AMP and exact state dicts.

A fused optimizer is a ``torch.optim.Optimizer`` whose ``step`` makes one multi-tensor engine call
per bucket. For each param group it keeps a *plan*: the group's params split into buckets by
``(device, param dtype, grad dtype, step count)`` and, per bucket, the state lists bound once to
the engine (:func:`multi_tensor.backends.prepare`). A step then only collects grads and calls each
bucket. The plan is rebuilt when the set of params with grads changes, after
``load_state_dict`` and after ``add_param_group``.

Per-parameter ``state[p]["step"]`` is a float32 scalar tensor, as in ``torch.optim``. Params that
step together share one step tensor, advanced once per step; a param that misses a step gets its
own tensor again at the next plan, so skipped params never advance.

Subclasses define the op and its state:

* ``_op``: the engine op name (``"fused_ema_adamw"``, ``"adam"``, ``"radam"``);
* ``_init_state(p, group, state)``: create missing state entries for ``p``;
* ``_state_lists(params, group)``: the op's lists after the grads, for one bucket;
* ``_op_args(group, step)``: the op's scalar arguments after ``tensor_lists``.

Optional hooks: ``_plan_signature(group)`` (group options that change the lists, e.g. whether an
EMA is kept: a change rebuilds the plan) and ``_validator_for(group)`` (the list check of a group's
buckets). Complex params (``_supports_complex``) run as ``torch.view_as_real`` views of the param,
its grad and its state, as ``torch.optim`` does; the state itself stays complex.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from multi_tensor import multi_tensor_applier, validation
from multi_tensor.backends import prepare
from multi_tensor.bucketing import group_indices

LOW_PRECISION = validation.LOW_PRECISION


class _Bucket:
    """One engine call: params of one device/dtype/step, their bound state lists, their step."""

    __slots__ = ("params", "prepared", "step_tensor", "step", "device", "complex")

    def __init__(self, params, prepared, step: int):
        self.params = params
        self.prepared = prepared
        self.step = step
        self.device = params[0].device
        self.complex = params[0].is_complex()
        self.step_tensor = torch.tensor(float(step), dtype=torch.float32)

    def grads(self) -> List[torch.Tensor]:
        """The params' grads as the op takes them (real views for complex params)."""
        if not self.complex:
            return [p.grad for p in self.params]
        return [_real_grad(p) for p in self.params]


class _GroupPlan:
    __slots__ = ("params", "count", "buckets", "signature")

    def __init__(self, params, buckets, signature):
        self.params = params          # the group's own list object, to notice a replaced list
        self.count = len(params)
        self.buckets = buckets
        self.signature = signature    # _plan_signature(group) when the plan was built


def _real_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    g = p.grad
    if g is None:
        return None
    if not g.is_complex():
        raise TypeError(f"param of dtype {p.dtype} has a grad of dtype {g.dtype}; a complex param "
                        f"needs a complex grad")
    return torch.view_as_real(g)


def _real_view(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


COMPLEX_DTYPES = (torch.complex64, torch.complex128)


class FusedOptimizerBase(torch.optim.Optimizer):
    """Base class of the fused multi-tensor optimizers (see the module docstring)."""

    _step_supports_amp_scaling = True
    _op: str = ""
    _supports_complex = False  # complex64/complex128 params, run as real views

    def __init__(self, params, defaults: Dict[str, Any], chunk_size: int = multi_tensor_applier.chunk_size):
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        self._chunk_size = chunk_size
        self._plans: Dict[int, _GroupPlan] = {}
        super().__init__(params, defaults)
        self._check_params()

    # --- subclass hooks -----------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _state_lists(self, params: List[torch.Tensor], group: Dict[str, Any]) -> List[List[torch.Tensor]]:
        raise NotImplementedError

    def _op_args(self, group: Dict[str, Any], step: int) -> tuple:
        raise NotImplementedError

    def _validator(self, tensor_lists) -> None:
        validation.check_adam_family_lists(self._op, tensor_lists)

    def _validator_for(self, group: Dict[str, Any]):
        """The list check of ``group``'s buckets (default :meth:`_validator`)."""
        return self._validator

    def _plan_signature(self, group: Dict[str, Any]) -> Any:
        """Group options the bound lists depend on; when they change, the plan is rebuilt."""
        return None

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
        super().add_param_group(param_group)
        if hasattr(self, "_plans"):
            self._check_params()
            self._plans.clear()

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_plans", {})
        self.__dict__.setdefault("_chunk_size", multi_tensor_applier.chunk_size)
        self._plans.clear()

    # --- plans --------------------------------------------------------------------------------
    def _step_of(self, p: torch.Tensor) -> int:
        step = self.state[p].get("step")
        if step is None:
            return 0
        return int(step.item()) if isinstance(step, torch.Tensor) else int(step)

    def _build_plan(self, group: Dict[str, Any], params: List[torch.Tensor],
                    grads: List[torch.Tensor]) -> List[_Bucket]:
        for p, g in zip(params, grads):
            if g.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        for p in params:
            state = self.state[p]
            self._init_state(p, group, state)
        keys = [(p.device, p.dtype, g.dtype, self._step_of(p)) for p, g in zip(params, grads)]
        buckets = []
        validator = self._validator_for(group)
        for (_, dtype, _, step), rows in group_indices(keys).items():
            bucket_params = [params[i] for i in rows]
            lists = self._state_lists(bucket_params, group)
            if dtype.is_complex:  # the kernels run on the real views (state stays complex)
                lists = [[_real_view(t) for t in tensors] for tensors in lists]
            prepared = prepare(self._op, lists, self._chunk_size, validator)
            bucket = _Bucket(bucket_params, prepared, step)
            for p in bucket_params:
                self.state[p]["step"] = bucket.step_tensor
            buckets.append(bucket)
        return buckets

    def _plan_for(self, group: Dict[str, Any], lazy: bool = False):
        """``[(bucket, grads)]`` for this step; rebuilds the plan when the params with grads change.

        ``lazy``: when the cached plan is one real bucket, return ``[(bucket, None)]``: its call
        reads the params' grads itself (``prepared.step_param_grads``).
        """
        plan = self._plans.get(id(group))
        signature = self._plan_signature(group)
        if (plan is not None and plan.params is group["params"]
                and plan.count == len(group["params"]) and plan.signature == signature):
            if lazy and len(plan.buckets) == 1 and not plan.buckets[0].complex:
                return [(plan.buckets[0], None)]
            work = []
            for bucket in plan.buckets:
                grads = bucket.grads()
                if any(g is None for g in grads):
                    break
                work.append((bucket, grads))
            else:
                return work
        params = group["params"]
        grads = [p.grad for p in params]
        with_grad = [i for i, g in enumerate(grads) if g is not None]
        if len(with_grad) == len(params):
            buckets = self._build_plan(group, params, grads)
            self._plans[id(group)] = _GroupPlan(params, buckets, signature)
        else:  # intermittent grads: a one-off plan over the params that have one
            self._plans.pop(id(group), None)
            buckets = self._build_plan(group, [params[i] for i in with_grad],
                                       [grads[i] for i in with_grad])
        return [(b, b.grads()) for b in buckets]

    def _update(self, grad_scale: Optional[torch.Tensor]) -> None:
        """Plan, check and run every bucket; counts the buckets run in ``self._buckets_run``.

        Every call checks its own bucket before it writes anything. With several buckets, all of
        them are checked first, so a bad grad in one leaves every other bucket untouched too.
        """
        self._buckets_run = 0
        lazy = len(self.param_groups) == 1  # one group: a single bucket reads its own grads
        work = [(group, bucket, grads)
                for group in self.param_groups
                for bucket, grads in self._plan_for(group, lazy)]
        if len(work) > 1:
            for _, bucket, grads in work:
                bucket.prepared.validate(grads)
        self._before_step(work)
        for group, bucket, grads in work:
            step = bucket.step + 1
            scale = None if grad_scale is None else grad_scale.to(bucket.device)
            args = self._op_args(group, step)
            maximize = bool(group.get("maximize", False))
            noop = self._noop_flag(bucket.device)
            if grads is None:  # the only bucket (see _plan_for): nothing has run yet
                if not bucket.prepared.step_param_grads(noop, *args, grad_scale=scale,
                                                        maximize=maximize):
                    # a param lost its grad since the plan was built: plan afresh
                    self._plans.pop(id(group), None)
                    return self._update(grad_scale)
            else:
                bucket.prepared(grads, noop, *args, grad_scale=scale, maximize=maximize)
            bucket.step = step
            bucket.step_tensor.fill_(step)
            self._buckets_run += 1
        self._after_step(work)

    # --- step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One update of every param that has a grad. Returns ``closure()``'s loss, if given.

        Under ``torch.amp.GradScaler`` the scaler sets ``grad_scale`` and ``found_inf`` on the
        optimizer: grads are unscaled inside the kernel, and when ``found_inf`` is set nothing
        changes (params, masters, moments, EMA and step).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale: Optional[torch.Tensor] = getattr(self, "grad_scale", None)
        found_inf: Optional[torch.Tensor] = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf.item() != 0):
            return loss
        try:
            self._update(grad_scale)
        except (TypeError, ValueError, RuntimeError):
            if self._buckets_run:
                raise
            # Nothing has changed. The grads may have changed dtype or shape since the cached
            # plan was built: plan afresh and try once more (a real error raises again).
            self._plans.clear()
            self._update(grad_scale)
        return loss

    def _before_step(self, work) -> None:
        """Hook for subclasses (e.g. EMA schedules); ``work`` is ``[(group, bucket, grads)]``."""

    def _after_step(self, work) -> None:
        """Hook for subclasses, after every bucket was updated."""

    _noop_flags: Dict[torch.device, torch.Tensor] = {}

    def _noop_flag(self, device: torch.device) -> torch.Tensor:
        flag = FusedOptimizerBase._noop_flags.get(device)
        if flag is None:
            flag = torch.zeros(1, dtype=torch.int32, device=device)
            FusedOptimizerBase._noop_flags[device] = flag
        return flag

    # --- state dict ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim.Optimizer.state_dict()``, with a step tensor of its own for every param.

        Params that step together share one step tensor here; a saved dict must not carry that
        sharing (a ``torch.optim`` optimizer loading it would advance the shared tensor once per
        param), so each param's entry gets its own copy of ``step``. Everything else is returned
        by reference, as torch does.
        """
        state_dict = super().state_dict()
        state_dict["state"] = {
            pid: ({**entry, "step": entry["step"].clone()}
                  if isinstance(entry.get("step"), torch.Tensor) else entry)
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
