"""state_dict round trips (fp32 state stays fp32; resume is bit-for-bit) and torch.amp.GradScaler
(unscaling inside the step; on overflow nothing changes)."""
from __future__ import annotations

import copy
import io

import pytest
import torch

from fused_optim import FusedEmaAdamW
from seed_reference import assert_bitwise_equal, assert_close64, assert_unchanged, snapshot

HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.02, ema_decay=0.8)
STATE_KEYS = ("exp_avg", "exp_avg_sq", "ema", "master_param")


class Mixed(torch.nn.Module):
    """fp32, bf16 and fp16 params, plus a buffer."""

    def __init__(self, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w32 = torch.nn.Parameter(torch.randn(4, 3, generator=gen))
        self.b32 = torch.nn.Parameter(torch.randn(3, generator=gen))
        self.wbf = torch.nn.Parameter(torch.randn(5, 2, generator=gen).bfloat16())
        self.whf = torch.nn.Parameter(torch.randn(7, generator=gen).half())
        self.sometimes = torch.nn.Parameter(torch.randn(2, 2, generator=gen).bfloat16())
        self.register_buffer("buf", torch.arange(3.0))


def set_step_grads(model, step):
    """Deterministic grads for ``step``; ``sometimes`` has a grad only on every third step."""
    gen = torch.Generator().manual_seed(1000 + step)
    for name, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        p.grad = None if (name == "sometimes" and step % 3) else g


def run(model, opt, steps):
    for step in steps:
        set_step_grads(model, step)
        opt.step()


def full_state(model, opt):
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().clone()
        for k, v in opt.state[p].items():
            out[f"{name}.{k}"] = v.detach().clone()
    return out


def assert_same_state(a, b):
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert_bitwise_equal(b[k], a[k], k)


def test_state_dict_keeps_fp32_state_for_low_precision_params(backend):
    model = Mixed()
    opt = FusedEmaAdamW(model.parameters(), **HP)
    run(model, opt, range(1, 5))
    sd = opt.state_dict()
    for name, p in model.named_parameters():
        st = sd["state"][_pid(model, name)]
        low = p.dtype in (torch.bfloat16, torch.float16)
        assert ("master_param" in st) == low
        for k in STATE_KEYS:
            if k in st:
                assert st[k].dtype == (torch.float32 if low else p.dtype), f"{name}.{k}"
        assert st["step"].dtype == torch.float32
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf)

    fresh_model = Mixed(seed=1)
    fresh_model.load_state_dict(model.state_dict())
    fresh = FusedEmaAdamW(fresh_model.parameters(), **HP)
    fresh.load_state_dict(loaded)
    for (name, p), q in zip(model.named_parameters(), fresh_model.parameters()):
        st, fst = opt.state[p], fresh.state[q]
        assert set(st) == set(fst)
        for k in STATE_KEYS:
            if k in st:
                assert fst[k].dtype == st[k].dtype, f"{name}.{k} was cast on load"
                assert_bitwise_equal(fst[k], st[k], f"{name}.{k}")
        assert fst["step"].dtype == torch.float32 and int(fst["step"]) == int(st["step"])
    # the loaded optimizer does not alias the state dict it was loaded from
    before = {pid: {k: v.clone() for k, v in s.items()} for pid, s in loaded["state"].items()}
    run(fresh_model, fresh, range(5, 7))
    for pid, s in loaded["state"].items():
        for k, v in s.items():
            assert_bitwise_equal(v, before[pid][k], f"loaded state dict {pid}.{k} was modified")


def _pid(model, name):
    return [n for n, _ in model.named_parameters()].index(name)


def test_torch_base_class_would_cast_the_state(backend):
    """Why the override matters: torch.optim.Optimizer.load_state_dict casts to the param dtype."""
    model = Mixed()
    opt = FusedEmaAdamW(model.parameters(), **HP)
    run(model, opt, range(1, 3))
    sd = opt.state_dict()
    plain = FusedEmaAdamW(Mixed().parameters(), **HP)
    torch.optim.Optimizer.load_state_dict(plain, copy.deepcopy(sd))
    p = list(plain.param_groups[0]["params"])[_pid(model, "wbf")]
    assert plain.state[p]["master_param"].dtype == torch.bfloat16
    ours = FusedEmaAdamW(Mixed().parameters(), **HP)
    ours.load_state_dict(copy.deepcopy(sd))
    q = list(ours.param_groups[0]["params"])[_pid(model, "wbf")]
    assert ours.state[q]["master_param"].dtype == torch.float32


@pytest.mark.parametrize("loader", ["fresh", "stepped"])
def test_resume_is_bit_for_bit(backend, loader):
    model = Mixed()
    opt = FusedEmaAdamW(model.parameters(), **HP)
    run(model, opt, range(1, 11))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    run(model, opt, range(11, 21))
    expected = full_state(model, opt)

    buf.seek(0)
    ckpt = torch.load(buf)
    model2 = Mixed(seed=7)
    opt2 = FusedEmaAdamW(model2.parameters(), lr=1.0, ema_decay=0.1)  # hyperparameters come from ckpt
    if loader == "stepped":  # an optimizer with its own history (and cached plans) first
        run(model2, opt2, range(50, 53))
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.param_groups[0]["lr"] == HP["lr"] and opt2.param_groups[0]["ema_decay"] == HP["ema_decay"]
    run(model2, opt2, range(11, 21))
    assert_same_state(expected, full_state(model2, opt2))
    steps = {n: int(opt2.state[p]["step"]) for n, p in model2.named_parameters()}
    assert steps["w32"] == 20 and steps["sometimes"] == 6  # steps 3, 6, 9, 12, 15, 18


def test_state_dict_round_trip_then_resume_on_same_optimizer(backend):
    """Loading its own state dict back into an optimizer is a no-op for the trajectory."""
    a, b = Mixed(), Mixed()
    oa, ob = FusedEmaAdamW(a.parameters(), **HP), FusedEmaAdamW(b.parameters(), **HP)
    run(a, oa, range(1, 6))
    run(b, ob, range(1, 6))
    buf = io.BytesIO()
    torch.save(ob.state_dict(), buf)
    buf.seek(0)
    ob.load_state_dict(torch.load(buf))
    run(a, oa, range(6, 10))
    run(b, ob, range(6, 10))
    assert_same_state(full_state(a, oa), full_state(b, ob))


# ---------------------------------------------------------------------------------------------
# GradScaler

class Tiny(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(6, 5).to(dtype)
        self.l2 = torch.nn.Linear(5, 2).to(dtype)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def batches(dtype, n):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 6, generator=gen).to(dtype), torch.randn(8, 2, generator=gen)) for _ in range(n)]


def loss_fn(model, x, y):
    return (model(x).float() - y).square().mean()


def opt_tensors(model, opt):
    return [p for p in model.parameters()] + [v for p in model.parameters() for v in opt.state[p].values()]


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaler_steps_match_unscaled_reference(backend, dtype):
    model, ref_model = Tiny(dtype), Tiny(dtype)
    opt = FusedEmaAdamW(model.parameters(), **HP)
    ref = FusedEmaAdamW(ref_model.parameters(), **HP)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=1000)
    for x, y in batches(dtype, 6):
        opt.zero_grad()
        ref.zero_grad()
        scaler.scale(loss_fn(model, x, y)).backward()
        loss_fn(ref_model, x, y).backward()
        scaled = snapshot(p.grad for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        ref.step()
        # the unscale happened inside the step: the grads still hold the scaled values
        assert_unchanged([p.grad for p in model.parameters()], scaled, "grads after scaler.step")
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert_close64(p.grad, q.grad.double() * 2.0 ** 12, rtol=1e-2 if dtype != torch.float32 else 1e-5,
                           atol=1e-3, msg="scaled grads")
        assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    assert scaler.get_scale() == 2.0 ** 12
    for p, q in zip(model.parameters(), ref_model.parameters()):
        st, rst = opt.state[p], ref.state[q]
        assert int(st["step"]) == 6
        # a power-of-two scale commutes exactly with backward and with the in-kernel unscale
        assert_bitwise_equal(p, q.detach(), "param")
        for k in STATE_KEYS:
            if k in st:
                assert_bitwise_equal(st[k], rst[k], k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaler_skips_step_on_inf(backend, dtype):
    model = Tiny(dtype)
    opt = FusedEmaAdamW(model.parameters(), **HP)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    data = batches(dtype, 3)
    for x, y in data[:2]:
        opt.zero_grad()
        scaler.scale(loss_fn(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
    x, y = data[2]
    opt.zero_grad()
    scaler.scale(loss_fn(model, x, y)).backward()
    model.l2.weight.grad[0, 1] = float("inf")
    tensors = opt_tensors(model, opt)
    saved = snapshot(tensors)
    grads = snapshot(p.grad for p in model.parameters())
    scale_before = scaler.get_scale()
    scaler.step(opt)
    assert_unchanged(tensors, saved, "params, masters, moments, EMA and steps after an overflow")
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())
    assert_unchanged([p.grad for p in model.parameters()], grads, "grads")
    scaler.update()
    assert scaler.get_scale() == scale_before * 0.5
    # the next good step proceeds normally
    opt.zero_grad()
    scaler.scale(loss_fn(model, x, y)).backward()
    scaler.step(opt)
    scaler.update()
    assert all(int(opt.state[p]["step"]) == 3 for p in model.parameters())
    assert any(not torch.equal(p, s) for p, s in zip(model.parameters(), saved))


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_grad_scaler_skips_step_on_nan_in_low_precision(backend, bad):
    model = Tiny(torch.bfloat16)
    opt = FusedEmaAdamW(model.parameters(), **HP)
    scaler = torch.amp.GradScaler("cpu")
    x, y = batches(torch.bfloat16, 1)[0]
    scaler.scale(loss_fn(model, x, y)).backward()
    model.l1.bias.grad[2] = bad
    saved = snapshot(model.parameters())
    scaler.step(opt)
    scaler.update()
    assert_unchanged(list(model.parameters()), saved)
    assert all(len(opt.state[p]) == 0 or int(opt.state[p]["step"]) == 0 for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_scaler_with_explicit_unscale_does_not_unscale_twice(backend, dtype):
    model, ref_model = Tiny(dtype), Tiny(dtype)
    opt = FusedEmaAdamW(model.parameters(), **HP)
    ref = FusedEmaAdamW(ref_model.parameters(), **HP)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    for x, y in batches(dtype, 3):
        opt.zero_grad()
        ref.zero_grad()
        scaler.scale(loss_fn(model, x, y)).backward()
        loss_fn(ref_model, x, y).backward()
        scaler.unscale_(opt)  # e.g. to clip grads: the grads are now unscaled in place
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert_bitwise_equal(p.grad, q.grad, "unscaled grads")
        scaler.step(opt)
        scaler.update()
        ref.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert_bitwise_equal(p, q.detach(), "param")
        assert_bitwise_equal(opt.state[p]["ema"], ref.state[q]["ema"], "ema")


def test_grad_scaler_state_dict_resume(backend):
    """A checkpoint taken mid-AMP-training resumes bit-for-bit, scaler included."""
    dtype = torch.bfloat16
    data = batches(dtype, 8)

    def train(model, opt, scaler, part):
        for x, y in part:
            opt.zero_grad()
            scaler.scale(loss_fn(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()

    model = Tiny(dtype)
    opt = FusedEmaAdamW(model.parameters(), **HP)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 9)
    train(model, opt, scaler, data[:4])
    buf = io.BytesIO()
    torch.save({"m": model.state_dict(), "o": opt.state_dict(), "s": scaler.state_dict()}, buf)
    train(model, opt, scaler, data[4:])

    buf.seek(0)
    ckpt = torch.load(buf)
    model2 = Tiny(dtype)
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    model2.load_state_dict(ckpt["m"])
    opt2 = FusedEmaAdamW(model2.parameters(), **HP)
    opt2.load_state_dict(ckpt["o"])
    scaler2 = torch.amp.GradScaler("cpu")
    scaler2.load_state_dict(ckpt["s"])
    train(model2, opt2, scaler2, data[4:])
    for p, q in zip(model.parameters(), model2.parameters()):
        assert_bitwise_equal(q, p.detach(), "param")
        for k, v in opt.state[p].items():
            assert_bitwise_equal(opt2.state[q][k], v, k)


def test_plain_state_dict_has_one_step_tensor_per_param_and_torch_continues_from_it():
    """Params stepping together share a step tensor inside the optimizer, never in a saved dict."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    opt = FusedEmaAdamW(params, lr=1e-2)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(5)
        opt.step()
    sd = opt.state_dict()
    steps = [entry["step"] for entry in sd["state"].values()]
    assert len({id(s) for s in steps}) == len(params)
    assert all(s.item() == 3.0 for s in steps)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.AdamW(twins, lr=1e-2)
    torch_opt.load_state_dict(torch.load(buf))
    for p in twins:
        p.grad = torch.randn(5)
    torch_opt.step()
    assert [torch_opt.state[p]["step"].item() for p in twins] == [4.0, 4.0, 4.0]
    assert all(s.item() == 3.0 for s in (opt.state[p]["step"] for p in params))
