"""torch.optim state-dict compatibility (both ways) and the MindSpeed/diffusers EMA API."""
from __future__ import annotations

import copy

import pytest
import torch

import helpers

import fused_optim
from fused_optim import FusedEmaAdamW, compat


def fused_class(name):
    return getattr(fused_optim, name)  # a removed optimizer fails here (AttributeError)


SHAPES = ((8, 5), (13,))  # the params every test here makes (helpers.make_params)


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def set_grads(params, t):
    gen = torch.Generator().manual_seed(5000 + t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def run(opt, params, steps):
    for t in steps:
        set_grads(params, t)
        opt.step()


# (fused class, fused kwargs, torch class, torch kwargs)
PAIRS = [
    ("FusedEmaAdamW", dict(ema_decay=0.9), torch.optim.AdamW, dict(weight_decay=0.1)),
    ("FusedEmaAdamW", dict(ema_decay=0.9), torch.optim.Adam, dict(weight_decay=0.1)),
    ("FusedAdamW", dict(), torch.optim.AdamW, dict(weight_decay=0.1)),
    ("FusedAdam", dict(), torch.optim.Adam, dict(weight_decay=0.1)),
    ("FusedAdam", dict(), torch.optim.AdamW, dict(weight_decay=0.1)),
    ("FusedRAdam", dict(), torch.optim.RAdam, dict(weight_decay=0.1)),
    ("FusedRAdam", dict(ema_decay=0.9), torch.optim.RAdam,
     dict(weight_decay=0.1, decoupled_weight_decay=True)),
]
IDS = [f"{f}-{t.__name__}-{i}" for i, (f, _, t, _) in enumerate(PAIRS)]


# --- torch -> fused -----------------------------------------------------------------------------
@pytest.mark.parametrize("fused_name,fused_kw,torch_cls,torch_kw", PAIRS, ids=IDS)
def test_torch_state_dict_loads_into_fused_and_continues(fused_name, fused_kw, torch_cls, torch_kw):
    cls = fused_class(fused_name)
    ref_params = helpers.make_params(SHAPES)
    ref = torch_cls(ref_params, lr=1e-2, **torch_kw)
    run(ref, ref_params, range(20))

    params = clone_params(ref_params)
    opt = cls(params, lr=0.5, **fused_kw)     # hyperparameters come from the torch state dict
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    group = opt.param_groups[0]
    assert group["lr"] == 1e-2 and group["weight_decay"] == 0.1
    decoupled = ref.param_groups[0]["decoupled_weight_decay"]
    assert group.get("adam_w_mode", group.get("decoupled_weight_decay")) == decoupled
    for key in ("foreach", "capturable", "differentiable", "fused", "amsgrad"):
        assert key not in group or key in opt.defaults
    for p, q in zip(params, ref_params):
        st, ref_st = opt.state[p], ref.state[q]
        assert int(st["step"]) == 20 and st["step"].dtype == torch.float32
        assert torch.equal(st["exp_avg"], ref_st["exp_avg"])
        assert torch.equal(st["exp_avg_sq"], ref_st["exp_avg_sq"])
        if fused_kw.get("ema_decay") is not None:
            assert torch.equal(st["ema"], p.detach())   # the EMA starts at the loaded weights

    run(ref, ref_params, range(20, 40))
    run(opt, params, range(20, 40))
    for p, q in zip(params, ref_params):
        assert int(opt.state[p]["step"]) == 40
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused_name", ["FusedEmaAdamW", "FusedAdamW", "FusedRAdam"])
def test_low_precision_torch_state_becomes_fp32_state_with_masters(fused_name):
    cls = fused_class(fused_name)
    torch_cls = torch.optim.RAdam if fused_name == "FusedRAdam" else torch.optim.AdamW
    ref_params = helpers.make_params(SHAPES, torch.bfloat16)
    ref = torch_cls(ref_params, lr=1e-2)
    run(ref, ref_params, range(5))
    assert ref.state[ref_params[0]]["exp_avg"].dtype == torch.bfloat16

    params = clone_params(ref_params)
    kw = dict(ema_decay=0.99) if fused_name != "FusedAdamW" else {}
    opt = cls(params, lr=1e-2, **kw)
    opt.load_state_dict(ref.state_dict())
    for p, q in zip(params, ref_params):
        st = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key].dtype == torch.float32
            assert torch.equal(st[key], ref.state[q][key].float())
        assert torch.equal(st["master_param"], p.detach().float())
        if "ema_decay" in kw:
            assert st["ema"].dtype == torch.float32 and torch.equal(st["ema"], st["master_param"])
    run(opt, params, range(5, 8))
    sd = opt.state_dict()
    assert all(v.dtype == torch.float32 for st in sd["state"].values() for v in st.values())
    assert int(opt.state[params[0]]["step"]) == 8


def test_amsgrad_state_dict_is_rejected_before_loading():
    ref_params = helpers.make_params(SHAPES)
    ref = torch.optim.AdamW(ref_params, amsgrad=True)
    run(ref, ref_params, range(2))
    params = clone_params(ref_params)
    opt = FusedEmaAdamW(params, lr=1e-3)
    with pytest.raises(ValueError, match="amsgrad=True"):
        opt.load_state_dict(ref.state_dict())
    assert len(opt.state) == 0 and opt.param_groups[0]["lr"] == 1e-3


def test_restart_ema_schedule_on_load():
    ref_params = helpers.make_params(SHAPES)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    run(ref, ref_params, range(20))
    params = clone_params(ref_params)
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.999, ema_schedule="warmup")
    compat.load_torch_state_dict(opt, ref.state_dict())
    set_grads(params, 21)
    opt.step()
    assert opt.last_ema_decays == {(0, 21): min(0.999, 22 / 31)}   # continues at n = 21

    opt2 = FusedEmaAdamW(clone_params(ref_params), lr=1e-2, ema_decay=0.999, ema_schedule="warmup")
    compat.load_torch_state_dict(opt2, ref.state_dict(), restart_ema_schedule=True)
    assert opt2.param_groups[0]["ema_start_step"] == 20
    set_grads(opt2.param_groups[0]["params"], 21)
    opt2.step()
    assert opt2.last_ema_decays == {(0, 21): 2 / 11}                # starts afresh at n = 1


def test_lr_scheduler_key_survives_both_ways():
    ref_params = helpers.make_params(SHAPES)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(ref, step_size=5, gamma=0.5)
    for t in range(7):
        set_grads(ref_params, t)
        ref.step()
        sched.step()
    opt = FusedEmaAdamW(clone_params(ref_params))
    opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["initial_lr"] == 1e-2 and opt.param_groups[0]["lr"] == 5e-3
    back = opt.torch_state_dict()
    assert back["param_groups"][0]["initial_lr"] == 1e-2


# --- fused -> torch -----------------------------------------------------------------------------
@pytest.mark.parametrize("fused_name,fused_kw,torch_cls,torch_kw", PAIRS, ids=IDS)
def test_fused_state_dict_loads_into_torch_and_continues(fused_name, fused_kw, torch_cls, torch_kw):
    cls = fused_class(fused_name)
    params = helpers.make_params(SHAPES)
    kw = dict(fused_kw)
    if fused_name == "FusedEmaAdamW" or fused_name == "FusedAdam":
        kw["adam_w_mode"] = torch_cls is torch.optim.AdamW
    if fused_name == "FusedRAdam":
        kw["decoupled_weight_decay"] = torch_kw.get("decoupled_weight_decay", False)
    opt = cls(params, lr=1e-2, weight_decay=0.1, **kw)
    run(opt, params, range(20))
    assert compat.torch_class_for(opt) is torch_cls

    sd = opt.torch_state_dict()
    expected_keys = set(torch_cls([torch.zeros(1, requires_grad=True)]).defaults) | {"params"}
    assert set(sd["param_groups"][0]) == expected_keys
    steps = [st["step"] for st in sd["state"].values()]
    assert len({id(s) for s in steps}) == len(steps)      # torch increments each in place
    for st in sd["state"].values():
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}

    torch_params = clone_params(params)
    ref = torch_cls(torch_params, lr=0.5)
    ref.load_state_dict(sd)
    assert ref.param_groups[0]["lr"] == 1e-2
    run(ref, torch_params, range(20, 40))
    run(opt, params, range(20, 40))
    for p, q in zip(params, torch_params):
        assert int(ref.state[q]["step"]) == 40
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ref.state[q]["exp_avg_sq"], opt.state[p]["exp_avg_sq"],
                                   rtol=1e-5, atol=1e-9)


def test_torch_state_dict_of_low_precision_params():
    params = helpers.make_params(SHAPES, torch.bfloat16)
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.99, ema_schedule="warmup")
    run(opt, params, range(4))
    sd = opt.torch_state_dict()
    for pid, st in sd["state"].items():
        assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.bfloat16
        assert "ema" not in st and "master_param" not in st
    assert not any(k.startswith("ema") or k == "master_weights" for k in sd["param_groups"][0])
    # the fused optimizer itself is unchanged (still fp32 state)
    assert opt.state[params[0]]["exp_avg"].dtype == torch.float32
    ref = torch.optim.AdamW(clone_params(params))
    ref.load_state_dict(sd)
    run(ref, ref.param_groups[0]["params"], range(4, 6))


def test_torch_state_dict_rejects_what_torch_cannot_express():
    params = helpers.make_params(SHAPES)
    opt = FusedEmaAdamW(params, bias_correction=False)
    run(opt, params, range(2))
    with pytest.raises(ValueError, match="bias_correction=False"):
        opt.torch_state_dict()


def test_mixed_modes_become_torch_adam_with_per_group_flags():
    params = helpers.make_params(SHAPES)
    opt = FusedEmaAdamW([{"params": params[:1], "adam_w_mode": False}, {"params": params[1:]}],
                        lr=1e-2, weight_decay=0.1)
    run(opt, params, range(3))
    assert compat.torch_class_for(opt) is torch.optim.Adam
    sd = opt.torch_state_dict()
    assert [g["decoupled_weight_decay"] for g in sd["param_groups"]] == [False, True]
    torch_params = clone_params(params)
    ref = torch.optim.Adam([{"params": torch_params[:1]}, {"params": torch_params[1:]}])
    ref.load_state_dict(sd)
    run(ref, torch_params, range(3, 8))
    run(opt, params, range(3, 8))
    for p, q in zip(params, torch_params):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5)


# --- store / restore / copy_to (MindSpeed, diffusers) -------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_copy_to_restore_is_exact(dtype):
    params = helpers.make_params(SHAPES, dtype)
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.9)
    run(opt, params, range(5))
    original = [p.detach().clone() for p in params]
    masters = [opt.state[p].get("master_param") for p in params]
    master_copies = [None if m is None else m.clone() for m in masters]
    emas = [opt.state[p]["ema"].clone() for p in params]

    opt.store()
    opt.copy_to()
    for p, ema, master in zip(params, emas, masters):
        assert torch.equal(p, ema.to(dtype))                     # EMA rounded to the param dtype
        if master is not None:
            assert torch.equal(master, ema)                      # MindSpeed: params become the EMA
    opt.restore()
    for p, saved, master, saved_master, ema in zip(params, original, masters, master_copies, emas):
        assert torch.equal(p, saved)
        if master is not None:
            assert torch.equal(master, saved_master)
        assert torch.equal(opt.state[p]["ema"], ema)             # the EMA itself is untouched

    # training afterwards is the same as if nothing had happened
    ref_params = helpers.make_params(SHAPES, dtype)
    ref = FusedEmaAdamW(ref_params, lr=1e-2, ema_decay=0.9)
    run(ref, ref_params, range(8))
    run(opt, params, range(5, 8))
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["ema"], ref.state[q]["ema"])


def test_copy_to_then_training_continues_from_the_ema_weights():
    params = helpers.make_params(SHAPES, torch.bfloat16)
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.9)
    run(opt, params, range(4))
    opt.copy_to()
    ema = [opt.state[p]["ema"].clone() for p in params]
    set_grads(params, 4)
    opt.step()
    for p, e in zip(params, ema):  # the step moved from the EMA weights, not the old master
        assert (opt.state[p]["master_param"] - e).abs().max() < 2e-2


def test_store_restore_with_modules_and_other_targets():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2, ema_decay=0.8)
    for t in range(3):
        set_grads(list(model.parameters()), t)
        opt.step()
    before = copy.deepcopy(model.state_dict())
    opt.store(model.parameters())
    opt.copy_to(model.parameters())
    assert all(torch.equal(p, opt.state[p]["ema"]) for p in model.parameters())
    opt.restore(model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])

    shadow = copy.deepcopy(model)
    opt.copy_to(shadow)                            # another module gets the EMA weights
    for p, q in zip(model.parameters(), shadow.parameters()):
        assert torch.equal(q, opt.state[p]["ema"])
    assert torch.equal(model[0].weight, before["0.weight"])  # the model itself unchanged


def test_store_restore_errors():
    params = helpers.make_params(SHAPES)
    opt = FusedEmaAdamW(params, ema_decay=0.9)
    with pytest.raises(RuntimeError, match="call store\\(\\) first"):
        opt.restore()
    opt.store()
    with pytest.raises(ValueError, match="got 1 tensors but store\\(\\) saved 2"):
        opt.restore(params[:1])
    opt.restore()
    with pytest.raises(RuntimeError, match="nothing to restore"):
        opt.restore()                               # released after a restore (diffusers)
    with pytest.raises(ValueError, match="got 1 tensors but the optimizer has 2"):
        opt.copy_to(params[:1])
    run(opt, params, range(1))
    with opt.swap_ema_weights():
        with pytest.raises(RuntimeError, match="inside swap_ema_weights"):
            opt.copy_to()


def test_ema_api_on_fused_radam():
    FusedRAdam = fused_class("FusedRAdam")
    params = helpers.make_params(SHAPES, torch.bfloat16)
    opt = FusedRAdam(params, lr=1e-2, ema_decay=0.9)
    run(opt, params, range(8))
    original = [p.detach().clone() for p in params]
    masters = [opt.state[p]["master_param"].clone() for p in params]
    opt.store()
    opt.copy_to()
    assert all(torch.equal(p, opt.state[p]["ema"].to(p.dtype)) for p in params)
    opt.restore()
    assert all(torch.equal(p, o) for p, o in zip(params, original))
    assert all(torch.equal(opt.state[p]["master_param"], m) for p, m in zip(params, masters))
