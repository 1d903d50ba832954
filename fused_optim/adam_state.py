"""What the Adam-family fused optimizers share: group checks, moments, masters and the EMA.

:class:`AdamStateMixin` goes between :class:`~fused_optim.ema.EmaAccessMixin` (when the optimizer
keeps an EMA) and :class:`~fused_optim.base.FusedOptimizerBase`::

    class FusedRAdam(EmaAccessMixin, AdamStateMixin, FusedOptimizerBase): ...

It implements the base class's state hooks for the op list forms
``[grads, params, exp_avgs, exp_avg_sqs(, emas)(, masters)]``:

* state per param, named as ``torch.optim`` names it: ``step`` (float32 scalar tensor),
  ``exp_avg``, ``exp_avg_sq``; ``ema`` when the group keeps an EMA (``group["ema_decay"]`` is not
  None), initialised to the weights; ``master_param``, an fp32 copy, for fp16/bf16 params when
  ``group["master_weights"] is True``; ``param_remainder`` (int16, the low halves of the fp32
  masters: :mod:`multi_tensor.rules`' remainder encoding) for bf16 params when
  ``group["master_weights"] == "remainder"``. Moments and EMA are fp32 with a master or a
  remainder, else in the param's dtype (complex for complex params, which the base class runs as
  real views). A loaded ``master_param`` in a remainder group becomes a remainder when the group
  is next planned (the param is then the master rounded to nearest, ties away from zero: it
  changes only at exact ties), and a loaded ``param_remainder`` in a ``master_weights=True``
  group becomes the exact master joined from the param: load the model's weights before that;
* the EMA's storage dtype, ``group["ema_dtype"]`` (:func:`ema_storage_dtype`): ``torch.float32``
  (the default) or ``None`` keep it in the state dtype above; ``torch.bfloat16`` keeps it in bf16
  whatever the param dtype (fp32 params, fp16/bf16 params with fp32 masters or without masters;
  not fp64 params, whose buckets compute in fp64). The update itself is unchanged and in fp32:
  ``s = float(s); s = s + ema_w * (w' - s)``, stored rounded once to bf16 (round to nearest
  even). A new EMA starts as the weights rounded once to bf16; an existing EMA of another dtype
  (a changed ``ema_dtype``, a loaded state dict) is converted when the group is next planned;
* group checks (betas, lr, eps, weight_decay, ema_decay and the EMA schedule options; unsupported
  torch flags), run when a group is added (a rejected group does not stay) and at every step
  before any bucket is updated, so a bad value raises before any tensor changes.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from multi_tensor import rules, schema, validation
from multi_tensor.bucketing import is_dtensor, local_shard

from . import ema_schedules
from .base import LOW_PRECISION

EMA_DTYPES = (None, torch.float32, schema.REDUCED_EMA_DTYPE)
BF16_EMA_PARAM_DTYPES = LOW_PRECISION + (torch.float32,)  # params whose math is fp32


def ema_storage_dtype(group: Dict[str, Any], state_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``state["ema"]`` is kept in: bf16 for ``ema_dtype=torch.bfloat16`` (the group
    check admits it for fp16/bf16/fp32 params only), else the state dtype (fp32 with masters,
    else the param's dtype)."""
    return schema.REDUCED_EMA_DTYPE if group.get("ema_dtype") == schema.REDUCED_EMA_DTYPE \
        else state_dtype


def check_ema_dtype(owner: str, ema_dtype) -> None:
    if not any(ema_dtype is d or ema_dtype == d for d in EMA_DTYPES):
        raise ValueError(f"{owner}: ema_dtype must be torch.float32 (the EMA in the state dtype; "
                         f"None means the same) or torch.bfloat16 (the EMA stored in bf16, "
                         f"rounded to nearest even), got {ema_dtype!r}")

def check_master_weights(owner: str, value, params=()) -> None:
    """``master_weights``: ``True``, ``False`` or ``"remainder"`` (bf16 params only)."""
    if value is True or value is False:
        return
    if not (isinstance(value, str) and value == rules.MASTER_REMAINDER):
        raise ValueError(f"{owner}: master_weights must be True (fp32 masters), False (none) or "
                         f"'remainder' (the fp32 masters of bf16 params held as int16 remainders "
                         f"beside the params), got {value!r}")
    for i, p in enumerate(params):
        if isinstance(p, torch.Tensor) and p.dtype != torch.bfloat16:
            raise ValueError(
                f"{owner}: master_weights='remainder' is for bf16 params (the param is the fp32 "
                f"master's high half), but params[{i}] of the group is {p.dtype}: put it in a "
                f"group with master_weights=True or False")


def _split_into(master: torch.Tensor, p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Write the param half of ``master`` (fp32) into ``p`` and return its int16 remainder,
    shaped (and sharded) like ``like``; works on the local shards of DTensors."""
    remainder = torch.zeros_like(like, dtype=torch.int16, memory_format=torch.preserve_format)
    high, low = rules.split_master(local_shard(master).detach().to(torch.float32))
    with torch.no_grad():
        local_shard(p).copy_(high)
        local_shard(remainder).copy_(low)
    return remainder


def _joined(p: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 masters held as ``p`` and ``remainder`` (a DTensor for DTensor params)."""
    if not is_dtensor(p):
        return rules.join_master(p.detach(), remainder)
    master = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
    local_shard(master).copy_(rules.join_master(local_shard(p).detach(), local_shard(remainder)))
    return master

# torch.optim flags the fused optimizers accept but cannot honour when True.
UNSUPPORTED_FLAGS = {
    "amsgrad": "the AMSGrad variant (amsgrad=True)",
    "differentiable": "differentiable=True (autograd through step)",
}


def check_unsupported_flags(owner: str, **flags) -> None:
    """Raise ``NotImplementedError`` (a ``RuntimeError``, as apex raises) for a True flag."""
    for key, value in flags.items():
        if value:
            raise NotImplementedError(f"{owner} does not support {UNSUPPORTED_FLAGS[key]}")


def check_torch_options(owner: str, lr, betas, *, foreach=None, fused=None, capturable=False,
                        differentiable=False) -> None:
    """The argument errors ``torch.optim.Adam``/``AdamW``/``RAdam`` raise, with torch's
    exception types and messages (``optim_error_inputs_func_*`` in torch's optimizer tests)."""
    if isinstance(lr, torch.Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if isinstance(betas, (tuple, list)) and len(betas) == 2:
        tensors = [isinstance(b, torch.Tensor) for b in betas]
        if tensors[0] != tensors[1]:
            raise ValueError("betas must be either both floats or both Tensors")
        for i, is_tensor in enumerate(tensors):
            if is_tensor and foreach and not capturable:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False "
                                 f"and foreach=True")
            if is_tensor and betas[i].numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if fused and differentiable:
        raise RuntimeError("`fused` does not support `differentiable`")


class AdamStateMixin:
    """Group checks and ``exp_avg``/``exp_avg_sq``/``ema``/``master_param`` state (module docstring)."""

    _supports_complex = True
    _ema_required = False  # True: every group must have an ema_decay (FusedEmaAdamW)
    _rule = rules.ADAM
    _decoupled_key = "adam_w_mode"  # the group option that selects decoupled decay

    # --- group options ------------------------------------------------------------------------
    @staticmethod
    def _has_ema(group: Dict[str, Any]) -> bool:
        return group.get("ema_decay") is not None

    @staticmethod
    def _uses_master(p: torch.Tensor, group: Dict[str, Any]) -> bool:
        return group.get("master_weights", False) is True and p.dtype in LOW_PRECISION

    @staticmethod
    def _uses_remainder(p: torch.Tensor, group: Dict[str, Any]) -> bool:
        return group.get("master_weights") == rules.MASTER_REMAINDER and p.dtype == torch.bfloat16

    def _check_group(self, group: Dict[str, Any]) -> None:
        name = type(self).__name__
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{name}: betas must be a pair (beta1, beta2), got {betas!r}")
        check_torch_options(name, group["lr"], betas, foreach=group.get("foreach"),
                            fused=group.get("fused"), capturable=group.get("capturable", False),
                            differentiable=group.get("differentiable", False))
        if self._ema_required and group.get("ema_decay") is None:
            raise ValueError(f"{name}: ema_decay must be a number in [0, 1), got None")
        validation.check_hyperparameters(
            name, lr=group["lr"], eps=group["eps"], beta1=betas[0], beta2=betas[1],
            ema_decay=group.get("ema_decay"), weight_decay=group["weight_decay"])
        check_unsupported_flags(name, **{k: group[k] for k in UNSUPPORTED_FLAGS if k in group})
        if self._has_ema(group):  # the EMA schedule options (fused_optim.ema_schedules)
            ema_schedules.check_group(name, group)
        check_ema_dtype(name, group.get("ema_dtype"))
        check_master_weights(name, group.get("master_weights", False), group.get("params", ()))
        if group.get("ema_dtype") == schema.REDUCED_EMA_DTYPE:
            for i, p in enumerate(group.get("params", ())):
                if isinstance(p, torch.Tensor) and p.dtype not in BF16_EMA_PARAM_DTYPES:
                    raise ValueError(
                        f"{name}: ema_dtype=torch.bfloat16 is for fp16/bf16/fp32 params, but "
                        f"params[{i}] of the group is {p.dtype} (fp64 params compute in fp64 "
                        f"and keep an fp64 EMA; complex params keep a complex one): put it in a "
                        f"group with ema_dtype=torch.float32")

    def _plan_signature(self, group: Dict[str, Any]) -> Any:
        master = group.get("master_weights", False)
        return (self._has_ema(group), master if isinstance(master, str) else bool(master),
                ema_schedules.update_every(group), group.get("ema_dtype"),
                bool(group.get("capturable", False)))

    def _ema_skipping(self, group: Dict[str, Any], lists: schema.AdamLists) -> Optional[tuple]:
        """With ``ema_update_every = k > 1``: the no-EMA op on the lists without the EMA."""
        every = ema_schedules.update_every(group)
        if not self._has_ema(group) or every == 1:
            return None
        return every, schema.adam_op(self._rule, False), lists.without_ema()

    def _step_dependent(self, group: Dict[str, Any]) -> bool:
        """An EMA schedule other than a constant decay from step 1, or an EMA updated every k > 1
        steps, depends on the step."""
        if not self._has_ema(group):
            return False
        schedule = group.get("ema_schedule")
        constant = schedule is None or (isinstance(schedule, str) and schedule.lower() == "constant")
        return (not constant or bool(group.get("ema_start_step", 0))
                or ema_schedules.update_every(group) > 1)

    def _op(self, group: Dict[str, Any]) -> schema.OpSpec:
        return schema.adam_op(self._rule, self._has_ema(group))

    def _decoupled(self, group: Dict[str, Any]) -> bool:
        """AdamW's decoupled decay (True) or Adam's L2 decay."""
        return bool(group[self._decoupled_key])

    def _hyper(self, group: Dict[str, Any], step: int) -> rules.AdamHyper:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        return rules.AdamHyper(
            # capturable: a tensor lr is read by the kernel on the device (see _device_lr)
            lr=0.0 if isinstance(lr, torch.Tensor) and group.get("capturable") else float(lr),
            beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]), decoupled=self._decoupled(group),
            bias_correction=bool(group.get("bias_correction", True)),
            maximize=bool(group.get("maximize", False)),
            ema_decay=self._ema_decay(group, step) if self._has_ema(group) else None,
            rule=self._rule)

    def _ema_decay(self, group: Dict[str, Any], step: int) -> Optional[float]:
        """The EMA decay of ``group`` at ``step`` (None: no EMA).

        :class:`~fused_optim.ema.EmaAccessMixin`, listed before this class, may override it
        with EMA schedules; this is the plain per-group ``ema_decay``.
        """
        decay = group.get("ema_decay")
        if decay is None or not ema_schedules.updates_at(step, ema_schedules.update_every(group)):
            return None
        return float(decay)

    # --- state --------------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any]) -> None:
        """Create missing state (loaded state keeps its values, cast to the state dtype).

        A param on the meta device holds no data, so it cannot be stepped: refused here, before
        any of its state exists, as torch's fused optimizers refuse it."""
        if p.is_meta:
            self._refuse_meta(p, state)
        use_master = self._uses_master(p, group)
        use_remainder = self._uses_remainder(p, group)
        state_dtype = torch.float32 if use_master or use_remainder else p.dtype
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if use_master and state.get("master_param") is None:
            remainder = state.pop("param_remainder", None)  # a remainder group's state dict
            state["master_param"] = (p.detach().to(dtype=torch.float32, copy=True)
                                     if remainder is None else _joined(p, remainder))
        if use_remainder and state.get("param_remainder") is None:
            master = state.pop("master_param", None)  # a master_weights=True state dict
            # from a master, the param becomes its high half (rounded to nearest, ties away
            # from zero): it changes only where the master is an exact tie, and writing it
            # again after a refused plan gives the same bits
            state["param_remainder"] = (
                torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)
                if master is None else _split_into(master, p, p))
        keys = ("exp_avg", "exp_avg_sq", "ema") if self._has_ema(group) else ("exp_avg", "exp_avg_sq")
        for key in keys:
            value = state.get(key)
            dtype = ema_storage_dtype(group, state_dtype) if key == "ema" else state_dtype
            if value is None:
                if key == "ema":
                    weights = (state["master_param"] if use_master
                               else _joined(p, state["param_remainder"]) if use_remainder
                               else p.detach())
                    state[key] = weights.to(dtype=dtype, copy=True)
                else:
                    state[key] = torch.zeros_like(p, dtype=dtype,
                                                  memory_format=torch.preserve_format)
            elif value.dtype != dtype:
                state[key] = value.to(dtype=dtype)

    def _refuse_meta(self, p: torch.Tensor, state: Dict[str, Any]) -> None:
        # planning reads self.state[q] (a defaultdict) and so leaves empty entries; a refused
        # step keeps none (an empty entry means what no entry means)
        for key in [k for k, v in self.state.items() if isinstance(v, dict) and not v]:
            del self.state[key]
        where = next((f"param_groups[{gi}]['params'][{pi}]"
                      for gi, g in enumerate(self.param_groups)
                      for pi, q in enumerate(g["params"]) if q is p), "a param")
        raise RuntimeError(
            f"`fused=True` requires all the params to be floating point Tensors of supported "
            f"devices ({type(self).__name__}: {where} is on the meta device, which holds no "
            f"data; materialize the params first, e.g. with module.to_empty(device=...))")

    def _state_lists(self, params: List[torch.Tensor], group: Dict[str, Any]) -> schema.AdamLists:
        states = [self.state[p] for p in params]
        return schema.AdamLists(
            grads=None, params=list(params), exp_avgs=[s["exp_avg"] for s in states],
            exp_avg_sqs=[s["exp_avg_sq"] for s in states],
            emas=[s["ema"] for s in states] if self._has_ema(group) else None,
            masters=([s["master_param"] for s in states]
                     if self._uses_master(params[0], group) else None),
            remainders=([s["param_remainder"] for s in states]
                        if self._uses_remainder(params[0], group) else None))
