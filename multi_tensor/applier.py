"""apex's ``MultiTensorApply``: binds a chunk size to multi-tensor op calls."""
from __future__ import annotations


class MultiTensorApply:
    """``applier(op, noop_flag, tensor_lists, *args)`` calls ``op(chunk_size, noop_flag, tensor_lists, *args)``.

    ``chunk_size`` is the number of elements one unit of parallel work covers. It changes how
    work is split across threads, never a result.
    """

    available = True
    warned = False

    def __init__(self, chunk_size: int):
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        self.chunk_size = chunk_size

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args, **kwargs):
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args, **kwargs)

    def __repr__(self) -> str:
        return f"MultiTensorApply(chunk_size={self.chunk_size})"


multi_tensor_applier = MultiTensorApply(2048 * 32)
