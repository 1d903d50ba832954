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
* :func:`same_objects`: whether two lists hold the very same objects (identity);
* :func:`addresses_match`: ``addresses(tensors) == packed``, stopping at the first difference;
* :func:`grads_of`: the params' ``.grad``, or the previous list itself when it holds exactly
  those grads (a steady-state step then makes no Python object per param).
"""
from __future__ import annotations

import itertools
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


_ptr = torch.Tensor.data_ptr


def py_addresses(tensors: Sequence) -> Optional[bytes]:
    """:func:`addresses` in Python (for builds without the extension, and to test it)."""
    tensors = tensors if isinstance(tensors, (list, tuple)) else list(tensors)
    try:  # the common case without a Python call per tensor: every address nonzero (a tensor
        # without storage, sparse ones included, raises; an empty one may be at 0: the full pass)
        fast = np.fromiter(map(_ptr, tensors), dtype=np.int64, count=len(tensors))
    except (RuntimeError, TypeError, ValueError):
        fast = None
    if fast is not None and fast.all():
        return fast.tobytes()
    ptrs = list(map(_address, tensors))
    if None in ptrs:
        return None
    return np.asarray(ptrs, dtype=np.int64).tobytes()


def py_describe(tensors: Sequence) -> Optional[Facts]:
    """:func:`describe` in Python (for builds without the extension, and to test it), without
    a Python step per tensor (``map`` and numpy iterate)."""
    tensors = tensors if isinstance(tensors, (list, tuple)) else list(tensors)
    ptrs = py_addresses(tensors)
    if ptrs is None:
        return None
    try:
        shapes = list(map(_shape, tensors))
        lens = np.fromiter(map(len, shapes), dtype=np.int64, count=len(shapes))
        sizes = np.fromiter(itertools.chain.from_iterable(shapes), dtype=np.int64)
    except (RuntimeError, TypeError, ValueError):  # symbolic sizes
        return None
    # each tensor's ndim, then its sizes
    packed = np.empty(len(lens) + len(sizes), dtype=np.int64)
    at = np.cumsum(lens + 1) - (lens + 1)
    is_len = np.zeros(len(packed), dtype=bool)
    is_len[at] = True
    packed[at] = lens
    packed[~is_len] = sizes
    dtypes = set(map(_dtype, tensors))
    devices = set(map(_device, tensors))
    return Facts(ptrs, packed.tobytes(),
                 dtypes.pop() if len(dtypes) == 1 else None,
                 devices.pop() if len(devices) == 1 else None,
                 bytes(map(int, map(_is_contiguous, tensors))))


_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")
_is_contiguous = operator.methodcaller("is_contiguous")


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


def native_module():
    """The extension module these functions run in, or None (the Python twins run)."""
    return _mod()


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
    mod = _NATIVE
    if mod is None or not isinstance(a, (list, tuple)) or not isinstance(b, (list, tuple)):
        return py_same_objects(a, b)
    return mod.same_objects(a, b)


def py_same_objects(a: Sequence, b: Sequence) -> bool:
    """:func:`same_objects` in Python."""
    if a is b:
        return True
    a, b = list(a), list(b)
    return len(a) == len(b) and all(map(operator.is_, a, b))


def addresses_match(tensors: Sequence, packed: bytes) -> bool:
    """Whether ``addresses(tensors) == packed`` (every tensor still at the address recorded)."""
    mod = _mod()
    if mod is None or not hasattr(mod, "addresses_match") or not isinstance(tensors, (list, tuple)):
        return addresses(tensors) == packed
    return mod.addresses_match(tensors, packed)


def grads_of(params: Sequence, last: Optional[list] = None) -> list:
    """``[p.grad for p in params]``, or ``last`` itself (the same list object) when it holds
    exactly those grads (the same tensor objects, None where a param has none): a step whose
    grads were accumulated in place, or reassigned to the same tensors, then builds nothing and
    its binds recognise the list by identity."""
    mod = _NATIVE
    if mod is not None and hasattr(mod, "grads_of") and isinstance(params, list):
        out = mod.grads_of(params, last)
        if out is not None:
            return out
    return py_grads_of(params, last)


_grad = operator.attrgetter("grad")


def py_grads_of(params: Sequence, last: Optional[list] = None) -> list:
    """:func:`grads_of` in Python."""
    grads = list(map(_grad, params))
    if last is not None and len(last) == len(grads) and all(map(operator.is_, grads, last)):
        return last
    return grads


def as_array(packed: bytes) -> np.ndarray:
    """Packed int64s (:attr:`Facts.addresses`) as a read-only numpy array, without a copy."""
    return np.frombuffer(packed, dtype=np.int64)
