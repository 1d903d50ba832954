"""The Adam-family update as a torch custom op, for steps traced by ``torch.compile``.

``torch.ops.fused_optim.adam_step_`` is a torch custom op (``torch.library``: a schema declaring
which lists it mutates, a real implementation and a fake one), the way torch's own fused
optimizers reach the compiler as opaque ops (``torch._fused_adam_``): dynamo and inductor see one
node per bucket that mutates its inputs in place and returns nothing (its fake implementation),
and at run time the node runs the very kernel an eager step runs.

Arguments: ``op``, a name from :data:`multi_tensor.schema.OPS` (``fused_ema_adamw``, ``adam``,
``radam``, ``radam_ema``); one bucket's lists, already checked against that op's table entry
(``emas`` empty for ops without an EMA, ``masters`` empty without master weights); ``steps``, each
param's ``state["step"]`` (float32 scalar tensors, none of them shared); the group's
hyperparameters as Python scalars; the EMA schedule by name and ``ema_update_every`` (a
callable cannot be an op argument);
GradScaler's ``grad_scale`` and ``found_inf``.

The step number is a tensor in a traced step, so the per-step scalars cannot be folded into the
graph; they are computed when the op runs, from the steps, exactly as an eager step computes
them, by the backend registered for the bucket's device: the same kernel, the same bits. Every
step of a bucket then advances by one; with ``found_inf`` set nothing changes.

Where the steps are read. The op remembers the step tensors it advanced together (all equal),
with their version counters after its write (:data:`_UNIFORM`). When it is called again on those
very tensors, unwritten since (the same versions), with an EMA decay that does not depend on the
step (a ``"constant"`` schedule from step 1, updated every step) and a bucket that computes its
scalars on the device (the Triton backend's ``run_device_step``), nothing is read on the host:
the device step kernel reads the first step tensor, advances it unless ``found_inf`` (read there
as the skip flag) is set and computes the step's scalars from it; a tensor ``lr`` on the params'
device is read by that kernel too; the other step tensors copy the first on the device
(``_foreach_copy_``). Otherwise the op reads on the host: the steps once per call (one
``tolist``; rows whose steps differ run as one call per step value), ``found_inf`` and a tensor
``lr``; a CPU tensor is read without a device sync. So on a GPU a compiled step whose step
tensors are on the device syncs once (the first call, or after anyone writes a step tensor) and
then not at all; step tensors on the CPU are read there (no device sync), and ``found_inf`` or a
tensor ``lr`` on the device are then read with a sync.

The cached bucket is bound as an eager step binds its plan (:func:`multi_tensor.plan.bound`):
the grads by identity and address, the params' and every state tensor's address at every call.
"""
from __future__ import annotations

import collections
from typing import List, Optional

import torch

from multi_tensor import plan, rules, schema, tensor_facts
from multi_tensor.bucketing import group_indices

from . import ema_schedules

OP_NAME = "fused_optim::adam_step_"
SCHEMA = (
    "(str op, Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] emas, Tensor(e!)[] masters, Tensor(f!)[] steps, "
    "float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, float weight_decay, "
    "bool decoupled, bool bias_correction, bool maximize, float? ema_decay, str ema_schedule, "
    "int ema_start_step, float ema_inv_gamma, float ema_power, float ema_min_decay, "
    "int ema_update_every, Tensor? grad_scale, Tensor? found_inf, int chunk_size) -> ()")


def adam_step_(op: str, grads: List[torch.Tensor], params: List[torch.Tensor],
               exp_avgs: List[torch.Tensor], exp_avg_sqs: List[torch.Tensor],
               emas: List[torch.Tensor], masters: List[torch.Tensor], steps: List[torch.Tensor],
               lr: float, lr_tensor: Optional[torch.Tensor], beta1: float, beta2: float,
               eps: float, weight_decay: float, decoupled: bool, bias_correction: bool,
               maximize: bool, ema_decay: Optional[float], ema_schedule: str,
               ema_start_step: int, ema_inv_gamma: float, ema_power: float,
               ema_min_decay: float, ema_update_every: int, grad_scale: Optional[torch.Tensor],
               found_inf: Optional[torch.Tensor], chunk_size: int) -> None:
    """One bucket's update and step advance (see the module docstring)."""
    if not params:
        return
    spec = schema.OPS[op]
    lists = schema.AdamLists(grads=grads, params=params, exp_avgs=exp_avgs,
                             exp_avg_sqs=exp_avg_sqs, emas=emas if spec.has_ema else None,
                             masters=masters or None)
    device = params[0].device
    scale = None if grad_scale is None else grad_scale.to(device)
    fixed = ema_decay is None or (ema_schedule == "constant" and not ema_start_step
                                  and ema_update_every == 1)
    if fixed and _known_uniform(steps):
        if _device_step(spec, lists, steps, lr, lr_tensor, beta1, beta2, eps, weight_decay,
                        decoupled, bias_correction, maximize, ema_decay, scale, found_inf,
                        chunk_size):
            return
    # the host path: the steps (and found_inf, a tensor lr) read on the host
    if found_inf is not None and bool(found_inf.reshape(-1)[0].item() != 0):
        return
    lr_value = lr if lr_tensor is None else float(lr_tensor)
    counts = torch.stack(steps).tolist()  # one host read for the bucket
    uniform = min(counts) == max(counts)  # the usual case
    by_step = {int(counts[0]): None} if uniform else group_indices(int(c) for c in counts)
    bucket = None
    for done, rows in by_step.items():
        t = done + 1
        decay = None if ema_decay is None else ema_schedules.ema_decay_at(
            t, ema_decay, ema_schedule, ema_start_step, ema_inv_gamma, ema_power, ema_min_decay,
            ema_update_every, owner=op)
        # a step that ema_update_every skips runs the op without the EMA (no EMA bytes moved)
        run_spec, run_lists = (spec, lists) if decay is not None or not spec.has_ema else (
            schema.adam_op(spec.rule, False), lists.without_ema())
        hyper = rules.AdamHyper(lr=lr_value, beta1=beta1, beta2=beta2, eps=eps,
                                weight_decay=weight_decay, decoupled=decoupled,
                                bias_correction=bias_correction, maximize=maximize,
                                ema_decay=decay, rule=spec.rule)
        if rows is not None:
            run_lists = run_lists.take(rows)
        # checked when the step was compiled (compiled.init_group); the prepared bucket is
        # reused across steps (multi_tensor.plan's cache)
        bucket = plan.bound(run_spec, run_lists, chunk_size)
        plan.run_adam(run_spec, run_lists, hyper, t, plan.noop_flag(device), scale,
                      chunk_size=chunk_size, checked=True, bucket=bucket)
    torch._foreach_add_(steps, 1.0)
    if (fixed and uniform and bucket.device_steps
            and all(s.device == device for s in steps)):
        _remember_uniform(steps)


# The step tensors of the buckets whose steps this op advanced together last (so known equal
# without reading them), each with the tensors' version counters after that write: a write by
# anyone else (fill_, copy_, a load) bumps a version, and the op reads the steps again. Keyed by
# the first step tensor's id; the entry holds the tensors, so that id names one tensor while
# the entry lives.
_UNIFORM: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_UNIFORM_SIZE = plan.CACHE_SIZE
_versions = tensor_facts.versions  # (None: inference tensors keep no version counter)


def _remember_uniform(steps) -> None:
    versions = _versions(steps)
    if versions is None:
        return
    key = (id(steps[0]), len(steps))
    _UNIFORM[key] = (list(steps), versions)
    _UNIFORM.move_to_end(key)
    while len(_UNIFORM) > _UNIFORM_SIZE:
        _UNIFORM.popitem(last=False)


def _known_uniform(steps) -> bool:
    entry = _UNIFORM.get((id(steps[0]), len(steps)))
    if entry is None:
        return False
    held, versions = entry
    now = _versions(steps)
    return tensor_facts.same_objects(steps, held) and now is not None and now == versions


def _device_step(spec, lists, steps, lr, lr_tensor, beta1, beta2, eps, weight_decay, decoupled,
                 bias_correction, maximize, ema_decay, scale, found_inf, chunk_size) -> bool:
    """The step on the device, nothing read back: for steps known equal (on the params'
    device) and a step-independent EMA decay. The bucket's device step kernel reads the first
    step tensor, advances it unless ``found_inf`` is set and computes the step's scalars from
    it; the other step tensors copy it on the device. A tensor lr on the device is read by the
    kernel, one on the CPU on the host (no device sync). False (nothing done) when the bucket
    keeps its steps on the host."""
    device = lists.params[0].device
    bucket = plan.bound(spec, lists, chunk_size)
    if not bucket.device_steps:
        return False
    flag = plan.noop_flag(device)
    if found_inf is not None:
        if found_inf.device == device:
            flag = found_inf
        elif found_inf.device.type == "cpu":
            if bool(found_inf.reshape(-1)[0].item() != 0):  # a host value: no device sync
                return True
        else:
            flag = found_inf.to(device)
    lr_device = lr_tensor if lr_tensor is not None and lr_tensor.device == device else None
    lr_value = lr if lr_tensor is None else (0.0 if lr_device is not None else float(lr_tensor))
    hyper = rules.AdamHyper(lr=lr_value, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay, decoupled=decoupled,
                            bias_correction=bias_correction, maximize=maximize,
                            ema_decay=ema_decay, rule=spec.rule)
    bucket.run_device_step(steps[0], hyper, flag, scale, lr=lr_device)
    if len(steps) > 1:
        torch._foreach_copy_(steps[1:], [steps[0]] * (len(steps) - 1))
    _remember_uniform(steps)
    return True


def _adam_step_fake(op, grads, params, exp_avgs, exp_avg_sqs, emas, masters, steps, lr,
                    lr_tensor, beta1, beta2, eps, weight_decay, decoupled, bias_correction,
                    maximize, ema_decay, ema_schedule, ema_start_step, ema_inv_gamma, ema_power,
                    ema_min_decay, ema_update_every, grad_scale, found_inf, chunk_size) -> None:
    """In place: no outputs, nothing to allocate."""
    return None


# Defined with torch.library.define/impl rather than torch.library.custom_op: custom_op adds a
# Python ADInplaceOrView kernel that bumps the version counter of every mutated tensor, a Python
# loop over five tensors per param at every step; the eager step's kernels do not bump them either.
# The op has no autograd formula (an optimizer step is not differentiated; torch's _fused_adam_
# has none either).
torch.library.define(OP_NAME, SCHEMA)
torch.library.impl(OP_NAME, "CompositeExplicitAutograd", func=adam_step_)
torch.library.register_fake(OP_NAME, _adam_step_fake)
