"""The apex-compatible op front ends: positional signatures, checked once, then the plan.

This is the one place where lists are told apart by their number: each Adam-family front end
maps apex's positional ``tensor_lists`` to a :class:`multi_tensor.schema.AdamLists` by the op's
:data:`POSITIONAL` forms, checks its scalars and lists before any tensor is modified, turns its
positional hyperparameters into an :class:`~multi_tensor.rules.AdamHyper` and hands the call to
:func:`multi_tensor.plan.run_adam` (the backend registered for the bucket's device, a prepared
bucket reused across calls on the same tensors). Call them through
``multi_tensor_applier(op, noop_flag, tensor_lists, *args)`` or directly with a chunk size first.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import plan, rules, schema, validation

_ADAM = ("grads", "params", "exp_avgs", "exp_avg_sqs")
# The positional forms of apex's signatures, by op: the lists' names, by position.
POSITIONAL = {
    "fused_ema_adamw": (_ADAM + ("emas",), _ADAM + ("emas", "masters")),
    "adam": (_ADAM, _ADAM + ("masters",)),
    "radam": (_ADAM, _ADAM + ("masters",)),
    "radam_ema": (_ADAM + ("emas",), _ADAM + ("emas", "masters")),
}


def named_lists(spec, tensor_lists) -> schema.AdamLists:
    """apex's positional ``tensor_lists`` of op ``spec`` (an OpSpec or its name) by name; raises
    on a count no form of the op has."""
    spec = schema.OPS[spec] if isinstance(spec, str) else spec
    op = spec.api_name
    validation.check_list_of_lists(op, tensor_lists)
    forms = POSITIONAL[spec.name]
    for names in forms:
        if len(names) == len(tensor_lists):
            return schema.AdamLists(**dict(zip(names, (list(ts) for ts in tensor_lists))))
    raise ValueError(f"{op}: tensor_lists must be "
                     + " or ".join(f"[{', '.join(names)}]" for names in forms)
                     + f"; got {len(tensor_lists)} lists")


def _adam_call(spec: schema.OpSpec, chunk_size, noop_flag, tensor_lists, step, grad_scale,
               check_finite, *, lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction,
               maximize, ema_decay=None) -> None:
    """Check an Adam-family call once, then run it on its device's backend."""
    op = spec.api_name
    validation.check_chunk_size(op, chunk_size)
    validation.check_list_of_lists(op, tensor_lists)
    if spec.has_ema and ema_decay is None:
        # Five lists with no decay would read as [grads, params, m, v, masters] to an op without
        # the EMA and as [..., emas] to this one: refused, the same on every backend.
        raise ValueError(f"{op}: ema_decay is None; this op updates an EMA and needs an "
                         f"ema_decay in [0, 1) (for the update without an EMA, call "
                         f"{schema.adam_op(spec.rule, False).api_name})")
    validation.check_hyperparameters(op, lr=lr, eps=eps, beta1=beta1, beta2=beta2,
                                     ema_decay=ema_decay, weight_decay=weight_decay)
    step = validation.check_step(op, step)
    lists = named_lists(spec, tensor_lists)
    # a loop that calls the op on the same tensors each step: checked when its bucket was made
    cached = plan.unchanged(spec, lists, chunk_size)
    if cached is None:
        schema.check_adam_lists(spec, lists)
    # the flag and the scale on the tensors' device (grad_scale may also be on the CPU); tensors
    # without real storage run on the reference, which reads both on the host
    refs = lists.params
    if cached is not None:  # its tensors have real storage: the bucket bound their addresses
        device = cached.device
    else:
        device = (refs[0].device if refs and validation.storageless([refs], ("",)) is None
                  else None)
    validation.check_noop_flag(op, noop_flag, device)
    validation.check_grad_scale(op, grad_scale, device)
    number = functools.partial(validation.real, op)
    hyper = rules.AdamHyper(
        lr=number("lr", lr), beta1=number("beta1", beta1), beta2=number("beta2", beta2),
        eps=number("eps", eps), weight_decay=number("weight_decay", weight_decay),
        decoupled=bool(decoupled), bias_correction=bool(bias_correction),
        maximize=bool(maximize),
        ema_decay=None if ema_decay is None else number("ema_decay", ema_decay), rule=spec.rule)
    # an optimizer op, as apex's kernels are: autograd does not see the in-place writes (a leaf
    # param that requires grad is updated like any other tensor, on every backend)
    with torch.no_grad():
        plan.run_adam(spec, lists, hyper, step, noop_flag, grad_scale, check_finite, chunk_size,
                      checked=True, bucket=cached)


def _mode(op: str, mode) -> bool:
    return validation.check_mode(op, mode)


def multi_tensor_fused_ema_adamw(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float,
                                 ema_decay: float, beta1: float, beta2: float, eps: float,
                                 step: int, mode: int, bias_correction: bool, weight_decay: float,
                                 *, grad_scale: Optional[torch.Tensor] = None,
                                 maximize: bool = False, check_finite: bool = False) -> None:
    """AdamW (``mode=1``) or Adam with L2 decay (``mode=0``) plus an EMA of the weights, in place.

    ``tensor_lists`` is ``[grads, params, exp_avgs, exp_avg_sqs, emas]`` (one float dtype) or
    ``[grads, params, exp_avgs, exp_avg_sqs, emas, masters]`` (fp16/bf16 params, fp32 state and
    masters). ``emas`` may instead be bf16 (a bf16 EMA: loaded exactly, updated in fp32, rounded
    once to nearest even) unless the params are fp64. The seed operator's update (SPEC section 2)
    in :mod:`multi_tensor.rules`' order; ``grad_scale``: grads are unscaled by it; ``maximize``: the grad is negated.
    ``noop_flag`` nonzero: nothing changes. ``check_finite``: if any grad is inf/NaN, set
    ``noop_flag`` and change nothing.
    """
    spec = schema.OPS["fused_ema_adamw"]
    decoupled = _mode(spec.api_name, mode)
    _adam_call(spec, chunk_size, noop_flag, tensor_lists, step, grad_scale, check_finite, lr=lr,
               beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, decoupled=decoupled,
               bias_correction=bias_correction, maximize=maximize, ema_decay=ema_decay)


def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float,
                      beta1: float, beta2: float, eps: float, step: int, mode: int,
                      bias_correction: bool, weight_decay: float, *,
                      grad_scale: Optional[torch.Tensor] = None, maximize: bool = False,
                      check_finite: bool = False) -> None:
    """apex ``multi_tensor_adam``: the update above without the EMA.

    ``tensor_lists`` is ``[grads, params, exp_avgs, exp_avg_sqs]`` or, with fp32 masters for
    fp16/bf16 params, ``[grads, params, exp_avgs, exp_avg_sqs, masters]``.
    """
    spec = schema.OPS["adam"]
    decoupled = _mode(spec.api_name, mode)
    _adam_call(spec, chunk_size, noop_flag, tensor_lists, step, grad_scale, check_finite, lr=lr,
               beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, decoupled=decoupled,
               bias_correction=bias_correction, maximize=maximize)


def multi_tensor_radam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float,
                       beta1: float, beta2: float, eps: float, step: int, weight_decay: float,
                       decoupled_weight_decay: bool, *,
                       grad_scale: Optional[torch.Tensor] = None, maximize: bool = False,
                       check_finite: bool = False) -> None:
    """``torch.optim.RAdam``'s update, in place.

    ``tensor_lists`` is ``[grads, params, exp_avgs, exp_avg_sqs]`` or, with fp32 masters for
    fp16/bf16 params, ``[grads, params, exp_avgs, exp_avg_sqs, masters]``. The scalars are in
    :func:`multi_tensor.rules.step_scalars` (rectified when rho_t > 5).
    """
    spec = schema.OPS["radam"]
    _adam_call(spec, chunk_size, noop_flag, tensor_lists, step, grad_scale, check_finite, lr=lr,
               beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
               decoupled=decoupled_weight_decay, bias_correction=True, maximize=maximize)


def multi_tensor_radam_ema(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float,
                           ema_decay: float, beta1: float, beta2: float, eps: float, step: int,
                           weight_decay: float, decoupled_weight_decay: bool, *,
                           grad_scale: Optional[torch.Tensor] = None, maximize: bool = False,
                           check_finite: bool = False) -> None:
    """:func:`multi_tensor_radam` plus an EMA of the weights in the same pass.

    ``tensor_lists`` is ``[grads, params, exp_avgs, exp_avg_sqs, emas]`` or
    ``[grads, params, exp_avgs, exp_avg_sqs, emas, masters]``.
    """
    spec = schema.OPS["radam_ema"]
    _adam_call(spec, chunk_size, noop_flag, tensor_lists, step, grad_scale, check_finite, lr=lr,
               beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
               decoupled=decoupled_weight_decay, bias_correction=True, maximize=maximize,
               ema_decay=ema_decay)


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: float) -> None:
    """apex ``multi_tensor_scale``: ``dsts[i] = srcs[i] * scale`` (rounded once to dst's dtype).

    Sets ``noop_flag`` to 1 if any source holds an inf or NaN (the copy still happens, as in apex).
    """
    spec = schema.OPS["scale"]
    validation.check_chunk_size(spec.api_name, chunk_size)
    form = schema.check_lists(spec, tensor_lists)
    backend = plan.backend_for_lists(spec, zip(form.names, tensor_lists))
    if backend is not None:
        backend.ops["scale"](chunk_size, noop_flag, tensor_lists, float(scale))


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                        per_tensor: bool = False):
    """apex ``multi_tensor_l2norm``: ``(total_norm, per_tensor_norms)``, fp32 tensors.

    Independent of chunk size and thread count. Sets ``noop_flag`` on an inf/NaN input.
    """
    spec = schema.OPS["l2norm"]
    validation.check_chunk_size(spec.api_name, chunk_size)
    form = schema.check_lists(spec, tensor_lists)
    backend = plan.backend_for_lists(spec, zip(form.names, tensor_lists))
    if backend is None:
        backend = schema.registry.backend_for("l2norm", noop_flag.device)
    return backend.ops["l2norm"](chunk_size, noop_flag, tensor_lists, bool(per_tensor))
