"""What a bind needs to know of a list of tensors, in one pass at C speed.

The device backends' host side checks at every step that the tensors it bound are the ones it
is given and still where it bound them (a ``data_ptr`` per tensor), and, when the grads are new
objects (every step after ``zero_grad(set_to_none=True)``), their dtype, device, layout and
shape. In Python each of those costs 0.1-0.4 µs per tensor and attribute, milliseconds per step
for thousands of tensors; the native extension (``csrc/cpu/tensor_facts.cpp``) does the pass in a
few ns per tensor; the cpu backend hands it over when it loads (:func:`use_native`). Without the
extension the pure-Python twins below give the same results.

* :func:`addresses`: each tensor's ``data_ptr`` as native int64 bytes (equal bytes: the same
  addresses), or None when an item is not a strided tensor with an address (a nonempty tensor
  at address 0, as meta tensors and wrapper subclasses like DTensor report, has none);
* :func:`describe`: :class:`Facts` (addresses, shapes, the one dtype and device or None,
  per-item contiguity), or None likewise;
* :func:`versions`: each tensor's version counter as native int64 bytes, or None;
* :func:`same_objects`: whether two lists hold the very same objects (identity).
"""
from __future__ import annotations

import operator
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch


class Facts(NamedTuple):
    addresses: bytes  # native int64 per item: its data_ptr
    shapes: bytes  # native int64 per item: ndim, then the sizes
    dtype: Optional[torch.dtype]  # the items' one dtype, or None when they differ
    device: Optional[torch.device]  # the items' one device, or None when they differ
    contiguous: bytes  # 1 per contiguous item, else 0


def _address(t) -> Optional[int]:
    """``t.data_ptr()``, or None: not a strided tensor, no storage (a traced or wrapper tensor:
    data_ptr raises), or a null address for a nonempty tensor (meta tensors, and wrapper
    subclasses such as DTensor and FakeTensor, whose storage holds no data)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return None
    try:
        address = t.data_ptr()
    except (RuntimeError, TypeError):
        return None
    return None if address == 0 and t.numel() else address


def py_addresses(tensors: Sequence) -> Optional[bytes]:
    """:func:`addresses` in Python (for builds without the extension, and to test it)."""
    tensors = tensors if isinstance(tensors, (list, tuple)) else list(tensors)
    ptrs = list(map(_address, tensors))
    if None in ptrs:
        return None
    return np.asarray(ptrs, dtype=np.int64).tobytes()


def py_describe(tensors: Sequence) -> Optional[Facts]:
    """:func:`describe` in Python (for builds without the extension, and to test it)."""
    tensors = tensors if isinstance(tensors, (list, tuple)) else list(tensors)
    ptrs = py_addresses(tensors)
    if ptrs is None:
        return None
    shapes = []
    for t in tensors:
        try:
            sizes = [int(s) for s in t.shape]
        except (RuntimeError, TypeError):  # symbolic sizes
            return None
        shapes += [len(sizes)] + sizes
    dtypes = {t.dtype for t in tensors}
    devices = {t.device for t in tensors}
    return Facts(ptrs, np.asarray(shapes, dtype=np.int64).tobytes(),
                 dtypes.pop() if len(dtypes) == 1 else None,
                 devices.pop() if len(devices) == 1 else None,
                 bytes(int(t.is_contiguous()) for t in tensors))


def py_versions(tensors: Sequence) -> Optional[bytes]:
    """:func:`versions` in Python (for builds without the extension, and to test it)."""
    tensors = tensors if isinstance(tensors, (list, tuple)) else list(tensors)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    try:
        return np.asarray([t._version for t in tensors], dtype=np.int64).tobytes()
    except RuntimeError:  # inference tensors keep no version counter
        return None


def pack_shapes(shapes: Sequence) -> bytes:
    """Shapes packed as :attr:`Facts.shapes` packs a list's (to compare with it)."""
    return np.asarray([v for s in shapes for v in (len(s), *s)], dtype=np.int64).tobytes()


_NATIVE = None  # the extension module with these functions, or None (the Python twins)


def use_native(mod) -> None:
    """Run these functions on ``mod``, the native extension (the cpu backend calls this when
    its extension loads; this module never imports a backend), or on the Python twins (None,
    or a build without them)."""
    global _NATIVE
    _NATIVE = mod if mod is not None and hasattr(mod, "same_objects") else None


def _mod():
    """The extension module these functions run on, or None (the Python twins)."""
    return _NATIVE


def addresses(tensors: Sequence) -> Optional[bytes]:
    """Each tensor's ``data_ptr`` as native int64 bytes, or None when an item has none."""
    mod = _mod()
    if mod is None:
        return py_addresses(tensors)
    return mod.addresses(tensors if isinstance(tensors, (list, tuple)) else list(tensors))


def describe(tensors: Sequence) -> Optional[Facts]:
    """The :class:`Facts` of a list of strided tensors with addresses, or None."""
    mod = _mod()
    if mod is None:
        return py_describe(tensors)
    out = mod.describe(tensors if isinstance(tensors, (list, tuple)) else list(tensors))
    return None if out is None else Facts(*out)


def versions(tensors: Sequence) -> Optional[bytes]:
    """Each tensor's version counter as native int64 bytes (a write in place bumps it), or None
    when an item is not a tensor or keeps no counter (an inference tensor)."""
    mod = _mod()
    if mod is None:
        return py_versions(tensors)
    return mod.versions(tensors if isinstance(tensors, (list, tuple)) else list(tensors))


def same_objects(a: Sequence, b: Sequence) -> bool:
    """Whether ``a`` and ``b`` hold the very same objects in order (identity, never ``==``)."""
    mod = _mod()
    if mod is None or not isinstance(a, (list, tuple)) or not isinstance(b, (list, tuple)):
        return py_same_objects(a, b)
    return mod.same_objects(a, b)


def py_same_objects(a: Sequence, b: Sequence) -> bool:
    """:func:`same_objects` in Python."""
    a, b = list(a), list(b)
    return len(a) == len(b) and all(map(operator.is_, a, b))


def as_array(packed: bytes) -> np.ndarray:
    """Packed int64s (:attr:`Facts.addresses`) as a read-only numpy array, without a copy."""
    return np.frombuffer(packed, dtype=np.int64)
