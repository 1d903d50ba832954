"""FusedEmaAdamW as a torch.optim.Optimizer: against torch.optim.AdamW/Adam, mixed precision with
fp32 masters, chunk size and bucket order invariance, intermittent grads, param groups, LR
schedulers, hooks, closures and EMA access."""
from __future__ import annotations

import copy

import pytest
import torch

import helpers

from fused_optim import FusedEmaAdamW
from fused_optim.planning import PlanningMixin
from seed_reference import (SeedParamState, assert_bitwise_equal, assert_close64,
                            assert_unchanged, assert_within_ulps, seed_update, snapshot)

SHAPES = [(5, 4), (4,), (0,), (3, 2, 2), (1,)]


def make_grads(params, steps, seed=1, dtype=None):
    """``grads[step][i]``: fixed random grads, optionally rounded to ``dtype`` (kept in fp32)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        gs = [torch.randn(p.shape, generator=gen) for p in params]
        if dtype is not None:
            gs = [g.to(dtype).float() for g in gs]
        out.append(gs)
    return out


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.to(p.dtype).clone()


# ---------------------------------------------------------------------------------------------
# against torch.optim

@pytest.mark.parametrize("adam_w_mode,maximize", [(True, False), (False, False), (True, True)])
def test_matches_torch_over_100_steps(backend, adam_w_mode, maximize):
    lr, betas, eps, wd, decay = 1e-3, (0.9, 0.999), 1e-8, 0.05, 0.9
    ours = helpers.make_params(SHAPES)
    theirs = helpers.make_params(SHAPES)
    opt = FusedEmaAdamW(ours, lr=lr, betas=betas, eps=eps, weight_decay=wd, ema_decay=decay,
                        adam_w_mode=adam_w_mode, maximize=maximize)
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = torch_cls(theirs, lr=lr, betas=betas, eps=eps, weight_decay=wd, maximize=maximize,
                    foreach=False)
    ema = [p.detach().double().clone() for p in theirs]
    for grads in make_grads(ours, 100):
        set_grads(ours, grads)
        set_grads(theirs, grads)
        opt.step()
        ref.step()
        for e, p in zip(ema, theirs):
            e.mul_(decay).add_((1 - decay) * p.detach().double())
    for i, (p, q, e) in enumerate(zip(ours, theirs, ema)):
        st, rst = opt.state[p], ref.state[q]
        assert p.dtype == torch.float32
        assert int(st["step"]) == 100 and int(rst["step"]) == 100
        assert set(st) == {"step", "exp_avg", "exp_avg_sq", "ema"}
        assert_close64(p, q, rtol=1e-5, atol=1e-6, msg=f"param {i}")
        assert_close64(st["exp_avg"], rst["exp_avg"], rtol=1e-5, atol=1e-7, msg=f"exp_avg {i}")
        assert_close64(st["exp_avg_sq"], rst["exp_avg_sq"], rtol=1e-5, atol=1e-9, msg=f"exp_avg_sq {i}")
        assert_close64(st["ema"], e, rtol=1e-5, atol=1e-6, msg=f"ema {i}")
        assert st["ema"].dtype == torch.float32
    # the trajectory really moved: 100 steps of lr 1e-3 change params far beyond the tolerance
    start = helpers.make_params(SHAPES)
    assert any((p - s).abs().max() > 1e-2 for p, s in zip(ours, start) if p.numel())


def test_fp64_params_match_torch(backend):
    ours = helpers.make_params(SHAPES, torch.float64)
    theirs = helpers.make_params(SHAPES, torch.float64)
    opt = FusedEmaAdamW(ours, lr=1e-2, weight_decay=0.1, ema_decay=0.5)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, foreach=False)
    for grads in make_grads(ours, 20):
        set_grads(ours, [g.double() for g in grads])
        set_grads(theirs, [g.double() for g in grads])
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        assert opt.state[p]["exp_avg"].dtype == torch.float64
        assert_close64(p, q, rtol=1e-12, atol=1e-13)


def test_real_model_training_loop_matches_torch(backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 2, generator=gen)
        for mdl, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            torch.nn.functional.mse_loss(mdl(x), y).backward()
            o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close64(p, q, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# mixed precision

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_with_masters_tracks_fp32_run(backend, dtype):
    """bf16/fp16 params + fp32 masters vs an fp32 run on the same (representable) grads."""
    decay = 0.9
    low = helpers.make_params(SHAPES, dtype)
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in low]  # the same starting values
    opt = FusedEmaAdamW(low, lr=1e-3, weight_decay=0.05, ema_decay=decay)
    ref = FusedEmaAdamW(fp32, lr=1e-3, weight_decay=0.05, ema_decay=decay)
    for grads in make_grads(low, 100, dtype=dtype):
        set_grads(low, grads)
        set_grads(fp32, grads)
        opt.step()
        ref.step()
        for p in low:
            assert_bitwise_equal(p, opt.state[p]["master_param"].to(dtype), "param == round(master)")
    for i, (p, q) in enumerate(zip(low, fp32)):
        st, rst = opt.state[p], ref.state[q]
        assert p.dtype == dtype
        assert set(st) == {"step", "exp_avg", "exp_avg_sq", "ema", "master_param"}
        for key in ("exp_avg", "exp_avg_sq", "ema", "master_param"):
            assert st[key].dtype == torch.float32, key
        # masters get exactly the fp32 run's inputs, so they follow it closely (in fact bitwise:
        # the same fp32 arithmetic on the same values)
        assert_close64(st["master_param"], q, rtol=1e-6, atol=1e-7, msg=f"master {i}")
        assert_bitwise_equal(st["master_param"], q.detach(), f"master {i} vs fp32 run")
        assert_bitwise_equal(st["ema"], rst["ema"], f"ema {i} vs fp32 run")
        assert_bitwise_equal(st["exp_avg"], rst["exp_avg"], f"exp_avg {i}")
        assert_bitwise_equal(st["exp_avg_sq"], rst["exp_avg_sq"], f"exp_avg_sq {i}")
        # params: within the low-precision dtype's resolution of the fp32 run
        res = torch.finfo(dtype).eps
        assert_close64(p, q, rtol=res, atol=res * 1e-3, msg=f"param {i}")


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
def test_bf16_params_with_other_grad_dtypes(backend, grad_dtype):
    """Grads may be fp16/bf16/fp32 (torch's ``grad_dtype``): the masters see the exact grads."""
    low = helpers.make_params(SHAPES, torch.bfloat16)
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in low]
    for p in low:
        p.grad_dtype = grad_dtype
    opt = FusedEmaAdamW(low, lr=1e-3, weight_decay=0.05, ema_decay=0.9)
    ref = FusedEmaAdamW(fp32, lr=1e-3, weight_decay=0.05, ema_decay=0.9)
    for grads in make_grads(low, 5, dtype=grad_dtype):
        for p, q, g in zip(low, fp32, grads):
            p.grad = g.to(grad_dtype)
            q.grad = g.clone()
        opt.step()
        ref.step()
    for p, q in zip(low, fp32):
        assert p.grad.dtype == grad_dtype
        assert_bitwise_equal(opt.state[p]["master_param"], q.detach(), "master vs fp32 run")
        assert_bitwise_equal(opt.state[p]["ema"], ref.state[q]["ema"], "ema vs fp32 run")
        assert_bitwise_equal(p, q.detach().bfloat16(), "param")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_false_keeps_state_in_param_dtype(backend, dtype):
    params = helpers.make_params(SHAPES, dtype)
    opt = FusedEmaAdamW(params, lr=1e-2, weight_decay=0.05, ema_decay=0.5, master_weights=False)
    grads = make_grads(params, 3, dtype=dtype)
    for it, gs in enumerate(grads):
        set_grads(params, gs)
        before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) if opt.state[p]
                  else None for p in params]
        opt.step()
        for i, p in enumerate(params):
            st = opt.state[p]
            assert "master_param" not in st
            for key in ("exp_avg", "exp_avg_sq", "ema"):
                assert st[key].dtype == dtype, key
            if before[i] is None:
                continue
            p0, s0 = before[i]
            var_, m_, v_, s_ = seed_update(gs[i], p0, s0["exp_avg"], s0["exp_avg_sq"], s0["ema"],
                                           it + 1, 1e-2, 0.5, 0.9, 0.999, 1e-8, 1, True, 0.05)
            # computed in fp32, rounded once to the param dtype: within one ulp of the exact value
            for name, actual, exp in (("param", p, var_), ("m", st["exp_avg"], m_),
                                      ("v", st["exp_avg_sq"], v_), ("ema", st["ema"], s_)):
                if exp.numel():
                    assert_within_ulps(actual, exp, 1.0, msg=f"step {it + 1} {name} {i}")


def test_state_layout(backend):
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4).bfloat16())]
    opt = FusedEmaAdamW(params)
    set_grads(params, [torch.randn(3, 2), torch.randn(4)])
    opt.step()
    s0, s1 = opt.state[params[0]], opt.state[params[1]]
    for st in (s0, s1):
        assert isinstance(st["step"], torch.Tensor) and st["step"].dtype == torch.float32
        assert st["step"].dim() == 0 and st["step"].item() == 1.0
    assert "master_param" not in s0 and s1["master_param"].dtype == torch.float32
    assert s0["ema"].shape == params[0].shape and s1["ema"].shape == params[1].shape


# ---------------------------------------------------------------------------------------------
# invariance: chunk size, bucket order

MIXED_SPECS = [((5, 4), torch.float32), ((4,), torch.bfloat16), ((0,), torch.float32),
               ((3, 2, 2), torch.float16), ((1,), torch.bfloat16), ((300,), torch.float32),
               ((7, 9), torch.float16), ((2,), torch.float64)]


def make_mixed(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in MIXED_SPECS]


def run_mixed(order, groups=None, steps=3, **kw):
    """Optimize the mixed params given in ``order`` (indices); results in the original order."""
    params = make_mixed()
    grads = make_grads(params, steps, seed=5)
    if groups is None:
        ordered = [params[i] for i in order]
    else:
        ordered = [{"params": [params[i] for i in g]} for g in groups]
    opt = FusedEmaAdamW(ordered, lr=1e-2, weight_decay=0.02, ema_decay=0.7, **kw)
    for gs in grads:
        set_grads(params, [g.to(p.dtype) for p, g in zip(params, gs)])
        opt.step()
    return [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params]


def assert_same_results(a, b, what):
    for i, ((pa, sa), (pb, sb)) in enumerate(zip(a, b)):
        assert_bitwise_equal(pb, pa, f"{what}: param {i}")
        assert set(sa) == set(sb)
        for k in sa:
            assert_bitwise_equal(sb[k], sa[k], f"{what}: state[{i}][{k}]")


def test_chunk_size_does_not_change_bits(backend):
    order = list(range(len(MIXED_SPECS)))
    base = run_mixed(order, chunk_size=2048 * 32)
    for chunk_size in (1, 7):
        assert_same_results(base, run_mixed(order, chunk_size=chunk_size), f"chunk_size={chunk_size}")


def test_bucket_order_does_not_change_bits(backend):
    n = len(MIXED_SPECS)
    base = run_mixed(list(range(n)))
    orders = [list(reversed(range(n))), [3, 0, 6, 1, 7, 2, 5, 4],
              sorted(range(n), key=lambda i: str(MIXED_SPECS[i][1]))]
    for order in orders:
        assert_same_results(base, run_mixed(order), f"order {order}")
    # split across param groups (same hyperparameters): still the same bits
    assert_same_results(base, run_mixed(None, groups=[[7, 1, 2], [0, 6], [5, 4, 3]]), "groups")
    # every param alone in its own group: one bucket per param
    assert_same_results(base, run_mixed(None, groups=[[i] for i in range(n)]), "singletons")


# ---------------------------------------------------------------------------------------------
# intermittent grads

def test_param_without_grad_is_skipped_and_keeps_its_step(backend):
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.02, ema_decay=0.8)
    params = helpers.make_params([(4, 3), (5,), (2, 2)])
    refs = [SeedParamState(p) for p in params]
    opt = FusedEmaAdamW(params, **hp)
    gen = torch.Generator().manual_seed(9)
    # which params have a grad at each step (param 1 skips steps 2-4, param 2 starts late)
    pattern = [(1, 1, 0), (1, 0, 0), (1, 0, 1), (1, 0, 1), (1, 1, 1), (0, 1, 1), (1, 1, 1)]
    for it, has in enumerate(pattern):
        grads = [torch.randn(p.shape, generator=gen) if h else None for p, h in zip(params, has)]
        set_grads(params, grads)
        before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params]
        opt.step()
        for i, (p, g, r) in enumerate(zip(params, grads, refs)):
            if g is None:
                p0, s0 = before[i]
                assert_bitwise_equal(p, p0, f"step {it}: skipped param {i} changed")
                assert set(opt.state[p]) == set(s0)
                for k, v in s0.items():
                    assert_bitwise_equal(opt.state[p][k], v, f"step {it}: skipped state[{i}][{k}]")
                continue
            r.update(g, **hp)
            st = opt.state[p]
            assert int(st["step"]) == r.step, f"param {i}"
            assert_close64(p, r.var, rtol=1e-6, atol=1e-6, msg=f"step {it} param {i}")
            assert_close64(st["exp_avg"], r.m, rtol=1e-6, atol=1e-6, msg=f"step {it} m {i}")
            assert_close64(st["exp_avg_sq"], r.v, rtol=1e-6, atol=1e-9, msg=f"step {it} v {i}")
            assert_close64(st["ema"], r.s, rtol=1e-6, atol=1e-6, msg=f"step {it} ema {i}")
    assert [r.step for r in refs] == [6, 4, 5]
    assert [int(opt.state[p]["step"]) for p in params] == [6, 4, 5]


def test_param_losing_its_grad_after_the_plan_is_cached_is_skipped(backend):
    """One group, one bucket: its call reads the grads itself; a missing one re-plans first."""
    params = helpers.make_params([(4, 3), (5,), (2, 2)])
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.8)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):  # all params step together: one cached plan with one bucket
        set_grads(params, [torch.randn(p.shape, generator=gen) for p in params])
        opt.step()
    set_grads(params, [torch.randn(params[0].shape, generator=gen), None,
                       torch.randn(params[2].shape, generator=gen)])
    skipped = params[1].detach().clone()
    skipped_state = {k: v.clone() for k, v in opt.state[params[1]].items()}
    opt.step()
    assert_bitwise_equal(params[1], skipped, "param without grad changed")
    for k, v in skipped_state.items():
        assert_bitwise_equal(opt.state[params[1]][k], v, f"state[{k}] of the skipped param")
    assert [int(opt.state[p]["step"]) for p in params] == [3, 2, 3]


def test_no_grads_at_all_is_a_noop(backend):
    params = helpers.make_params(SHAPES)
    opt = FusedEmaAdamW(params)
    saved = snapshot(params)
    opt.step()
    assert_unchanged(params, saved)
    assert all(len(opt.state[p]) == 0 for p in params)


# ---------------------------------------------------------------------------------------------
# param groups, schedulers, hooks, closures

GROUP_HP = [dict(lr=1e-2, weight_decay=0.0, ema_decay=0.5, betas=(0.9, 0.999), eps=1e-8),
            dict(lr=3e-3, weight_decay=0.1, ema_decay=0.99, betas=(0.8, 0.9), eps=1e-3),
            dict(lr=5e-2, weight_decay=0.01, ema_decay=0.0, betas=(0.0, 0.5), eps=1e-6)]


def test_param_groups_with_their_own_hyperparameters(backend):
    params = helpers.make_params([(3, 4), (5,), (2, 3), (4,), (6,)])
    groups = [{"params": params[:2], **GROUP_HP[0]}, {"params": params[2:4], **GROUP_HP[1]},
              {"params": params[4:], **GROUP_HP[2]}]
    group_of = [0, 0, 1, 1, 2]
    opt = FusedEmaAdamW(groups, lr=1.0, weight_decay=1.0, ema_decay=0.1)  # defaults all overridden
    refs = [SeedParamState(p) for p in params]
    grads = make_grads(params, 5, seed=3)
    for gs in grads:
        set_grads(params, gs)
        opt.step()
        for r, g, gi in zip(refs, gs, group_of):
            r.update(g, **GROUP_HP[gi])
    for i, (p, r) in enumerate(zip(params, refs)):
        st = opt.state[p]
        assert_close64(p, r.var, rtol=1e-6, atol=1e-6, msg=f"param {i}")
        assert_close64(st["exp_avg"], r.m, rtol=1e-6, atol=1e-6, msg=f"m {i}")
        assert_close64(st["exp_avg_sq"], r.v, rtol=1e-6, atol=1e-9, msg=f"v {i}")
        assert_close64(st["ema"], r.s, rtol=1e-6, atol=1e-6, msg=f"ema {i}")


def test_per_group_adam_w_mode_and_bias_correction(backend):
    params = helpers.make_params([(3,), (4,)])
    opt = FusedEmaAdamW([{"params": [params[0]], "adam_w_mode": False, "bias_correction": False},
                         {"params": [params[1]]}], lr=1e-2, weight_decay=0.1, ema_decay=0.9)
    gs = make_grads(params, 1)[0]
    expected = [seed_update(gs[0], params[0], torch.zeros(3), torch.zeros(3), params[0], 1, 1e-2, 0.9,
                            0.9, 0.999, 1e-8, 0, False, 0.1),
                seed_update(gs[1], params[1], torch.zeros(4), torch.zeros(4), params[1], 1, 1e-2, 0.9,
                            0.9, 0.999, 1e-8, 1, True, 0.1)]
    set_grads(params, gs)
    opt.step()
    for p, (var_, m_, v_, s_) in zip(params, expected):
        assert_close64(p, var_, rtol=1e-6, atol=1e-6)
        assert_close64(opt.state[p]["ema"], s_, rtol=1e-6, atol=1e-6)


def test_step_lr_scheduler_takes_effect(backend):
    params = helpers.make_params([(4, 3), (5,)])
    opt = FusedEmaAdamW(params, lr=1e-2, weight_decay=0.01, ema_decay=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    refs = [SeedParamState(p) for p in params]
    lrs = []
    for gs in make_grads(params, 6, seed=4):
        lr = opt.param_groups[0]["lr"]
        lrs.append(lr)
        set_grads(params, gs)
        opt.step()
        sched.step()
        for r, g in zip(refs, gs):
            r.update(g, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, ema_decay=0.9)
    assert lrs == pytest.approx([1e-2, 1e-2, 1e-3, 1e-3, 1e-4, 1e-4])
    for p, r in zip(params, refs):
        assert_close64(p, r.var, rtol=1e-6, atol=1e-7)
        assert_close64(opt.state[p]["ema"], r.s, rtol=1e-6, atol=1e-7)


def test_lr_change_in_group_takes_effect_with_cached_plan(backend):
    params = helpers.make_params([(6,)])
    opt = FusedEmaAdamW(params, lr=1e-2, weight_decay=0.0)
    for gs in make_grads(params, 2):
        set_grads(params, gs)
        opt.step()
    opt.param_groups[0]["lr"] = 0.0
    opt.param_groups[0]["ema_decay"] = 0.0
    before = params[0].detach().clone()
    set_grads(params, make_grads(params, 1, seed=77)[0])
    opt.step()
    assert_bitwise_equal(params[0], before, "lr=0 changes nothing")
    assert_bitwise_equal(opt.state[params[0]]["ema"], before, "ema_decay=0: ema = param")


def test_zero_grad(backend):
    params = helpers.make_params([(3,), (2, 2)])
    opt = FusedEmaAdamW(params)
    set_grads(params, make_grads(params, 1)[0])
    opt.step()
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    saved = snapshot(params)
    opt.step()  # no grads: nothing happens
    assert_unchanged(params, saved)
    assert all(int(opt.state[p]["step"]) == 1 for p in params)


def test_step_with_closure_returns_loss(backend):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    calls = []

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        calls.append(loss.detach())
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    loss = opt.step(closure)
    assert len(calls) == 1 and torch.equal(loss.detach(), calls[0])
    assert loss.requires_grad  # grad mode was enabled inside the closure
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.step() is None


def test_step_pre_and_post_hooks_fire(backend):
    params = helpers.make_params([(3,)])
    opt = FusedEmaAdamW(params)
    events = []

    def pre(optimizer, args, kwargs):
        events.append(("pre", int(optimizer.state[params[0]].get("step", torch.tensor(0.0)))))

    def post(optimizer, args, kwargs):
        events.append(("post", int(optimizer.state[params[0]]["step"])))

    h1 = opt.register_step_pre_hook(pre)
    h2 = opt.register_step_post_hook(post)
    set_grads(params, make_grads(params, 1)[0])
    opt.step()
    opt.step()
    assert events == [("pre", 0), ("post", 1), ("pre", 1), ("post", 2)]
    h1.remove()
    h2.remove()
    opt.step()
    assert len(events) == 4


def test_add_param_group_after_some_steps(backend):
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, ema_decay=0.9)
    new_hp = dict(hp, lr=5e-3, ema_decay=0.5)
    params = helpers.make_params([(4,), (2, 3)])
    extra = helpers.make_params([(5,), (3, 3)], torch.bfloat16, 7)
    opt = FusedEmaAdamW(params, **hp)
    refs = [SeedParamState(p) for p in params]
    extra_refs = [SeedParamState(p) for p in extra]
    gen = torch.Generator().manual_seed(12)
    for it in range(6):
        if it == 3:
            opt.add_param_group({"params": extra, "lr": 5e-3, "ema_decay": 0.5})
        gs = [torch.randn(p.shape, generator=gen) for p in params]
        set_grads(params, gs)
        for r, g in zip(refs, gs):
            r.update(g, **hp)
        if it >= 3:
            egs = [torch.randn(p.shape, generator=gen).bfloat16().float() for p in extra]
            set_grads(extra, egs)
            for r, g in zip(extra_refs, egs):
                r.update(g, **new_hp)
        opt.step()
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 5e-3
    assert opt.param_groups[1]["weight_decay"] == 0.01  # defaults fill the new group
    for p, r in zip(params, refs):
        assert int(opt.state[p]["step"]) == 6
        assert_close64(p, r.var, rtol=1e-6, atol=1e-6)
    for p, r in zip(extra, extra_refs):
        st = opt.state[p]
        assert int(st["step"]) == 3
        assert st["master_param"].dtype == torch.float32
        assert_close64(st["master_param"], r.var, rtol=1e-6, atol=1e-6)
        assert_close64(st["ema"], r.s, rtol=1e-6, atol=1e-6)
        assert_bitwise_equal(p, st["master_param"].bfloat16())


# ---------------------------------------------------------------------------------------------
# EMA access

class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3).to(dtype)
        self.norm = torch.nn.BatchNorm1d(3).to(dtype)
        self.frozen = torch.nn.Parameter(torch.ones(2, dtype=dtype), requires_grad=False)

    def forward(self, x):
        return self.norm(self.lin(x))


def trained(dtype=torch.float32, steps=4):
    torch.manual_seed(0)
    net = Net(dtype)
    opt = FusedEmaAdamW([p for p in net.parameters() if p.requires_grad], lr=5e-2, ema_decay=0.5)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 4, generator=gen).to(dtype)
        net(x).float().square().mean().backward()
        opt.step()
    return net, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_ema_weights_and_restore_exactly(backend, dtype):
    net, opt = trained(dtype)
    params = [p for p in net.parameters() if p.requires_grad]
    saved = snapshot(params)
    state_saved = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    with opt.swap_ema_weights():
        for p, before in zip(params, saved):
            assert_bitwise_equal(p, opt.state[p]["ema"].to(dtype), "param holds the EMA in the block")
            assert not torch.equal(p, before)
        net.eval()
        net(torch.randn(2, 4).to(dtype))
    assert_unchanged(params, saved, "restored params")
    for p in params:
        for k, v in state_saved[id(p)].items():
            assert_bitwise_equal(opt.state[p][k], v, f"state {k}")
    # also when the block raises
    with pytest.raises(KeyError, match="boom"):
        with opt.swap_ema_weights():
            raise KeyError("boom")
    assert_unchanged(params, saved, "restored after an exception")
    # enabled=False: a no-op
    with opt.swap_ema_weights(enabled=False):
        assert_unchanged(params, saved)
    # usable again after all of that, and training continues normally
    with opt.swap_ema_weights():
        pass
    assert_unchanged(params, saved)


def test_step_inside_swap_raises_and_changes_nothing(backend):
    net, opt = trained()
    params = [p for p in net.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.ones_like(p)
    saved = snapshot(params)
    states = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    with pytest.raises(RuntimeError, match="swap_ema_weights"):
        with opt.swap_ema_weights():
            in_block = snapshot(params)
            try:
                opt.step()
            finally:
                assert_unchanged(params, in_block, "step inside the block")
    assert_unchanged(params, saved)
    for p in params:
        for k, v in states[id(p)].items():
            assert_bitwise_equal(opt.state[p][k], v, f"state {k}")
    opt.step()  # fine after the block
    assert int(opt.state[params[0]]["step"]) == 5


def test_nested_swap_raises(backend):
    net, opt = trained()
    params = [p for p in net.parameters() if p.requires_grad]
    saved = snapshot(params)
    with opt.swap_ema_weights():
        with pytest.raises(RuntimeError):
            with opt.swap_ema_weights():
                pass
    assert_unchanged(params, saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_ema_to_other_model(backend, dtype):
    net, opt = trained(dtype)
    other = Net(torch.float32)
    trainable = [p for p in net.parameters() if p.requires_grad]
    saved = snapshot(trainable)
    other_trainable = [p for p in other.parameters() if p.requires_grad]
    opt.copy_ema_to(other_trainable)
    for p, q in zip(trainable, other_trainable):
        assert_bitwise_equal(q.detach(), opt.state[p]["ema"].float(), "copied EMA")
    assert_unchanged(trainable, saved, "source params")
    # a module works too when its parameters() line up with the optimizer's params
    twin = Net(dtype)
    twin.frozen = None
    opt.copy_ema_to(twin)
    for p, q in zip(trainable, twin.parameters()):
        assert_bitwise_equal(q.detach(), opt.state[p]["ema"].to(dtype), "copied EMA (module)")
    with pytest.raises(ValueError):
        opt.copy_ema_to(other_trainable[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ema_state_dict(backend, dtype):
    net, opt = trained(dtype)
    sd = opt.ema_state_dict(net)
    model_sd = net.state_dict()
    assert list(sd) == list(model_sd)
    named = dict(net.named_parameters())
    for name, value in sd.items():
        if name in named and named[name].requires_grad:
            p = named[name]
            assert value.dtype == dtype
            assert_bitwise_equal(value, opt.state[p]["ema"].to(dtype), name)
            assert value.data_ptr() != opt.state[p]["ema"].data_ptr()  # a copy
        else:  # buffers and params the optimizer does not hold: as they are
            assert_bitwise_equal(value, model_sd[name], name)
    # it loads into a fresh model
    fresh = Net(dtype)
    fresh.load_state_dict(sd)
    if dtype == torch.bfloat16:
        sd32 = opt.ema_state_dict(net, dtype=torch.float32)
        for name, p in named.items():
            if p.requires_grad:
                assert sd32[name].dtype == torch.float32
                assert_bitwise_equal(sd32[name], opt.state[p]["ema"], f"fp32 EMA {name}")
                assert not torch.equal(sd32[name], sd32[name].bfloat16().float()), "unrounded"
        assert sd32["norm.running_mean"].dtype == torch.float32
        assert sd32["norm.num_batches_tracked"].dtype == torch.int64


def test_ema_of_unstepped_param_is_the_param(backend):
    params = helpers.make_params([(3,), (4,)])
    opt = FusedEmaAdamW(params, ema_decay=0.5)
    set_grads(params, [torch.ones(3), None])
    opt.step()
    target = [torch.zeros(3), torch.zeros(4)]
    opt.copy_ema_to(target)
    assert_bitwise_equal(target[0], opt.state[params[0]]["ema"])
    assert_bitwise_equal(target[1], params[1].detach())
    saved = snapshot(params)
    with opt.swap_ema_weights():
        assert_bitwise_equal(params[1], saved[1])
    assert_unchanged(params, saved)


# What happens between steps, and whether the steady-state step (planning._steady_step) may take
# the next one: the same grads; new grad objects (zero_grad(set_to_none=True)); a new lr object
# (a scheduler); a param without a grad; GradScaler-style found_inf/grad_scale attributes; a
# second group added. Every step must give the bits of the full step.
STEADY_EVENTS = [
    ("same grads", True),
    ("new grads", True),
    ("new lr", False),
    ("same grads", True),
    ("one grad None", False),
    ("same grads", True),
    ("all grads back", False),
    ("scaler attributes", False),
    ("same grads", True),
    ("add group", False),
    ("new grads", True),
]


def _steady_run(steady: bool, monkeypatch):
    params = helpers.make_params([(7,), (3, 5), (2,)], seed=3)
    extra = helpers.make_params([(4,)], seed=4)
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.9)
    taken = []
    original = PlanningMixin._steady_step

    def steady_step(self):
        took = steady and original(self)
        taken.append(took)
        return took
    monkeypatch.setattr(type(opt), "_steady_step", steady_step)

    def set_grads(seed):
        for p, g in zip(params + extra, helpers.random_grads(params + extra, seed)):
            p.grad = g
    set_grads(10)
    opt.step()
    for k, (event, _) in enumerate(STEADY_EVENTS):
        if event == "new grads":
            set_grads(20 + k)
        elif event == "new lr":
            opt.param_groups[0]["lr"] = 5e-3
        elif event == "one grad None":
            params[1].grad = None
        elif event == "all grads back":
            set_grads(40 + k)
        elif event == "scaler attributes":
            opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.tensor(0.0)
        elif event == "add group":
            opt.add_param_group({"params": extra, "lr": 1e-3})
        taken.clear()
        opt.step()
        if event == "scaler attributes":
            del opt.grad_scale, opt.found_inf
        yield event, taken[0], [t.clone() for p in params + extra
                                for t in (p, *opt.state[p].values())]


def test_steady_step_takes_the_steady_steps_with_the_full_steps_bits(monkeypatch):
    full = list(_steady_run(False, monkeypatch))
    steady = list(_steady_run(True, monkeypatch))
    for (event, expected), (_, _, want), (_, took, got) in zip(STEADY_EVENTS, full, steady):
        assert took == expected, event
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_bitwise_equal(a, b)
