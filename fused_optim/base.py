"""The machinery every fused optimizer shares: the step, on plans, clipping and state dicts.

A fused optimizer is a ``torch.optim.Optimizer`` whose ``step`` makes one engine call per
bucket. ``step()`` reads as a straight line::

    grads  = [p.grad for p in group["params"]]          # collect, per group
    plan   = self._plan(group, grads)                   # cached; checked and bound
    scalars = per bucket, from the group's hyperparameters (every group checked first)
    run every bucket; advance its step

The pieces live by concern: the plans (buckets, their checks and binding, the options cache) in
:mod:`fused_optim.planning`, global-norm clipping and GradScaler's flag in
:mod:`fused_optim.clipping`, state dicts and DCP's state initialisation in
:mod:`fused_optim.checkpoint`.

Subclasses define:

* ``_op(group)``: the op (:class:`multi_tensor.schema.OpSpec`) of a group's buckets;
* ``_init_state(p, group, state)``: create missing state entries for ``p``;
* ``_state_lists(params, group)``: the op's lists (:class:`multi_tensor.schema.AdamLists`,
  without grads) for one bucket;
* ``_hyper(group, step)``: the group's :class:`multi_tensor.rules.AdamHyper` at ``step``;
* ``_check_group(group)``: the group's option checks (run when added and when one changes).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from multi_tensor import multi_tensor_applier, plan, rules, schema, validation

from .checkpoint import CheckpointMixin
from .clipping import ClippingMixin
from .planning import PlanningMixin, _GroupPlan


LOW_PRECISION = validation.LOW_PRECISION
COMPLEX_DTYPES = (torch.complex64, torch.complex128)


def _device_lr(group: Dict[str, Any]) -> Optional[torch.Tensor]:
    """A capturable group's tensor ``lr``, which its kernels read on the device."""
    lr = group["lr"]
    return lr if group.get("capturable") and isinstance(lr, torch.Tensor) else None


class FusedOptimizerBase(CheckpointMixin, ClippingMixin, PlanningMixin, torch.optim.Optimizer):
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
        # id(group) -> its checked options (planning._GroupOptions), or None for options that
        # change in place
        self._checked_groups: Dict[int, Optional[Any]] = {}
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

    def _state_lists(self, params: List[torch.Tensor], group: Dict[str, Any]) -> schema.AdamLists:
        raise NotImplementedError

    def _hyper(self, group: Dict[str, Any], step: int) -> rules.AdamHyper:
        raise NotImplementedError

    @staticmethod
    def _uses_master(p: torch.Tensor, group: Dict[str, Any]) -> bool:
        """Whether ``p`` keeps an fp32 master (part of its bucket key)."""
        return False

    def _check_group(self, group: Dict[str, Any]) -> None:
        """Raise if a group option is invalid (before any tensor is modified)."""

    def _plan_signature(self, group: Dict[str, Any]) -> Any:
        """Group options the bound lists depend on; when they change, the plan is rebuilt."""
        return None

    def _ema_skipping(self, group: Dict[str, Any], lists: schema.AdamLists) -> Optional[tuple]:
        """``(k, op, lists)`` when the group updates its EMA only every ``k > 1`` steps: the op
        and lists (without the EMA) of the steps in between; None otherwise."""
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
        else:
            self._eager_step()
        return loss

    def _eager_step(self) -> None:
        """The step's eager body, under ``torch.no_grad()`` (a compiled step runs it too, behind
        a graph break, for what it cannot trace: :mod:`fused_optim.compiled`)."""
        self._before_step()
        # nothing but the grads changed since the last step (planning.PlanningMixin._steady_step):
        # bind and run the buckets, skipping the checks and bookkeeping below that would find
        # nothing to do (they are most of a small step's fixed cost)
        if self.state and self._steady_step():
            return
        if not self.state and self._is_state_init_call():
            self.init_state()
            return
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and not isinstance(found_inf, torch.Tensor):
            # GradScaler sums its per-device found_inf tensors: without any grad, the int 0
            found_inf = torch.tensor(float(found_inf))
        # a host found_inf is read before planning (a skipped step creates no state), unless the
        # buckets read it on the device (on the NPU's CPU stand-in, device steps on the CPU)
        if (found_inf is not None and found_inf.device.type == "cpu"
                and not self._device_steps_planned()):
            if bool(found_inf.item() != 0):
                return
            found_inf = None  # read: nothing cancels this step
        # plans built for earlier groups are undone when a later one is refused
        self._plan_journal: Optional[list] = []
        try:
            work = [(group, bucket) for group in self.param_groups
                    for bucket in self._bound_buckets(group)]
            skip, skip_flag = self._overflow(found_inf, work)
            if not skip:
                skip, grad_scale, skip_flag = self._unscale_factor(work, skip_flag)
            if skip:
                for _, bucket in work:
                    bucket.grads = None
                return
            hypers = self._hypers(work)
        except BaseException:
            for group, touched, saved in reversed(self._plan_journal):
                self._restore_state(touched, saved)
                self._plans.pop(id(group), None)
            raise
        finally:
            self._plan_journal = None
        for (group, bucket), hyper in zip(work, hypers):
            bucket.run(hyper, plan.noop_flag(bucket.device), skip_flag, grad_scale,
                       _device_lr(group))

    def _device_steps_planned(self) -> bool:
        """Whether the current plans have buckets that keep their steps on the device."""
        return any(b.device_steps for p in self._plans.values() for b in p.buckets)

    def _init_group(self, *lists):
        """What dynamo runs eagerly when it compiles ``step()`` (see fused_optim/compiled.py)."""
        from . import compiled
        return compiled.init_group(self, *lists)


    def _hypers(self, work) -> List[rules.AdamHyper]:
        """Every bucket's hyperparameters, once per (group, step), before any bucket runs (an
        EMA schedule that raises changes nothing)."""
        memo: Dict[tuple, rules.AdamHyper] = {}
        index_of = {id(group): i for i, group in enumerate(self.param_groups)}
        out = []
        for group, bucket in work:
            step = bucket.step + 1
            options = self._checked_groups.get(id(group))
            hyper = options.hyper if options is not None else None  # the same at every step
            if hyper is None:
                key = (id(group), step)
                hyper = memo.get(key)
                if hyper is None:
                    hyper = memo[key] = self._hyper(group, step)
            self._note_hyper(index_of[id(group)], step, hyper)
            out.append(hyper)
        return out

    def _note_hyper(self, index: int, step: int, hyper: rules.AdamHyper) -> None:
        """Called for every bucket with the hyperparameters its step uses (``index``: its
        group's in ``param_groups``)."""


    # --- zero_grad ----------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``, keeping flat grad buffers.

        Params whose ``.grad`` a backend keeps as a view of one flat buffer (the NPU backend's
        buckets, :class:`multi_tensor.backends.npu.flat.FlatGrads`): the buffer is zeroed, one launch
        per bucket, and the grads are set to None (``set_to_none``) or to their zero views, as
        torch leaves them; backward's grad hook gives a param its zero view back when a grad
        arrives, so the grads accumulate into the buffer in place. Every other param: as torch.
        """
        keepers = self._grad_keepers_now()
        if not keepers:
            super().zero_grad(set_to_none=set_to_none)
            return
        if not hasattr(self, "_zero_grad_profile_name"):
            self._patch_step_function()
        with torch.autograd.profiler.record_function(self._zero_grad_profile_name):
            kept = {id(p) for keeper in keepers for p in keeper.zero(set_to_none)}
            rest = [p for group in self.param_groups for p in group["params"]
                    if id(p) not in kept and p.grad is not None]
            if set_to_none:
                for p in rest:
                    p.grad = None
                return
            per_device_and_dtype: Dict[tuple, List[torch.Tensor]] = {}
            for p in rest:  # as torch: detached, then zeroed
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                if p.grad.is_sparse:
                    p.grad.zero_()
                else:
                    per_device_and_dtype.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
            for grads in per_device_and_dtype.values():
                torch._foreach_zero_(grads)

    def _grad_keepers_now(self) -> list:
        """The flat grad buffers that keep grads of this optimizer's params: those of the
        current plans' buckets and those zeroed before that still keep some (a param left out of
        a re-built plan keeps its view there). Remembered for ``step()``'s grad collection."""
        found = {id(k): k for k in self.__dict__.get("_grad_keepers") or ()}
        for group_plan in self._plans.values():
            for bucket in group_plan.buckets:
                for prepared in (bucket.prepared, bucket.ema_free):
                    keeper = prepared.grad_keeper
                    if keeper is not None:
                        found[id(keeper)] = keeper
        keepers = [k for k in found.values() if k.owns()]
        self.__dict__["_grad_keepers"] = keepers
        return keepers
