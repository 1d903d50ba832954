"""The step ``torch.compile`` traces: one custom op per bucket, no graph break.

Under dynamo (``torch.compiler.is_compiling()``) :meth:`FusedOptimizerBase.step` runs :func:`step`
instead of its eager body. It follows the protocol dynamo has for ``torch.optim`` optimizers
(``torch/_dynamo/variables/optimizer.py``): the optimizer's ``_init_group`` (:func:`init_group`)
is not traced but run once, eagerly, while the step is being compiled. It checks every group,
creates missing state, checks each bucket's lists against the op table (raising as an eager step
would, naming the tensor), and fills the lists it is given with the params that have grads, their
grads and state, bucketed by ``(device, param dtype, grad dtype, master or not)``; it returns the
buckets as Python constants (list ranges, op name, hyperparameters). Dynamo then guards on the
param groups, the state and which grads are None, so a changed option or a new grad recompiles
and runs ``init_group`` again. The traced part is a loop over those constants that calls
``torch.ops.fused_optim.adam_step_`` (:mod:`fused_optim.custom_ops`) once per bucket: the kernel
an eager step runs, with the step number and the per-step scalars taken from the step tensors when
the op runs, so compiled and eager steps give the same bits.

Each param gets a step tensor of its own here (an eager step shares one per bucket; a mutated
op argument must not alias another), on the params' device when the bucket's backend computes
the step's scalars there (:func:`_step_home`: then a compiled step reads nothing on the host,
GradScaler's ``found_inf`` included), and the eager step's cached plans are dropped at every
compiled step, so eager and compiled steps can be mixed (each switch recompiles once).

Not traceable, run eagerly behind one graph break (an error under ``fullgraph=True`` that names
the feature): ``max_grad_norm``, a buffer EMA (``register_ema_buffers``), an EMA schedule given
as a callable, ``betas`` given as tensors, complex params, params or grads without real storage
(DTensor), sparse grads, ``capturable=True``, and a step inside ``swap_ema_weights()`` (which
raises, as eagerly).
``last_ema_decays`` is left empty by a compiled step (the decays are computed when the op runs).
An ``lr`` given as a tensor is read when the op runs, so an LR scheduler that updates it in place
(``lr=torch.tensor(1e-3)``) does not recompile; a float ``lr`` is a constant of the graph and a
new value recompiles, as for ``torch.optim`` optimizers.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from multi_tensor import plan, schema, validation

from . import custom_ops  # noqa: F401  (registers torch.ops.fused_optim.adam_step_)
from . import ema_schedules

# Why a step cannot be traced (the key a fallback is chosen by) -> the message dynamo shows.
UNSUPPORTED = {
    "max_grad_norm": "max_grad_norm (the global grad norm needs a host read)",
    "ema_buffers": "a buffer EMA (register_ema_buffers: updated after the step, in a hook)",
    "ema_schedule": "an ema_schedule given as a callable (an op argument must be a name)",
    "betas": "betas given as tensors",
    "complex": "complex params",
    "storage": "params or grads without real storage (DTensor, meta or fake tensors)",
    "sparse": "sparse gradients",
    "swapped": "a step inside swap_ema_weights()",
    "op": "an optimizer whose op is not of the Adam family",
    "capturable": "capturable=True (the eager step keeps steps and scalars on the device; the "
                  "traced op reads them on the host)",
    "remainder": "master_weights='remainder' (the traced op's lists have no remainders)",
}


def _eager_step(opt) -> None:
    with torch.no_grad():
        opt._eager_step()  # FusedOptimizerBase's eager body


_EAGER = {key: torch._dynamo.disable(
    _eager_step, reason=f"fused_optim: a compiled step with {text} runs eagerly")
    for key, text in UNSUPPORTED.items()}


def step(opt) -> None:
    """The traced step of ``opt`` (see the module docstring). GradScaler's attributes are read
    here; the closure has run already."""
    reason = _unsupported(opt)
    if reason is None:
        lists: List[List[torch.Tensor]] = [[], [], [], [], [], [], [], []]
        buckets = opt._init_group(*lists)
        reason = buckets if isinstance(buckets, str) else None
    if reason is not None:
        _EAGER[reason](opt)
        return
    opt._plans.clear()  # the eager step's plans hold step counts that this step advances
    if getattr(opt, "last_ema_decays", None):
        opt.last_ema_decays = {}
    grads, params, exp_avgs, exp_avg_sqs, emas, masters, steps, lrs = lists
    grad_scale = getattr(opt, "grad_scale", None)
    found_inf = getattr(opt, "found_inf", None)
    for op, (s, e), (es, ee), (ms, me), li, hyper in buckets:
        lr, beta1, beta2, eps, wd, decoupled, bias_correction, maximize, ema = hyper
        ema_decay, schedule, start, inv_gamma, power, min_decay, every = ema
        torch.ops.fused_optim.adam_step_(
            op, grads[s:e], params[s:e], exp_avgs[s:e], exp_avg_sqs[s:e], emas[es:ee],
            masters[ms:me], steps[s:e], lr, None if li is None else lrs[li], beta1, beta2, eps,
            wd, decoupled, bias_correction, maximize, ema_decay, schedule, start, inv_gamma,
            power, min_decay, every, grad_scale, found_inf, opt._chunk_size)


def _unsupported(opt) -> Optional[str]:
    """The optimizer-level features a traced step cannot take (read under guards)."""
    if getattr(opt, "_ema_swapped", False):
        return "swapped"
    if opt.max_grad_norm is not None:
        return "max_grad_norm"
    if getattr(opt, "_ema_buffer_avg", None) is not None:
        return "ema_buffers"
    return None


def init_group(opt, grads, params, exp_avgs, exp_avg_sqs, emas, masters, steps, lrs):
    """``opt._init_group``, run eagerly by dynamo while it compiles :func:`step`.

    Fills the lists with every bucket's tensors (see the module docstring) and returns the
    buckets, ``(op, rows, ema rows, master rows, index into lrs or None, hyperparameters)`` each,
    or the :data:`UNSUPPORTED` key of a feature the traced step cannot take (then nothing is
    filled or created).
    """
    work = []
    for group in opt.param_groups:
        opt._check_group(group)
        present = [p for p in group["params"] if p.grad is not None]
        reason = _group_unsupported(opt, group, present)
        if reason is not None:
            return reason
        work.append((group, present))
    buckets, seen_steps = [], set()
    for group, present in work:
        spec = opt._op(group)
        lr_index = None
        if isinstance(group["lr"], torch.Tensor):
            lr_index = len(lrs)
            lrs.append(group["lr"])
        hyper = _hyper(opt, group)
        # steps are read when the op runs, which splits a bucket by step itself
        split = plan.split_buckets(present, [p.grad for p in present],
                                   [opt._uses_master(p, group) for p in present])
        for rows in split.values():
            bucket_params = [present[i] for i in rows]
            for p in bucket_params:
                opt._init_state(p, group, opt.state[p])
            lists = opt._state_lists(bucket_params, group).with_grads(
                [p.grad for p in bucket_params])
            schema.check_adam_lists(spec, lists)
            home = _step_home(opt, group, spec, lists)
            start, ema_start, master_start = len(params), len(emas), len(masters)
            out = {"grads": grads, "params": params, "exp_avgs": exp_avgs,
                   "exp_avg_sqs": exp_avg_sqs, "emas": emas, "masters": masters}
            for name, tensors in lists.present():
                out[name].extend(tensors)
            for p in bucket_params:
                steps.append(_own_step(opt.state[p], seen_steps, home))
            buckets.append((spec.name, (start, len(params)), (ema_start, len(emas)),
                            (master_start, len(masters)), lr_index, hyper))
    return tuple(buckets)


def _group_unsupported(opt, group: Dict[str, Any], present: List[torch.Tensor]) -> Optional[str]:
    if opt._op(group).rule is None:
        return "op"
    if group.get("capturable"):
        return "capturable"
    if group.get("master_weights") == "remainder":
        return "remainder"
    if opt._has_ema(group) and callable(group.get("ema_schedule")):
        return "ema_schedule"
    if any(isinstance(b, torch.Tensor) for b in group["betas"]):
        return "betas"
    for p in present:
        if p.is_complex():
            return "complex"
        if p.grad.is_sparse:
            return "sparse"
        if not (validation.has_storage(p) and validation.has_storage(p.grad)):
            return "storage"
    return None


def _hyper(opt, group: Dict[str, Any]) -> tuple:
    """The op's hyperparameter arguments for ``group`` (the EMA decay by schedule)."""
    h = opt._hyper({**group, "ema_decay": None}, 1)  # every field but the scheduled decay
    lr = 0.0 if isinstance(group["lr"], torch.Tensor) else h.lr
    ema = (None, "constant", 0, 1.0, 1.0, 0.0, 1)
    if opt._has_ema(group):
        options = ema_schedules.group_options(group)
        schedule = options["ema_schedule"]
        ema = (float(group["ema_decay"]), "constant" if schedule is None else schedule.lower(),
               int(options["ema_start_step"]), float(options["ema_inv_gamma"]),
               float(options["ema_power"]), float(options["ema_min_decay"]),
               int(options["ema_update_every"]))
    return (lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled, h.bias_correction,
            h.maximize, ema)


def _step_home(opt, group: Dict[str, Any], spec: schema.OpSpec,
               lists: schema.AdamLists) -> Optional[torch.device]:
    """The device a bucket's step tensors belong on: the params' device when its backend
    computes the step's scalars there (``run_device_step``, the Triton backend) and the decay
    does not depend on the step, so the op reads neither the steps nor GradScaler's
    ``found_inf`` on the host (as torch's fused optimizers keep ``state["step"]`` on the
    device); else None (where they are: a step-dependent decay reads the steps on the host,
    which costs no device sync while they are on the CPU). Prepares the bucket the op then
    finds in :mod:`multi_tensor.plan`'s cache."""
    if opt._step_dependent(group):
        return None
    backend = plan.backend_for_lists(spec, lists.present())
    bucket = plan.prepared(spec, lists, backend, opt._chunk_size)
    return lists.params[0].device if bucket.device_steps else None


def _own_step(state: Dict[str, Any], seen: set,
              home: Optional[torch.device] = None) -> torch.Tensor:
    """``state["step"]``, copied first if another param shares it (eager buckets share one),
    and moved to ``home`` (the same float32 count) when it is elsewhere."""
    step = state["step"]
    if id(step) in seen or (home is not None and step.device != home):
        step = state["step"] = step.to(home if home is not None else step.device, copy=True)
    seen.add(id(step))
    return step

