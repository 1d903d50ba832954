"""Functional API: the per-tensor NPU operator contract and a list-based fused EMA-AdamW."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from multi_tensor import multi_tensor_applier, multi_tensor_fused_ema_adamw, schema, validation
from multi_tensor.bucketing import bucket_tensor_lists

_NOOP_FLAGS: Dict[torch.device, torch.Tensor] = {}


def _noop_flag(device: torch.device) -> torch.Tensor:
    flag = _NOOP_FLAGS.get(device)
    if flag is None:
        flag = _NOOP_FLAGS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


def npu_apply_fused_ema_adamw(grad: torch.Tensor, var: torch.Tensor, m: torch.Tensor,
                              v: torch.Tensor, s: torch.Tensor, step, lr: float = 1e-3,
                              ema_decay: float = 0.9999, beta1: float = 0.9, beta2: float = 0.999,
                              eps: float = 1e-8, mode: int = 1, bias_correction: bool = True,
                              weight_decay: float = 0.0):
    r"""MindSpeed's ``npu_apply_fused_ema_adamw``, on any device: updates var, m, v, s in place.

    ``grad, var, m, v, s``: tensors of one shape and float dtype (the operator's contract is
    float32); ``step``: the step number, an int64 tensor of shape ``(1,)`` or an int >= 1.
    ``mode`` 1 is AdamW (decoupled decay), 0 is Adam (L2 decay added to the gradient)::

        bc1 = 1 - beta1**step * bias_correction;  bc2 = 1 - beta2**step * bias_correction
        g   = grad + weight_decay * var * (1 - mode)
        m   = beta1 * m + (1 - beta1) * g
        v   = beta2 * v + (1 - beta2) * g * g
        var = var - lr * ((m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * var * mode)
        s   = ema_decay * s + (1 - ema_decay) * var

    Returns ``(var, m, v, s)``, the same tensor objects, updated.
    """
    op = "npu_apply_fused_ema_adamw"
    names = ("grad", "var", "m", "v", "s")
    tensors = (grad, var, m, v, s)
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in zip(names, tensors):
        if t.dtype != var.dtype:
            raise TypeError(f"{op}: {name} is {t.dtype} but var is {var.dtype}; all five tensors "
                            f"must share one dtype (float32 in the operator's contract)")
        if t.shape != var.shape:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)} but var has shape {tuple(var.shape)}")
    if isinstance(step, torch.Tensor) and step.is_floating_point():
        raise TypeError(f"{op}: step must be an integer tensor (int64, shape (1,)), got {step.dtype}")
    step = validation.check_step(op, step)
    validation.check_mode(op, mode)
    multi_tensor_fused_ema_adamw(
        multi_tensor_applier.chunk_size, _noop_flag(var.device), [[grad], [var], [m], [v], [s]],
        lr, ema_decay, beta1, beta2, eps, step, mode, bias_correction, weight_decay)
    return var, m, v, s


def fused_ema_adamw(params: List[torch.Tensor], grads: List[torch.Tensor],
                    exp_avgs: List[torch.Tensor], exp_avg_sqs: List[torch.Tensor],
                    emas: List[torch.Tensor], state_steps: List[torch.Tensor],
                    masters: Optional[List[Optional[torch.Tensor]]] = None, *, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float,
                    ema_decay: float, adam_w_mode: bool = True, bias_correction: bool = True,
                    maximize: bool = False, grad_scale: Optional[torch.Tensor] = None,
                    found_inf: Optional[torch.Tensor] = None,
                    chunk_size: int = multi_tensor_applier.chunk_size) -> None:
    r"""Functional core of :class:`~fused_optim.FusedEmaAdamW` over explicit lists.

    ``masters[i]`` is the fp32 master of ``params[i]`` or ``None``. ``state_steps`` are scalar
    tensors advanced by one (unless ``found_inf`` is set, when nothing changes). Rows are
    bucketed by ``(device, dtype, grad dtype, master, step)``; one engine call per bucket. The
    math is :func:`npu_apply_fused_ema_adamw`'s.
    """
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "emas": emas,
             "state_steps": state_steps}
    if masters is None:
        masters = [None] * n
    lists["masters"] = masters
    for name, values in lists.items():
        if len(values) != n:
            raise ValueError(f"fused_ema_adamw: {name} has {len(values)} entries but params has {n}")
    if found_inf is not None and bool(found_inf.item() != 0):
        return
    steps = [validation.check_step("fused_ema_adamw", int(t.item()) + 1) for t in state_steps]
    keys = [(p.device, p.dtype, g.dtype, mt is not None, st)
            for p, g, mt, st in zip(params, grads, masters, steps)]
    buckets = bucket_tensor_lists([grads, params, exp_avgs, exp_avg_sqs, emas, masters],
                                  key=keys.__getitem__)
    calls = []
    for (device, _, _, has_master, step), bucket_lists in buckets.items():
        tensor_lists = bucket_lists if has_master else bucket_lists[:5]
        schema.check_lists(schema.OPS["fused_ema_adamw"], tensor_lists)
        calls.append((device, step, tensor_lists))
    for device, step, tensor_lists in calls:
        multi_tensor_fused_ema_adamw(
            chunk_size, _noop_flag(device), tensor_lists, lr, ema_decay, beta1, beta2, eps, step,
            1 if adam_w_mode else 0, bias_correction, weight_decay,
            grad_scale=None if grad_scale is None else grad_scale.to(device), maximize=maximize)
    for t in state_steps:
        t.add_(1)
