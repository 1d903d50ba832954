"""FusedRAdam: torch.optim.RAdam on the engine's "radam" op, with an optional fused EMA."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from multi_tensor import multi_tensor_applier, rules

from .adam_state import AdamStateMixin
from .base import FusedOptimizerBase
from .ema import EmaAccessMixin


class FusedRAdam(EmaAccessMixin, AdamStateMixin, FusedOptimizerBase):
    r"""``torch.optim.RAdam``, fused, optionally with an EMA of the weights in the same pass.

    Per element, in fp32 (fp64 for fp64 params), t = the param's step (torch's formula; the exact
    operation order, shared with Adam, is :mod:`multi_tensor.rules`')::

        g   = grad                 (unscaled by GradScaler's scale inside the op; -grad if maximize)
        p   = p - (lr * weight_decay) * p         decoupled_weight_decay
        g   = g + weight_decay * p                otherwise (L2)
        m   = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g^2
        rho_inf = 2 / (1 - beta2) - 1;   rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t)
        rho_t > 5:  rect = sqrt((rho_t-4)(rho_t-2) rho_inf / ((rho_inf-4)(rho_inf-2) rho_t))
                    p = p - lr * m / (1 - beta1^t) * sqrt(1 - beta2^t) / (sqrt(v) + eps) * rect
        otherwise:  p = p - lr * m / (1 - beta1^t)
        ema = ema + (1 - ema_decay) * (p - ema)               only with an ema_decay (new p)

    Args:
        params, lr, betas, eps, weight_decay, decoupled_weight_decay, maximize: as
            ``torch.optim.RAdam`` (same defaults).
        ema_decay: ``None`` (default): no EMA state. A float in ``[0, 1)``: ``state["ema"]`` is
            kept (initialised to the weights) and updated in the same op, and the EMA access API
            (``swap_ema_weights``, ``copy_ema_to``, ``ema_state_dict``, EMA schedules) applies.
            Per param group: groups may differ.
        ema_dtype: the EMA's storage: ``torch.float32`` (default; ``None`` is the same) keeps it
            in the state dtype (fp32 with masters or fp32 params, else the param's dtype);
            ``torch.bfloat16`` keeps it in bf16 for fp16/bf16/fp32 params, updated in fp32 and
            rounded once to nearest even per step (see ``FusedEmaAdamW``'s ``ema_dtype``).
        master_weights: fp16/bf16 params keep an fp32 ``master_param``; moments and EMA are fp32
            and the param receives the master rounded once per step. ``False``: state in the
            param's dtype.
            ``"remainder"`` (bf16 params only): the same fp32 masters, bit for bit, held
            in half the memory as int16 ``param_remainder`` state beside the params (the param is
            the master rounded to nearest, ties away from zero; see the README).
        foreach: accepted and ignored. differentiable: ``True`` raises ``NotImplementedError``.
        capturable: ``True``: sync-free, CUDA-graph-capturable steps (as ``FusedEmaAdamW``'s).
        fused_unscale, max_grad_norm, chunk_size: the options every fused optimizer takes (the
            unscale in the kernel, global-norm clipping folded into it, the unit of parallel
            work); see :class:`fused_optim.base.FusedOptimizerBase`.

    State per param: ``step`` (float32 scalar tensor), ``exp_avg``, ``exp_avg_sq`` (as torch),
    ``ema`` with an ``ema_decay``, ``master_param`` for fp16/bf16 params with master weights.
    """

    _rule = rules.RADAM
    _decoupled_key = "decoupled_weight_decay"

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, decoupled_weight_decay: bool = False,
                 *, ema_decay: Optional[float] = None,
                 ema_dtype: Optional[torch.dtype] = torch.float32, master_weights: Union[bool, str] = True,
                 maximize: bool = False, foreach: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False,
                 fused_unscale: bool = True, max_grad_norm: Optional[float] = None,
                 chunk_size: int = multi_tensor_applier.chunk_size):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay, ema_decay=ema_decay,
                        ema_dtype=ema_dtype,
                        master_weights=master_weights, maximize=maximize, foreach=foreach,
                        capturable=capturable, differentiable=differentiable)
        self._check_group(defaults)
        super().__init__(params, defaults, chunk_size=chunk_size, fused_unscale=fused_unscale,
                         max_grad_norm=max_grad_norm)
