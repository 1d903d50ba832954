"""Bucketing: split tensor rows into groups that one multi-tensor call can take.

A call runs on one device with one dtype per list, so rows are grouped by a key
(:func:`multi_tensor.plan.bucket_key`). Grouping keeps the original order inside each bucket, and
bucket order never changes a result (the update is elementwise).
"""
from __future__ import annotations

from typing import Dict, Hashable, Iterable, List, Optional

import torch

def group_indices(keys: Iterable[Hashable]) -> Dict[Hashable, List[int]]:
    """``{key: [indices with that key, in order]}``, keys in order of first appearance."""
    groups: Dict[Hashable, List[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return groups


# --- sharded tensors (DTensor) --------------------------------------------------------------------
# A DTensor (FSDP2's params, grads and state) has no storage a kernel can address, but its local
# shard is a plain tensor, and the update is elementwise: a bucket of DTensors that share one
# device mesh and one placement runs on their local shards, with the same bits as the full tensors.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_dtensor_cls: list = []


def _dtensor_type():
    """``torch.distributed.tensor.DTensor``, imported on first need (None without distributed)."""
    if not _dtensor_cls:
        cls = None
        if torch.distributed.is_available():
            from torch.distributed.tensor import DTensor as cls
        _dtensor_cls.append(cls)
    return _dtensor_cls[0]


def is_dtensor(t) -> bool:
    if type(t) in _PLAIN_TYPES:
        return False
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def shard_layout(t) -> Optional[Hashable]:
    """``(device mesh, placements)`` of a DTensor, ``None`` for any other tensor: part of the
    bucket key, so that one bucket's local shards are cut alike (and reduce over one mesh)."""
    if not is_dtensor(t):
        return None
    return (t.device_mesh, tuple(t.placements))


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor holding its data: writes to it change the DTensor),
    any other tensor as it is."""
    return t._local_tensor if is_dtensor(t) else t
