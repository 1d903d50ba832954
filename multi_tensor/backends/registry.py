"""Backend registry: which implementation runs an op on a given device.

A :class:`~multi_tensor.backends.contract.Backend` names the device types it serves, a priority,
and the ops it implements (names from :data:`multi_tensor.schema.OPS`). ``backend_for(op,
device)`` returns the highest-priority backend that implements ``op`` for ``device.type``. The
pure-PyTorch reference backend serves every device type (``"*"``) at the lowest priority, so an
op always resolves. Optimizers never name a backend: a new one (say CUDA) is one module that
registers itself. What a backend and its buckets offer (*prepare, bind, run* and the rest) is
written out in :mod:`multi_tensor.backends.contract`.

Every backend receives input already checked against the op table (:mod:`multi_tensor.schema`)
and trusts it. Tensors without real storage (DTensor, meta, fake) go only to backends that
declare ``tensor_subclasses=True`` (the reference does: it runs plain torch ops, which dispatch
through such tensors); for the others the front end raises ``TypeError``.

``MULTI_TENSOR_BACKEND=<name>`` in the environment, or :func:`forced_backend`, restricts
resolution to one backend (ops it does not implement still resolve to ``reference``).
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Dict, Iterator, List, Optional

import torch

from .. import tensor_facts
from ..schema import grad_dtypes
from .contract import ANY_DEVICE, Backend, Bucket  # noqa: F401  (Backend: registered here)


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


def unregister_backend(name: str) -> None:
    """Remove a backend by name (no error if it is not registered)."""
    with _lock:
        _backends[:] = [b for b in _backends if b.name != name]
        _resolve_cache.clear()


def registered_backends() -> List[Backend]:
    return list(_backends)


def _device_type(device) -> str:
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str) and ":" not in device:
        return device  # e.g. "npu" before torch knows that name
    return torch.device(device).type


def backend_for(op: str, device, *, tensor_subclasses: bool = False) -> Backend:
    """The backend that runs ``op`` on ``device`` (a torch.device or device string).

    ``tensor_subclasses``: the tensors have no real storage; only backends that declare they
    run such tensors qualify.
    """
    device_type = _device_type(device)
    forced = _forced[0]
    key = (op, device_type, forced, tensor_subclasses)
    backend = _resolve_cache.get(key)
    if backend is not None:
        return backend
    candidates = [b for b in _backends if op in b.ops and b.handles(device_type)]
    if forced is not None:  # only the forced backend; the reference for ops it lacks
        chosen = [b for b in candidates if b.name == forced]
        candidates = chosen or [b for b in candidates if b.name == "reference"]
    for candidate in candidates:
        if tensor_subclasses and not candidate.tensor_subclasses:
            continue
        backend = candidate
        break
    if backend is None:
        raise NotImplementedError(
            f"no multi-tensor backend implements op '{op}' for device type '{device_type}'"
            + (" with tensors without real storage" if tensor_subclasses else ""))
    _resolve_cache[key] = backend
    return backend


class GradsCheck:
    """The per-step grad check of the Python buckets: one grad per row, one dtype from
    ``allowed``, each of its row's shape, strided, on ``device``. False means "plan again":
    the optimizer's full check then names what is wrong.

    One native pass over the grads (:func:`multi_tensor.tensor_facts.describe`) compared with
    the shapes packed once; grads without addresses (DTensor, fake tensors: the reference runs
    them) are checked one by one."""

    __slots__ = ("shapes", "device", "allowed", "_packed")

    def __init__(self, shapes, device, allowed):
        self.shapes = list(shapes)
        self.device = device
        self.allowed = allowed
        self._packed = tensor_facts.pack_shapes(self.shapes)

    def fits(self, grads) -> bool:
        if len(grads) != len(self.shapes):
            return False
        if not grads:
            return True
        facts = tensor_facts.describe(grads)
        if facts is not None:
            return (facts.dtype in self.allowed and facts.device == self.device
                    and facts.shapes == self._packed)
        dtype = grads[0].dtype if grads[0] is not None else None
        if dtype not in self.allowed:
            return False
        for g, shape in zip(grads, self.shapes):
            if (g is None or g.dtype != dtype or g.shape != shape or g.device != self.device
                    or g.layout != torch.strided):
                return False
        return True

    def same_shapes(self, tensors) -> bool:
        """Whether ``tensors`` (a state list) still have the rows' shapes (``p.data = x`` may
        reshape a param in place)."""
        facts = tensor_facts.describe(tensors)
        if facts is not None:
            return facts.shapes == self._packed
        return len(tensors) == len(self.shapes) and all(
            t.shape == shape for t, shape in zip(tensors, self.shapes))


class PreparedOp(Bucket):
    """An Adam-family bucket of a backend whose kernel takes whole lists per call (the reference).

    ``bind(grads)`` is the cheap per-step check (same count, one allowed dtype, dense, the
    params' shapes and device, and every state tensor still of its param's shape: ``p.data = x``
    may reshape a param in place); ``run`` calls the op with the bound grads prepended.
    """

    def __init__(self, impl: Callable, lists, chunk_size: int):
        self.impl = impl
        self.lists = lists.state()
        self.chunk_size = chunk_size
        params = lists.params
        self._check = GradsCheck([p.shape for p in params], params[0].device if params else None,
                                 grad_dtypes(params[0].dtype if params else None))
        self._grads = None

    def bind(self, grads) -> bool:
        self._grads = None
        if not self._check.fits(grads):
            return False
        if not all(self._check.same_shapes(tensors) for _, tensors in self.lists.present()):
            return False
        self._grads = list(grads)
        return True

    def run(self, noop_flag, scalars, grad_scale=None, check_finite=False) -> None:
        grads, self._grads = self._grads, None
        self.impl(self.chunk_size, noop_flag, self.lists.with_grads(grads), scalars, grad_scale,
                  check_finite)


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
