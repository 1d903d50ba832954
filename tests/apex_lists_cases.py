"""The apex positional calls whose list roles a count alone cannot tell, run on one backend.

``[[g], [p], [m], [v], [s]]`` is ``[grads, params, exp_avgs, exp_avg_sqs, emas]`` for the EMA
ops and ``[..., masters]`` for ``multi_tensor_adam``/``multi_tensor_radam``: the apex adapter
(:mod:`multi_tensor.ops`) names the lists once, by op, so every backend gives the same result,
or the same error (an EMA op called with ``ema_decay=None``). :data:`VALID` and :data:`REFUSED`
say which each call is; :func:`oracle` gives a valid call's bits independently of the backends.
Used by tests/test_apex_lists.py (reference, native, the NPU stand-in) and
tests/test_triton_interpreter.py (the Triton kernels).
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

# What each call must do, written from the README's op list and update table (not from a
# backend): the hyperparameters of a valid call (rule, lr, ema_decay, beta1, beta2, eps, step,
# decoupled, weight_decay, the weights' list), or the error of a refused one.
REFUSED = {ema_op_without_decay: ("ValueError", "ema_decay is None", "call multi_tensor_adam)"),
           radam_ema_op_without_decay: ("ValueError", "ema_decay is None",
                                        "call multi_tensor_radam)")}
VALID = {
    ema_op: dict(rule="adam", lr=1e-3, ema_decay=0.9, beta1=0.9, beta2=0.999, eps=1e-8, step=1,
                 decoupled=True, weight_decay=0.01, weights=1),
    adam_op_with_masters: dict(rule="adam", lr=1e-3, ema_decay=None, beta1=0.9, beta2=0.999,
                               eps=1e-8, step=1, decoupled=True, weight_decay=0.01, weights=4),
    radam_op_with_masters: dict(rule="radam", lr=1e-3, ema_decay=None, beta1=0.9, beta2=0.999,
                                eps=1e-8, step=7, decoupled=True, weight_decay=0.01, weights=4),
}


def oracle(run: Callable) -> List[torch.Tensor]:
    """The tensors a valid call leaves, from tests/ieee_oracle.py (numpy fp32, one rounding per
    line; its scalars from the documented formulas): the fifth list is the EMA for the EMA op,
    the fp32 master (the weights the update runs on; the param gets it back) for the others."""
    import numpy as np

    import ieee_oracle
    kw = dict(VALID[run])
    weights = kw.pop("weights")
    c = ieee_oracle.scalars(bias_correction=True, **kw)
    g, p, m, v, fifth = (ieee_oracle.as_numpy(ts[0]) for ts in _tensors())
    w = fifth if weights == 4 else p
    w2, m2, v2, s2 = ieee_oracle.adam_update(c, g, w, m, v, fifth if c.ema else None,
                                             dtype=np.float32)
    out = [g, w2, m2, v2, s2 if c.ema else w2]
    return [torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)) for x in out]


def assert_expected(got: Outcome, run: Callable, what: str) -> None:
    """A refused call: the declared error; a valid one: the oracle's bits (a refusal fails)."""
    if run in REFUSED:
        kind, *texts = REFUSED[run]
        assert isinstance(got, tuple) and got[0] == kind and all(t in got[1] for t in texts), \
            f"{what}: expected {kind} saying {texts!r}, got {got!r}"
        return
    assert not isinstance(got, tuple), f"{what}: a valid call was refused: {got!r}"
    assert_same_outcome(got, oracle(run), what + " (against the numpy oracle)")


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
