"""Bucketing: split tensor rows into groups that one multi-tensor call can take.

A call runs on one device with one dtype per list, so rows are grouped by a key such as
``(device, param dtype, grad dtype)``. Grouping keeps the original order inside each bucket, and
bucket order never changes a result (the update is elementwise).
"""
from __future__ import annotations

from typing import Callable, Dict, Hashable, Iterable, List, Sequence

import torch

def group_indices(keys: Iterable[Hashable]) -> Dict[Hashable, List[int]]:
    """``{key: [indices with that key, in order]}``, keys in order of first appearance."""
    groups: Dict[Hashable, List[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return groups


def bucket_tensor_lists(tensor_lists: Sequence[Sequence[torch.Tensor]],
                        key: Callable[[int], Hashable] = None) -> Dict[Hashable, List[List[torch.Tensor]]]:
    """Split parallel tensor lists into per-bucket tensor lists.

    ``key(i)`` gives row ``i``'s bucket; by default ``(device, dtype)`` of every list's tensor in
    that row, so each bucket's lists each hold one device and one dtype.
    """
    n = len(tensor_lists[0]) if tensor_lists else 0
    if key is None:
        def key(i):
            return tuple((tensors[i].device, tensors[i].dtype) for tensors in tensor_lists)
    return {
        k: [[tensors[i] for i in rows] for tensors in tensor_lists]
        for k, rows in group_indices(key(i) for i in range(n)).items()
    }
