"""The apex calls a list count alone cannot read (tests/apex_lists_cases.py), on every backend
that runs CPU tensors here and on the NPU stand-in: a valid call gives the numpy oracle's bits
(a refusal fails), a refused one the declared error with nothing changed. The Triton kernels run
them under the interpreter (tests/test_triton_interpreter.py, case
``apex-five-lists-same-on-every-backend``)."""
from __future__ import annotations

import pytest
import torch

import apex_lists_cases as A
import backend_cases as C
from multi_tensor.testing import npu_standin

BACKENDS = [name for name in C.backend_names() if C.backend_skip_reason(name) is None]


@pytest.mark.parametrize("run", A.CALLS, ids=[r.__name__ for r in A.CALLS])
@pytest.mark.parametrize("backend", BACKENDS + ["npu_standin"])
def test_expected_outcome(backend, run):
    if backend == "npu_standin":
        with npu_standin.standin_backend(mode="exact"):
            got = A.outcome(run, backend)
    else:
        got = A.outcome(run, backend)
    A.assert_expected(got, run, f"{run.__name__} on {backend}")
    if run in A.REFUSED and backend != "reference":  # and in the reference's words
        assert got == A.outcome(run, "reference"), f"{run.__name__} on {backend}: {got!r}"


def test_every_call_is_declared():
    assert set(A.CALLS) == set(A.VALID) | set(A.REFUSED)
    assert not set(A.VALID) & set(A.REFUSED)


def test_what_the_lists_mean():
    """The fifth list is the EMA for the EMA op and the master for the op without one; an EMA
    op without a decay is refused, naming the op to call instead."""
    before = A._tensors()
    ema = A.outcome(A.ema_op, "reference")
    p0, s0 = before[1][0], before[4][0]
    assert 0 < float((ema[1] - p0).abs().max()) <= 1.1e-3  # one step of lr 1e-3 (+ the decay)
    assert not torch.equal(ema[4], s0)                              # the EMA moved
    master = A.outcome(A.adam_op_with_masters, "reference")
    assert torch.equal(master[1], master[4])                        # param = its master
    assert float((master[1] - s0).abs().max()) <= 1.1e-3          # one step from the master
    err = A.outcome(A.ema_op_without_decay, "reference")
    assert err[0] == "ValueError" and "ema_decay is None" in err[1] \
        and "multi_tensor_adam" in err[1]
