"""The NPU backend's whole path on CPU tensors (multi_tensor.testing.npu_standin).

The stand-in registers a copy of the NPU backend for device type "cpu" (removed after each test)
whose device operator is the reference's seed operator. Everything but CANN itself runs here:
flattening and re-pointing the state, the grad gather (and zero-copy grads), unscale, noop, the
write-back of masters, state dicts, intermittent grads, empty tensors, alignment, the choice of
path. Default (torch) path: bitwise equal to the unflattened reference over many steps.
"""
from __future__ import annotations

import io

import pytest
import torch

import helpers

from fused_optim import FusedAdam, FusedEmaAdamW, FusedRAdam
from multi_tensor import forced_backend, multi_tensor_fused_ema_adamw, rules
from multi_tensor.backends import npu
from multi_tensor.backends.npu import flat
from multi_tensor.testing import npu_standin
from multi_tensor.schema import AdamLists

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
SHAPES = ((3, 5), (0,), (130,), (1,), (7, 3, 2), (2, 0, 3), (257,))
STANDIN = "npu_standin"


def grads_for(params, step, dtype=None, scale=1.0):
    return helpers.random_grads(params, 1000 + step, dtype, scale)


def train(backend, *, dtype=F32, grad_dtype=None, steps=12, shapes=SHAPES, opt_cls=FusedEmaAdamW,
          skip=lambda step, i: False, scale=None, seed=0, **kwargs):
    params = helpers.make_params(shapes, dtype, seed)
    if grad_dtype is not None:
        for p in params:
            p.grad_dtype = grad_dtype  # torch >= 2.9 checks a grad's dtype against it
    opt = opt_cls(params, **kwargs)
    for k in range(steps):
        for i, (p, g) in enumerate(zip(params, grads_for(params, k, grad_dtype, scale or 1.0))):
            p.grad = None if skip(k, i) else g
        if scale is not None:
            opt.grad_scale = torch.tensor(scale)
            opt.found_inf = torch.zeros(())
        with forced_backend(backend):
            opt.step()
    return params, opt


def assert_same(pa, oa, pb, ob):
    for i, (p, q) in enumerate(zip(pa, pb)):
        assert p.dtype == q.dtype and torch.equal(p, q), f"param {i}"
        sa, sb = oa.state[p], ob.state[q]
        assert sa.keys() == sb.keys(), (sa.keys(), sb.keys())
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), f"{key}[{i}]"


def buckets(opt):
    return [b.prepared for plan in opt._plans.values() for b in plan.buckets]


CASES = {
    "fp32_adamw": dict(dtype=F32, weight_decay=0.1),
    "bf16_masters": dict(dtype=BF16, master_weights=True, weight_decay=0.05),
    "fp16_grads_into_masters_adam_l2": dict(dtype=F16, master_weights=True, adam_w_mode=False,
                                            weight_decay=0.01),
    "bf16_params_fp32_grads": dict(dtype=BF16, grad_dtype=F32, master_weights=True),
    "fp16_no_masters": dict(dtype=F16, master_weights=False, weight_decay=0.01),
    "no_bias_correction_maximize": dict(dtype=F32, bias_correction=False, maximize=True),
    # a bf16 EMA beside fp32 / fp16 state: a bf16 flat EMA buffer on the torch path
    "fp32_ema_bf16": dict(dtype=F32, ema_dtype=BF16, ema_decay=0.9),
    "bf16_masters_ema_bf16": dict(dtype=BF16, master_weights=True, ema_dtype=BF16,
                                  ema_decay=0.9),
    "fp16_no_masters_ema_bf16": dict(dtype=F16, master_weights=False, ema_dtype=BF16,
                                     ema_decay=0.9),
    # the EMA every 3 steps: the steps between run the op without the EMA on the same state
    "fp32_ema_every_3": dict(dtype=F32, ema_decay=0.9, ema_update_every=3),
    "bf16_masters_ema_every_3": dict(dtype=BF16, master_weights=True, ema_decay=0.9,
                                     ema_update_every=3),
    "fp32_ema_bf16_every_3": dict(dtype=F32, ema_dtype=BF16, ema_decay=0.9, ema_update_every=3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bitwise_equal_to_reference_over_many_steps(standin, case):
    kw = dict(CASES[case], lr=1e-2, steps=25, skip=lambda k, i: i == 2 and k % 4 == 1)
    pa, oa = train(STANDIN, **kw)
    pb, ob = train("reference", **kw)
    assert_same(pa, oa, pb, ob)
    assert all(b.stats["exact"] > 0 for b in buckets(oa))
    if kw.get("ema_dtype") == BF16:  # the flat EMA buffer itself is bf16
        assert all(oa.state[p]["ema"].dtype == BF16 for p in pa)
        assert all(b.ema_list.flat.dtype == BF16 for b in buckets(oa))


@pytest.mark.parametrize("opt_cls,kw", [
    (FusedAdam, dict(weight_decay=0.1)),
    (FusedRAdam, dict(weight_decay=0.1, decoupled_weight_decay=True, ema_decay=0.99)),
    (FusedRAdam, dict(dtype=BF16)),
])
def test_other_ops_bitwise(standin, opt_cls, kw):
    kw = dict(kw, opt_cls=opt_cls, steps=10)
    pa, oa = train(STANDIN, **kw)
    pb, ob = train("reference", **kw)
    assert_same(pa, oa, pb, ob)


def test_grad_scale_bitwise_and_found_inf_changes_nothing(standin):
    kw = dict(dtype=BF16, master_weights=True, scale=1000.0, steps=6)
    pa, oa = train(STANDIN, **kw)
    pb, ob = train("reference", **kw)
    assert_same(pa, oa, pb, ob)
    before = ([p.detach().clone() for p in pa],
              [{k: v.clone() for k, v in oa.state[p].items()} for p in pa])
    for p, g in zip(pa, grads_for(pa, 99)):
        p.grad = g
    oa.found_inf = torch.ones(())
    with forced_backend(STANDIN):
        oa.step()
    for p, p0, s0 in zip(pa, *before):
        assert torch.equal(p, p0)
        for k, v in oa.state[p].items():
            assert torch.equal(v, s0[k]), k


def test_state_is_flat_aligned_and_the_same_objects(standin):
    params = helpers.make_params(SHAPES, F32)
    opt = FusedEmaAdamW(params, master_weights=True)
    for p, g in zip(params, grads_for(params, 0)):
        p.grad = g
    with forced_backend(STANDIN):
        opt.step()  # creates the state, then flattens it
    objects = {(i, k): v for i, p in enumerate(params) for k, v in opt.state[p].items()}
    for p, g in zip(params, grads_for(params, 1)):
        p.grad = g
    with forced_backend(STANDIN):
        opt.step()
    for key in ("exp_avg", "exp_avg_sq", "ema"):
        tensors = [opt.state[p][key] for p in params]
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1, key
        for t in tensors:
            assert t.is_contiguous()
            assert (t.storage_offset() * t.element_size()) % flat.ALIGN_BYTES == 0
            assert t.untyped_storage().data_ptr() % 64 == 0
    for (i, k), v in objects.items():
        assert opt.state[params[i]][k] is v  # re-pointed in place, never replaced
    (bucket,) = buckets(opt)
    assert bucket.layout.offsets[:3] == (0, 128, 128)  # (3,5) at 0, (0,) and (130,) at 128


def test_bf16_master_layout_aligns_to_512_bytes(standin):
    params = helpers.make_params(((3,), (5,)), BF16)
    opt = FusedEmaAdamW(params, master_weights=True)
    for p, g in zip(params, grads_for(params, 0)):
        p.grad = g
    with forced_backend(STANDIN):
        opt.step()
    (bucket,) = buckets(opt)
    assert bucket.layout.offsets == (0, 256)  # 512 bytes of the narrowest (bf16) buffer
    for p in params:
        for t in opt.state[p].values():
            if t.dim():
                assert (t.storage_offset() * t.element_size()) % 512 == 0


def test_param_without_grad_keeps_its_state_and_step(standin):
    params = helpers.make_params(((4,), (6,), (5,)), F32)
    opt = FusedEmaAdamW(params, weight_decay=0.1)
    for k in range(3):
        for p, g in zip(params, grads_for(params, k)):
            p.grad = g
        with forced_backend(STANDIN):
            opt.step()
    idle = params[1]
    saved = {k: v.clone() for k, v in opt.state[idle].items()}
    value = idle.detach().clone()
    for k in range(3, 6):
        for p, g in zip(params, grads_for(params, k)):
            p.grad = None if p is idle else g
        with forced_backend(STANDIN):
            opt.step()
        assert torch.equal(idle, value)
        for key, v in opt.state[idle].items():
            assert torch.equal(v, saved[key]), key
    assert int(opt.state[idle]["step"]) == 3 and int(opt.state[params[0]]["step"]) == 6


def test_state_dict_round_trip(standin):
    kw = dict(dtype=BF16, master_weights=True, weight_decay=0.1)
    pa, oa = train(STANDIN, steps=5, **kw)
    buf = io.BytesIO()
    torch.save({"model": [p.detach() for p in pa], "opt": oa.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    assert saved["opt"]["state"][0]["master_param"].dtype == F32
    assert saved["opt"]["state"][0]["exp_avg"].shape == SHAPES[0]
    # a fresh optimizer loads it and continues; so does an unflattened reference run
    pc = helpers.make_params(SHAPES, BF16)
    with torch.no_grad():
        for p, v in zip(pc, saved["model"]):
            p.copy_(v)
    oc = FusedEmaAdamW(pc, master_weights=True, weight_decay=0.1)
    oc.load_state_dict(saved["opt"])
    pb, ob = train("reference", steps=5, **kw)
    for k in range(5, 9):
        for p, q, r, g in zip(pa, pb, pc, grads_for(pa, k)):
            p.grad, q.grad, r.grad = g, g.clone(), g.clone()
        with forced_backend(STANDIN):
            oa.step()
            oc.step()
        with forced_backend("reference"):
            ob.step()
    assert_same(pa, oa, pb, ob)
    assert_same(pc, oc, pb, ob)
    assert len({oc.state[p]["exp_avg"].untyped_storage().data_ptr() for p in pc}) == 1
    # the state dict format is the reference's
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for pid in sb["state"]:
        assert sa["state"][pid].keys() == sb["state"][pid].keys()


def test_rebuilt_plan_reuses_the_flat_state(standin):
    params, opt = train(STANDIN, steps=2)
    (first,) = buckets(opt)
    assert first.stats["prepare_copies"] == 3  # m, v, EMA copied in once
    opt._plans.clear()  # as add_param_group / a refused bind would
    for p, g in zip(params, grads_for(params, 7)):
        p.grad = g
    with forced_backend(STANDIN):
        opt.step()
    (second,) = buckets(opt)
    assert second is not first and second.stats["prepare_copies"] == 0
    assert second.exp_avg.flat.data_ptr() == first.exp_avg.flat.data_ptr()


def test_megatron_style_flat_params_and_grads_copy_nothing(standin):
    shapes = ((4, 3), (5,), (2, 2))
    sizes = [torch.Size(s).numel() for s in shapes]
    pbuf, gbuf = torch.randn(sum(sizes)), torch.zeros(sum(sizes))
    params, grads, pos = [None] * 3, [None] * 3, 0
    for i in (2, 1, 0):  # laid out in reverse, as Megatron does
        params[i] = torch.nn.Parameter(pbuf[pos:pos + sizes[i]].view(shapes[i]))
        grads[i] = gbuf[pos:pos + sizes[i]].view(shapes[i])
        pos += sizes[i]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedEmaAdamW(params, weight_decay=0.1, lr=1e-2)
    ropt = FusedEmaAdamW(ref, weight_decay=0.1, lr=1e-2)
    def step_both():
        for p, q, g in zip(params, ref, grads):
            p.grad, q.grad = g, g.clone()
        with forced_backend(STANDIN):
            opt.step()
        with forced_backend("reference"):
            ropt.step()

    for k in range(4):
        gbuf.copy_(torch.randn(gbuf.shape, generator=torch.Generator().manual_seed(k)))
        step_both()
    (bucket,) = buckets(opt)
    assert bucket.param_region is not None and bucket.layout.gap_free
    assert bucket.layout.offsets == (9, 4, 0)
    assert bucket.stats["grad_alias"] == 4 and bucket.stats["grad_gathers"] == 0
    assert all(p.untyped_storage().data_ptr() == pbuf.data_ptr() for p in params)
    assert_same(params, opt, ref, ropt)
    # a param reallocated behind the optimizer's back: noticed at bind, the plan is rebuilt
    params[1].data = params[1].data.clone()
    step_both()
    (bucket,) = buckets(opt)
    assert bucket.param_region is None
    assert_same(params, opt, ref, ropt)


def test_noop_flag_and_check_finite_change_nothing(standin):
    params = helpers.make_params(((6,), (0,), (9,)), F32)
    state = [[torch.rand(p.shape) for p in params] for _ in range(3)]
    grads = grads_for(params, 0)
    before = [[t.clone() for t in ts] for ts in [params] + state]
    lists = [grads, params] + state
    noop = torch.ones(1, dtype=torch.int32)
    multi_tensor_fused_ema_adamw(2048, noop, lists, 1e-2, 0.99, 0.9, 0.999, 1e-8, 1, 1, True, 0.1)
    grads[2][3] = float("inf")
    noop = torch.zeros(1, dtype=torch.int32)
    multi_tensor_fused_ema_adamw(2048, noop, lists, 1e-2, 0.99, 0.9, 0.999, 1e-8, 1, 1, True, 0.1,
                                 check_finite=True)
    assert int(noop) == 1
    for ts, bs in zip([params] + state, before):
        for t, b in zip(ts, bs):
            assert torch.equal(t, b)


@pytest.mark.parametrize("mode", ["exact", "cann"])
def test_fp64_is_refused_at_planning_naming_the_tensor(mode):
    """No fp64 on the AI Core: an fp64 param fails when its bucket is prepared, before any
    state or param changes."""
    params = helpers.make_params(((3, 5), (4,)), F64)
    opt = FusedEmaAdamW(params)
    for p, g in zip(params, grads_for(params, 0)):
        p.grad = g
    before = [p.detach().clone() for p in params]
    with npu_standin.standin_backend(mode=mode), forced_backend(STANDIN):
        with pytest.raises(TypeError, match=r"params\[0\].*float64.*no fp64"):
            opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_prepared_bucket_noop_and_bind_refusals(standin):
    params = helpers.make_params(((6,), (9,)), F32)
    state = [[torch.zeros(p.shape) for p in params] for _ in range(3)]
    bucket = standin.prepare_bucket("fused_ema_adamw", AdamLists(None, params, *state), 2048)
    assert not bucket.bind([params[0].detach()])                    # count
    assert not bucket.bind([torch.zeros(6), torch.zeros(8)])        # shape
    assert not bucket.bind([torch.zeros(6, dtype=F64), torch.zeros(9, dtype=F64)])
    assert not bucket.bind([torch.zeros(6), None])
    assert bucket.bind(grads_for(params, 0))
    before = [p.detach().clone() for p in params]
    scalars = rules.step_scalars(rules.AdamHyper(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                                                 ema_decay=0.9), 1)
    bucket.run(torch.ones(1, dtype=torch.int32), scalars)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    with pytest.raises(RuntimeError, match="bind"):
        bucket.run(torch.zeros(1, dtype=torch.int32), scalars)  # the bind was used up


def test_functional_call_stages_the_callers_tensors(standin):
    """A one-shot call copies in and out; the caller's tensors keep their own storage."""
    params = helpers.make_params(((6,), (9,), (4, 4)), F32)
    state = [[torch.rand(p.shape) for p in params] for _ in range(3)]
    ptrs = [t.data_ptr() for ts in [params] + state for t in ts]
    ref_params = [p.detach().clone() for p in params]
    ref_state = [[t.clone() for t in ts] for ts in state]
    grads = grads_for(params, 0)
    args = (1e-2, 0.99, 0.9, 0.999, 1e-8, 3, 1, True, 0.1)
    multi_tensor_fused_ema_adamw(2048, torch.zeros(1, dtype=torch.int32),
                                 [grads, params] + state, *args)
    with forced_backend("reference"):
        multi_tensor_fused_ema_adamw(2048, torch.zeros(1, dtype=torch.int32),
                                     [grads, ref_params] + ref_state, *args)
    assert ptrs == [t.data_ptr() for ts in [params] + state for t in ts]
    for a, b in zip(params + sum(state, []), ref_params + sum(ref_state, [])):
        assert torch.equal(a, b)


def test_complex_params_run_staged(standin):
    kw = dict(dtype=torch.complex64, shapes=((3,), (2, 2)), steps=4, weight_decay=0.1)
    pa, oa = train(STANDIN, **kw)
    pb, ob = train("reference", **kw)
    assert_same(pa, oa, pb, ob)
    assert all(fl.staged for b in buckets(oa) for fl in b.state)


def test_only_empty_tensors(standin):
    kw = dict(shapes=((0,), (3, 0)), steps=3)
    pa, oa = train(STANDIN, **kw)
    pb, ob = train("reference", **kw)
    assert_same(pa, oa, pb, ob)
    assert int(oa.state[pa[0]]["step"]) == 3


def test_torch_path_in_slices_is_still_bitwise(standin, monkeypatch):
    monkeypatch.setattr(npu.bucket, "TORCH_PATH_SLICE", 100)
    pa, oa = train(STANDIN, dtype=BF16, master_weights=True, steps=4)
    pb, ob = train("reference", dtype=BF16, master_weights=True, steps=4)
    assert_same(pa, oa, pb, ob)


# --- the CANN path, with the device operator replaced ------------------------------------------

class Recorder:
    """The reference's seed operator, recording each launch's arguments."""

    def __init__(self, op=npu_standin.reference_device_op):
        self.op, self.calls = op, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.op(*args)


def test_cann_one_launch_per_bucket_with_folded_arguments():
    rec = Recorder()
    with npu_standin.standin_backend(rec, mode="cann"):
        pa, oa = train(STANDIN, dtype=BF16, master_weights=True, steps=3, lr=1e-2,
                       weight_decay=0.1, ema_decay=0.99)
    assert len(rec.calls) == 3  # one bucket, three steps, one launch each
    for step, call in enumerate(rec.calls, 1):
        grad, var, m, v, s, step_t, lr, ema_decay, beta1, beta2, eps, mode, bc, wd = call
        assert {t.dtype for t in (grad, var, m, v, s)} == {F32}
        assert all(t.dim() == 1 and t.is_contiguous() and t.shape == var.shape
                   for t in (grad, m, v, s))
        assert step_t.dtype == torch.int64 and tuple(step_t.shape) == (1,) and int(step_t) == 1
        assert bc is False and mode == 1 and ema_decay == 1.0  # EMA by the unbiased lerp
        bc1, bc2 = 1 - 0.9 ** step, 1 - 0.999 ** step
        assert lr == pytest.approx(1e-2 * bc2 ** 0.5 / bc1, rel=1e-12)
        assert eps == pytest.approx(1e-8 * bc2 ** 0.5, rel=1e-12)
        assert lr * wd == pytest.approx(1e-2 * 0.1, rel=1e-12)
        assert all(type(x) is float for x in (lr, ema_decay, beta1, beta2, eps, wd))
    (bucket,) = buckets(oa)
    assert bucket.last_path == "cann" and bucket.stats["launches"] == 3


@pytest.mark.parametrize("dtype,master", [(F32, False), (BF16, True)])
def test_cann_path_within_tolerance_of_the_reference(dtype, master):
    kw = dict(dtype=dtype, master_weights=master, steps=8, lr=1e-2, weight_decay=0.1,
              ema_decay=0.9, skip=lambda k, i: i == 2 and k == 3)
    with npu_standin.standin_backend(mode="cann"):
        pa, oa = train(STANDIN, **kw)
    pb, ob = train("reference", **kw)
    for p, q in zip(pa, pb):
        for key in ("exp_avg", "exp_avg_sq"):  # same scalars, same operation: bitwise
            assert torch.equal(oa.state[p][key], ob.state[q][key])
        for key in ("ema", "master_param") if master else ("ema",):
            torch.testing.assert_close(oa.state[p][key], ob.state[q][key], rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(p, q, rtol=2e-6 if dtype == F32 else 8e-3, atol=1e-7)


def test_cann_literal_hands_the_ema_to_the_operator():
    rec = Recorder(npu_standin.literal_device_op)
    with npu_standin.standin_backend(rec, mode="cann_literal"):
        pa, oa = train(STANDIN, steps=2, ema_decay=0.9)
    assert [call[7] for call in rec.calls] == [pytest.approx(0.9, abs=1e-15)] * 2
    (bucket,) = buckets(oa)
    assert bucket.last_path == "cann_literal"


@pytest.mark.parametrize("name,kw", [
    ("maximize", dict(maximize=True)),
    ("adam op", dict(opt_cls=FusedAdam)),
    ("radam op", dict(opt_cls=FusedRAdam, ema_decay=0.9)),
    ("grads wider than state", dict(dtype=BF16, grad_dtype=F32, master_weights=False)),
    ("grad scale on fp16 state", dict(dtype=F16, master_weights=False, scale=64.0)),
    ("bf16 EMA beside fp32 state", dict(ema_dtype=BF16)),
])
def test_cann_mode_falls_back_to_the_exact_path(name, kw):
    rec = Recorder()
    kw = dict(kw, steps=4)
    with npu_standin.standin_backend(rec, mode="cann"):
        pa, oa = train(STANDIN, **kw)
    pb, ob = train("reference", **kw)
    assert rec.calls == []
    assert all(b.last_path == "exact" and b.last_reason in npu.fallback_reasons()
               for b in buckets(oa)), name
    assert_same(pa, oa, pb, ob)


def test_cann_unscales_and_checks_a_copy_of_zero_copy_grads():
    pbuf, gbuf = torch.randn(16), torch.randn(16) * 100
    params = [torch.nn.Parameter(pbuf[:8]), torch.nn.Parameter(pbuf[8:])]
    grads = [gbuf[:8], gbuf[8:]]
    graw = gbuf.clone()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ropt = FusedEmaAdamW(params), FusedEmaAdamW(ref)
    with npu_standin.standin_backend(mode="cann"):
        for o, ps in ((opt, params), (ropt, ref)):
            for p, g in zip(ps, grads):
                p.grad = g if o is opt else g.clone()
            o.grad_scale, o.found_inf = torch.tensor(100.0), torch.zeros(())
            with forced_backend(STANDIN if o is opt else "reference"):
                o.step()
        (bucket,) = buckets(opt)
        assert bucket.last_path == "cann" and bucket.stats["grad_alias"] == 1
    assert torch.equal(gbuf, graw)  # the caller's grads were not unscaled in place
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)


def test_cann_check_finite_skips_the_step():
    params = helpers.make_params(((6,), (9,)), F32)
    state = [[torch.rand(p.shape) for p in params] for _ in range(3)]
    before = [[t.detach().clone() for t in ts] for ts in [params] + state]
    grads = grads_for(params, 0)
    grads[1][0] = float("nan")
    noop = torch.zeros(1, dtype=torch.int32)
    rec = Recorder()
    with npu_standin.standin_backend(rec, mode="cann"):
        multi_tensor_fused_ema_adamw(2048, noop, [grads, params] + state, 1e-2, 0.99, 0.9,
                                     0.999, 1e-8, 1, 1, True, 0.1, check_finite=True,
                                     grad_scale=torch.tensor(4.0))
    assert int(noop) == 1 and rec.calls == []
    for ts, bs in zip([params] + state, before):
        assert all(torch.equal(t, b) for t, b in zip(ts, bs))


def test_cann_splits_huge_buckets_into_launches(monkeypatch):
    monkeypatch.setattr(npu.bucket, "MAX_LAUNCH_NUMEL", 128)
    rec = Recorder()
    with npu_standin.standin_backend(rec, mode="cann"):
        pa, oa = train(STANDIN, steps=1)
    (bucket,) = buckets(oa)
    assert len(rec.calls) == -(-bucket.layout.total // 128) > 1


@pytest.mark.parametrize("decoupled,bias_correction,step", [
    (True, True, 1), (True, True, 1000), (False, True, 3), (True, False, 7), (False, False, 2)])
def test_folded_scalars_are_the_same_update(decoupled, bias_correction, step):
    h = rules.AdamHyper(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05,
                        decoupled=decoupled, bias_correction=bias_correction, ema_decay=0.999)
    c = rules.step_scalars(h, step)
    f = npu.fold_scalars(c)
    w, m, v = 0.7, 0.02, 3e-4
    g = 0.0  # the update given m, v (after the moment lines, which the fold leaves alone)
    bc1, bc2 = ((1 - 0.9 ** step, 1 - 0.999 ** step) if bias_correction else (1.0, 1.0))
    seed_update = (m / bc1) / ((v / bc2) ** 0.5 + 1e-8) + (0.05 * w if decoupled else 0.0)
    folded_update = m / (v ** 0.5 + f["eps"]) + (f["weight_decay"] * w if f["mode"] else 0.0)
    assert f["lr"] * folded_update == pytest.approx(3e-3 * seed_update + g, rel=1e-12)
    assert f["mode"] == (1 if decoupled else 0)
    if not decoupled:
        assert f["weight_decay"] == 0.05


def test_op_mode_is_checked():
    with pytest.raises(ValueError, match="cann_literal"):
        npu.set_op_mode("fast")
    assert npu.get_op_mode() == npu.DEFAULT_MODE == "cann"  # MULTI_TENSOR_NPU_OP unset
    with npu.op_mode("exact"):
        assert npu.get_op_mode() == "exact"
    with npu.op_mode("torch"):  # the exact path's other name
        assert npu.get_op_mode() == "exact"
    assert npu.get_op_mode() == "cann"


def test_the_default_and_its_fallbacks_in_the_env_report():
    from multi_tensor import env

    text = env.report()
    assert "NPU op mode cann" in text and "exact path instead for:" in text
    assert "maximize" in text


def test_the_stand_in_is_removed_after_use():
    import multi_tensor

    with npu_standin.standin_backend() as backend:
        assert multi_tensor.backend_for("fused_ema_adamw", "cpu") is backend
    names = [b.name for b in multi_tensor.registered_backends()]
    assert STANDIN not in names and "npu" in names
    assert multi_tensor.backend_for("fused_ema_adamw", "cpu").name != STANDIN
