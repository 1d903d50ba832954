"""FusedAdam, FusedAdamW and FusedRAdam against torch.optim, and the engine's radam/radam_ema ops.

Optimizer tests run on every registered multi-tensor backend (``reference``, and ``native_cpu``
when its extension loaded), inside ``forced_backend``.

Tolerances: fp32 runs are compared with torch's fp32 run at rtol 1e-5 / atol 1e-6 (float
rounding). Every op follows the one operation order of multi_tensor/rules.py, which is not
torch's: Adam's ``m / (sqrt(v) * (1 / sqrt(bc2)) + eps) * (lr / bc1)`` with the scalars folded in
double, and RAdam as the same element math with other scalars (``m`` as ``beta1 * m + (1 - beta1)
* g`` where torch lerps, ``lr * rect * sqrt(bc2) / bc1`` folded in double where torch multiplies
elementwise). So no op reproduces torch bit for bit; each differs by fp32 roundings that do not
accumulate a bias (measured over 200 steps without decoupled decay: max abs deviation from torch
fp32 2.4e-7, for adam and radam alike). One stated exception: decoupled (AdamW / RAdam
``decoupled_weight_decay``) decay is ``w - (lr * wd) * w``, where torch multiplies by
``1 - lr * wd`` rounded to fp32 first. That rounding (e.g. 2.6e-8 for lr 2e-3, wd 0.1) is a
systematic bias of torch's, the same sign every step, so it grows linearly: over 200 steps up to
5.3e-6 relative (measured max abs deviation 1.3e-5 for AdamW at wd 0.05, 2.2e-5 for RAdam at
wd 0.1, on |p| ~ 4).
Decoupled-decay comparisons with torch fp32 therefore add ``steps * that rounding`` to rtol, and
test_adamw_matches_exact_math_better_than_torch / test_radam_matches_exact_math_better_than_torch
compare with torch run in float64 at the plain rtol 1e-5 (e.g. RAdam decoupled: fused 2.3e-6 max
abs, torch fp32 2.2e-5).
"""
from __future__ import annotations

import copy
import io
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import helpers  # noqa: E402
from multi_tensor import (multi_tensor_applier, multi_tensor_radam,  # noqa: E402
                          multi_tensor_radam_ema)
from multi_tensor.rules import radam_rect  # noqa: E402
from fused_optim import (AdamStateMixin, FusedAdam, FusedAdamW, FusedEmaAdamW,  # noqa: E402
                         FusedRAdam)

FP32 = dict(rtol=1e-5, atol=1e-6)
STEPS = 200
SHAPES = [(33, 17), (64,), (5, 4, 3), (1,)]


# --- helpers ------------------------------------------------------------------------------------
def init_values(dtype=torch.float32, seed=0, shapes=SHAPES):
    return [p.detach() for p in helpers.make_params(shapes, dtype, seed)]


def grads_at(step, shapes=SHAPES, dtype=torch.float32, seed=1):
    """Grads independent of the params (deterministic per step): runs differ by rounding only."""
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    out = []
    for s in shapes:
        g = torch.randn(s, generator=gen) * (0.1 + torch.rand((), generator=gen))
        out.append(g.to(dtype))
    return out


def params_of(values):
    return [torch.nn.Parameter(v.clone()) for v in values]


def split_groups(params, group_options):
    """Params round-robin into len(group_options) groups with the given options."""
    groups = [dict(params=[], **opts) for opts in group_options]
    for i, p in enumerate(params):
        groups[i % len(groups)]["params"].append(p)
    return groups


def run(opt, params, steps, grad_dtype=None, start=0, shapes=SHAPES):
    for t in range(start, start + steps):
        for p, g in zip(params, grads_at(t, shapes)):
            p.grad = g.to(grad_dtype or p.dtype)
        opt.step()


def assert_close(actual, expected, msg="", **tol):
    torch.testing.assert_close(actual.detach(), expected.detach(), msg=lambda m: f"{msg}: {m}",
                               **(tol or FP32))


def max_abs(a, b):
    return max((x.detach().double() - y.detach().double()).abs().max().item() for x, y in zip(a, b))


def assert_bitwise(a, b, msg=""):
    assert a.dtype == b.dtype and a.shape == b.shape, msg
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), msg


def decay_factor_rounding(opt) -> float:
    """The largest fp32 rounding error of torch's decoupled-decay factor ``1 - lr * wd``."""
    worst = 0.0
    for group in opt.param_groups:
        factor = 1 - group["lr"] * group["weight_decay"]
        worst = max(worst, abs(torch.tensor(factor, dtype=torch.float32).item() - factor))
    return worst


def tol_vs_torch(ot, steps, adam_decoupled: bool):
    """FP32, plus the decay-factor allowance when the fused "adam" op runs AdamW (see above)."""
    tol = dict(FP32)
    if adam_decoupled:
        tol["rtol"] += steps * decay_factor_rounding(ot)
    return tol


def compare_with_torch(make_fused, make_torch, group_options, dtype=torch.float32, steps=STEPS,
                       state_keys=("exp_avg", "exp_avg_sq"), torch_decay_bias=False):
    """Run both ``steps`` steps on the same grads and compare params and state.

    ``torch_decay_bias``: the fused op applies decoupled decay exactly where torch multiplies by
    a rounded factor (module docstring): rtol grows by ``steps * that rounding`` for the params.
    """
    values = init_values(dtype)
    pf, pt = params_of(values), params_of(values)
    of = make_fused(split_groups(pf, group_options))
    ot = make_torch(split_groups(pt, group_options))
    run(of, pf, steps)
    run(ot, pt, steps)
    tol = tol_vs_torch(ot, steps, torch_decay_bias)
    for i, (a, b) in enumerate(zip(pf, pt)):
        assert_close(a, b, f"param {i}", **tol)
        for key in state_keys:
            assert_close(of.state[a][key], ot.state[b][key], f"state[{i}][{key!r}]")
        assert of.state[a]["step"].item() == ot.state[b]["step"].item() == steps
    return max_abs(pf, pt), ot


ADAM_GROUPS = {
    "one_group_wd0": [dict()],
    "two_groups": [dict(lr=3e-3, weight_decay=0.1, betas=(0.8, 0.99)),
                   dict(lr=1e-3, weight_decay=0.0, eps=1e-6)],
    "maximize_wd": [dict(weight_decay=0.05, maximize=True)],
}


# --- FusedAdam / FusedAdamW vs torch ------------------------------------------------------------
@pytest.mark.parametrize("groups", list(ADAM_GROUPS), ids=list(ADAM_GROUPS))
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw_mode", "adam_mode"])
def test_fused_adam_matches_torch(backend, adam_w_mode, groups):
    def fused(g):
        return FusedAdam(g, lr=2e-3, adam_w_mode=adam_w_mode)

    def reference(g):
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        return cls(g, lr=2e-3, weight_decay=0.0)  # FusedAdam's default weight_decay is 0

    compare_with_torch(fused, reference, ADAM_GROUPS[groups], torch_decay_bias=adam_w_mode)


@pytest.mark.parametrize("groups", list(ADAM_GROUPS), ids=list(ADAM_GROUPS))
def test_fused_adamw_matches_torch(backend, groups):
    compare_with_torch(lambda g: FusedAdamW(g, lr=2e-3), lambda g: torch.optim.AdamW(g, lr=2e-3),
                       ADAM_GROUPS[groups], torch_decay_bias=True)


def test_fused_adamw_defaults_and_groups_like_torch():
    p = torch.nn.Parameter(torch.zeros(3))
    ours, theirs = FusedAdamW([p]), torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    for key, value in theirs.param_groups[0].items():
        if key != "params":
            assert ours.param_groups[0][key] == value, key
    assert ours.param_groups[0]["master_weights"] is True
    # foreach / fused accepted and ignored; both True is torch's RuntimeError
    FusedAdamW([p], foreach=True)
    FusedAdamW([p], fused=True)
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        FusedAdamW([p], foreach=True, fused=True)
    FusedRAdam([p], foreach=False)


def test_adamw_decay_fp64_shows_which_is_exact():
    """In float64 the adam op and torch agree to 1e-12: the fp32 gap is rounding only."""
    values = init_values(torch.float64)
    pf, pt = params_of(values), params_of(values)
    of, ot = FusedAdamW(pf, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(pt, lr=1e-2, weight_decay=0.1)
    run(of, pf, 50)
    run(ot, pt, 50)
    for a, b in zip(pf, pt):
        assert_close(a, b, "fp64", rtol=1e-12, atol=1e-13)


# --- FusedRAdam vs torch ------------------------------------------------------------------------
RADAM_GROUPS = {
    "wd0": [dict(weight_decay=0.0)],
    "l2": [dict(weight_decay=0.1)],
    "decoupled": [dict(weight_decay=0.1, decoupled_weight_decay=True)],
    "maximize_l2": [dict(weight_decay=0.02, maximize=True)],
    "maximize_decoupled": [dict(weight_decay=0.02, maximize=True, decoupled_weight_decay=True)],
    # different lr / betas / eps / decay per group; beta1 = 0.3 takes torch's lerp large-weight
    # branch (ours has no lerp: m = beta1 * m + (1 - beta1) * g either way)
    "groups": [dict(lr=3e-3, betas=(0.9, 0.999), weight_decay=0.0),
               dict(lr=1e-2, betas=(0.3, 0.99), weight_decay=0.05, decoupled_weight_decay=True),
               dict(lr=5e-4, betas=(0.5, 0.9), eps=1e-6, weight_decay=0.01)],
}


EXACT_MATH_CASES = {
    **{f"adamw-{k}": (FusedAdamW, torch.optim.AdamW, v) for k, v in ADAM_GROUPS.items()},
    **{f"radam-{k}": (FusedRAdam, torch.optim.RAdam, v) for k, v in RADAM_GROUPS.items()},
}


@pytest.mark.parametrize("case", list(EXACT_MATH_CASES))
def test_matches_exact_math_better_than_torch(backend, case):
    """fp32 FusedAdamW/FusedRAdam vs torch's AdamW/RAdam run in float64: plain fp32 tolerance,
    no bias allowance."""
    fused_cls, torch_cls, groups = EXACT_MATH_CASES[case]
    values = init_values()
    pf, p64 = params_of(values), params_of([v.double() for v in values])
    of = fused_cls(split_groups(pf, groups), lr=2e-3)
    o64 = torch_cls(split_groups(p64, groups), lr=2e-3)
    run(of, pf, STEPS)
    for t in range(STEPS):
        for p, g in zip(p64, grads_at(t)):
            p.grad = g.double()
        o64.step()
    for i, (a, b) in enumerate(zip(pf, p64)):
        assert_close(a.double(), b, f"param {i}")


def has_decoupled(group_options) -> bool:
    return any(g.get("decoupled_weight_decay") and g.get("weight_decay") for g in group_options)


@pytest.mark.parametrize("groups", list(RADAM_GROUPS), ids=list(RADAM_GROUPS))
def test_fused_radam_matches_torch(backend, groups):
    """Not bitwise (module docstring: another op order): rtol 1e-5 / atol 1e-6 elementwise, and
    the largest deviation over 200 steps below 1e-5 (measured 2.4e-7) plus, with decoupled decay,
    torch's decay-factor bias ``steps * rounding * max|p|`` (measured 2.2e-5 in all)."""
    options = RADAM_GROUPS[groups]
    diff, ot = compare_with_torch(lambda g: FusedRAdam(g, lr=2e-3),
                                  lambda g: torch.optim.RAdam(g, lr=2e-3), options,
                                  torch_decay_bias=has_decoupled(options))
    bound = 1e-5
    if has_decoupled(options):
        max_p = max(p.detach().abs().max().item() for g in ot.param_groups for p in g["params"])
        bound += STEPS * decay_factor_rounding(ot) * max_p
    assert diff < bound


def test_fused_radam_with_ema_matches_torch_plus_hand_ema(backend):
    decay = 0.9
    values = init_values()
    pf, pt = params_of(values), params_of(values)
    groups = [dict(weight_decay=0.1, decoupled_weight_decay=True), dict(weight_decay=0.0)]
    of = FusedRAdam(split_groups(pf, groups), lr=3e-3, ema_decay=decay)
    ot = torch.optim.RAdam(split_groups(pt, groups), lr=3e-3)
    emas = [v.clone() for v in values]
    for t in range(STEPS):
        run(of, pf, 1, start=t)
        run(ot, pt, 1, start=t)
        emas = [s * decay + p.detach() * (1 - decay) for s, p in zip(emas, pt)]
    for i, (a, b, s) in enumerate(zip(pf, pt, emas)):
        assert_close(a, b, f"param {i}")
        assert_close(of.state[a]["ema"], s, f"ema {i}")
    # the EMA access API applies
    with of.swap_ema_weights():
        for p, s in zip(pf, emas):
            assert_close(p, s, "swapped")
    assert_close(pf[0], pt[0], "restored")


def test_fused_radam_without_ema_keeps_no_ema_state():
    p = torch.nn.Parameter(torch.randn(10))
    opt = FusedRAdam([p])
    p.grad = torch.randn(10)
    opt.step()
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("name", ["adam", "adamw", "radam", "radam_ema"])
def test_small_model_matches_torch(backend, name):
    """A small MLP, grads from the loss (so they depend on the params), 200 steps."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ref = copy.deepcopy(model)
    kw = dict(lr=1e-3, weight_decay=0.01)
    if name == "adam":
        of, ot = FusedAdam(model.parameters(), **kw), torch.optim.AdamW(ref.parameters(), **kw)
    elif name == "adamw":
        of, ot = FusedAdamW(model.parameters(), **kw), torch.optim.AdamW(ref.parameters(), **kw)
    else:
        ema = 0.99 if name == "radam_ema" else None
        of = FusedRAdam(model.parameters(), decoupled_weight_decay=True, ema_decay=ema, **kw)
        ot = torch.optim.RAdam(ref.parameters(), decoupled_weight_decay=True, **kw)
    for _ in range(STEPS):
        for m, o in ((model, of), (ref, ot)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    tol = tol_vs_torch(ot, STEPS, name in ("adam", "adamw"))
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_close(a, b, name, **tol)


# --- low precision with fp32 masters ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["adam", "adamw", "radam", "radam_ema"])
def test_low_precision_with_masters_tracks_fp32_torch(backend, dtype, name):
    """Masters follow torch's fp32 run (same grads) within fp32 rounding; params are the masters
    rounded once; the low-precision param is within its own resolution of torch's fp32 param."""
    values = init_values(dtype)
    pf = params_of(values)
    pt = params_of([v.float() for v in values])
    if name == "adam":
        of, ot = FusedAdam(pf, lr=2e-3, master_weights=True), torch.optim.AdamW(pt, lr=2e-3, weight_decay=0)
    elif name == "adamw":
        of, ot = FusedAdamW(pf, lr=2e-3), torch.optim.AdamW(pt, lr=2e-3)
    else:
        ema = 0.95 if name == "radam_ema" else None
        of = FusedRAdam(pf, lr=2e-3, weight_decay=0.1, ema_decay=ema)
        ot = torch.optim.RAdam(pt, lr=2e-3, weight_decay=0.1)
    for t in range(STEPS):
        grads = grads_at(t)
        for p, q, g in zip(pf, pt, grads):
            p.grad = g.to(dtype)
            q.grad = g.to(dtype).float()  # the same (rounded) values in fp32
        of.step()
        ot.step()
    eps = torch.finfo(dtype).eps
    tol = tol_vs_torch(ot, STEPS, name == "adamw")
    for i, (a, b) in enumerate(zip(pf, pt)):
        st = of.state[a]
        assert st["master_param"].dtype == st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
        assert_close(st["master_param"], b, f"master {i}", **tol)
        assert_bitwise(a.detach(), st["master_param"].to(dtype), f"param {i} is the rounded master")
        assert_close(a.float(), b, f"param {i}", rtol=eps, atol=eps)
        if name == "radam_ema":
            assert st["ema"].dtype == torch.float32


# --- the radam op -------------------------------------------------------------------------------
def radam_f64(g, p, m, v, s, *, lr, beta1, beta2, eps, step, wd, decoupled, ema_decay,
              maximize=False, inv_scale=1.0):
    """torch.optim.RAdam's formula in float64 (one step)."""
    g, p, m, v = (t.double() for t in (g, p, m, v))
    g = g * inv_scale
    if maximize:
        g = -g
    if wd:
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
    m = m + (1 - beta1) * (g - m)
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * beta2 ** step / bc2
    if rho_t > 5:
        rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
        p = p - lr * (m / bc1) * rect * math.sqrt(bc2) / (v.sqrt() + eps)
    else:
        p = p - lr * (m / bc1)
    if s is not None:
        s = ema_decay * s.double() + (1 - ema_decay) * p
    return p, m, v, s


def radam_op(chunk_size, noop, lists, lr, beta1, beta2, eps, step, wd, decoupled, ema_decay=None,
             **kw):
    """The radam op (``ema_decay`` None) or the radam_ema op, with one argument order."""
    if ema_decay is None:
        multi_tensor_radam(chunk_size, noop, lists, lr, beta1, beta2, eps, step, wd, decoupled,
                           **kw)
    else:
        multi_tensor_radam_ema(chunk_size, noop, lists, lr, ema_decay, beta1, beta2, eps, step, wd,
                               decoupled, **kw)


def op_inputs(n=257, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen, dtype=torch.float64)
    p = torch.randn(n, generator=gen, dtype=torch.float64)
    m = torch.randn(n, generator=gen, dtype=torch.float64) * 0.1
    v = torch.rand(n, generator=gen, dtype=torch.float64) * 0.01
    s = p + 0.01 * torch.randn(n, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (g, p, m, v, s)]


def test_early_steps_are_unrectified():
    rect_steps = [t for t in range(1, 10) if radam_rect(0.999, t) is not None]
    assert rect_steps and rect_steps[0] == 6  # steps 1..5 have rho_t <= 5 with beta2 = 0.999


@pytest.mark.parametrize("step", [1, 3, 5, 6, 7, 50, 1000])
@pytest.mark.parametrize("form", ["plain", "ema", "master", "ema_master"])
@pytest.mark.parametrize("decoupled,wd,maximize", [(False, 0.0, False), (False, 0.1, True),
                                                   (True, 0.1, False)])
def test_radam_op_matches_float64_formula(step, form, decoupled, wd, maximize):
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
    ema_decay = 0.9 if "ema" in form else None
    g, p, m, v, s = op_inputs()
    pe, me, ve, se = radam_f64(g, p, m, v, s if ema_decay else None, step=step, wd=wd,
                               decoupled=decoupled, ema_decay=ema_decay, maximize=maximize, **hp)
    lists = [[g.clone()], [p.clone()], [m.clone()], [v.clone()]]
    if ema_decay is not None:
        lists.append([s.clone()])
    if "master" in form:
        lists[1] = [p.to(torch.bfloat16)]
        lists.append([p.clone()])
    radam_op(2048, torch.zeros(1, dtype=torch.int32), lists, hp["lr"], hp["beta1"], hp["beta2"],
             hp["eps"], step, wd, decoupled, ema_decay, maximize=maximize)
    tol = dict(rtol=2e-6, atol=1e-7)  # a few fp32 roundings
    weights = lists[-1][0] if "master" in form else lists[1][0]
    assert_close(weights.double(), pe, "p", **tol)
    assert_close(lists[2][0].double(), me, "m", **tol)
    assert_close(lists[3][0].double(), ve, "v", **tol)
    if ema_decay is not None:
        assert_close(lists[4][0].double(), se, "ema", **tol)
    if "master" in form:
        assert_bitwise(lists[1][0], lists[-1][0].to(torch.bfloat16), "param = round(master)")


@pytest.mark.parametrize("step", [2, 6, 100])
def test_radam_op_fp64_exact_to_formula(step):
    g, p, m, v, s = op_inputs(dtype=torch.float64)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
    pe, me, ve, se = radam_f64(g, p, m, v, s, step=step, wd=0.1, decoupled=False, ema_decay=0.99, **hp)
    lists = [[g], [p.clone()], [m.clone()], [v.clone()], [s.clone()]]
    multi_tensor_radam_ema(2048, torch.zeros(1, dtype=torch.int32), lists, hp["lr"], 0.99,
                           hp["beta1"], hp["beta2"], hp["eps"], step, 0.1, False)
    for t, e in zip((lists[1][0], lists[2][0], lists[3][0], lists[4][0]), (pe, me, ve, se)):
        assert_close(t, e, "fp64", rtol=1e-12, atol=1e-14)


def test_radam_op_grad_scale_noop_and_check_finite():
    g, p, m, v, _ = op_inputs()
    hp = (1e-2, 0.9, 0.999, 1e-8, 7, 0.0, False)
    ref = [[g.clone()], [p.clone()], [m.clone()], [v.clone()]]
    multi_tensor_radam(64, torch.zeros(1, dtype=torch.int32), ref, *hp)
    scaled = [[g * 1024], [p.clone()], [m.clone()], [v.clone()]]
    multi_tensor_radam(64, torch.zeros(1, dtype=torch.int32), scaled, *hp,
                       grad_scale=torch.tensor([1024.0]))
    for a, b in zip(ref[1:], scaled[1:]):
        assert_bitwise(a[0], b[0], "unscaled in the op")
    flag = torch.ones(1, dtype=torch.int32)
    lists = [[g.clone()], [p.clone()], [m.clone()], [v.clone()]]
    multi_tensor_radam(64, flag, lists, *hp)
    assert torch.equal(lists[1][0], p) and torch.equal(lists[2][0], m)
    bad = g.clone()
    bad[3] = float("inf")
    flag = torch.zeros(1, dtype=torch.int32)
    lists = [[bad], [p.clone()], [m.clone()], [v.clone()]]
    multi_tensor_radam(64, flag, lists, *hp, check_finite=True)
    assert flag.item() == 1 and torch.equal(lists[1][0], p) and torch.equal(lists[3][0], v)


def test_radam_op_errors_name_the_problem():
    g, p, m, v, s = op_inputs()
    noop = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(TypeError):  # the radam op takes no ema_decay (that is radam_ema)
        multi_tensor_radam(64, noop, [[g], [p], [m], [v], [s]], 1e-3, 0.9, 0.999, 1e-8, 1, 0.0,
                           False, 0.9)
    with pytest.raises(ValueError, match="emas"):  # radam_ema without an EMA list
        multi_tensor_radam_ema(64, noop, [[g], [p], [m], [v]], 1e-3, 0.9, 0.9, 0.999, 1e-8, 1, 0.0,
                               False)
    with pytest.raises(TypeError, match="masters"):  # radam with 5 lists: the 5th is masters
        multi_tensor_radam(64, noop, [[g], [p.half()], [m], [v], [s.half()]], 1e-3, 0.9, 0.999,
                           1e-8, 1, 0.0, False)
    with pytest.raises(ValueError, match="ema_decay"):
        multi_tensor_radam_ema(64, noop, [[g], [p], [m], [v], [s]], 1e-3, 1.5, 0.9, 0.999, 1e-8, 1,
                               0.0, False)
    with pytest.raises(ValueError, match="shape"):
        multi_tensor_radam(64, noop, [[g], [p], [m[:5]], [v]], 1e-3, 0.9, 0.999, 1e-8, 1, 0.0, False)
    assert torch.equal(p, op_inputs()[1])


def test_radam_chunk_sizes_bitwise_identical(backend):
    """The op and FusedRAdam give the same bits for chunk sizes 1, 7 and 65536."""
    results = []
    for chunk in (1, 7, 65536):
        g, p, m, v, s = op_inputs(n=1000)
        lists = [[g, g[:77] * 2], [p, p[:77].clone()], [m, m[:77].clone()], [v, v[:77].clone()],
                 [s, s[:77].clone()]]
        for step in (1, 6, 7):
            multi_tensor_radam_ema(chunk, torch.zeros(1, dtype=torch.int32), lists, 1e-2, 0.9, 0.9,
                                   0.999, 1e-8, step, 0.1, True, maximize=True)
        values = init_values(torch.bfloat16)
        params = params_of(values)
        opt = FusedRAdam(params, lr=1e-2, weight_decay=0.1, ema_decay=0.99, chunk_size=chunk)
        run(opt, params, 10)
        results.append([t for lst in lists[1:] for t in lst]
                       + [q.detach() for q in params] + [opt.state[q][k] for q in params
                                                          for k in ("master_param", "ema", "exp_avg")])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_bitwise(a, b, "chunk size changed a result")


# --- AMP, state dicts, complex, errors ----------------------------------------------------------
def test_grad_scaler_skips_inf_step_for_fused_adam(backend):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    ref = copy.deepcopy(model)
    opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    ropt = FusedAdam(ref.parameters(), lr=1e-2, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(4, 6)
    for step in range(4):
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        if step == 2:
            model.weight.grad[0, 0] = float("inf")
            before = {k: v.clone() for k, v in model.state_dict().items()}
            st = {k: v.clone() for k, v in opt.state[model.weight].items()}
        scaler.step(opt)
        scaler.update()
        if step == 2:
            for k, v in model.state_dict().items():
                assert torch.equal(v, before[k]), f"{k} changed on an overflow step"
            for k, v in opt.state[model.weight].items():
                assert torch.equal(v, st[k]), f"state {k} changed on an overflow step"
            continue
        ropt.zero_grad()
        ref(x).square().mean().backward()
        ropt.step()
    assert scaler.get_scale() < 1024.0 * 2 ** 3  # backed off once
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_close(a, b, "unscaled in the kernel")
    assert opt.state[model.weight]["step"].item() == 3


@pytest.mark.parametrize("name", ["adam", "adamw", "radam", "radam_ema"])
def test_state_dict_round_trip_continues_bitwise(backend, name):
    def make(params):
        if name == "adam":
            return FusedAdam(params, lr=1e-2, weight_decay=0.01, master_weights=True)
        if name == "adamw":
            return FusedAdamW(params, lr=1e-2)
        return FusedRAdam(params, lr=1e-2, weight_decay=0.1,
                          ema_decay=0.9 if name == "radam_ema" else None)

    values = init_values(torch.bfloat16)
    pa, pb = params_of(values), params_of(values)
    oa = make(pa)
    run(oa, pa, 8 + 7)
    ob = make(pb)
    run(ob, pb, 8)
    buf = io.BytesIO()
    torch.save(ob.state_dict(), buf)
    buf.seek(0)
    pc = params_of([p.detach() for p in pb])
    oc = make(pc)
    oc.load_state_dict(torch.load(buf))
    for q in pc:
        st = oc.state[q]
        assert st["master_param"].dtype == st["exp_avg"].dtype == torch.float32
    run(oc, pc, 7, start=8)
    for a, c in zip(pa, pc):
        assert_bitwise(a.detach(), c.detach(), "param after round trip")
        for key, value in oa.state[a].items():
            assert_bitwise(value, oc.state[c][key], f"state {key!r} after round trip")


@pytest.mark.parametrize("name", ["adamw", "adam_l2", "radam", "radam_decoupled"])
def test_complex_params_match_torch(backend, name):
    shapes = [(6, 5), (11,)]
    gen = torch.Generator().manual_seed(3)
    values = [torch.randn(s, generator=gen, dtype=torch.complex64) for s in shapes]
    pf, pt = params_of(values), params_of(values)
    if name == "adamw":
        of, ot = FusedAdamW(pf, lr=1e-2), torch.optim.AdamW(pt, lr=1e-2)
    elif name == "adam_l2":
        of = FusedAdam(pf, lr=1e-2, adam_w_mode=False, weight_decay=0.1)
        ot = torch.optim.Adam(pt, lr=1e-2, weight_decay=0.1)
    else:
        dec = name == "radam_decoupled"
        of = FusedRAdam(pf, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=dec)
        ot = torch.optim.RAdam(pt, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=dec)
    for t in range(50):
        gen = torch.Generator().manual_seed(100 + t)
        for p, q in zip(pf, pt):
            g = torch.randn(p.shape, generator=gen, dtype=torch.complex64)
            p.grad, q.grad = g.clone(), g.clone()
        of.step()
        ot.step()
    tol = tol_vs_torch(ot, 50, name == "adamw")
    for a, b in zip(pf, pt):
        assert_close(a, b, "complex param", **tol)
        for key in ("exp_avg", "exp_avg_sq"):
            assert of.state[a][key].dtype == ot.state[b][key].dtype == torch.complex64
            assert_close(of.state[a][key], ot.state[b][key], key)
    sd = of.state_dict()
    o2 = type(of)(params_of(values))
    o2.load_state_dict(sd)
    assert o2.state[o2.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.complex64


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex_half_is_rejected_clearly():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex32))
    with pytest.raises(TypeError, match=r"params'\]\[0\].*complex32"):
        FusedAdamW([p])


@pytest.mark.parametrize("make", [
    lambda p: FusedAdam(p, amsgrad=True), lambda p: FusedAdamW(p, amsgrad=True),
    lambda p: FusedAdamW(p, differentiable=True), lambda p: FusedRAdam(p, differentiable=True),
], ids=["adam_amsgrad", "adamw_amsgrad", "adamw_differentiable", "radam_differentiable"])
def test_unsupported_flags_raise(make):
    with pytest.raises(NotImplementedError, match="does not support"):
        make([torch.nn.Parameter(torch.zeros(2))])


def test_bad_hyperparameters_raise_before_any_change():
    with pytest.raises(ValueError, match="beta"):
        FusedRAdam([torch.nn.Parameter(torch.zeros(2))], betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="ema_decay"):
        FusedRAdam([torch.nn.Parameter(torch.zeros(2))], ema_decay=1.0)
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = FusedAdamW([p])
    with pytest.raises(ValueError, match="learning rate"):
        opt.add_param_group(dict(params=[q], lr=-1.0))
    assert len(opt.param_groups) == 1  # the bad group was not added
    opt.add_param_group(dict(params=[q], lr=1e-3))
    opt.param_groups[1]["eps"] = -1.0
    p.grad, q.grad = torch.ones(2), torch.ones(2)
    with pytest.raises(ValueError, match="epsilon"):
        opt.step()
    assert torch.equal(p, torch.ones(2)) and not opt.state  # no state created either


def test_zero_grad_follows_set_grad_none():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    FusedAdam([p], set_grad_none=False).zero_grad()
    assert p.grad is not None and not p.grad.any()
    FusedAdam([p]).zero_grad()
    assert p.grad is None


def test_radam_ema_can_be_turned_on_later_and_groups_differ():
    p, q = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    opt = FusedRAdam([dict(params=[p]), dict(params=[q], ema_decay=0.5)])
    p.grad, q.grad = torch.randn(4), torch.randn(4)
    opt.step()
    assert "ema" not in opt.state[p] and "ema" in opt.state[q]
    opt.param_groups[0]["ema_decay"] = 0.5  # the plan is rebuilt with an EMA list
    before = p.detach().clone()
    opt.step()
    assert opt.state[p]["ema"].shape == p.shape
    assert_close(opt.state[p]["ema"], 0.5 * before + 0.5 * p.detach(), "first ema update")


def test_shared_state_code():
    """FusedEmaAdamW and the new optimizers share one implementation of state and checks."""
    for cls in (FusedAdam, FusedAdamW, FusedRAdam, FusedEmaAdamW):
        assert issubclass(cls, AdamStateMixin)
        assert cls._init_state is AdamStateMixin._init_state
        assert cls._state_lists is AdamStateMixin._state_lists
    assert multi_tensor_applier.chunk_size == 2048 * 32


@pytest.mark.parametrize("name", ["adamw", "adam_l2", "radam_decoupled", "radam_ema"])
def test_torch_state_dicts_load_both_ways(name):
    """torch -> fused (load_state_dict) and fused -> torch (torch_state_dict) continue like torch."""
    fused_cls, torch_cls, kw = {
        "adamw": (FusedAdamW, torch.optim.AdamW, {}),
        "adam_l2": (FusedAdam, torch.optim.Adam, dict(adam_w_mode=False, weight_decay=0.1)),
        "radam_decoupled": (FusedRAdam, torch.optim.RAdam,
                            dict(weight_decay=0.1, decoupled_weight_decay=True)),
        "radam_ema": (FusedRAdam, torch.optim.RAdam, dict(ema_decay=0.9)),
    }[name]
    torch_kw = {k: v for k, v in kw.items() if k not in ("adam_w_mode", "ema_decay")}
    values = init_values()
    pt = params_of(values)
    ot = torch_cls(pt, lr=1e-2, **torch_kw)
    run(ot, pt, 5)
    pf = params_of([p.detach() for p in pt])
    of = fused_cls(pf, lr=1e-2, **kw)
    of.load_state_dict(ot.state_dict())
    run(ot, pt, 5, start=5)
    run(of, pf, 5, start=5)
    for a, b in zip(pf, pt):
        assert_close(a, b, "torch -> fused")
    pt2 = params_of([p.detach() for p in pf])
    ot2 = torch_cls(pt2, lr=1e-2, **torch_kw)
    ot2.load_state_dict(of.torch_state_dict())
    run(ot2, pt2, 5, start=10)
    run(of, pf, 5, start=10)
    for a, b in zip(pf, pt2):
        assert_close(a, b, "fused -> torch")
