"""The optimizer-kept EMA of a module's buffers (``register_ema_buffers``).

BatchNorm running statistics get an fp32 EMA moved by torch's lerp with the decay of the step's
param EMA, after every step that makes an EMA update; ``num_batches_tracked`` is copied. Checked
against a float64 recursion, against torch's lerp bit for bit, under GradScaler overflow, through
state-dict round trips, export and swap.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch

import fused_optim
from fused_optim import FusedEmaAdamW
from fused_optim.ema_buffers import BUFFERS_KEY

STEPS = 30


class BNNet(torch.nn.Module):
    def __init__(self, dtype=torch.float32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(4, 6).to(dtype)
        self.bn = torch.nn.BatchNorm1d(6).to(dtype)
        self.head = torch.nn.Linear(6, 3).to(dtype)
        self.bn2 = torch.nn.BatchNorm1d(3, momentum=None).to(dtype)   # cumulative average
        self.register_buffer("scratch", torch.zeros(2, dtype=dtype), persistent=False)

    def forward(self, x):
        return self.bn2(self.head(torch.relu(self.bn(self.lin(x)))))


FLOAT_BUFFERS = ("bn.running_mean", "bn.running_var", "bn2.running_mean", "bn2.running_var")
INT_BUFFERS = ("bn.num_batches_tracked", "bn2.num_batches_tracked")


def batch(t, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 + t)
    return (torch.randn(16, 4, generator=gen) * 3 + 1).to(dtype)


def train_step(model, opt, t, dtype=torch.float32):
    opt.zero_grad()
    model(batch(t, dtype)).float().square().mean().backward()
    opt.step()


def make(dtype=torch.float32, register=True, **options):
    model = BNNet(dtype)
    opt = FusedEmaAdamW(model.parameters(), lr=3e-2, **{"ema_decay": 0.9, **options})
    if register:
        opt.register_ema_buffers(model)
    return model, opt


def buffers(model):
    return {k: v.detach().clone() for k, v in model.named_buffers()}


# --- the update -----------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [
    dict(),
    dict(ema_schedule="warmup", ema_decay=0.999),
    dict(ema_schedule="diffusers", ema_decay=0.95, ema_start_step=4, ema_min_decay=0.3),
    dict(ema_schedule="diffusers_warmup", ema_decay=0.99, ema_start_step=3),
])
def test_buffer_ema_follows_the_param_decay(options, backend):
    model, opt = make(**options)
    assert set(opt.ema_buffers) == set(FLOAT_BUFFERS) | set(INT_BUFFERS)   # not "scratch"
    ref = {k: model.get_buffer(k).double().clone() for k in FLOAT_BUFFERS}   # float64 recursion
    lerp = {k: model.get_buffer(k).float().clone() for k in FLOAT_BUFFERS}   # torch's lerp, fp32
    for t in range(1, STEPS + 1):
        train_step(model, opt, t)
        assert set(opt.last_ema_decays) == {(0, t)}
        d = opt.last_ema_decays[(0, t)]
        assert d == opt.ema_decay_at(t)
        for k in FLOAT_BUFFERS:
            b = model.get_buffer(k)
            ref[k] = ref[k] + (1.0 - d) * (b.double() - ref[k])
            lerp[k].lerp_(b.float(), 1.0 - d)
            avg = opt.ema_buffers[k]
            assert avg.dtype == torch.float32
            assert torch.equal(avg, lerp[k]), (k, t)          # exactly torch's lerp
        for k in INT_BUFFERS:
            assert torch.equal(opt.ema_buffers[k], model.get_buffer(k))
            assert int(opt.ema_buffers[k]) == t
    for k in FLOAT_BUFFERS:
        torch.testing.assert_close(opt.ema_buffers[k].double(), ref[k], rtol=2e-6, atol=2e-6)
        assert not torch.equal(opt.ema_buffers[k].double(), model.get_buffer(k).double())


def test_registering_buffers_does_not_change_the_param_update(backend):
    a_model, a_opt = make(register=False, ema_schedule="warmup")
    b_model, b_opt = make(register=True, ema_schedule="warmup")
    for t in range(1, 8):
        train_step(a_model, a_opt, t)
        train_step(b_model, b_opt, t)
    for p, q in zip(a_model.parameters(), b_model.parameters()):
        assert torch.equal(p, q)
        for key in ("ema", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a_opt.state[p][key], b_opt.state[q][key])
    assert BUFFERS_KEY not in a_opt.state_dict()


def test_before_the_start_step_the_buffer_ema_is_the_buffer():
    model, opt = make(ema_schedule="constant", ema_start_step=5)
    for t in range(1, 8):
        train_step(model, opt, t)
        same = all(torch.equal(opt.ema_buffers[k], model.get_buffer(k)) for k in FLOAT_BUFFERS)
        assert same == (t <= 5), t     # decay 0.0: torch's lerp with weight 1 gives the buffer


def test_bf16_buffers_keep_an_fp32_ema():
    model, opt = make(dtype=torch.bfloat16)
    shadow = {k: model.get_buffer(k).float().clone() for k in FLOAT_BUFFERS}
    for t in range(1, 6):
        train_step(model, opt, t, torch.bfloat16)
        d = opt.last_ema_decays[(0, t)]
        for k in FLOAT_BUFFERS:
            shadow[k].lerp_(model.get_buffer(k).float(), 1.0 - d)
    for k in FLOAT_BUFFERS:
        assert model.get_buffer(k).dtype == torch.bfloat16
        assert opt.ema_buffers[k].dtype == torch.float32
        assert torch.equal(opt.ema_buffers[k], shadow[k])


def test_no_grads_means_no_buffer_update():
    model, opt = make()
    train_step(model, opt, 1)
    saved = {k: v.clone() for k, v in opt.ema_buffers.items()}
    model(batch(2))               # BatchNorm moves its statistics ...
    opt.zero_grad()
    opt.step()                    # ... but a step without grads makes no EMA update
    assert opt.last_ema_decays == {}
    for k, v in saved.items():
        assert torch.equal(opt.ema_buffers[k], v)


def test_decay_of_the_first_group_that_updated():
    model = BNNet()
    opt = FusedEmaAdamW([{"params": model.lin.parameters(), "ema_decay": 0.5},
                         {"params": list(model.bn.parameters()) + list(model.head.parameters())
                          + list(model.bn2.parameters()), "ema_decay": 0.8}], lr=1e-2)
    opt.register_ema_buffers(model)
    assert opt._ema_buffer_decay() is None
    train_step(model, opt, 1)
    assert opt._ema_buffer_decay() == 0.5            # group 0
    for t in (2, 3):                                 # group 0 has no grads: group 1's decay
        opt.zero_grad()
        model(batch(t)).square().mean().backward()
        for p in model.lin.parameters():
            p.grad = None
        before = {k: v.clone() for k, v in opt.ema_buffers.items()}
        opt.step()
        assert set(opt.last_ema_decays) == {(1, t)}
        assert opt._ema_buffer_decay() == 0.8
        for k in FLOAT_BUFFERS:
            expected = before[k].lerp(model.get_buffer(k).float(), 1.0 - 0.8)
            assert torch.equal(opt.ema_buffers[k], expected)
    # params of group 0 at different steps (one skipped): the decay of its most advanced ones
    opt.set_ema_schedule("warmup")
    opt.zero_grad()
    model(batch(4)).square().mean().backward()
    opt.step()
    assert set(opt.last_ema_decays) == {(0, 2), (1, 4)}
    model.lin.bias.grad = None                       # lin.bias misses this step
    opt.step()
    assert set(opt.last_ema_decays) == {(0, 3), (1, 5)}
    opt.zero_grad()
    model(batch(5)).square().mean().backward()
    opt.step()                                       # lin.weight at step 4, lin.bias at step 3
    assert set(opt.last_ema_decays) == {(0, 4), (0, 3), (1, 6)}
    assert opt._ema_buffer_decay() == opt.last_ema_decays[(0, 4)] == min(0.5, 5 / 14)


def test_fused_radam_with_ema_keeps_a_buffer_ema():
    FusedRAdam = fused_optim.FusedRAdam
    model = BNNet()
    opt = FusedRAdam(model.parameters(), lr=1e-2, ema_decay=0.9)
    opt.register_ema_buffers(model)
    shadow = {k: model.get_buffer(k).float().clone() for k in FLOAT_BUFFERS}
    for t in range(1, 5):
        train_step(model, opt, t)
        for k in FLOAT_BUFFERS:
            shadow[k].lerp_(model.get_buffer(k).float(), 1.0 - 0.9)
    for k in FLOAT_BUFFERS:
        assert torch.equal(opt.ema_buffers[k], shadow[k])
    plain = FusedRAdam(BNNet().parameters(), lr=1e-2)          # no EMA: nothing to register
    with pytest.raises(ValueError, match="no param group keeps an EMA"):
        plain.register_ema_buffers(model)


# --- GradScaler -----------------------------------------------------------------------------------
def test_overflow_step_does_not_move_the_buffer_ema():
    model, opt = make()
    for t in range(1, 4):
        train_step(model, opt, t)
    saved = {k: v.clone() for k, v in opt.ema_buffers.items()}
    opt.zero_grad()
    model(batch(4)).square().mean().backward()     # BatchNorm statistics move in the forward
    opt.found_inf = torch.ones(1)
    opt.grad_scale = torch.full((1,), 1024.0)
    opt.step()
    del opt.found_inf, opt.grad_scale
    for k, v in saved.items():
        assert torch.equal(opt.ema_buffers[k], v), k
    assert not torch.equal(model.bn.running_mean, saved["bn.running_mean"])
    opt.found_inf = torch.zeros(1)                 # a step that is not skipped moves it
    opt.grad_scale = torch.ones(1)
    opt.step()
    assert not torch.equal(opt.ema_buffers["bn.running_mean"], saved["bn.running_mean"])
    assert torch.equal(opt.ema_buffers["bn.num_batches_tracked"], model.bn.num_batches_tracked)


def test_step_skipped_for_a_non_finite_grad_norm_does_not_move_the_buffer_ema():
    model, opt = make()
    assert hasattr(opt, "max_grad_norm")  # a removed option fails here, never skips
    opt.max_grad_norm = 1.0          # as FusedAdamW(max_grad_norm=...) sets it
    train_step(model, opt, 1)
    saved = {k: v.clone() for k, v in opt.ema_buffers.items()}
    opt.zero_grad()
    model(batch(2)).square().mean().backward()
    model.head.weight.grad[0, 0] = float("nan")
    opt.step()
    assert int(opt.state[model.lin.weight]["step"]) == 1          # the step was skipped ...
    for k, v in saved.items():
        assert torch.equal(opt.ema_buffers[k], v), k                # ... and so is the buffer EMA
    train_step(model, opt, 3)
    assert not torch.equal(opt.ema_buffers["bn.running_mean"], saved["bn.running_mean"])


@pytest.mark.parametrize("fused_unscale", [True, False])
def test_grad_scaler_skip_with_a_real_scaler(fused_unscale):
    model = BNNet()
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2, ema_decay=0.9, fused_unscale=fused_unscale)
    opt.register_ema_buffers(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    history = []
    for t in range(1, 7):
        opt.zero_grad()
        loss = model(batch(t)).square().mean()
        scaler.scale(loss).backward()
        if t == 3:
            model.lin.weight.grad[0, 0] = float("inf")      # this step overflows
        before = {k: v.clone() for k, v in opt.ema_buffers.items()}
        scaler.step(opt)
        scaler.update()
        moved = not torch.equal(opt.ema_buffers["bn.running_mean"], before["bn.running_mean"])
        history.append(moved)
        if t == 3:
            for k, v in before.items():
                assert torch.equal(opt.ema_buffers[k], v), k
    assert history == [True, True, False, True, True, True]
    assert int(opt.state[model.lin.weight]["step"]) == 5


def test_device_side_skip_flag_keeps_or_moves_exactly():
    """The no-sync path (found_inf on an accelerator): a bool tensor decides, same bits."""
    model, opt = make()
    for t in range(1, 4):
        train_step(model, opt, t)
    model(batch(9))
    moved = copy.deepcopy(opt)
    moved._lerp_ema_buffers(0.75)                         # the plain path
    kept = copy.deepcopy(opt)
    kept._lerp_ema_buffers(0.75, torch.tensor(True))      # skipped on the "device"
    taken = copy.deepcopy(opt)
    taken._lerp_ema_buffers(0.75, torch.tensor(False))    # taken on the "device"
    for k in FLOAT_BUFFERS + INT_BUFFERS:
        assert torch.equal(kept.ema_buffers[k], opt.ema_buffers[k])
        assert torch.equal(taken.ema_buffers[k], moved.ema_buffers[k])
    assert not torch.equal(moved.ema_buffers["bn.running_var"], opt.ema_buffers["bn.running_var"])


# --- state dicts ----------------------------------------------------------------------------------
@pytest.mark.parametrize("register_first", [True, False])
@pytest.mark.parametrize("options", [dict(), dict(ema_schedule="diffusers", ema_decay=0.99)])
def test_state_dict_round_trip_is_exact(register_first, options, backend):
    total, cut = 16, 7
    ref_model, ref_opt = make(**options)
    for t in range(1, total + 1):
        train_step(ref_model, ref_opt, t)

    model, opt = make(**options)
    for t in range(1, cut + 1):
        train_step(model, opt, t)
    sd = opt.state_dict()
    assert set(sd[BUFFERS_KEY]) == set(FLOAT_BUFFERS) | set(INT_BUFFERS)
    buffer = io.BytesIO()
    torch.save({"opt": sd, "model": model.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    model2 = BNNet(seed=123)
    model2.load_state_dict(saved["model"])
    opt2 = FusedEmaAdamW(model2.parameters(), lr=1.0, ema_decay=0.5)
    if register_first:
        opt2.register_ema_buffers(model2)
        opt2.load_state_dict(saved["opt"])
    else:
        opt2.load_state_dict(saved["opt"])
        assert set(opt2.ema_buffers) == set(FLOAT_BUFFERS) | set(INT_BUFFERS)
        opt2.register_ema_buffers(model2)          # keeps the loaded buffer EMA
    for k, v in saved["opt"][BUFFERS_KEY].items():
        assert torch.equal(opt2.ema_buffers[k], v) and opt2.ema_buffers[k].dtype == v.dtype
        assert opt2.ema_buffers[k].data_ptr() != v.data_ptr()    # a copy
    assert opt2.state_dict()[BUFFERS_KEY].keys() == sd[BUFFERS_KEY].keys()
    for t in range(cut + 1, total + 1):
        train_step(model2, opt2, t)
    for k in FLOAT_BUFFERS + INT_BUFFERS:
        assert torch.equal(opt2.ema_buffers[k], ref_opt.ema_buffers[k]), k
        assert torch.equal(model2.get_buffer(k), ref_model.get_buffer(k)), k
    for p, q in zip(ref_model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(ref_opt.state[p]["ema"], opt2.state[q]["ema"])


def test_state_dict_loads_into_torch_optimizers():
    model, opt = make()
    for t in range(1, 4):
        train_step(model, opt, t)
    sd = opt.state_dict()
    assert BUFFERS_KEY in sd
    twin = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(twin.parameters(), lr=3e-2)
    torch_opt.load_state_dict(opt.torch_state_dict())
    torch_opt.load_state_dict(sd)        # the extra top-level key is ignored by torch
    assert BUFFERS_KEY not in torch_opt.state_dict()
    assert all(isinstance(k, int) for k in torch_opt.state_dict()["state"])
    train_step(twin, torch_opt, 4)
    # and a torch state dict (no buffer EMA) restarts the buffer EMA from the module's buffers
    opt.load_state_dict(torch_opt.state_dict())
    for k in FLOAT_BUFFERS:
        assert torch.equal(opt.ema_buffers[k], model.get_buffer(k).float())
    for k in INT_BUFFERS:
        assert torch.equal(opt.ema_buffers[k], model.get_buffer(k))


def test_mismatched_buffer_ema_is_rejected_before_loading():
    model, opt = make()
    train_step(model, opt, 1)
    sd = copy.deepcopy(opt.state_dict())
    del sd[BUFFERS_KEY]["bn2.running_var"]
    lr_before = opt.param_groups[0]["lr"]
    sd["param_groups"][0]["lr"] = 123.0
    before = {k: v.clone() for k, v in opt.ema_buffers.items()}
    with pytest.raises(ValueError, match="saved buffer EMA has buffers"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == lr_before
    for k, v in before.items():
        assert torch.equal(opt.ema_buffers[k], v)
    sd2 = copy.deepcopy(opt.state_dict())
    sd2[BUFFERS_KEY]["bn.running_mean"] = torch.zeros(7)
    with pytest.raises(ValueError, match="bn.running_mean"):
        opt.load_state_dict(sd2)


def test_register_checks_and_reset():
    model, opt = make()
    train_step(model, opt, 1)
    other = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    with pytest.raises(ValueError, match="reset=True"):
        opt.register_ema_buffers(other)
    assert set(opt.ema_buffers) == set(FLOAT_BUFFERS) | set(INT_BUFFERS)   # unchanged
    with pytest.raises(TypeError, match="torch.nn.Module"):
        opt.register_ema_buffers([model.bn.running_mean])
    kept = opt.ema_buffers["bn.running_mean"]
    opt.register_ema_buffers(model)                 # again: the EMA is kept as it is
    assert opt.ema_buffers["bn.running_mean"] is kept
    assert sum(h.__name__ == "_buffer_ema_post_hook"
               for h in opt._optimizer_step_post_hooks.values()) == 1
    opt.register_ema_buffers(model, reset=True)     # afresh from the current buffers
    assert torch.equal(opt.ema_buffers["bn.running_mean"], model.bn.running_mean)
    opt.unregister_ema_buffers()
    assert opt.ema_buffers == {} and BUFFERS_KEY not in opt.state_dict()
    assert not opt._optimizer_step_post_hooks
    train_step(model, opt, 2)                       # no buffer EMA, no error


def test_deepcopy_of_the_optimizer_keeps_updating_its_copy():
    model, opt = make()
    train_step(model, opt, 1)
    model2, opt2 = copy.deepcopy((model, opt))
    assert opt2._ema_buffer_module is model2
    train_step(model, opt, 2)
    train_step(model2, opt2, 2)
    for k in FLOAT_BUFFERS + INT_BUFFERS:
        assert torch.equal(opt2.ema_buffers[k], opt.ema_buffers[k])
        assert opt2.ema_buffers[k].data_ptr() != opt.ema_buffers[k].data_ptr()


# --- export and swap ------------------------------------------------------------------------------
def trained(steps=6, dtype=torch.float32):
    model, opt = make(dtype=dtype, ema_decay=0.7)
    for t in range(1, steps + 1):
        train_step(model, opt, t, dtype)
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ema_state_dict_includes_the_buffer_ema(dtype):
    model, opt = trained(dtype=dtype)
    live = model.state_dict()
    sd = opt.ema_state_dict(model)
    assert list(sd) == list(live)
    for k in FLOAT_BUFFERS:
        assert sd[k].dtype == dtype
        assert torch.equal(sd[k], opt.ema_buffers[k].to(dtype))
        assert not torch.equal(sd[k], live[k])
    for k in INT_BUFFERS:
        assert torch.equal(sd[k], live[k]) and sd[k].dtype == torch.int64
    for name, p in model.named_parameters():
        assert torch.equal(sd[name], opt.state[p]["ema"].to(dtype))
    sd32 = opt.ema_state_dict(model, dtype=torch.float32, ema_buffers=True)
    for k in FLOAT_BUFFERS:
        assert sd32[k].dtype == torch.float32 and torch.equal(sd32[k], opt.ema_buffers[k])
    plain = opt.ema_state_dict(model, ema_buffers=False)
    for k in FLOAT_BUFFERS + INT_BUFFERS:
        assert torch.equal(plain[k], live[k])
    fresh = BNNet(dtype, seed=5)
    fresh.load_state_dict(sd)
    for k in FLOAT_BUFFERS:
        assert torch.equal(fresh.get_buffer(k), sd[k])
    _, no_buffers = make(register=False)
    with pytest.raises(ValueError, match="register_ema_buffers"):
        no_buffers.ema_state_dict(BNNet(), ema_buffers=True)


def test_copy_ema_to_and_store_restore_include_buffers():
    model, opt = trained()
    other = BNNet(seed=9)
    opt.copy_ema_to(other)
    for k in FLOAT_BUFFERS:
        assert torch.equal(other.get_buffer(k), opt.ema_buffers[k])
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(q, opt.state[p]["ema"])
    only_params = BNNet(seed=9)
    opt.copy_ema_to(only_params, ema_buffers=False)
    assert torch.equal(only_params.bn.running_var, BNNet(seed=9).bn.running_var)
    with pytest.raises(TypeError, match="needs a module"):
        opt.copy_ema_to(list(other.parameters()), ema_buffers=True)
    mismatched = torch.nn.Sequential()
    mismatched.lin, mismatched.bn = torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6)
    mismatched.head, mismatched.bn2 = torch.nn.Linear(6, 3), torch.nn.LayerNorm(3)
    snapshot = [p.detach().clone() for p in mismatched.parameters()]
    with pytest.raises(ValueError, match="bn2.running_mean"):
        opt.copy_ema_to(mismatched)
    assert all(torch.equal(p, s) for p, s in zip(mismatched.parameters(), snapshot))  # nothing

    # MindSpeed's store(); copy_to(); ...; restore() on the own model: buffers included
    live_params = [p.detach().clone() for p in model.parameters()]
    live_buffers = buffers(model)
    opt.store()
    opt.copy_to()
    for k in FLOAT_BUFFERS:
        assert torch.equal(model.get_buffer(k), opt.ema_buffers[k])
    model.eval()
    model(batch(50))
    model.train()
    model(batch(51))              # BatchNorm in train mode writes the statistics in place
    opt.restore()
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), live_params))
    for k, v in buffers(model).items():
        assert torch.equal(v, live_buffers[k]), k


def test_swap_ema_weights_includes_buffers():
    model, opt = trained()
    live_params = [p.detach().clone() for p in model.parameters()]
    live_buffers = buffers(model)
    with opt.swap_ema_weights():
        for k in FLOAT_BUFFERS + INT_BUFFERS:
            assert torch.equal(model.get_buffer(k), opt.ema_buffers[k].to(live_buffers[k].dtype))
        assert not torch.equal(model.bn.running_mean, live_buffers["bn.running_mean"])
        model.train()
        model(batch(77))          # even a train-mode forward inside the block is undone
    for k, v in buffers(model).items():
        assert torch.equal(v, live_buffers[k]), k
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), live_params))
    with pytest.raises(KeyError, match="boom"):
        with opt.swap_ema_weights():
            raise KeyError("boom")
    for k, v in buffers(model).items():
        assert torch.equal(v, live_buffers[k]), k
    with opt.swap_ema_weights(ema_buffers=False):
        for k, v in buffers(model).items():
            assert torch.equal(v, live_buffers[k]), k
    with opt.swap_ema_weights():
        with pytest.raises(RuntimeError, match="inside swap_ema_weights"):
            opt.copy_ema_to()
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        with pytest.raises(RuntimeError, match="swap_ema_weights"):
            opt.step()


def test_buffer_ema_follows_the_module_to_its_device_and_dtype():
    model, opt = trained()
    model.double()                      # buffers replaced by new tensors: found again by name
    before = {k: v.clone() for k, v in opt.ema_buffers.items()}
    model(batch(8).double())
    opt._lerp_ema_buffers(0.5)
    for k in FLOAT_BUFFERS:
        expected = before[k].lerp(model.get_buffer(k).float(), 0.5)
        assert opt.ema_buffers[k].dtype == torch.float32
        assert torch.equal(opt.ema_buffers[k], expected)
