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
    if not t.is_floating_point():
        raise TypeError(f"{op}: {name}[{index}] must be a floating-point tensor, got {t.dtype}")
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
    for li, (tensors, name) in enumerate(zip(tensor_lists, names)):
        for i, t in enumerate(tensors):
            check_tensor(op, name, i, t, refs[i] if li != ref_list else None, names[ref_list])
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
