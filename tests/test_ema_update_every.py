"""``ema_update_every=k``: the EMA moves at steps 1, 1 + k, 1 + 2k, ... only.

Oracles: the params of a run with an EMA every k steps equal, bit for bit, those of the same
optimizer without an EMA (the EMA never feeds back into the update); the EMA equals the fp32 lerp
``s + (1 - d) * (p - s)`` applied, in numpy float32, at exactly the updating steps to the params
those steps produced.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import helpers

from fused_optim import FusedAdamW, FusedEmaAdamW, FusedRAdam


def _params(dtype, seed=0):
    return helpers.make_params([(7, 33), (130,), (0,), (4, 5, 6)], dtype, seed)


def _grads(params, t):
    gen = torch.Generator().manual_seed(100 + t)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def _np_lerp(s: np.ndarray, p: np.ndarray, decay: float) -> np.ndarray:
    w = np.float32(1.0 - decay)            # the kernel rounds 1 - decay once to fp32
    return (s + w * (p - s)).astype(np.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("every", [1, 3, 10])
def test_params_as_without_ema_and_ema_only_on_updating_steps(backend, dtype, every):
    ours, plain = _params(dtype), _params(dtype)
    opt = FusedEmaAdamW(ours, lr=1e-2, ema_decay=0.9, ema_update_every=every)
    ref = FusedAdamW(plain, lr=1e-2)
    weights = lambda p: opt.state[p]["master_param"] if dtype != torch.float32 else p  # noqa: E731
    emas = None
    for t in range(1, 24):
        for p, q, g in zip(ours, plain, _grads(ours, t)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for p, q in zip(ours, plain):
            assert torch.equal(p, q), t
        now = [weights(p).detach().float().numpy().copy() for p in ours]
        if emas is None:
            emas = [_np_lerp(_params(dtype)[i].detach().float().numpy(), now[i], 0.9)
                    for i in range(len(ours))]
            assert (t - 1) % every == 0
        elif (t - 1) % every == 0:
            emas = [_np_lerp(s, w, 0.9) for s, w in zip(emas, now)]
        updates = (t - 1) % every == 0
        assert opt.last_ema_decays == ({(0, t): 0.9} if updates else {}), t
        assert opt.ema_decay_at(t) == (0.9 if updates else None)
        for p, s in zip(ours, emas):
            np.testing.assert_array_equal(opt.state[p]["ema"].float().numpy(), s, err_msg=str(t))


def test_skipped_steps_run_the_op_without_ema(backend, monkeypatch):
    """Between updates the bucket runs the no-EMA op, so the EMA is neither read nor written:
    the bucket prepared with the EMA runs only at the updating steps (runs counted per prepared
    bucket), and a finite sentinel planted in the EMA after step 1 keeps its bits through steps
    2-4; at step 5 the update reads it (the sentinel's lerp is what the EMA then holds)."""
    params = _params(torch.float32)
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.5, ema_update_every=4)
    runs = []

    def counted(cls):
        original = cls.run

        def run(self, *args, **kwargs):
            runs[-1].append(self)
            return original(self, *args, **kwargs)
        monkeypatch.setattr(cls, "run", run)

    sentinel = 1234.5
    for t in range(1, 6):
        for p, g in zip(params, _grads(params, t)):
            p.grad = g
        runs.append([])
        opt.step()
        if t == 1:
            (bucket,) = opt._plans[id(opt.param_groups[0])].buckets
            assert bucket.every == 4 and bucket.ema_free is not bucket.prepared
            for cls in {type(bucket.prepared), type(bucket.ema_free)}:
                counted(cls)
            ema = opt.state[params[0]]["ema"]
            ema.view(-1)[0] = sentinel
            planted = [opt.state[p]["ema"].clone() for p in params]
        elif t < 5:
            assert runs[-1] == [bucket.ema_free], t   # only the bucket without the EMA ran
            for p, s in zip(params, planted):
                assert torch.equal(opt.state[p]["ema"], s), t
    assert runs[-1] == [bucket.prepared]              # step 5 updates the EMA ...
    w = params[0].detach().view(-1)[0].numpy()
    want = _np_lerp(np.float32(sentinel), w, 0.5)     # ... from the sentinel it reads
    assert ema.view(-1)[0].numpy() == want
    assert all(torch.isfinite(p).all() for p in params)


def test_resume_mid_cycle_is_exact(backend):
    a = _params(torch.float32)
    opt_a = FusedEmaAdamW(a, lr=1e-2, ema_decay=0.8, ema_update_every=3,
                          ema_schedule="warmup")
    b = _params(torch.float32)
    opt_b = FusedEmaAdamW(b, lr=1e-2, ema_decay=0.8)       # options come from the state dict
    for t in range(1, 12):
        for p, g in zip(a, _grads(a, t)):
            p.grad = g
        opt_a.step()
        if t == 5:
            with torch.no_grad():
                for p, q in zip(a, b):
                    q.copy_(p)
            opt_b.load_state_dict(opt_a.state_dict())
            assert opt_b.param_groups[0]["ema_update_every"] == 3
        elif t > 5:
            for p, g in zip(b, _grads(b, t)):
                p.grad = g
            opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert torch.equal(opt_a.state[p]["ema"], opt_b.state[q]["ema"])


def test_buffer_ema_follows_the_param_ema():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2, ema_decay=0.5, ema_update_every=2)
    opt.register_ema_buffers(model)
    x = torch.randn(8, 3)
    for t in range(1, 6):
        opt.zero_grad()
        model(x + t).square().mean().backward()
        before = opt.ema_buffers["1.running_mean"].clone()
        opt.step()
        after = opt.ema_buffers["1.running_mean"]
        assert torch.equal(before, after) == ((t - 1) % 2 != 0), t


def test_radam_with_ema_and_set_ema_schedule():
    a, b = _params(torch.float32), _params(torch.float32)
    opt = FusedRAdam(a, lr=1e-2, ema_decay=0.9)
    opt.set_ema_schedule(ema_update_every=2)
    ref = FusedRAdam(b, lr=1e-2)
    for t in range(1, 6):
        for p, q, g in zip(a, b, _grads(a, t)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        assert sorted(opt.last_ema_decays) == ([(0, t)] if t % 2 else [])
    for p, q in zip(a, b):
        assert torch.equal(p, q)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_bad_values_raise_before_anything_changes(bad):
    params = _params(torch.float32)
    with pytest.raises(ValueError, match="ema_update_every"):
        FusedEmaAdamW(params, ema_update_every=bad)
    opt = FusedEmaAdamW(params, lr=1e-2)
    for p, g in zip(params, _grads(params, 1)):
        p.grad = g
    opt.param_groups[0]["ema_update_every"] = bad
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="ema_update_every"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    assert not opt.state or all(float(s["step"]) == 0 for s in opt.state.values())
