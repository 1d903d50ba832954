"""FusedEmaAdamW: AdamW and an EMA of the weights in one pass over memory."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from multi_tensor import multi_tensor_applier

from . import ema_schedules
from .adam_state import AdamStateMixin
from .base import FusedOptimizerBase
from .ema import EmaAccessMixin


class FusedEmaAdamW(EmaAccessMixin, AdamStateMixin, FusedOptimizerBase):
    r"""AdamW (or Adam) with an exponential moving average of the weights, fused.

    For every param with a grad, per element, in fp32 (the seed operator's formula)::

        bc1 = 1 - beta1^t,  bc2 = 1 - beta2^t             (1 and 1 if not bias_correction)
        g   = grad                          (-grad if maximize; unscaled by GradScaler's scale)
        g   = g + weight_decay * p                         if not adam_w_mode (Adam, L2)
        m   = beta1 * m + (1 - beta1) * g
        v   = beta2 * v + (1 - beta2) * g^2
        p   = p - lr * ( (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p )   # decay term
                                                           only in adam_w_mode (decoupled)
        ema = ema + (1 - ema_decay) * (p - ema)          (= ema_decay * ema + (1 - ema_decay) * p)

    The operation order every backend follows, bit for bit, is :mod:`multi_tensor.rules`'. All
    of it is one multi-tensor engine call per (device, dtype) bucket per step, reading each
    of grad, p, m, v, ema once and writing p, m, v, ema once.

    Args:
        params: iterable of params or dicts defining param groups.
        lr: learning rate. betas: ``(beta1, beta2)``. eps: added to the denominator.
        weight_decay: decoupled decay in ``adam_w_mode``, L2 penalty otherwise (default 1e-2
            as ``torch.optim.AdamW``).
        ema_decay: EMA decay per step (the cap of the warm-up schedules).
        ema_schedule: ``None``/``"constant"`` (``ema_decay`` every step), ``"warmup"``
            (MindSpeed's ``use_num_updates``: ``min(ema_decay, (1 + n) / (10 + n))``),
            ``"diffusers"`` (diffusers' default ``EMAModel``: ``(1 + k) / (10 + k)``, k = n - 1,
            clamped to ``[ema_min_decay, ema_decay]``), ``"diffusers_warmup"``
            (``use_ema_warmup=True``: ``1 - (1 + k / ema_inv_gamma) ** -ema_power``, same clamp)
            or a callable ``n -> decay``. ``n`` is the param's step minus ``ema_start_step``;
            see :mod:`fused_optim.ema_schedules`.
        ema_start_step: up to this step the EMA tracks the params (decay 0: ``ema == param``).
        ema_inv_gamma, ema_power: the ``"diffusers_warmup"`` schedule's options; ema_min_decay:
            both diffusers schedules'.
        ema_update_every: update the EMA at steps ``1, 1 + k, 1 + 2k, ...`` only (ema-pytorch's
            ``update_every``); the steps in between run AdamW alone and move no EMA bytes.
            All ``ema_*`` options live in the param groups and are saved by ``state_dict()``.
        ema_dtype: the EMA's storage. ``torch.float32`` (default; ``None`` is the same): the
            state dtype, i.e. fp32 with master weights or fp32 params, else the param's dtype.
            ``torch.bfloat16``: ``state["ema"]`` is bf16 whatever the param dtype (fp32 params;
            fp16/bf16 params with or without masters; fp64 params are rejected), halving the
            EMA's memory and traffic. The update is unchanged and in fp32:
            ``s = float(s); s = s + (1 - ema_decay) * (p' - s)``, stored rounded once to bf16
            (round to nearest even); a new EMA is the weights rounded once to bf16. Caution: bf16
            keeps 8 significant bits, and an increment ``(1 - ema_decay) * (p' - s)`` below
            half a bf16 ulp of ``s`` (2**-9 to 2**-8 of ``|s|``) rounds away, so the EMA moves
            only where ``|p' - s| > 2**-9 |s| / (1 - ema_decay)``: about 20 ``|s|`` at 0.9999,
            2 ``|s|`` at 0.999, 0.2 ``|s|`` at 0.99. A bf16 EMA suits decays of about 0.99 and
            below; keep long-horizon EMAs in fp32.
            Per param group; saved in ``state_dict()``; a changed value converts the existing
            EMA (rounded once) at the next step.
        adam_w_mode: ``True``: AdamW (mode 1); ``False``: Adam with L2 decay (mode 0).
        bias_correction: divide the moments by ``1 - beta^t``.
        master_weights: fp16/bf16 params keep an fp32 ``master_param``; moments and EMA are fp32;
            the param is the master rounded once per step. ``False``: state in the param dtype.
            ``"remainder"`` (bf16 params only): the same fp32 masters, bit for bit, held
            in half the memory as int16 ``param_remainder`` state beside the params (the param is
            the master rounded to nearest, ties away from zero; see the README).
        maximize: maximize the objective instead of minimizing.
        amsgrad, differentiable: accepted for compatibility with ``torch.optim.AdamW``; ``True``
            raises ``NotImplementedError`` naming the feature.
        capturable: ``True``: every step runs without a host sync and can be captured in a CUDA
            graph (the step counters and per-step scalars live on the device; ``lr`` may be a
            device tensor, read by the kernel, so an LR schedule that updates it in place needs
            no re-capture). Needs the Triton backend (CUDA) or the NPU backend's CANN operator
            (``MULTI_TENSOR_NPU_OP=cann``; a float ``lr``; a step GradScaler or clipping may
            cancel then saves and restores the state on the device, docs/npu.md) and, with an
            EMA, a constant decay from step 1; otherwise the first step raises ``ValueError``
            naming the param.
        foreach, fused: accepted and ignored (always one fused call per bucket); torch's argument
            errors are raised (e.g. both True).
        fused_unscale, max_grad_norm, chunk_size: the options every fused optimizer takes (the
            unscale in the kernel, global-norm clipping folded into it, the unit of parallel
            work); see :class:`fused_optim.base.FusedOptimizerBase`.

    State per param: ``step`` (float32 scalar tensor), ``exp_avg``, ``exp_avg_sq``, ``ema`` (in
    ``ema_dtype``'s storage) and, for fp16/bf16 params with master weights, ``master_param``.
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, ema_decay: float = 0.9999, *,
                 adam_w_mode: bool = True, bias_correction: bool = True,
                 master_weights: Union[bool, str] = True, maximize: bool = False,
                 ema_schedule: ema_schedules.Schedule = None, ema_start_step: int = 0,
                 ema_inv_gamma: float = 1.0, ema_power: float = 2.0 / 3.0,
                 ema_min_decay: float = 0.0, ema_update_every: int = 1,
                 ema_dtype: Optional[torch.dtype] = torch.float32, amsgrad: bool = False,
                 foreach: Optional[bool] = None, fused: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False,
                 fused_unscale: bool = True, max_grad_norm: Optional[float] = None,
                 chunk_size: int = multi_tensor_applier.chunk_size):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        ema_decay=ema_decay, adam_w_mode=adam_w_mode,
                        bias_correction=bias_correction, master_weights=master_weights,
                        maximize=maximize, capturable=capturable, ema_schedule=ema_schedule,
                        ema_start_step=ema_start_step, ema_inv_gamma=ema_inv_gamma,
                        ema_power=ema_power, ema_min_decay=ema_min_decay,
                        ema_update_every=ema_update_every, ema_dtype=ema_dtype)
        # every option checked once, before anything is made; the torch flags that are not kept
        # in the groups (amsgrad, foreach, fused, differentiable) with them
        self._check_group(dict(defaults, amsgrad=amsgrad, foreach=foreach, fused=fused,
                               differentiable=differentiable))
        super().__init__(params, defaults, chunk_size=chunk_size, fused_unscale=fused_unscale,
                         max_grad_norm=max_grad_norm)

    # State, state lists, group checks (EMA schedule options included) and the op: AdamStateMixin,
    # shared with FusedAdam/FusedAdamW/FusedRAdam.
    _ema_required = True
