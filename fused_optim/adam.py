"""FusedAdam (apex's signature) and FusedAdamW (torch.optim.AdamW's): Adam on the engine's "adam" op.

No EMA is kept, so neither the memory nor the traffic of one: one multi-tensor call per
(device, dtype) bucket reads grad, p, m, v (and the fp32 master) once and writes them once.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

from multi_tensor import multi_tensor_applier

from .adam_state import AdamStateMixin
from .base import FusedOptimizerBase

_UPDATE_DOC = r"""
    Per element, in fp32 (fp64 for fp64 params), t = the param's step::

        g  = grad                  (unscaled by GradScaler's scale inside the op; -grad if maximize)
        g  = g + weight_decay * p                                  Adam (L2) mode only
        m  = beta1 * m + (1 - beta1) * g
        v  = beta2 * v + (1 - beta2) * g^2
        p  = p - lr * ( (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p )
                  # the weight_decay * p term (old p) in AdamW (decoupled) mode only
        bc1 = 1 - beta1^t, bc2 = 1 - beta2^t    (1 and 1 without bias correction)

    The exact operation order is :mod:`multi_tensor.rules`'. This is torch's Adam/AdamW up to
    rounding: torch applies AdamW's decay as ``p *= 1 - lr * wd`` before the update, updates m
    with ``lerp`` and forms ``m / bc1 / (sqrt(v) / sqrt(bc2) + eps)``.
"""


class FusedAdam(AdamStateMixin, FusedOptimizerBase):
    __doc__ = r"""apex's ``FusedAdam``: Adam or AdamW, fused, with optional fp32 master weights.

    Args:
        params: iterable of params or dicts defining param groups (float or complex).
        lr: learning rate. bias_correction: divide the moments by ``1 - beta^t``.
        betas: ``(beta1, beta2)``. eps: added to the denominator.
        adam_w_mode: ``True`` (apex's default): decoupled weight decay (AdamW); ``False``: L2
            decay added to the gradient (Adam).
        weight_decay: the decay (default 0).
        amsgrad: not supported: ``True`` raises ``NotImplementedError`` (apex: RuntimeError).
        set_grad_none: what ``zero_grad()`` does by default: set grads to None (``True``) or
            to zero.
        master_weights: fp16/bf16 params keep an fp32 ``master_param``, moments are fp32 and
            the param receives the master rounded once per step. ``False`` (apex's default):
            state in the param's dtype, math in fp32.
            ``"remainder"`` (bf16 params only): the same fp32 masters, bit for bit, held
            in half the memory as int16 ``param_remainder`` state beside the params (the param is
            the master rounded to nearest, ties away from zero; see the README).
        maximize: maximize the objective.
        differentiable: not supported: ``True`` raises ``NotImplementedError``.
        capturable: ``True``: sync-free, CUDA-graph-capturable steps (as ``FusedEmaAdamW``'s).
        foreach, fused: accepted for compatibility with ``torch.optim.Adam`` (torch's argument
            errors are raised, e.g. both True); the update is always one fused call per bucket.
        fused_unscale, max_grad_norm, chunk_size: the options every fused optimizer takes (the
            unscale in the kernel, global-norm clipping folded into it, the unit of parallel
            work); see :class:`fused_optim.base.FusedOptimizerBase`.

    State per param (torch's names): ``step`` (float32 scalar tensor), ``exp_avg``,
    ``exp_avg_sq`` and, for fp16/bf16 params with master weights, ``master_param``.
    """ + _UPDATE_DOC

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, *, master_weights: Union[bool, str] = False,
                 maximize: bool = False, capturable: bool = False,
                 foreach: Optional[bool] = None, fused: Optional[bool] = None,
                 differentiable: bool = False,
                 fused_unscale: bool = True, max_grad_norm: Optional[float] = None,
                 chunk_size: int = multi_tensor_applier.chunk_size):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                        master_weights=master_weights, maximize=maximize, capturable=capturable)
        # every option checked once, with the torch flags that are not kept in the groups
        self._check_group(dict(defaults, amsgrad=amsgrad, foreach=foreach, fused=fused,
                               differentiable=differentiable))
        self.set_grad_none = bool(set_grad_none)
        super().__init__(params, defaults, chunk_size=chunk_size, fused_unscale=fused_unscale,
                         max_grad_norm=max_grad_norm)

    _instance_attrs = ("set_grad_none",)  # carried by deepcopy/pickle (FusedOptimizerBase)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Clear grads: to None if ``set_to_none`` (default: the ``set_grad_none`` option)."""
        if set_to_none is None:
            set_to_none = getattr(self, "set_grad_none", True)
        super().zero_grad(set_to_none=set_to_none)



class FusedAdamW(AdamStateMixin, FusedOptimizerBase):
    __doc__ = r"""``torch.optim.AdamW``, fused: same signature, defaults, state and param groups.

    Args:
        params, lr, betas, eps, weight_decay (default 1e-2), maximize: as ``torch.optim.AdamW``.
        amsgrad, differentiable: accepted for compatibility; ``True`` raises
            ``NotImplementedError``.
        capturable: ``True``: sync-free, CUDA-graph-capturable steps (as ``FusedEmaAdamW``'s).
        foreach, fused: accepted and ignored (the update is always one fused call per bucket).
        master_weights: fp16/bf16 params keep an fp32 ``master_param`` (default ``True``);
            ``False``: state in the param's dtype, as torch keeps it.
            ``"remainder"`` (bf16 params only): the same fp32 masters, bit for bit, held
            in half the memory as int16 ``param_remainder`` state beside the params (the param is
            the master rounded to nearest, ties away from zero; see the README).
        fused_unscale, max_grad_norm, chunk_size: the options every fused optimizer takes (the
            unscale in the kernel, global-norm clipping folded into it, the unit of parallel
            work); see :class:`fused_optim.base.FusedOptimizerBase`.

    State per param: ``step``, ``exp_avg``, ``exp_avg_sq`` (as torch) and ``master_param`` for
    fp16/bf16 params with master weights. Param groups hold torch's keys (``amsgrad``,
    ``foreach``, ``fused``, ``decoupled_weight_decay`` = True, ...) plus ``master_weights``.
    """ + _UPDATE_DOC

    _decoupled_key = "decoupled_weight_decay"  # always True (torch.optim.AdamW)

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, master_weights: Union[bool, str] = True,
                 fused_unscale: bool = True, max_grad_norm: Optional[float] = None,
                 chunk_size: int = multi_tensor_applier.chunk_size):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused, decoupled_weight_decay=True,
                        master_weights=master_weights)
        self._check_group(defaults)
        super().__init__(params, defaults, chunk_size=chunk_size, fused_unscale=fused_unscale,
                         max_grad_norm=max_grad_norm)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # as torch.optim.AdamW: always decoupled
            group["decoupled_weight_decay"] = True

