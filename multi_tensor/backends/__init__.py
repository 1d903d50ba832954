"""Backend dispatch for the multi-tensor ops.

Importing this package registers the reference backend (any device) and, when its extension
loads, the native CPU backend. See :mod:`multi_tensor.backends.registry`.
"""
from . import reference  # noqa: F401  (registers the reference backend)
from .registry import (Backend, PreparedOp, backend_for, forced_backend,  # noqa: F401
                       register_backend, registered_backends)

try:  # the native CPU kernels are optional: without them every op runs on the reference
    from . import native_cpu  # noqa: F401
except ImportError:  # pragma: no cover - only while native_cpu.py itself is absent
    native_cpu = None
