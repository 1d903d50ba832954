"""Input checks: tensors, lists and scalars.

Every check runs before any tensor is modified and raises an error that names the op, the tensor
(list name and index) and what is wrong with it. The op table (:mod:`multi_tensor.schema`) says
which lists an op takes; this module checks them. Backends never re-check: they trust what
passed here.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
GRAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def has_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain tensor whose data a kernel can address.

    False for meta tensors and for tensor subclasses that intercept dispatch (DTensor,
    FakeTensor, functional wrappers: the Python dispatch key): their ``data_ptr()`` is not the
    data (it is 0 for a DTensor).
    """
    if t.is_meta:
        return False
    return type(t) in _PLAIN or not torch._C._dispatch_keys(t).has(_PYTHON_KEY)


_PYTHON_KEY = torch._C.DispatchKey.Python
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def check_same_lengths(op: str, tensor_lists: Sequence[Sequence], names: Sequence[str]) -> int:
    lengths = [len(tensors) for tensors in tensor_lists]
    if len(set(lengths)) > 1:
        detail = ", ".join(f"{n}={l}" for n, l in zip(names, lengths))
        raise ValueError(f"{op}: tensor lists must have equal lengths, got {detail}")
    return lengths[0] if lengths else 0


def check_tensor(op: str, name: str, index: int, t, ref: Optional[torch.Tensor], ref_name: str):
    """One tensor: a dense float tensor with the shape and device of the row's reference."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name}[{index}] must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse or t.layout != torch.strided:
        raise RuntimeError(
            f"{op}: {name}[{index}] is a sparse tensor ({t.layout}); fused optimizers need dense "
            f"tensors (sparse gradients are not supported)"
        )
    if not t.is_floating_point() and not (name == "remainders" and t.dtype == torch.int16):
        raise TypeError(f"{op}: {name}[{index}] must be a floating-point tensor, got {t.dtype}"
                        + (" (remainders are int16)" if name == "remainders" else ""))
    if ref is not None and t is not ref:
        if t.shape != ref.shape:
            raise ValueError(
                f"{op}: {name}[{index}] has shape {tuple(t.shape)} but {ref_name}[{index}] has "
                f"shape {tuple(ref.shape)}"
            )
        if t.device != ref.device:
            raise RuntimeError(
                f"{op}: {name}[{index}] is on {t.device} but {ref_name}[{index}] is on {ref.device}"
            )


def check_list_dtype(op: str, name: str, tensors: Sequence[torch.Tensor], allowed) -> Optional[torch.dtype]:
    """All tensors of one list share one dtype, from ``allowed``."""
    if not tensors:
        return None
    dtype = tensors[0].dtype
    for i, t in enumerate(tensors):
        if t.dtype != dtype:
            raise TypeError(
                f"{op}: {name}[{i}] is {t.dtype} but {name}[0] is {dtype}; every tensor of one "
                f"list must share one dtype (bucket tensors by dtype first)"
            )
    if dtype not in allowed:
        raise TypeError(
            f"{op}: {name} are {dtype}; supported: {', '.join(str(d) for d in allowed)}"
        )
    return dtype


def check_rows(op: str, tensor_lists, names, ref_list: int = 1) -> int:
    """Equal list lengths, and per row: dense float tensors of the reference tensor's shape/device."""
    n = check_same_lengths(op, tensor_lists, names)
    refs = tensor_lists[ref_list]
    for i, t in enumerate(refs):  # first: every other row is compared with these
        check_tensor(op, names[ref_list], i, t, None, names[ref_list])
    for li, (tensors, name) in enumerate(zip(tensor_lists, names)):
        if li != ref_list:
            for i, t in enumerate(tensors):
                check_tensor(op, name, i, t, refs[i], names[ref_list])
    if n:
        device = refs[0].device
        for i, t in enumerate(refs):
            if t.device != device:
                raise RuntimeError(
                    f"{op}: {names[ref_list]}[{i}] is on {t.device} but {names[ref_list]}[0] is on "
                    f"{device}; one call runs on one device (bucket tensors by device first)"
                )
    return n


def storageless(tensor_lists, names) -> Optional[str]:
    """The name of the first tensor without real storage (``name[i]``), or None."""
    for tensors, name in zip(tensor_lists, names):
        for i, t in enumerate(tensors):
            if not has_storage(t):
                return f"{name}[{i}] ({type(t).__name__} on {t.device})"
    return None


def _is_real(x) -> bool:
    if type(x) is float or type(x) is int:
        return True
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def real(op: str, name: str, value) -> float:
    """A finite real number (or a 1-element tensor holding one), as a float."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{op}: {name} must be a number or a 1-element tensor")
        value = value.item()
    if not _is_real(value) or not math.isfinite(float(value)):
        raise ValueError(f"{op}: {name} must be a finite real number, got {value!r}")
    return float(value)


# torch.optim's texts for the same errors (Adam/AdamW/RAdam); ours start with them, the detail
# follows in parentheses
_TORCH_TEXT = {
    "lr": "Invalid learning rate: {}",
    "eps": "Invalid epsilon value: {}",
    "beta1": "Invalid beta parameter at index 0: {}",
    "beta2": "Invalid beta parameter at index 1: {}",
    "weight_decay": "Invalid weight_decay value: {}",
    "ema_decay": "Invalid ema_decay value: {}",
}


def _check_range(op: str, name: str, value, below_one: bool) -> None:
    """``value`` finite and >= 0 (and < 1 with ``below_one``), else torch's text and ours."""
    try:
        x = real(op, name, value)
    except ValueError as e:
        raise ValueError(f"{_TORCH_TEXT[name].format(value)} ({e})") from None
    if x < 0.0 or (below_one and x >= 1.0):
        bound = "in [0, 1)" if below_one else ">= 0"
        raise ValueError(f"{_TORCH_TEXT[name].format(value)} ({op}: {name} must be {bound})")


def check_hyperparameters(op: str, *, lr=None, eps=None, beta1=None, beta2=None, ema_decay=None,
                          weight_decay=None, step=None, mode=None) -> None:
    """Scalar hyperparameters: finite, and in the range the update is defined for. A message
    starts with torch.optim's text for the same error, e.g. ``Invalid learning rate: -1``."""
    for name, value, below_one in (("lr", lr, False), ("eps", eps, False), ("beta1", beta1, True),
                                   ("beta2", beta2, True), ("ema_decay", ema_decay, True),
                                   ("weight_decay", weight_decay, False)):
        if value is not None:
            _check_range(op, name, value, below_one)
    if step is not None:
        check_step(op, step)
    if mode is not None and (isinstance(mode, bool) or mode not in (0, 1)):
        raise ValueError(f"{op}: mode must be 0 (Adam, L2 decay) or 1 (AdamW, decoupled decay), got {mode!r}")


def check_step(op: str, step) -> int:
    """A step is a positive integer (an int, or an integer-valued 1-element tensor)."""
    value = step
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise ValueError(f"{op}: step must be a 1-element tensor, got shape {tuple(step.shape)}")
        value = step.item()
        if isinstance(value, float) and value.is_integer():
            value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{op}: step must be a positive integer, got {step!r}")
    return int(value)


def check_chunk_size(op: str, chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive integer, got {chunk_size!r}")
    return chunk_size


def check_list_of_lists(op: str, tensor_lists) -> None:
    if not isinstance(tensor_lists, (list, tuple)) or not all(
            isinstance(tensors, (list, tuple)) for tensors in tensor_lists):
        raise TypeError(f"{op}: tensor_lists must be a list of lists of tensors, got "
                        f"{type(tensor_lists).__name__}")


def check_noop_flag(op: str, noop_flag, device: Optional[torch.device]) -> None:
    """``noop_flag``: a bool, integer or floating-point tensor of at least one element on the call's
    ``device`` (None: any device). Backends read and set its first element there (the GPU kernel
    in device memory), so a flag elsewhere, an empty one or a non-tensor is refused here rather
    than each backend failing its own way."""
    if not isinstance(noop_flag, torch.Tensor):
        raise TypeError(f"{op}: noop_flag must be a torch.Tensor (e.g. torch.zeros(1, "
                        f"dtype=torch.int32)), got {type(noop_flag).__name__}")
    if not (noop_flag.is_floating_point() or noop_flag.dtype in _INT_DTYPES):
        raise TypeError(f"{op}: noop_flag must be a bool, integer or floating-point tensor, got "
                        f"{noop_flag.dtype}")
    if noop_flag.numel() < 1:
        raise ValueError(f"{op}: noop_flag must have at least one element, got shape "
                         f"{tuple(noop_flag.shape)}")
    if noop_flag.layout != torch.strided:
        raise TypeError(f"{op}: noop_flag must be a dense tensor, got {noop_flag.layout}")
    if device is not None and noop_flag.device != device:
        raise RuntimeError(f"{op}: noop_flag is on {noop_flag.device} but the tensors are on "
                           f"{device}; the kernel reads and sets the flag on the tensors' device")


_INT_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def check_grad_scale(op: str, grad_scale, device: Optional[torch.device]) -> None:
    """``grad_scale`` (the grads are divided by it): None, or a 1-element floating-point tensor
    (any shape: ``()``, ``(1,)``, ...) on the call's device or on the CPU (every backend copies a
    CPU scale to the device; GradScaler's scale lives on the device). Its value is not read
    here: that would sync the device."""
    if grad_scale is None:
        return
    if not isinstance(grad_scale, torch.Tensor):
        raise TypeError(f"{op}: grad_scale must be None or a 1-element floating-point tensor, "
                        f"got {type(grad_scale).__name__} (wrap a number: torch.tensor(scale))")
    if not grad_scale.is_floating_point():
        raise TypeError(f"{op}: grad_scale must be a floating-point tensor, got {grad_scale.dtype}")
    if grad_scale.numel() != 1:
        raise ValueError(f"{op}: grad_scale must have exactly one element, got shape "
                         f"{tuple(grad_scale.shape)}")
    if grad_scale.layout != torch.strided or not has_storage(grad_scale):
        raise TypeError(f"{op}: grad_scale must be a plain dense tensor, got "
                        f"{type(grad_scale).__name__} ({grad_scale.layout}) on {grad_scale.device}")
    if device is not None and grad_scale.device != device and grad_scale.device.type != "cpu":
        raise RuntimeError(f"{op}: grad_scale is on {grad_scale.device} but the tensors are on "
                           f"{device}; pass it on {device} or on the CPU")


def check_mode(op: str, mode) -> bool:
    """``mode``: exactly 0 (Adam, L2 decay) or 1 (AdamW, decoupled decay); True for 1."""
    if mode is None or isinstance(mode, bool) or not isinstance(mode, numbers.Integral) \
            or mode not in (0, 1):
        raise ValueError(f"{op}: mode must be 0 (Adam, L2 decay) or 1 (AdamW, decoupled decay), "
                         f"got {mode!r}")
    return mode == 1


# --- memory overlap -------------------------------------------------------------------------

def _extent(t: torch.Tensor) -> int:
    """How many elements ``t``'s view spans, from its first to its last element (numel > 0;
    torch strides are never negative)."""
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _offsets(t: torch.Tensor) -> torch.Tensor:
    """The storage offsets (in elements, from the view's first one) of every element of ``t``."""
    offs = torch.zeros(1, dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offs = (offs[:, None] + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
    return offs


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an ``expand``ed tensor, a stride-0 dim, an
    ``as_strided`` view that revisits elements): writing it would write one address twice."""
    status = torch._debug_has_internal_overlap(t)
    if status != 2:  # 0: none, 1: certainly (a zero stride of a dim of size > 1)
        return status == 1
    # torch does not decide non-dense views: with dims sorted by stride, each stride beyond the
    # span of the dims below it is enough (every slice and transpose); else count the offsets
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1)
    span = 0
    for stride, size in dims:
        if stride <= span:
            break
        span += (size - 1) * stride
    else:
        return False
    offs = _offsets(t)
    return offs.unique().numel() != offs.numel()


def _share_memory(a: torch.Tensor, a_lo: int, b: torch.Tensor, b_lo: int) -> bool:
    """Whether two views without internal overlap whose byte ranges intersect share a byte (the
    ranges of interleaved views, e.g. two columns of one matrix, intersect while their elements do
    not): their element intervals sorted by start overlap only between neighbours."""
    # unique: a read-only view may visit an element twice (an expanded grad)
    a_starts = a_lo + _offsets(a).unique() * a.element_size()
    b_starts = b_lo + _offsets(b).unique() * b.element_size()
    starts = torch.cat([a_starts, b_starts])
    ends = torch.cat([a_starts + a.element_size(), b_starts + b.element_size()])
    order = torch.argsort(starts)
    starts, ends = starts[order], ends[order]
    return bool((starts[1:] < ends[:-1]).any())


def check_no_overlap(op: str, named_lists, read_only: Sequence[str] = ("grads",)) -> None:
    """No two tensors of one call share memory, and no written tensor overlaps itself.

    ``named_lists``: list name -> tensors. Every list is written except those in ``read_only``;
    read-only tensors may share memory with each other (the same grad twice is only read twice)
    but not with a written tensor. The backends update rows one element at a time in their own
    order, so a tensor written twice (the same param twice, views of one buffer that overlap, a
    moment that is also the EMA) would get results that depend on the backend: refused here,
    naming both tensors. Tensors without real storage (:func:`has_storage`) and empty ones are
    skipped. O(n log n): the byte ranges sorted by start.
    """
    spans = []
    for name, tensors in named_lists.items():
        written = name not in read_only
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or not t.numel() or not has_storage(t):
                continue
            size = t.element_size()
            lo = t.data_ptr()  # the storage's address + storage_offset * itemsize
            if t.is_contiguous():  # the common case, without Python work per dim
                spans.append((lo, lo + t.numel() * size, name, i, t, written))
                continue
            if written and has_internal_overlap(t):
                raise RuntimeError(
                    f"{op}: {name}[{i}] ({_describe(t)}, strides {tuple(t.stride())}) has elements "
                    f"that share memory (an expanded or stride-0 view); a tensor the op writes "
                    f"needs memory of its own for every element: pass a copy (t.contiguous() or "
                    f"t.clone())")
            spans.append((lo, lo + _extent(t) * size, name, i, t, written))
    spans.sort()  # by start (then end, list name and index: unique, so tensors are never compared)
    active = []  # spans whose range reaches past the current start
    reach = 0    # the furthest end among them
    for span in spans:
        lo = span[0]
        if lo >= reach:  # the common case: past every earlier span
            active = [span]
            reach = span[1]
            continue
        active = [a for a in active if a[1] > lo]
        for other in active:
            if not (span[5] or other[5]):
                continue
            a, b = other[4], span[4]
            dense = _extent(a) == a.numel() and _extent(b) == b.numel()
            if dense or _share_memory(a, other[0], b, lo):
                first, second = sorted((other, span), key=lambda s: (list(named_lists).index(s[2]), s[3]))
                same = "is the same memory as" if a.data_ptr() == b.data_ptr() and a.shape == b.shape \
                    else "overlaps"
                raise RuntimeError(
                    f"{op}: {second[2]}[{second[3]}] {same} {first[2]}[{first[3]}] (they share "
                    f"storage); the op writes {'them' if span[5] and other[5] else 'one of them'}, "
                    f"and a tensor written twice or read after another's write would give results "
                    f"that depend on the backend: pass tensors with memory of their own (the same "
                    f"param twice in one group, overlapping views of one buffer, or one tensor in "
                    f"two state lists are refused)")
        active.append(span)
        reach = max(reach, span[1])
