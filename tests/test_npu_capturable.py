"""``capturable=True`` on the NPU backend (multi_tensor.backends.npu.CapturableFlatAdamBucket).

The step counter lives on the device (int64, the CANN operator's step tensor), the operator
computes the bias corrections from it, and nothing is read on the host: a step GradScaler or
clipping cancels is undone on the device (the state saved and selected back). Run on the CPU
stand-in: with the reference's seed operator the update is bitwise the reference's (the same
unfolded scalars), with the CANN emulation within its tolerance; a cancelled step changes no bit,
whatever the grads hold. The launches, bytes and syncs of these steps are tests/test_npu_sim.py's.
"""
from __future__ import annotations

import copy

import pytest
import torch

import helpers
from fused_optim import FusedEmaAdamW
from multi_tensor import forced_backend
from multi_tensor.backends import npu
from multi_tensor.testing import npu_standin
from test_npu_backend import SHAPES, STANDIN, buckets, grads_for, train

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
OPS = {"reference op": npu_standin.reference_device_op, "cann op": npu_standin.cann_device_op}


def _state(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"])


def _assert_unchanged(before, opt, params):
    for i, (a, p) in enumerate(zip(before[0], params)):
        assert torch.equal(a, p), f"param {i}"
    after = opt.state_dict()["state"]
    for i, st in before[1].items():
        for key, value in st.items():
            assert torch.equal(value, after[i][key]), (i, key)


@pytest.mark.parametrize("dtype,master", [(F32, False), (BF16, True), (F16, True)])
def test_bitwise_the_reference_with_the_seed_operator(dtype, master):
    kw = dict(dtype=dtype, master_weights=master, steps=7, lr=1e-2, weight_decay=0.1,
              ema_decay=0.9, skip=lambda k, i: i == 2 and k == 3)
    with npu_standin.standin_backend():  # the default mode: the operator serves capturable steps
        assert npu.get_op_mode() == "cann"
        pa, oa = train(STANDIN, capturable=True, **kw)
    pb, ob = train("reference", **kw)
    assert all(isinstance(b, npu.CapturableFlatAdamBucket) and b.last_path == "cann"
               for b in buckets(oa))
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step") + (("master_param",) if master else ()):
            assert torch.equal(oa.state[p][key], ob.state[q][key]), key
        # the EMA: torch's lerp_ against the reference's s + (w - s) * (1 - d)
        torch.testing.assert_close(oa.state[p]["ema"], ob.state[q]["ema"], rtol=2e-6, atol=1e-7)


def test_adam_l2_and_no_bias_correction_bitwise():
    for kw in (dict(adam_w_mode=False, weight_decay=0.01), dict(bias_correction=False)):
        kw = dict(kw, steps=4, lr=1e-2, ema_decay=0.9)
        with npu_standin.standin_backend(mode="cann"):
            pa, oa = train(STANDIN, capturable=True, **kw)
        pb, ob = train("reference", **kw)
        for p, q in zip(pa, pb):
            assert torch.equal(p, q), kw


def test_within_tolerance_of_the_reference_with_the_cann_kernel():
    kw = dict(steps=6, lr=1e-2, weight_decay=0.1, ema_decay=0.9)
    with npu_standin.standin_backend(npu_standin.cann_device_op, mode="cann"):
        pa, oa = train(STANDIN, capturable=True, **kw)
    pb, ob = train("reference", **kw)
    for p, q in zip(pa, pb):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=1e-7)
        torch.testing.assert_close(oa.state[p]["ema"], ob.state[q]["ema"], rtol=2e-5, atol=1e-7)


def _run(op, dtype, *, steps=5, cancel=3, max_grad_norm=None, scaler=True, slice_=None,
         monkeypatch=None):
    """Capturable steps on the stand-in; at step ``cancel`` a grad holds inf (and GradScaler's
    found_inf is set when ``scaler``). Returns the params, the optimizer, the state before the
    cancelled step."""
    if slice_ is not None:
        monkeypatch.setattr(npu.bucket, "SKIP_SLICE", slice_)
    before = None
    with npu_standin.standin_backend(op, mode="cann") as backend:
        params = helpers.make_params(SHAPES, dtype)
        opt = FusedEmaAdamW(params, lr=1e-2, capturable=True, max_grad_norm=max_grad_norm,
                            master_weights=dtype != F32, weight_decay=0.1, ema_decay=0.9)
        for k in range(steps):
            for p, g in zip(params, grads_for(params, k)):
                p.grad = g
            if k == cancel:
                before = _state(opt, params)
                params[0].grad.view(-1)[0] = float("inf")
            if scaler:
                opt.grad_scale = torch.tensor(8.0)
                opt.found_inf = torch.tensor([1.0 if k == cancel else 0.0])
            with forced_backend(backend.name):
                opt.step()
            if k == cancel:
                _assert_unchanged(before, opt, params)
    return params, opt


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", [F32, F16])
def test_gradscaler_overflow_changes_nothing(op, dtype):
    params, opt = _run(OPS[op], dtype)
    assert all(float(opt.state[p]["step"]) == 4 for p in params if p.numel())
    (bucket,) = buckets(opt)
    assert bucket.stats["cann"] == 5 and bucket.last_path == "cann"


@pytest.mark.parametrize("op", sorted(OPS))
def test_a_non_finite_clip_norm_changes_nothing(op):
    params, opt = _run(OPS[op], F32, max_grad_norm=1.0, scaler=False)
    assert all(float(opt.state[p]["step"]) == 4 for p in params if p.numel())


def test_the_first_step_cancelled_keeps_step_zero():
    params, opt = _run(npu_standin.reference_device_op, F32, steps=2, cancel=0)
    assert all(float(opt.state[p]["step"]) == 1 for p in params if p.numel())


def test_clipped_steps_match_the_host_clipped_path():
    # the device's range-safe norm and fp32 clip factor against the host's one-read norm and its
    # fp32 factor: the same update up to the norms' last bits
    kw = dict(steps=5, lr=1e-2, weight_decay=0.1, ema_decay=0.9, max_grad_norm=0.05)
    with npu_standin.standin_backend(mode="cann"):
        pa, oa = train(STANDIN, capturable=True, **kw)
        pb, ob = train(STANDIN, **kw)
    assert float(oa.last_grad_norm) > 0.05  # clipping is active
    torch.testing.assert_close(oa.last_grad_norm, ob.last_grad_norm, rtol=1e-6, atol=0)
    for p, q in zip(pa, pb):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)


def test_sliced_save_and_restore_is_the_same(monkeypatch):
    # a cancellable step in slices of 64 elements: the same bits as in one slice, scratch bounded
    pa, oa = _run(npu_standin.cann_device_op, F32)
    pb, ob = _run(npu_standin.cann_device_op, F32, slice_=64, monkeypatch=monkeypatch)
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)
        for key in oa.state[p]:
            assert torch.equal(oa.state[p][key], ob.state[q][key]), key
    (bucket,) = buckets(ob)
    assert [t.numel() for t in bucket._scratch] == [64] * 4


def test_the_torch_mode_is_refused_when_planning():
    params = helpers.make_params(SHAPES, F32)
    opt = FusedEmaAdamW(params, capturable=True)
    for p, g in zip(params, grads_for(params, 0)):
        p.grad = g
    with npu_standin.standin_backend(mode="exact") as backend, forced_backend(backend.name):
        with pytest.raises(ValueError, match=r"capturable=True.*params'\]\[0\].*MULTI_TENSOR_NPU_OP"):
            opt.step()
    assert not opt.state or all("exp_avg" not in s for s in opt.state.values())


def test_a_tensor_lr_is_refused():
    params = helpers.make_params(SHAPES, F32)
    opt = FusedEmaAdamW(params, lr=torch.tensor(1e-3), capturable=True)
    for p, g in zip(params, grads_for(params, 0)):
        p.grad = g
    with npu_standin.standin_backend(mode="cann") as backend, forced_backend(backend.name):
        with pytest.raises(ValueError, match="tensor lr.*host value"):
            opt.step()


def test_a_step_the_operator_cannot_serve_runs_the_exact_path_on_the_host():
    # planned for the operator, then the mode changes: the step reads the host (logged) and
    # is the reference's, bit for bit; a cancelled one still changes nothing
    kw = dict(lr=1e-2, weight_decay=0.1, ema_decay=0.9)
    params, ref = helpers.make_params(SHAPES, F32), helpers.make_params(SHAPES, F32)
    opt, ropt = FusedEmaAdamW(params, capturable=True, **kw), FusedEmaAdamW(ref, **kw)
    with npu_standin.standin_backend(mode="cann") as backend:
        for k in range(4):
            for p, r, g in zip(params, ref, grads_for(params, k)):
                p.grad, r.grad = g, g.clone()
            cancel = k == 2
            opt.grad_scale = ropt.grad_scale = torch.tensor(4.0)
            opt.found_inf = ropt.found_inf = torch.tensor([1.0 if cancel else 0.0])
            with npu.op_mode("exact" if k else "cann"), forced_backend(backend.name):
                opt.step()
            with forced_backend("reference"):
                ropt.step()
            if k == 1:
                assert any("capturable step reads the host" in r
                           for r in npu.fallback_reasons())
            if k >= 1:
                (bucket,) = buckets(opt)
                assert bucket.last_path == (None if cancel else "exact")
    # step 0 ran the operator (tolerance); the later ones the exact path on the same state
    for p, r in zip(params, ref):
        assert float(opt.state[p]["step"]) == float(ropt.state[r]["step"]) if p.numel() else True
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-7)


def test_state_dict_round_trip_keeps_the_device_count():
    with npu_standin.standin_backend(mode="cann") as backend:
        params = helpers.make_params(SHAPES, F32)
        opt = FusedEmaAdamW(params, lr=1e-2, capturable=True)
        for k in range(3):
            for p, g in zip(params, grads_for(params, k)):
                p.grad = g
            with forced_backend(backend.name):
                opt.step()
        saved = copy.deepcopy(opt.state_dict())
        clone = [p.detach().clone().requires_grad_() for p in params]
        opt2 = FusedEmaAdamW(clone, lr=1e-2, capturable=True)
        opt2.load_state_dict(saved)
        for k in range(3, 5):
            for p, q, g in zip(params, clone, grads_for(params, k)):
                p.grad, q.grad = g, g.clone()
            with forced_backend(backend.name):
                opt.step()
                opt2.step()
    for p, q in zip(params, clone):
        assert torch.equal(p, q)
        assert float(opt2.state[q]["step"]) == 5 if q.numel() else True


@pytest.mark.parametrize("max_grad_norm,scaler", [(None, True), (1.0, False), (1.0, True)])
def test_a_cancelled_step_reads_nothing_and_launches_what_any_step_does(max_grad_norm, scaler):
    # the simulated 910B around a normal and a cancelled step: no host read in either, the same
    # launches (nothing branches on the flag), so one captured graph serves both
    from multi_tensor.testing.npu_model import DeviceModel

    summaries = []
    model = DeviceModel()
    with npu_standin.standin_backend(model.device_op(npu_standin.cann_device_op),
                                     mode="cann") as backend:
        params = helpers.make_params(SHAPES, F32)
        opt = FusedEmaAdamW(params, lr=1e-2, capturable=True, max_grad_norm=max_grad_norm)
        for k in range(4):
            opt.zero_grad()
            grads = grads_for(params, k)
            if k == 3:
                grads[0].view(-1)[0] = float("inf")
            with torch.enable_grad():
                torch.autograd.backward([(p * g).sum() for p, g in zip(params, grads)])
            if scaler:
                # GradScaler's own tensors live on the device: made inside the model with device=
                opt.grad_scale = torch.full((), 4.0, device="cpu")
                opt.found_inf = torch.full((1,), float(k == 3), device="cpu")
            before = _state(opt, params) if k == 3 else None
            with forced_backend(backend.name):
                if k >= 2:
                    model.reset()
                    with model, model.track_optimizer(opt):
                        opt.step()
                    summaries.append(model.summary("optimizer"))
                else:
                    opt.step()
            if before is not None:
                _assert_unchanged(before, opt, params)
    normal, cancelled = summaries
    assert normal.syncs == cancelled.syncs == 0, (normal.sync_ops, cancelled.sync_ops)
    assert normal.ops == cancelled.ops and normal.bytes == cancelled.bytes
