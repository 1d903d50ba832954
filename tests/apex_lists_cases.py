"""The apex positional calls whose list roles a count alone cannot tell, run on one backend.

``[[g], [p], [m], [v], [s]]`` is ``[grads, params, exp_avgs, exp_avg_sqs, emas]`` for the EMA
ops and ``[..., masters]`` for ``multi_tensor_adam``/``multi_tensor_radam``: the apex adapter
(:mod:`multi_tensor.ops`) names the lists once, by op, so every backend gives the same result,
or the same error (an EMA op called with ``ema_decay=None``). Used by tests/test_apex_lists.py
(reference, native, the NPU stand-in) and tests/test_triton_interpreter.py (the Triton kernels).
"""
from __future__ import annotations

from typing import Callable, List, Tuple, Union

import torch

import multi_tensor
from multi_tensor.backends import forced_backend

FLAG = torch.int32


def _tensors(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(1000, generator=gen)
    return [[torch.randn(1000, generator=gen)], [p], [torch.zeros(1000)], [torch.zeros(1000)],
            [p.clone() + 1]]


def ema_op_without_decay(lists):
    """The issue's call: an EMA op with ema_decay=None (refused: ambiguous)."""
    multi_tensor.multi_tensor_fused_ema_adamw(65536, torch.zeros(1, dtype=FLAG), lists, 1e-3,
                                              None, 0.9, 0.999, 1e-8, 1, 1, True, 0.01)


def radam_ema_op_without_decay(lists):
    multi_tensor.multi_tensor_radam_ema(65536, torch.zeros(1, dtype=FLAG), lists, 1e-3, None,
                                        0.9, 0.999, 1e-8, 1, 0.01, True)


def ema_op(lists):
    """Five lists for the EMA op: the fifth is the EMA."""
    multi_tensor.multi_tensor_fused_ema_adamw(65536, torch.zeros(1, dtype=FLAG), lists, 1e-3,
                                              0.9, 0.9, 0.999, 1e-8, 1, 1, True, 0.01)


def adam_op_with_masters(lists):
    """Five lists for the op without an EMA: the fifth is the fp32 master (fp32 params here)."""
    multi_tensor.multi_tensor_adam(65536, torch.zeros(1, dtype=FLAG), lists, 1e-3, 0.9, 0.999,
                                   1e-8, 1, 1, True, 0.01)


def radam_op_with_masters(lists):
    multi_tensor.multi_tensor_radam(65536, torch.zeros(1, dtype=FLAG), lists, 1e-3, 0.9, 0.999,
                                    1e-8, 7, 0.01, True)


CALLS: List[Callable] = [ema_op_without_decay, radam_ema_op_without_decay, ema_op,
                         adam_op_with_masters, radam_op_with_masters]

Outcome = Union[Tuple[str, str], List[torch.Tensor]]


def outcome(run: Callable, backend: str) -> Outcome:
    """Every tensor after ``run`` on ``backend``, or the error it raised (type, message) with the
    check that nothing changed."""
    lists = _tensors()
    before = [t.clone() for ts in lists for t in ts]
    with forced_backend(backend):
        try:
            run(lists)
        except Exception as exc:  # noqa: BLE001 - the error is the outcome compared
            after = [t for ts in lists for t in ts]
            assert all(torch.equal(a, b) for a, b in zip(after, before)), \
                f"{run.__name__} on {backend}: raised after changing a tensor"
            return type(exc).__name__, str(exc)
    return [t for ts in lists for t in ts]


def assert_same_outcome(got: Outcome, want: Outcome, what: str) -> None:
    if isinstance(want, tuple) or isinstance(got, tuple):
        assert got == want, f"{what}: {got!r} != {want!r}"
        return
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32)), \
            f"{what}: list {i} differs from the reference"
