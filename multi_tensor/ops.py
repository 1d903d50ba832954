"""The apex-compatible op front-ends.

Each checks its scalar arguments, finds the bucket's device and hands the call to the backend
registered for that device (see :mod:`multi_tensor.backends`). The backend checks the tensor
lists. All checks run before any tensor is modified. Call them through
``multi_tensor_applier(op, noop_flag, tensor_lists, *args)`` or directly with a chunk size first.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import validation
from .backends import registry


def _device_of(tensor_lists) -> Optional[torch.device]:
    for tensors in tensor_lists:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                return t.device
    return None


def _check_call(op: str, chunk_size, tensor_lists) -> None:
    """A positive integer chunk size, and tensor_lists a list (or tuple) of lists of tensors."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive integer, got {chunk_size!r}")
    if not isinstance(tensor_lists, (list, tuple)) or not all(
            isinstance(tensors, (list, tuple)) for tensors in tensor_lists):
        raise TypeError(f"{op}: tensor_lists must be a list of lists of tensors, got "
                        f"{type(tensor_lists).__name__}")


def _adam_family_prologue(op: str, lists_key: str, chunk_size, tensor_lists, step, **hyper):
    """Check an adam-family call's scalars; ``(device, step)``, device None for empty lists."""
    _check_call(op, chunk_size, tensor_lists)
    validation.check_hyperparameters(op, step=step, **hyper)
    step = validation.check_step(op, step)
    device = _device_of(tensor_lists)
    if device is None:
        validation.check_adam_family_lists(lists_key, tensor_lists)
    return device, step


def multi_tensor_fused_ema_adamw(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float,
                                 ema_decay: float, beta1: float, beta2: float, eps: float,
                                 step: int, mode: int, bias_correction: bool, weight_decay: float,
                                 *, grad_scale: Optional[torch.Tensor] = None,
                                 maximize: bool = False, check_finite: bool = False) -> None:
    """AdamW (``mode=1``) or Adam with L2 decay (``mode=0``) plus an EMA of the weights, in place.

    ``tensor_lists`` is ``[grads, params, exp_avgs, exp_avg_sqs, emas]`` (one float dtype) or
    ``[grads, params, exp_avgs, exp_avg_sqs, emas, masters]`` (fp16/bf16 params, fp32 state and
    masters). Per element, in fp32 (SPEC section 2)::

        bc1, bc2 = 1 - beta1**step, 1 - beta2**step      (1, 1 without bias_correction)
        g  = grad / grad_scale (- if maximize) (+ weight_decay * p if mode 0)
        m  = beta1 * m + (1 - beta1) * g
        v  = beta2 * v + (1 - beta2) * g * g
        p  = p - lr * ((m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p * mode)
        s  = ema_decay * s + (1 - ema_decay) * p

    ``noop_flag`` nonzero: nothing changes. ``check_finite``: if any grad is inf/NaN, set
    ``noop_flag`` and change nothing.
    """
    device, step = _adam_family_prologue(
        "multi_tensor_fused_ema_adamw", "fused_ema_adamw", chunk_size, tensor_lists, step, lr=lr,
        eps=eps, beta1=beta1, beta2=beta2, ema_decay=ema_decay, weight_decay=weight_decay,
        mode=mode)
    if device is None:
        return
    registry.resolve("fused_ema_adamw", device)(
        chunk_size, noop_flag, tensor_lists, float(lr), float(ema_decay), float(beta1),
        float(beta2), float(eps), step, int(mode), bool(bias_correction), float(weight_decay),
        grad_scale=grad_scale, maximize=bool(maximize), check_finite=bool(check_finite))


def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float,
                      beta1: float, beta2: float, eps: float, step: int, mode: int,
                      bias_correction: bool, weight_decay: float, *,
                      grad_scale: Optional[torch.Tensor] = None, maximize: bool = False,
                      check_finite: bool = False) -> None:
    """apex ``multi_tensor_adam``: the update above without the EMA.

    ``tensor_lists`` is ``[grads, params, exp_avgs, exp_avg_sqs]`` or, with fp32 masters for
    fp16/bf16 params, ``[grads, params, exp_avgs, exp_avg_sqs, masters]``.
    """
    device, step = _adam_family_prologue(
        "multi_tensor_adam", "adam", chunk_size, tensor_lists, step, lr=lr, eps=eps,
        beta1=beta1, beta2=beta2, weight_decay=weight_decay, mode=mode)
    if device is None:
        return
    registry.resolve("adam", device)(
        chunk_size, noop_flag, tensor_lists, float(lr), float(beta1), float(beta2), float(eps),
        step, int(mode), bool(bias_correction), float(weight_decay), grad_scale=grad_scale,
        maximize=bool(maximize), check_finite=bool(check_finite))


def multi_tensor_radam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float,
                       beta1: float, beta2: float, eps: float, step: int, weight_decay: float,
                       decoupled_weight_decay: bool, ema_decay: Optional[float] = None, *,
                       grad_scale: Optional[torch.Tensor] = None, maximize: bool = False,
                       check_finite: bool = False) -> None:
    """``torch.optim.RAdam``'s update, with an optional EMA of the weights, in place.

    ``ema_decay`` None: ``tensor_lists`` is ``[grads, params, exp_avgs, exp_avg_sqs]`` or, with
    fp32 masters for fp16/bf16 params, ``[grads, params, exp_avgs, exp_avg_sqs, masters]``.
    ``ema_decay`` a float: ``[grads, params, exp_avgs, exp_avg_sqs, emas]`` or
    ``[grads, params, exp_avgs, exp_avg_sqs, emas, masters]``. So a five-list call is told apart
    by ``ema_decay``. Per element, in fp32 (t = step)::

        g   = grad / grad_scale (- if maximize)
        p   = p * (1 - lr * weight_decay)        if decoupled_weight_decay
        g   = g + weight_decay * p               otherwise (L2)
        m   = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
        rho_inf = 2 / (1 - beta2) - 1;  rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t)
        p   = p - lr * m / (1 - beta1^t) * rect * sqrt(1 - beta2^t) / (sqrt(v) + eps)  if rho_t > 5
        p   = p - lr * m / (1 - beta1^t)                                                otherwise
        s   = ema_decay * s + (1 - ema_decay) * p

    The exact operation order is the reference backend's
    (:func:`multi_tensor.backends.reference.radam`).
    ``noop_flag`` nonzero: nothing changes. ``check_finite``: a non-finite grad sets ``noop_flag``
    and nothing changes.
    """
    device, step = _adam_family_prologue(
        "multi_tensor_radam", validation.radam_lists_key(ema_decay), chunk_size, tensor_lists,
        step, lr=lr, eps=eps, beta1=beta1, beta2=beta2, ema_decay=ema_decay,
        weight_decay=weight_decay)
    if device is None:
        return
    registry.resolve("radam", device)(
        chunk_size, noop_flag, tensor_lists, float(lr), float(beta1), float(beta2), float(eps),
        step, float(weight_decay), bool(decoupled_weight_decay),
        None if ema_decay is None else float(ema_decay), grad_scale=grad_scale,
        maximize=bool(maximize), check_finite=bool(check_finite))


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: float) -> None:
    """apex ``multi_tensor_scale``: ``dsts[i] = srcs[i] * scale`` (rounded once to dst's dtype).

    Sets ``noop_flag`` to 1 if any source holds an inf or NaN (the copy still happens, as in apex).
    """
    op = "multi_tensor_scale"
    _check_call(op, chunk_size, tensor_lists)
    device = _device_of(tensor_lists)
    if device is None:
        return
    registry.resolve("scale", device)(chunk_size, noop_flag, tensor_lists, float(scale))


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                        per_tensor: bool = False):
    """apex ``multi_tensor_l2norm``: ``(total_norm, per_tensor_norms)``, fp32 tensors.

    Independent of chunk size and thread count. Sets ``noop_flag`` on an inf/NaN input.
    """
    op = "multi_tensor_l2norm"
    _check_call(op, chunk_size, tensor_lists)
    device = _device_of(tensor_lists) or noop_flag.device
    return registry.resolve("l2norm", device)(chunk_size, noop_flag, tensor_lists, bool(per_tensor))
