"""multi_tensor.plan: the step plan the apex ops, the compiled op and the functional API share.

A call on the same state tensors reuses the bucket prepared at the first call (so a backend's
pointer tables or flat buffers are made once), a call on other tensors prepares its own, the
cache is bounded and can be cleared, and a reused bucket still gives the bits of a fresh one.
"""
from __future__ import annotations

import pytest
import torch

import helpers
from multi_tensor import multi_tensor_fused_ema_adamw, plan, registered_backends
from multi_tensor.backends import forced_backend

ARGS = (1e-3, 0.99, 0.9, 0.999, 1e-8)  # lr, ema_decay, beta1, beta2, eps


def _lists(seed=0, n=3):
    params = [p.detach() for p in helpers.make_params([(5,), (3, 4), (1,)][:n], seed=seed)]
    grads = helpers.random_grads(params, seed + 1)
    return [grads, params, [torch.zeros_like(p) for p in params],
            [torch.zeros_like(p) for p in params], [p.clone() for p in params]]


def _call(lists, step):
    multi_tensor_fused_ema_adamw(2048, torch.zeros(1, dtype=torch.int32), lists, *ARGS, step, 1,
                                 True, 0.01)


def _prepares(monkeypatch, backend_name):
    """Count the prepare calls of ``backend_name``."""
    backend = next(b for b in registered_backends() if b.name == backend_name)
    calls = []
    original = backend.prepare

    def counting(*args):
        calls.append(args[0])
        return original(*args)
    monkeypatch.setattr(backend, "prepare", counting)
    return calls


@pytest.mark.parametrize("backend", ["reference", "native_cpu"])
def test_same_tensors_reuse_the_prepared_bucket(monkeypatch, backend):
    if backend not in {b.name for b in registered_backends()}:
        pytest.skip(f"{backend} is not registered")
    plan.clear_cache()
    calls = _prepares(monkeypatch, backend)
    a, fresh = _lists(), _lists()
    with forced_backend(backend):
        for step in (1, 2, 3):
            a[0] = helpers.random_grads(a[1], 10 + step)   # new grads every step, as in training
            _call(a, step)
        assert calls == ["fused_ema_adamw"], "the bucket was prepared again for the same tensors"
        b = _lists(seed=5)
        _call(b, 1)
        assert len(calls) == 2, "other tensors need a bucket of their own"
        # the reused bucket gave the bits of a bucket prepared afresh at every call
        for step in (1, 2, 3):
            fresh[0] = helpers.random_grads(fresh[1], 10 + step)
            plan.clear_cache()
            _call(fresh, step)
    for x, y in zip(sum(a, []), sum(fresh, [])):
        assert torch.equal(x, y)


def test_the_cache_is_bounded_and_clears():
    plan.clear_cache()
    kept = [_lists(seed=s, n=1) for s in range(plan.CACHE_SIZE + 3)]
    for lists in kept:
        _call(lists, 1)
    assert len(plan._cache) == plan.CACHE_SIZE
    plan.clear_cache()
    assert not plan._cache


def test_bucket_key_separates_what_one_call_cannot_mix():
    p32, p16 = torch.zeros(2), torch.zeros(2, dtype=torch.float16)
    g = torch.zeros(2)
    keys = {plan.bucket_key(p32, g, master=False), plan.bucket_key(p16, g, master=False),
            plan.bucket_key(p16, g, master=True), plan.bucket_key(p32, g, master=False, step=3),
            plan.bucket_key(p32, g.half(), master=False)}
    assert len(keys) == 5
    assert plan.bucket_key(p32, g, master=False) == plan.bucket_key(torch.ones(2), g, master=False)


def test_the_compiled_op_reuses_its_bucket(monkeypatch):
    """torch.ops.fused_optim.adam_step_ (what a compiled step calls) prepares a bucket once for
    the same tensors, not at every call."""
    import fused_optim.custom_ops  # noqa: F401  (registers the op)

    plan.clear_cache()
    name = next(b.name for b in registered_backends() if b.handles("cpu"))
    calls = _prepares(monkeypatch, name)
    grads, params, m, v, s = _lists()
    steps = [torch.tensor(0.0) for _ in params]
    for _ in range(3):
        torch.ops.fused_optim.adam_step_(
            "fused_ema_adamw", grads, params, m, v, s, [], steps, 1e-3, None, 0.9, 0.999, 1e-8,
            0.01, True, True, False, 0.99, "constant", 0, 1.0, 1.0, 0.0, 1, None, None, 2048)
    assert [float(t) for t in steps] == [3.0] * len(params)
    assert calls == ["fused_ema_adamw"]
