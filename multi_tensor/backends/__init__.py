"""Backend dispatch for the multi-tensor ops.

Importing this package registers the reference backend (any device) and, when its extension
loads, the native CPU backend. What a backend and its buckets offer: :mod:`.contract`; how an op
finds its backend: :mod:`.registry`.
"""
from . import reference  # noqa: F401  (registers the reference backend)
from . import npu  # noqa: F401  (Ascend NPU, device type "npu"; torch_npu imported only on use)
from . import triton  # noqa: F401  (registers the CUDA Triton backend; imports triton lazily)
from .contract import Backend, Bucket  # noqa: F401
from .registry import (PreparedOp, backend_for, forced_backend,  # noqa: F401
                       register_backend, registered_backends, unregister_backend)

try:  # the native CPU kernels are optional: without them every op runs on the reference
    from . import cpu  # noqa: F401
except ImportError:  # pragma: no cover - only while cpu/ itself is absent
    cpu = None
