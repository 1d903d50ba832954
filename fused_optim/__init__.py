"""fused_optim: fused multi-tensor optimizers on the :mod:`multi_tensor` engine."""
from .base import FusedOptimizerBase
from .ema_adamw import FusedEmaAdamW
from .functional import fused_ema_adamw, npu_apply_fused_ema_adamw

__all__ = ["FusedOptimizerBase", "FusedEmaAdamW", "fused_ema_adamw", "npu_apply_fused_ema_adamw"]
