"""State-dict compatibility with ``torch.optim.Adam`` / ``AdamW`` / ``RAdam``.

torch -> fused
    ``fused_opt.load_state_dict(torch_opt.state_dict())`` works directly (it calls
    :func:`adapt_state_dict` and :func:`complete_loaded_state`), and so does the explicit
    :func:`load_torch_state_dict` (which can also restart the EMA schedule). What happens:

    * hyperparameters come from the saved groups, as with any ``load_state_dict``: ``lr``,
      ``betas``, ``eps``, ``weight_decay``, ``maximize`` and torch's ``decoupled_weight_decay``,
      which becomes ``adam_w_mode`` (torch ``Adam`` -> L2 mode, ``AdamW`` -> decoupled mode);
      torch-only flags (``foreach``, ``capturable``, ``differentiable``, ``fused``, ``amsgrad``)
      are dropped; options torch does not have (``ema_decay``, the EMA schedule,
      ``master_weights``, ...) keep the fused optimizer's current values;
    * ``step`` continues (per param, a float32 CPU scalar tensor as the fused optimizers keep it);
    * ``exp_avg`` / ``exp_avg_sq`` are taken over, cast to fp32 where the fused optimizer keeps
      fp32 state (fp16/bf16 params with master weights), else kept in the param dtype;
    * ``master_param`` is the param (fp32 copy) and ``ema`` starts as the master/param: the EMA of
      a freshly loaded optimizer is the loaded weights;
    * ``amsgrad=True`` raises ``ValueError`` (no fused AMSGrad variant).

    The EMA schedule counter is the param's step, so after loading a torch optimizer at step 20
    a ``"warmup"`` schedule continues at ``n = 21``. ``load_torch_state_dict(...,
    restart_ema_schedule=True)`` sets ``ema_start_step`` to the loaded step instead, so the
    schedule starts afresh (``n = 1`` on the next step).

fused -> torch
    ``fused_opt.torch_state_dict()`` (or :func:`torch_state_dict`) returns a state dict that the
    matching torch optimizer (``AdamW`` for ``adam_w_mode``, ``Adam`` for L2 mode, ``RAdam`` for
    FusedRAdam) loads and continues like the fused one: torch's param-group keys (torch's own
    defaults for its flags), per-param ``step`` (its own tensor, as torch increments it in
    place), ``exp_avg`` / ``exp_avg_sq`` cast to the param dtype (how torch keeps them). ``ema``
    and ``master_param`` (or ``param_remainder``) are dropped: for fp16/bf16 params torch continues from the rounded
    params; export the EMA with ``ema_state_dict(module)``. ``bias_correction=False`` raises
    (torch always corrects).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from . import ema_schedules

LOW_PRECISION = (torch.float16, torch.bfloat16)

# Param-group keys torch's Adam family has and the fused optimizers do not.
TORCH_ONLY_GROUP_KEYS = ("amsgrad", "foreach", "capturable", "differentiable", "fused",
                         "decoupled_weight_decay")
# Param-group options of the fused optimizers that torch's optimizers do not have.
FUSED_GROUP_KEYS = (("ema_decay",) + tuple(ema_schedules.EMA_OPTION_DEFAULTS)
                    + ("ema_dtype", "adam_w_mode", "bias_correction", "master_weights"))
# Per-param state torch's Adam / AdamW / RAdam keep (without amsgrad).
TORCH_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def _name(opt) -> str:
    return type(opt).__name__


def _adam_w_mode(opt, group: Dict[str, Any]) -> Optional[bool]:
    """The group's decoupled-decay mode, wherever the optimizer keeps it (None: unknown)."""
    for key in ("adam_w_mode", "decoupled_weight_decay"):
        if key in group:
            return bool(group[key])
    for attr in ("adam_w_mode", "decoupled_weight_decay"):
        if hasattr(opt, attr):
            return bool(getattr(opt, attr))
    return None


# --- torch -> fused ---------------------------------------------------------------------------
def is_torch_group(opt, group: Dict[str, Any], current: Dict[str, Any]) -> bool:
    """Whether a saved param group carries torch-only keys the fused optimizer does not have."""
    return any(k in group and k not in current for k in TORCH_ONLY_GROUP_KEYS)


def _lacks_options(group: Dict[str, Any], current: Dict[str, Any]) -> bool:
    return any(k not in group for k in current if k != "params")


def adapt_state_dict(opt, state_dict: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
    """``(state_dict in the fused optimizer's form, whether its state may need completing)``.

    The flag is set for torch's state dicts (torch-only group keys, or fused options missing);
    then :func:`complete_loaded_state` runs after loading (idempotent on complete state).

    Saved groups are translated (see the module doc) and keys they lack are filled from the
    optimizer's current groups, so state dicts saved before an option existed keep the current
    value of that option. The input is not modified. A mismatch in group count is left for
    ``load_state_dict`` to report.
    """
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(opt.param_groups):
        return state_dict, False
    foreign = False
    groups: List[Dict[str, Any]] = []
    for gi, (saved, current) in enumerate(zip(saved_groups, opt.param_groups)):
        group = dict(saved)
        if _lacks_options(saved, current):
            foreign = True  # torch's (or an older) state dict: state may need completing
        if group.get("amsgrad"):
            raise ValueError(
                f"{_name(opt)}.load_state_dict: param_groups[{gi}] has amsgrad=True; the fused "
                f"optimizers have no AMSGrad variant (max_exp_avg_sq cannot be continued)")
        if is_torch_group(opt, saved, current):
            foreign = True
            if "decoupled_weight_decay" in group and "decoupled_weight_decay" not in current:
                decoupled = bool(group.pop("decoupled_weight_decay"))
                if "adam_w_mode" in current:
                    group["adam_w_mode"] = decoupled
                else:
                    mode = _adam_w_mode(opt, current)
                    if mode is not None and mode != decoupled:
                        raise ValueError(
                            f"{_name(opt)}.load_state_dict: param_groups[{gi}] is from a torch "
                            f"optimizer with decoupled_weight_decay={decoupled} but this optimizer "
                            f"uses {'decoupled' if mode else 'L2'} weight decay")
            for key in TORCH_ONLY_GROUP_KEYS:
                if key in group and key not in current:
                    del group[key]
        for key, value in current.items():
            if key != "params" and key not in group:
                group[key] = value
        groups.append(group)
    adapted = dict(state_dict)
    adapted["param_groups"] = groups
    return adapted, foreign


@torch.no_grad()
def complete_loaded_state(opt) -> None:
    """After loading a torch state dict: create missing state (masters, EMA) and fix moment dtypes.

    ``_init_state`` creates ``master_param`` from the param and ``ema`` from the master/param
    (what it does for a new param), so the EMA starts at the loaded weights. Moments become fp32
    where the optimizer keeps fp32 state (a ``master_param`` exists), else the param dtype.
    """
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if not state:
                continue
            opt._init_state(p, group, state)
            state_dtype = (torch.float32 if state.get("master_param") is not None
                           or state.get("param_remainder") is not None else p.dtype)
            for key in MOMENT_KEYS:
                value = state.get(key)
                if isinstance(value, torch.Tensor) and value.dtype != state_dtype:
                    state[key] = value.to(dtype=state_dtype)


def load_torch_state_dict(opt, state_dict: Dict[str, Any], *, restart_ema_schedule: bool = False) -> None:
    """Load a ``torch.optim`` Adam/AdamW/RAdam state dict into the fused optimizer ``opt``.

    Same as ``opt.load_state_dict(state_dict)``; with ``restart_ema_schedule`` each EMA group's
    ``ema_start_step`` becomes the largest loaded step of its params, so the EMA schedule starts
    afresh at the next step (the EMA itself always starts at the loaded weights).
    """
    opt.load_state_dict(state_dict)
    if not restart_ema_schedule:
        return
    for gi, group in enumerate(opt.param_groups):
        if group.get("ema_decay") is None:
            raise ValueError(
                f"load_torch_state_dict: {_name(opt)} param_groups[{gi}] keeps no EMA; "
                f"restart_ema_schedule needs one")
        steps = [int(opt.state[p]["step"]) for p in group["params"]
                 if p in opt.state and "step" in opt.state[p]]
        group["ema_start_step"] = max(steps, default=0)


# --- fused -> torch ---------------------------------------------------------------------------
def torch_class_for(opt) -> type:
    """The ``torch.optim`` class whose state dict matches ``opt``'s (AdamW, Adam or RAdam)."""
    explicit = getattr(opt, "_torch_equivalent", None)
    if explicit is not None:
        return explicit
    op = getattr(opt, "_op", "")
    if op == "radam" or "radam" in type(opt).__name__.lower():
        return torch.optim.RAdam
    modes = {_adam_w_mode(opt, g) for g in opt.param_groups}
    if modes == {False}:
        return torch.optim.Adam
    if len(modes) > 1:  # mixed groups: Adam with a per-group decoupled_weight_decay
        return torch.optim.Adam
    return torch.optim.AdamW


def _torch_defaults(torch_cls: type) -> Dict[str, Any]:
    return dict(torch_cls([torch.zeros(1, requires_grad=True)]).defaults)


@torch.no_grad()
def torch_state_dict(opt, torch_cls: Optional[type] = None) -> Dict[str, Any]:
    """A state dict ``torch_cls(params).load_state_dict()`` accepts (default: :func:`torch_class_for`)."""
    torch_cls = torch_cls or torch_class_for(opt)
    defaults = _torch_defaults(torch_cls)
    fused_keys = set(opt.defaults) | set(FUSED_GROUP_KEYS)
    ours = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    ids = [pid for g in ours["param_groups"] for pid in g["params"]]
    param_of = dict(zip(ids, params))

    groups = []
    for gi, (group, live) in enumerate(zip(ours["param_groups"], opt.param_groups)):
        if not live.get("bias_correction", True):
            raise ValueError(
                f"{_name(opt)}.torch_state_dict: param_groups[{gi}] has bias_correction=False; "
                f"torch.optim.{torch_cls.__name__} always applies bias correction")
        new = dict(defaults)
        for key, value in group.items():
            if key == "params" or key in defaults or key not in fused_keys:
                new[key] = value  # torch's keys, and foreign ones such as 'initial_lr'
        mode = _adam_w_mode(opt, live)
        if mode is not None and torch_cls is not torch.optim.RAdam:
            if "decoupled_weight_decay" in defaults:
                new["decoupled_weight_decay"] = mode
            elif mode != (torch_cls is torch.optim.AdamW):
                raise ValueError(
                    f"{_name(opt)}.torch_state_dict: param_groups[{gi}] uses "
                    f"{'decoupled' if mode else 'L2'} weight decay, which torch.optim."
                    f"{torch_cls.__name__} of this torch version cannot express")
        elif mode is not None and "decoupled_weight_decay" in defaults:
            new["decoupled_weight_decay"] = mode
        for key in ("amsgrad",):
            if key in new:
                new[key] = False
        groups.append(new)

    state = {}
    for pid, st in ours["state"].items():
        p = param_of.get(pid)
        if p is None:
            continue
        new_state = {}
        if "step" in st:
            step = st["step"]
            value = float(step.item()) if isinstance(step, torch.Tensor) else float(step)
            new_state["step"] = torch.tensor(value, dtype=torch.float32)
        for key in MOMENT_KEYS:
            if key in st and st[key] is not None:
                new_state[key] = st[key].detach().to(dtype=p.dtype, copy=True)
        state[pid] = new_state
    return {"state": state, "param_groups": groups}
