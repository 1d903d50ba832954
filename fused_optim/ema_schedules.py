r"""EMA decay schedules for the optimizers that keep an EMA of the weights.

The EMA update itself is the kernel's unbiased (lerp) form ``s = s + (1 - decay) * (p - s)``
(:mod:`multi_tensor.rules`; ``= decay * s + (1 - decay) * p`` in exact arithmetic); a schedule
only picks the scalar ``decay`` of each update, so every schedule runs on the unchanged fused
kernel. Decays are Python floats (double precision), computed from the formulas below exactly as
written; the kernel rounds ``1 - decay`` once to its math type (fp32; fp64 for fp64 params).

The counter
-----------
``t`` is the number of the optimizer step being taken for a param: its ``state[p]["step"]`` after
the step (1 on a param's first update). It is per-param state, saved by ``state_dict()``, and it
does not advance when a param has no grad or when ``GradScaler`` skips a step on overflow.
``ema_start_step`` (``S``, a param-group option, also saved) delays the EMA::

    n = t - S                 # the EMA update count: 1 on the first update after the start step
    decay = 0.0               if n <= 0   (before the start the EMA tracks the param)
    decay = schedule(n)       otherwise

With ``decay = 0.0`` the update is ``s = s + (p - s)``: the param's value, exactly whenever
``p - s`` is exact (``s`` and ``p`` within a factor 2 of each other, as consecutive weights
typically are), else within one rounding of it.

Because both ``t`` and ``S`` are in the state dict, a ``state_dict()`` / ``load_state_dict()``
round trip continues a schedule exactly.

Schedules (``ema_schedule``)
----------------------------
``None`` / ``"constant"``
    ``decay`` (``ema_decay``) on every update: the behaviour without a schedule.
``"warmup"``
    MindSpeed's ``FusedEmaAdamW(use_num_updates=True)``: ``min(decay, (1 + n) / (10 + n))``.
    MindSpeed increments its ``num_updates`` before using it, so its first update has ``n = 1``,
    as here (``S = 0``). Unlike MindSpeed, whose counter is one optimizer-wide integer that also
    counts steps where a param had no grad (and is not saved by ``state_dict()``), ``n`` here is
    per param.
``"diffusers"``
    diffusers' ``EMAModel`` with its default ``use_ema_warmup=False``: ``get_decay`` with
    ``update_after_step = S`` and ``optimization_step = t`` (diffusers increments
    ``optimization_step`` before ``get_decay``, once per ``EMAModel.step()``)::

        k = max(0, t - S - 1)                  # = max(0, n - 1)
        decay = 0.0                                              if k <= 0
        decay = max(min((1 + k) / (10 + k), decay), min_decay)   otherwise

    (``ema_min_decay`` = 0 by default, as diffusers). Note the ``- 1``: diffusers' first update
    after ``update_after_step`` still has decay 0.0, and that 0.0 is not raised to
    ``min_decay``. (Earlier versions of this package used ``"diffusers"`` for the warm-up
    formula that is now ``"diffusers_warmup"``; a state dict saved by them with
    ``ema_schedule="diffusers"`` continues with the ``(1 + k) / (10 + k)`` formula.)
``"diffusers_warmup"``
    diffusers' ``EMAModel(use_ema_warmup=True)``: the same counter and clamping with
    ``1 - (1 + k / inv_gamma) ** -power`` in place of ``(1 + k) / (10 + k)``::

        decay = 0.0                                                             if k <= 0
        decay = max(min(1 - (1 + k / inv_gamma) ** -power, decay), min_decay)   otherwise

    (``ema_inv_gamma`` = 1, ``ema_power`` = 2/3 by default, as diffusers). timm's
    ``ModelEmaV3(use_warmup=True)`` with ``update(model, step=t)`` computes the same decays;
    ema-pytorch's ``EMA(update_every=1)`` the same formula, which it evaluates in fp32 tensors
    (so its decays differ from these in the last bits). See the migration table in docs/migrating.md.
a callable ``fn(n) -> float``
    ``fn`` gets the EMA update count ``n >= 1`` and returns the decay, used as it is (``ema_decay``
    does not cap it). A value outside ``[0, 1)`` raises ``ValueError`` naming it and the step,
    before any tensor is modified. It is stored in the param group by reference: ``torch.save``
    of a state dict then needs a picklable (module-level) function.

``ema_min_decay`` is used by ``"diffusers"`` and ``"diffusers_warmup"``, ``ema_inv_gamma`` and
``ema_power`` by ``"diffusers_warmup"`` only; the other schedules ignore them. Schedule names are
case-insensitive.

Updating every k-th step (``ema_update_every``)
-----------------------------------------------
With ``ema_update_every = k`` (an integer >= 1, default 1) the EMA is updated at the steps
``t = 1, 1 + k, 1 + 2k, ...`` (``(t - 1) % k == 0``), with the decay of that step ``t`` from the
schedule above; the steps in between run the kernel without the EMA (AdamW alone: the EMA's
8 bytes per element are neither read nor written) and leave the EMA, and the buffer EMA, as they
are. This is ema-pytorch's ``EMA(update_every=k)`` convention: it counts its calls from 0, tests
``call % k == 0`` and its first call always initialises the EMA.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Dict, Mapping, Optional, Union

import torch

Schedule = Union[None, str, Callable[[int], float]]

SCHEDULES = ("constant", "warmup", "diffusers", "diffusers_warmup")
# The schedules clamped to [ema_min_decay, ema_decay].
CLAMPED_SCHEDULES = ("diffusers", "diffusers_warmup")

# Param-group options of the EMA optimizers, with their defaults (also what a group saved before
# schedules existed means).
EMA_OPTION_DEFAULTS: Dict[str, Any] = {
    "ema_schedule": None,
    "ema_start_step": 0,
    "ema_inv_gamma": 1.0,
    "ema_power": 2.0 / 3.0,
    "ema_min_decay": 0.0,
    "ema_update_every": 1,
}


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _schedule_name(schedule: Schedule) -> Optional[str]:
    """The lower-cased schedule name (``"constant"`` for ``None``), or ``None`` for a callable."""
    if schedule is None:
        return "constant"
    if isinstance(schedule, str):
        return schedule.lower()
    return None


def check_ema_options(owner: str, *, ema_decay=None, ema_schedule: Schedule = None,
                      ema_start_step=0, ema_inv_gamma=1.0, ema_power=2.0 / 3.0,
                      ema_min_decay=0.0, ema_update_every=1) -> None:
    """Raise ``ValueError``/``TypeError`` naming ``owner`` and the option if an option is invalid."""
    if (isinstance(ema_update_every, bool) or not isinstance(ema_update_every, numbers.Integral)
            or ema_update_every < 1):
        raise ValueError(f"{owner}: ema_update_every must be an integer >= 1, got {ema_update_every!r}")
    if isinstance(ema_schedule, str):
        if ema_schedule.lower() not in SCHEDULES:
            raise ValueError(
                f"{owner}: unknown ema_schedule {ema_schedule!r}; use None, "
                + ", ".join(repr(s) for s in SCHEDULES) + " or a callable n -> decay")
    elif ema_schedule is not None and not callable(ema_schedule):
        raise TypeError(
            f"{owner}: ema_schedule must be None, a schedule name ({', '.join(SCHEDULES)}) or a "
            f"callable n -> decay, got {type(ema_schedule).__name__}")
    if (isinstance(ema_start_step, bool) or not isinstance(ema_start_step, numbers.Integral)
            or ema_start_step < 0):
        raise ValueError(f"{owner}: ema_start_step must be an integer >= 0, got {ema_start_step!r}")
    for name, value in (("ema_inv_gamma", ema_inv_gamma), ("ema_power", ema_power)):
        if not _is_real(value) or not math.isfinite(float(value)) or float(value) <= 0.0:
            raise ValueError(f"{owner}: {name} must be a finite number > 0, got {value!r}")
    if not _is_real(ema_min_decay) or not 0.0 <= float(ema_min_decay) < 1.0:
        raise ValueError(f"{owner}: ema_min_decay must be a number in [0, 1), got {ema_min_decay!r}")
    name = _schedule_name(ema_schedule)
    if (name in CLAMPED_SCHEDULES and ema_decay is not None and _is_real(ema_decay)
            and float(ema_min_decay) > float(ema_decay)):
        raise ValueError(
            f"{owner}: ema_min_decay={ema_min_decay} is above ema_decay={ema_decay}; the {name!r} "
            f"schedule clamps the decay to [ema_min_decay, ema_decay]")


def warmup_decay(n: int, decay: float) -> float:
    """MindSpeed's ``min(decay, (1 + n) / (10 + n))`` for EMA update ``n >= 1``."""
    return min(decay, (1 + n) / (10 + n))


def diffusers_decay(n: int, decay: float, min_decay: float = 0.0) -> float:
    """diffusers ``EMAModel.get_decay`` (default ``use_ema_warmup=False``), ``n = t - update_after_step``."""
    k = max(0, n - 1)
    if k <= 0:
        return 0.0
    value = (1 + k) / (10 + k)
    value = min(value, decay)
    return max(value, min_decay)


def diffusers_warmup_decay(n: int, decay: float, inv_gamma: float = 1.0, power: float = 2.0 / 3.0,
                           min_decay: float = 0.0) -> float:
    """diffusers ``EMAModel.get_decay`` with ``use_ema_warmup=True``, ``n = t - update_after_step``."""
    k = max(0, n - 1)
    if k <= 0:
        return 0.0
    value = 1 - (1 + k / inv_gamma) ** -power
    value = min(value, decay)
    return max(value, min_decay)


def updates_at(step: int, ema_update_every: int) -> bool:
    """Whether optimizer step ``step`` (``>= 1``) updates the EMA (see "ema_update_every" above)."""
    return (int(step) - 1) % int(ema_update_every) == 0


def ema_decay_at(step: int, ema_decay: float, ema_schedule: Schedule = None, ema_start_step: int = 0,
                 ema_inv_gamma: float = 1.0, ema_power: float = 2.0 / 3.0,
                 ema_min_decay: float = 0.0, ema_update_every: int = 1, *,
                 owner: str = "ema_decay_at") -> Optional[float]:
    """The decay of the EMA update made at optimizer step ``step`` (``>= 1``; see the module doc);
    ``None`` when ``ema_update_every`` skips that step.

    Options are assumed valid (see :func:`check_ema_options`); a callable's result is checked.
    """
    if not updates_at(step, ema_update_every):
        return None
    n = int(step) - int(ema_start_step)
    if n <= 0:
        return 0.0
    name = _schedule_name(ema_schedule)
    decay = float(ema_decay)
    if name == "constant":
        return decay
    if name == "warmup":
        return warmup_decay(n, decay)
    if name == "diffusers":
        return diffusers_decay(n, decay, float(ema_min_decay))
    if name == "diffusers_warmup":
        return diffusers_warmup_decay(n, decay, float(ema_inv_gamma), float(ema_power),
                                      float(ema_min_decay))
    value = ema_schedule(n)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not _is_real(value):
        raise TypeError(
            f"{owner}: ema_schedule callable returned {value!r} ({type(value).__name__}) at EMA "
            f"update n={n} (optimizer step {step}); it must return a number in [0, 1)")
    if not (math.isfinite(float(value)) and 0.0 <= float(value) < 1.0):
        raise ValueError(
            f"{owner}: ema_schedule callable returned decay={value!r} at EMA update n={n} "
            f"(optimizer step {step}); an EMA decay must be in [0, 1)")
    return float(value)


def group_options(group: Mapping[str, Any]) -> Dict[str, Any]:
    """The EMA options of a param group, defaults filled in for keys it does not have."""
    return {key: group.get(key, default) for key, default in EMA_OPTION_DEFAULTS.items()}


def update_every(group: Mapping[str, Any]) -> int:
    """A param group's ``ema_update_every`` (1 for a group saved before the option existed)."""
    return int(group.get("ema_update_every", 1))


def check_group(owner: str, group: Mapping[str, Any]) -> None:
    """Validate a param group's EMA schedule options (``ema_decay`` is checked by the optimizer)."""
    check_ema_options(owner, ema_decay=group.get("ema_decay"), **group_options(group))


def group_ema_decay(owner: str, group: Mapping[str, Any], step: int, *,
                    checked: bool = False) -> Optional[float]:
    """The decay for a param group's EMA update at ``step``; ``None`` if the group keeps no EMA
    or does not update it at ``step`` (``ema_update_every``).

    ``checked``: the group's options were already validated (:func:`check_group`).
    """
    if group.get("ema_decay") is None:
        return None
    if not checked:
        check_group(owner, group)
    return ema_decay_at(step, group["ema_decay"], owner=owner, **group_options(group))
