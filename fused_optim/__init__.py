"""fused_optim: fused multi-tensor optimizers on the :mod:`multi_tensor` engine."""
from .adam import FusedAdam, FusedAdamW
from .adam_state import AdamStateMixin
from .base import FusedOptimizerBase
from .ema_adamw import FusedEmaAdamW
from .functional import fused_ema_adamw, npu_apply_fused_ema_adamw
from .radam import FusedRAdam

__all__ = ["FusedOptimizerBase", "AdamStateMixin", "FusedEmaAdamW", "FusedAdam", "FusedAdamW",
           "FusedRAdam", "fused_ema_adamw", "npu_apply_fused_ema_adamw"]
