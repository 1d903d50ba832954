"""Backend registry: which implementation runs an op for a given device.

Every multi-tensor op (``fused_ema_adamw``, ``adam``, ``radam``, ``scale``, ``l2norm``) is a name.
A backend registers the op names it implements for one or more device types with a priority;
``resolve(op, device)`` returns the highest-priority implementation for ``device.type``. The
pure-PyTorch reference backend registers for every device type (``"*"``) at the lowest priority,
so an op always resolves. Optimizers never name a backend: a new one (CUDA, NPU) slots in by
registering, without touching them.

Backend implementations are plain callables with the apex calling convention
``impl(chunk_size, noop_flag, tensor_lists, *args, **kwargs)``. A backend may also provide a
``prepare(op, state_lists, chunk_size)`` factory returning a :class:`PreparedOp` that keeps the
state lists (params, m, v, ...) across steps so that a step only passes the grads.

``MULTI_TENSOR_BACKEND=<name>`` in the environment, or :func:`forced_backend`, restricts
resolution to one backend (falling back to ``reference`` for ops it does not implement).
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

import torch

ANY_DEVICE = "*"


@dataclass
class Backend:
    """A named set of op implementations for some device types."""

    name: str
    device_types: tuple
    priority: int
    ops: Dict[str, Callable] = field(default_factory=dict)
    prepare: Optional[Callable] = None  # prepare(op, state_lists, chunk_size) -> PreparedOp
    description: str = ""

    def handles(self, device_type: str) -> bool:
        return ANY_DEVICE in self.device_types or device_type in self.device_types


_lock = threading.Lock()
_backends: List[Backend] = []
_forced: List[Optional[str]] = [os.environ.get("MULTI_TENSOR_BACKEND") or None]
_resolve_cache: Dict[tuple, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Add (or replace, by name) a backend. Later resolutions see it at once."""
    with _lock:
        _backends[:] = [b for b in _backends if b.name != backend.name]
        _backends.append(backend)
        _backends.sort(key=lambda b: -b.priority)
        _resolve_cache.clear()
    return backend


def registered_backends() -> List[Backend]:
    return list(_backends)


def _device_type(device) -> str:
    if isinstance(device, torch.device):
        return device.type
    return torch.device(device).type


def backend_for(op: str, device) -> Backend:
    """The backend that runs ``op`` on ``device`` (a torch.device or device string)."""
    device_type = _device_type(device)
    key = (op, device_type, _forced[0])
    backend = _resolve_cache.get(key)
    if backend is not None:
        return backend
    forced = _forced[0]
    for candidate in _backends:
        if op not in candidate.ops or not candidate.handles(device_type):
            continue
        if forced is not None and candidate.name not in (forced, "reference"):
            continue
        backend = candidate
        break
    if backend is None:
        raise NotImplementedError(
            f"no multi-tensor backend implements op '{op}' for device type '{device_type}'"
        )
    _resolve_cache[key] = backend
    return backend


class PreparedOp:
    """An op bound to the state lists of one bucket; each call passes only the grads.

    The generic form, used for backends without a ``prepare`` factory, prepends the grads to
    the stored lists and calls the op. ``validate(grads)`` checks a call's grads without running
    it, so an optimizer can check every bucket before it modifies any. ``step_param_grads``
    calls with the grads of the params (the first state list), read at call time.
    """

    def __init__(self, op: str, impl: Callable, validator: Callable, state_lists, chunk_size: int):
        self.op = op
        self.impl = impl
        self.validator = validator
        self.state_lists = [list(tensors) for tensors in state_lists]
        self.chunk_size = chunk_size

    def validate(self, grads) -> None:
        self.validator([grads] + self.state_lists)

    def __call__(self, grads, noop_flag, *args, **kwargs):
        return self.impl(self.chunk_size, noop_flag, [grads] + self.state_lists, *args, **kwargs)

    def step_param_grads(self, noop_flag, *args, **kwargs) -> bool:
        """Call with the ``.grad`` of the params (the first state list); ``False``, running
        nothing, when any of them has no grad. Native backends do this without a Python list."""
        grads = [p.grad for p in self.state_lists[0]]
        if any(g is None for g in grads):
            return False
        self(grads, noop_flag, *args, **kwargs)
        return True


def prepare(op: str, state_lists, chunk_size: int, validator: Callable):
    """Bind ``op`` to a bucket's state lists on the backend that runs it for their device."""
    device = state_lists[0][0].device
    backend = backend_for(op, device)
    if backend.prepare is not None:
        return backend.prepare(op, state_lists, chunk_size)
    return PreparedOp(op, backend.ops[op], validator, state_lists, chunk_size)


def resolve(op: str, device) -> Callable:
    """The implementation of ``op`` for ``device``."""
    return backend_for(op, device).ops[op]


@contextlib.contextmanager
def forced_backend(name: Optional[str]) -> Iterator[None]:
    """Within the block, resolve only to backend ``name`` (``None``: no restriction).

    Ops that backend does not implement still resolve to the reference backend.
    """
    if name is not None and name not in {b.name for b in _backends}:
        raise ValueError(
            f"unknown multi-tensor backend '{name}'; registered: "
            f"{sorted(b.name for b in _backends)}"
        )
    with _lock:
        previous = _forced[0]
        _forced[0] = name
        _resolve_cache.clear()
    try:
        yield
    finally:
        with _lock:
            _forced[0] = previous
            _resolve_cache.clear()
