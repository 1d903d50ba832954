"""EMA schedules: decay sequences, the EMA they produce, validation and state-dict continuation."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import helpers

from fused_optim import FusedEmaAdamW
from fused_optim import ema_schedules

STEPS = 60


# --- hand-written formulas (independent of fused_optim.ema_schedules) ---------------------------
def hand_constant(t, decay, start=0):
    return 0.0 if t <= start else decay


def hand_mindspeed(t, decay, start=0):
    # MindSpeed FusedEmaAdamW: num_updates += 1, then min(decay, (1 + num_updates) / (10 + num_updates))
    if t <= start:
        return 0.0
    num_updates = t - start
    return min(decay, (1 + num_updates) / (10 + num_updates))


def hand_diffusers(optimization_step, decay, update_after_step=0, min_decay=0.0):
    # diffusers EMAModel.get_decay with its default use_ema_warmup=False (optimization_step
    # incremented before)
    step = max(0, optimization_step - update_after_step - 1)
    if step <= 0:
        return 0.0
    cur_decay_value = (1 + step) / (10 + step)
    cur_decay_value = min(cur_decay_value, decay)
    cur_decay_value = max(cur_decay_value, min_decay)
    return cur_decay_value


def hand_diffusers_warmup(optimization_step, decay, update_after_step=0, inv_gamma=1.0, power=2 / 3,
                          min_decay=0.0):
    # diffusers EMAModel.get_decay with use_ema_warmup=True (optimization_step incremented before)
    step = max(0, optimization_step - update_after_step - 1)
    if step <= 0:
        return 0.0
    cur_decay_value = 1 - (1 + step / inv_gamma) ** -power
    cur_decay_value = min(cur_decay_value, decay)
    cur_decay_value = max(cur_decay_value, min_decay)
    return cur_decay_value


def user_schedule(n):
    return 1.0 - 1.0 / (n + 1.5)


CASES = {
    "default": (dict(), lambda t: hand_constant(t, 0.97)),
    "constant": (dict(ema_schedule="constant"), lambda t: hand_constant(t, 0.97)),
    "constant_start": (dict(ema_schedule="constant", ema_start_step=7),
                       lambda t: hand_constant(t, 0.97, 7)),
    "warmup": (dict(ema_schedule="warmup"), lambda t: hand_mindspeed(t, 0.97)),
    "warmup_start": (dict(ema_schedule="WarmUp".lower(), ema_start_step=5),
                     lambda t: hand_mindspeed(t, 0.97, 5)),
    "diffusers": (dict(ema_schedule="diffusers"), lambda t: hand_diffusers(t, 0.97)),
    "diffusers_opts": (dict(ema_schedule="Diffusers", ema_start_step=4, ema_min_decay=0.5,
                            ema_inv_gamma=2.0, ema_power=0.75),   # the last two are ignored
                       lambda t: hand_diffusers(t, 0.97, 4, 0.5)),
    "diffusers_warmup": (dict(ema_schedule="diffusers_warmup"),
                         lambda t: hand_diffusers_warmup(t, 0.97)),
    "diffusers_warmup_opts": (dict(ema_schedule="diffusers_warmup", ema_start_step=4,
                                   ema_inv_gamma=2.0, ema_power=0.75, ema_min_decay=0.5),
                              lambda t: hand_diffusers_warmup(t, 0.97, 4, 2.0, 0.75, 0.5)),
    "callable": (dict(ema_schedule=user_schedule), lambda t: user_schedule(t)),
    "callable_start": (dict(ema_schedule=user_schedule, ema_start_step=3),
                       lambda t: 0.0 if t <= 3 else user_schedule(t - 3)),
}


SHAPES = ((6, 5), (11,))  # the params every test here makes (helpers.make_params)


def set_grads(params, t, seed=1000):
    gen = torch.Generator().manual_seed(seed + t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


# --- the schedule functions --------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_function_matches_hand_formula_exactly(name):
    options, hand = CASES[name]
    full = dict(ema_schedules.EMA_OPTION_DEFAULTS, **options)
    for t in range(1, 500):
        assert ema_schedules.ema_decay_at(t, 0.97, **full) == hand(t), (name, t)


@pytest.mark.parametrize("update_after_step", [0, 1, 10])
@pytest.mark.parametrize("inv_gamma,power,min_decay,decay", [(1.0, 2 / 3, 0.0, 0.9999),
                                                              (1.0, 0.75, 0.0, 0.999),
                                                              (3.0, 1.0, 0.2, 0.9)])
def test_diffusers_warmup_counter_convention(update_after_step, inv_gamma, power, min_decay, decay):
    for t in range(1, 3000, 7):
        expected = hand_diffusers_warmup(t, decay, update_after_step, inv_gamma, power, min_decay)
        got = ema_schedules.ema_decay_at(t, decay, "diffusers_warmup", update_after_step,
                                         inv_gamma, power, min_decay)
        assert got == expected
    # diffusers' first update after update_after_step still has decay 0.0 (not min_decay) ...
    assert ema_schedules.ema_decay_at(update_after_step + 1, decay, "diffusers_warmup",
                                      update_after_step, inv_gamma, power, min_decay) == 0.0
    # ... and the warm-up begins at k = 1 on the next one
    assert ema_schedules.ema_decay_at(update_after_step + 2, decay, "diffusers_warmup",
                                      update_after_step, inv_gamma, power, min_decay) == \
        max(min(1 - (1 + 1 / inv_gamma) ** -power, decay), min_decay)


@pytest.mark.parametrize("update_after_step", [0, 1, 10])
@pytest.mark.parametrize("min_decay,decay", [(0.0, 0.9999), (0.0, 0.95), (0.2, 0.9), (0.5, 0.5)])
def test_diffusers_default_counter_convention(update_after_step, min_decay, decay):
    # inv_gamma / power do not matter without the warm-up
    for inv_gamma, power in ((1.0, 2 / 3), (3.0, 1.0)):
        for t in list(range(1, 200)) + list(range(200, 3000, 7)):
            expected = hand_diffusers(t, decay, update_after_step, min_decay)
            got = ema_schedules.ema_decay_at(t, decay, "diffusers", update_after_step, inv_gamma,
                                             power, min_decay)
            assert got == expected, (t, got, expected)
    # 0.0 up to and including update_after_step + 1 (not raised to min_decay) ...
    for t in range(1, update_after_step + 2):
        assert ema_schedules.ema_decay_at(t, decay, "diffusers", update_after_step,
                                          ema_min_decay=min_decay) == 0.0
    # ... then (1 + k) / (10 + k) from k = 1, clamped to [min_decay, decay]
    assert ema_schedules.ema_decay_at(update_after_step + 2, decay, "diffusers", update_after_step,
                                      ema_min_decay=min_decay) == max(min(2 / 11, decay), min_decay)
    # the default is MindSpeed's (1 + n) / (10 + n) one update later
    for t in range(update_after_step + 2, update_after_step + 400):
        assert ema_schedules.ema_decay_at(t, decay, "diffusers", update_after_step,
                                          ema_min_decay=min_decay) == \
            max(ema_schedules.ema_decay_at(t - 1, decay, "warmup", update_after_step), min_decay)


def test_known_values():
    assert ema_schedules.ema_decay_at(1, 0.9999, "warmup") == 2 / 11
    assert ema_schedules.ema_decay_at(10 ** 6, 0.9999, "warmup") == 0.9999
    # crowsonkb's note in diffusers: gamma=1, power=2/3 reaches 0.999 at ~31.6K steps
    assert ema_schedules.ema_decay_at(31624, 0.9999, "diffusers_warmup") == \
        pytest.approx(0.999, abs=2e-6)
    # diffusers' default: 0.0 on its first update, then (1 + k) / (10 + k) from k = 1
    assert ema_schedules.ema_decay_at(1, 0.9999, "diffusers") == 0.0
    assert ema_schedules.ema_decay_at(2, 0.9999, "diffusers") == 2 / 11
    assert ema_schedules.ema_decay_at(3, 0.9999, "diffusers") == 3 / 12
    assert ema_schedules.ema_decay_at(8992, 0.9999, "diffusers") == 8992 / 9001
    assert ema_schedules.ema_decay_at(89992, 0.9999, "diffusers") == 0.9999   # capped, k = 89991
    assert ema_schedules.ema_decay_at(89990, 0.9999, "diffusers") == 89990 / 89999  # k = 89989
    assert ema_schedules.ema_decay_at(3, 0.9, "diffusers", ema_min_decay=0.5) == 0.5
    assert ema_schedules.ema_decay_at(5, 0.9, None, 5) == 0.0
    assert ema_schedules.ema_decay_at(6, 0.9, None, 5) == 0.9


# --- the optimizer applies them -----------------------------------------------------------------
def run_and_record(options, steps=STEPS, dtype=torch.float32, decay=0.97):
    params = helpers.make_params(SHAPES, dtype)
    opt = FusedEmaAdamW(params, lr=3e-2, weight_decay=0.01, ema_decay=decay, **options)
    weights = [[p.detach().to(torch.float64).clone()] for p in params]
    decays = []
    for t in range(1, steps + 1):
        set_grads(params, t)
        opt.step()
        assert set(opt.last_ema_decays) == {(0, t)}
        decays.append(opt.last_ema_decays[(0, t)])
        for w, p in zip(weights, params):
            w.append(p.detach().to(torch.float64).clone())
    return opt, params, weights, decays


@pytest.mark.parametrize("name", sorted(CASES))
def test_ema_equals_float64_recursion(name, backend):
    options, hand = CASES[name]
    opt, params, weights, decays = run_and_record(options)
    expected_decays = [hand(t) for t in range(1, STEPS + 1)]
    assert decays == expected_decays  # exactly
    for p, w in zip(params, weights):
        s = w[0].clone()                       # the EMA starts as the initial weights
        for t in range(1, STEPS + 1):
            d = expected_decays[t - 1]
            s = d * s + (1.0 - d) * w[t]
        ema = opt.state[p]["ema"]
        assert ema.dtype == torch.float32
        torch.testing.assert_close(ema.to(torch.float64), s, rtol=2e-6, atol=2e-6)
        assert opt.ema_decay_at(STEPS) == expected_decays[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_before_start_step_ema_tracks_params_exactly(dtype, backend):
    start = 6
    params = helpers.make_params(SHAPES, dtype)
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.99, ema_start_step=start,
                        ema_schedule="warmup")
    for t in range(1, start + 4):
        set_grads(params, t)
        opt.step()
        for p in params:
            weights = opt.state[p].get("master_param", p)
            if t <= start:
                assert torch.equal(opt.state[p]["ema"], weights.detach()), t
            else:
                assert not torch.equal(opt.state[p]["ema"], weights.detach()), t
    if dtype == torch.bfloat16:
        assert opt.state[params[0]]["ema"].dtype == torch.float32


def test_per_param_counter_with_skipped_params():
    params = helpers.make_params(SHAPES)
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.999, ema_schedule="warmup")
    for t in range(1, 6):
        set_grads(params, t)
        if t in (2, 3):
            params[1].grad = None        # param 1 misses two steps: its counter stays
        opt.step()
    assert int(opt.state[params[0]]["step"]) == 5
    assert int(opt.state[params[1]]["step"]) == 3
    assert opt.last_ema_decays == {(0, 5): hand_mindspeed(5, 0.999), (0, 3): hand_mindspeed(3, 0.999)}


@pytest.mark.parametrize("schedule,hand", [("diffusers", hand_diffusers),
                                           ("diffusers_warmup", hand_diffusers_warmup)])
def test_overflow_step_does_not_advance_the_schedule(schedule, hand):
    params = helpers.make_params(SHAPES)
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.999, ema_schedule=schedule)
    for t in range(1, 4):
        set_grads(params, t)
        opt.step()
    before = copy.deepcopy(opt.state_dict())
    set_grads(params, 4)
    opt.found_inf = torch.ones(1)
    opt.grad_scale = torch.full((1,), 1024.0)
    opt.step()
    del opt.found_inf, opt.grad_scale
    after = opt.state_dict()
    for pid, st in before["state"].items():
        for key, value in st.items():
            assert torch.equal(after["state"][pid][key], value), key
    opt.step()
    assert opt.last_ema_decays == {(0, 4): hand(4, 0.999)}


# --- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,match", [
    (dict(ema_schedule="cosine"), "unknown ema_schedule 'cosine'"),
    (dict(ema_schedule=3), "ema_schedule must be None"),
    (dict(ema_start_step=-1), "ema_start_step must be an integer >= 0"),
    (dict(ema_start_step=True), "ema_start_step"),
    (dict(ema_start_step=2.5), "ema_start_step"),
    (dict(ema_inv_gamma=0.0), "ema_inv_gamma must be a finite number > 0"),
    (dict(ema_power=-1.0), "ema_power"),
    (dict(ema_power=float("nan")), "ema_power"),
    (dict(ema_min_decay=1.0), "ema_min_decay must be a number in \\[0, 1\\)"),
    (dict(ema_schedule="diffusers", ema_min_decay=0.995), "ema_min_decay=0.995 is above ema_decay=0.99"),
    (dict(ema_schedule="diffusers_warmup", ema_min_decay=0.995),
     "ema_min_decay=0.995 is above ema_decay=0.99; the 'diffusers_warmup' schedule"),
    (dict(ema_schedule="diffusers_warmpu"), "unknown ema_schedule 'diffusers_warmpu'"),
])
def test_invalid_options_raise(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FusedEmaAdamW(helpers.make_params(SHAPES), ema_decay=0.99, **bad)


@pytest.mark.parametrize("value,error,match", [
    (1.0, ValueError, r"decay=1\.0 at EMA update n=3 \(optimizer step 3\)"),
    (-0.25, ValueError, r"decay=-0\.25 at EMA update n=3"),
    (float("nan"), ValueError, r"decay=nan"),
    ("0.5", TypeError, r"returned '0\.5' \(str\)"),
])
def test_bad_callable_value_raises_before_anything_changes(value, error, match):
    def schedule(n):
        return value if n == 3 else 0.9

    params = helpers.make_params(SHAPES)
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.99, ema_schedule=schedule)
    for t in (1, 2):
        set_grads(params, t)
        opt.step()
    snapshot = [p.detach().clone() for p in params]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    set_grads(params, 3)
    with pytest.raises(error, match=match):
        opt.step()
    for p, saved, saved_state in zip(params, snapshot, state):
        assert torch.equal(p, saved)
        for key, value_ in saved_state.items():
            assert torch.equal(opt.state[p][key], value_), key


def test_invalid_option_set_on_a_group_raises_at_step_before_anything_changes():
    params = helpers.make_params(SHAPES)
    opt = FusedEmaAdamW([{"params": params[:1]}, {"params": params[1:]}], ema_decay=0.99)
    set_grads(params, 1)
    opt.step()
    opt.param_groups[1]["ema_schedule"] = "linear"
    snapshot = [p.detach().clone() for p in params]
    set_grads(params, 2)
    with pytest.raises(ValueError, match="unknown ema_schedule 'linear'"):
        opt.step()
    assert all(torch.equal(p, s) for p, s in zip(params, snapshot))


def test_set_ema_schedule_and_param_group_options():
    params = helpers.make_params(SHAPES)
    opt = FusedEmaAdamW([{"params": params[:1], "ema_schedule": "diffusers"}, {"params": params[1:]}],
                        ema_decay=0.99)
    assert opt.param_groups[0]["ema_schedule"] == "diffusers"
    assert opt.param_groups[1]["ema_schedule"] is None
    opt.set_ema_schedule("warmup", ema_start_step=2)
    assert all(g["ema_schedule"] == "warmup" and g["ema_start_step"] == 2 for g in opt.param_groups)
    with pytest.raises(ValueError, match="ema_start_step"):
        opt.set_ema_schedule(ema_start_step=-3)
    assert opt.param_groups[0]["ema_start_step"] == 2     # unchanged after the failed call
    extra = torch.nn.Parameter(torch.randn(3))
    opt.add_param_group({"params": [extra]})
    assert opt.param_groups[2]["ema_schedule"] == "warmup"  # the defaults follow


# --- state dicts --------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [
    dict(ema_schedule="warmup"),
    dict(ema_schedule="diffusers", ema_start_step=3, ema_min_decay=0.1),
    dict(ema_schedule="diffusers_warmup", ema_start_step=3, ema_power=0.75, ema_min_decay=0.1),
    dict(ema_schedule="constant", ema_start_step=12),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_the_schedule_exactly(options, dtype, backend):
    total, cut = 30, 11
    ref_params = helpers.make_params(SHAPES, dtype)
    ref = FusedEmaAdamW(ref_params, lr=2e-2, ema_decay=0.995, **options)
    ref_decays = []
    for t in range(1, total + 1):
        set_grads(ref_params, t)
        ref.step()
        ref_decays.append(ref.last_ema_decays[(0, t)])

    params = helpers.make_params(SHAPES, dtype)
    opt = FusedEmaAdamW(params, lr=2e-2, ema_decay=0.995, **options)
    for t in range(1, cut + 1):
        set_grads(params, t)
        opt.step()
    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach() for p in params]}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # string schedules need no pickled code

    params2 = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    opt2 = FusedEmaAdamW(params2, lr=1.0, ema_decay=0.5)  # every option comes from the state dict
    opt2.load_state_dict(saved["opt"])
    for key, value in options.items():
        assert opt2.param_groups[0][key] == value
    decays = ref_decays[:cut]
    for t in range(cut + 1, total + 1):
        set_grads(params2, t)
        opt2.step()
        decays.append(opt2.last_ema_decays[(0, t)])
    assert decays == ref_decays
    for p, q in zip(ref_params, params2):
        assert torch.equal(p, q)
        for key in ("ema", "exp_avg", "exp_avg_sq", "master_param"):
            if key in ref.state[p]:
                assert torch.equal(ref.state[p][key], opt2.state[q][key]), key
                assert opt2.state[q][key].dtype == ref.state[p][key].dtype


def test_old_state_dict_without_schedule_keys_keeps_current_options():
    params = helpers.make_params(SHAPES)
    opt = FusedEmaAdamW(params, ema_decay=0.99)
    set_grads(params, 1)
    opt.step()
    sd = opt.state_dict()
    for group in sd["param_groups"]:   # as saved before schedules existed
        for key in ema_schedules.EMA_OPTION_DEFAULTS:
            del group[key]
    opt2 = FusedEmaAdamW(params, ema_decay=0.99, ema_schedule="warmup", ema_start_step=1)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["ema_schedule"] == "warmup"
    assert opt2.param_groups[0]["ema_start_step"] == 1
    set_grads(params, 2)
    opt2.step()
    assert opt2.last_ema_decays == {(0, 2): hand_mindspeed(1, 0.99)}


def test_callable_schedule_survives_state_dict_in_memory():
    params = helpers.make_params(SHAPES)
    opt = FusedEmaAdamW(params, ema_decay=0.99, ema_schedule=user_schedule)
    set_grads(params, 1)
    opt.step()
    opt2 = FusedEmaAdamW(params, ema_decay=0.99)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt2.param_groups[0]["ema_schedule"] is user_schedule
    set_grads(params, 2)
    opt2.step()
    assert opt2.last_ema_decays == {(0, 2): user_schedule(2)}


# --- FusedRAdam(ema_decay=...) gets the same schedules through the mixin -------------------------
@pytest.mark.parametrize("schedule,hand", [("diffusers", hand_diffusers),
                                           ("diffusers_warmup", hand_diffusers_warmup)])
def test_fused_radam_ema_schedule(schedule, hand):
    from fused_optim import FusedRAdam

    params = helpers.make_params(SHAPES)
    opt = FusedRAdam(params, lr=1e-2, ema_decay=0.99)
    opt.set_ema_schedule(schedule, ema_start_step=2)
    weights = [[p.detach().double().clone()] for p in params]
    decays = []
    for t in range(1, 25):
        set_grads(params, t)
        opt.step()
        decays.append(opt.last_ema_decays[(0, t)])
        for w, p in zip(weights, params):
            w.append(p.detach().double().clone())
    expected = [hand(t, 0.99, 2) for t in range(1, 25)]
    assert decays == expected
    for p, w in zip(params, weights):
        s = w[0].clone()
        for t, d in enumerate(expected, start=1):
            s = d * s + (1 - d) * w[t]
        torch.testing.assert_close(opt.state[p]["ema"].double(), s, rtol=2e-6, atol=2e-6)
    # without an EMA the schedule options are inert
    plain = FusedRAdam(helpers.make_params(SHAPES), lr=1e-2)
    set_grads(plain.param_groups[0]["params"], 1)
    plain.step()
    assert plain.last_ema_decays == {}
