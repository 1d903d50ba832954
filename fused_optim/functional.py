"""Functional API: the per-tensor NPU operator contract and a list-based fused EMA-AdamW."""
from __future__ import annotations

from typing import List, Optional

import torch

from multi_tensor import (multi_tensor_applier, multi_tensor_fused_ema_adamw, plan, rules, schema,
                          validation)

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
        multi_tensor_applier.chunk_size, plan.noop_flag(var.device), [[grad], [var], [m], [v], [s]],
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
    op = "fused_ema_adamw"
    n = len(params)
    if masters is None:
        masters = [None] * n
    for name, values in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                         ("emas", emas), ("state_steps", state_steps), ("masters", masters)):
        if not isinstance(values, (list, tuple)):
            raise TypeError(f"{op}: {name} must be a list, got {type(values).__name__}")
        if len(values) != n:
            raise ValueError(f"{op}: {name} has {len(values)} entries but params has {n}")
    for i, t in enumerate(state_steps):
        if not isinstance(t, torch.Tensor) or t.numel() != 1:
            raise TypeError(f"{op}: state_steps[{i}] must be a 1-element tensor")
    if not n:
        return
    if found_inf is not None and bool(found_inf.item() != 0):
        return
    # every step count in one host read (a stack, then one transfer), not one per param
    counts = torch.stack([t.detach().reshape(()).to(device="cpu", dtype=torch.float64)
                          for t in state_steps]).tolist()
    steps = [validation.check_step(op, int(c) + 1 if float(c).is_integer() else c + 1)
             for c in counts]
    spec = schema.OPS[op]
    hyper = rules.AdamHyper(
        lr=validation.real(op, "lr", lr), beta1=validation.real(op, "beta1", beta1),
        beta2=validation.real(op, "beta2", beta2), eps=validation.real(op, "eps", eps),
        weight_decay=validation.real(op, "weight_decay", weight_decay),
        decoupled=bool(adam_w_mode), bias_correction=bool(bias_correction),
        maximize=bool(maximize), ema_decay=validation.real(op, "ema_decay", ema_decay))
    validation.check_hyperparameters(op, lr=lr, eps=eps, beta1=beta1, beta2=beta2,
                                     ema_decay=ema_decay, weight_decay=weight_decay)
    everything = schema.AdamLists(grads=list(grads), params=list(params), exp_avgs=list(exp_avgs),
                                  exp_avg_sqs=list(exp_avg_sqs), emas=list(emas),
                                  masters=list(masters))
    calls = []
    split = plan.split_buckets(params, grads, [mt is not None for mt in masters], steps=steps)
    for (device, _, _, has_master, step, _), rows in split.items():
        lists = everything.take(rows)
        if not has_master:
            lists = lists.replace(masters=None)
        schema.check_adam_lists(spec, lists)  # every bucket checked before any runs
        calls.append((device, step, lists))
    for device, step, lists in calls:
        plan.run_adam(spec, lists, hyper, step, plan.noop_flag(device),
                      None if grad_scale is None else grad_scale.to(device),
                      chunk_size=chunk_size, checked=True)
    torch._foreach_add_(list(state_steps), 1)
