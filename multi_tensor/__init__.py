"""multi_tensor: apex-style multi-tensor apply engine.

Buckets of tensors (one device, one dtype per list) are cut into chunks and one native call per
bucket updates all of them. Ops resolve their implementation from the bucket's device type.
"""
from .applier import MultiTensorApply, multi_tensor_applier
from .backends import backend_for, forced_backend, register_backend, registered_backends
from .ops import (multi_tensor_adam, multi_tensor_fused_ema_adamw, multi_tensor_l2norm,
                  multi_tensor_radam, multi_tensor_radam_ema, multi_tensor_scale)
from .rules import AdamHyper, StepScalars, step_scalars
from .schema import AdamLists

__all__ = [
    "MultiTensorApply", "multi_tensor_applier", "multi_tensor_fused_ema_adamw",
    "multi_tensor_adam", "multi_tensor_radam", "multi_tensor_radam_ema", "multi_tensor_scale",
    "multi_tensor_l2norm", "AdamHyper", "StepScalars", "step_scalars", "AdamLists",
    "backend_for", "forced_backend", "register_backend", "registered_backends",
]
