"""Inputs that used to crash, corrupt state or differ between backends: each is refused at the
front end with a clear error before anything changes, or accepted alike by every backend."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from fused_optim import FusedEmaAdamW, FusedRAdam, fused_ema_adamw, npu_apply_fused_ema_adamw
from multi_tensor import multi_tensor_adam, multi_tensor_fused_ema_adamw, rules, validation
from multi_tensor.ops import named_lists
from multi_tensor.schema import AdamLists
from seed_reference import assert_bitwise_equal, assert_unchanged, snapshot

ADAM_ARGS = (1e-3, 0.9, 0.999, 1e-8, 1, 1, True, 0.0)   # lr, b1, b2, eps, step, mode, bc, wd


def _adam_lists(n=1, shape=(4,), seed=0):
    gen = torch.Generator().manual_seed(seed)
    lists = [[torch.randn(shape, generator=gen) for _ in range(n)] for _ in range(4)]
    for v in lists[3]:
        v.abs_()
    return lists


def _flag():
    return torch.zeros(1, dtype=torch.int32)


def _refused(call, lists, exc, match):
    tensors = [t for ts in lists for t in ts if isinstance(t, torch.Tensor)]
    saved = snapshot(tensors)
    with pytest.raises(exc, match=match):
        call()
    assert_unchanged(tensors, saved, "after a refused call")


# --- grad_scale and noop_flag ----------------------------------------------------------------

@pytest.mark.parametrize("scale, exc, match", [
    (torch.tensor([]), ValueError, r"grad_scale must have exactly one element"),
    (torch.tensor([2.0, 3.0]), ValueError, r"grad_scale must have exactly one element"),
    (2.0, TypeError, r"grad_scale must be None or a 1-element"),
    (torch.tensor([2], dtype=torch.int32), TypeError, r"grad_scale must be a floating-point"),
    (torch.zeros(1, 0, 3), ValueError, r"grad_scale must have exactly one element"),
], ids=["empty", "two", "float", "int", "empty-3d"])
def test_bad_grad_scale_is_refused(backend, scale, exc, match):
    lists = _adam_lists()
    _refused(lambda: multi_tensor_adam(2048, _flag(), lists, *ADAM_ARGS, grad_scale=scale),
             lists, exc, match)


@pytest.mark.parametrize("scale_shape", [(), (1,), (1, 1)])
def test_one_element_grad_scale_of_any_shape_is_accepted_alike(scale_shape):
    from multi_tensor.backends import forced_backend
    out = {}
    for name in ("reference", "native_cpu"):
        lists = _adam_lists()
        with forced_backend(name):
            multi_tensor_adam(2048, _flag(), lists, *ADAM_ARGS,
                              grad_scale=torch.full(scale_shape, 4.0, dtype=torch.float64))
        out[name] = lists
    for a, b in zip(out["reference"], out["native_cpu"]):
        assert_bitwise_equal(a[0], b[0], "grad_scale run")


@pytest.mark.parametrize("flag, exc, match", [
    (None, TypeError, r"noop_flag must be a torch.Tensor"),
    (0, TypeError, r"noop_flag must be a torch.Tensor"),
    (torch.zeros(0, dtype=torch.int32), ValueError, r"noop_flag must have at least one element"),
    (torch.zeros(1, dtype=torch.complex64), TypeError, r"noop_flag must be a bool, integer or "),
    (torch.zeros(1, device="meta"), RuntimeError, r"noop_flag is on meta"),
], ids=["none", "int", "empty", "complex", "meta"])
def test_bad_noop_flag_is_refused(backend, flag, exc, match):
    lists = _adam_lists()
    _refused(lambda: multi_tensor_adam(2048, flag, lists, *ADAM_ARGS, check_finite=True),
             lists, exc, match)


def test_direct_native_call_with_an_empty_grad_scale_raises():
    """The C++ side checks too: a direct call must raise, not read a null pointer."""
    from multi_tensor.backends import cpu as native_cpu
    if native_cpu.loaded_module is None:
        pytest.skip("native CPU backend not built")
    lists = _adam_lists()
    scalars = rules.step_scalars(rules.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8), 1)
    bucket = native_cpu.loaded_module.AdamBucket(named_lists("adam", lists).state(), 2048)
    assert bucket.bind(lists[0])
    with pytest.raises(RuntimeError, match="grad_scale must be a 1-element"):
        bucket.run(_flag(), scalars, torch.tensor([]), False)
    with pytest.raises(TypeError, match="lists must hold tensors"):
        native_cpu.loaded_module.AdamBucket(
            AdamLists(None, ["x"], lists[2], lists[3]), 2048)


# --- mode ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [None, True, 2, 1.0, "1"])
def test_mode_must_be_0_or_1(backend, mode):
    lists = _adam_lists()
    _refused(lambda: multi_tensor_adam(2048, _flag(), lists, 1e-3, 0.9, 0.999, 1e-8, 1, mode,
                                       True, 0.0), lists, ValueError, r"mode must be 0")
    ema_lists = _adam_lists() + [[torch.zeros(4)]]
    _refused(lambda: multi_tensor_fused_ema_adamw(2048, _flag(), ema_lists, 1e-3, 0.99, 0.9, 0.999,
                                                  1e-8, 1, mode, True, 0.0),
             ema_lists, ValueError, r"mode must be 0")
    g, var, m, v, s = (t[0] for t in ema_lists)
    _refused(lambda: npu_apply_fused_ema_adamw(g, var, m, v, s, 1, mode=mode), ema_lists,
             ValueError, r"npu_apply_fused_ema_adamw: mode must be 0")


# --- overlapping memory ----------------------------------------------------------------------

def test_same_param_twice_in_a_group_is_refused(backend):
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    with pytest.warns(UserWarning):  # torch warns about the duplicate
        opt = FusedEmaAdamW([p, p], lr=0.1, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"\['params'\]\[1\] is the same tensor as .*\['params'\]\[0\]"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(4)) and not opt.state


def test_overlapping_param_views_are_refused(backend):
    base = torch.zeros(8)
    a, b = torch.nn.Parameter(base[0:4]), torch.nn.Parameter(base[2:6])
    a.grad, b.grad = torch.ones(4), torch.ones(4)
    opt = FusedEmaAdamW([a, b], lr=0.1)
    with pytest.raises(RuntimeError, match=r"params\[1\] overlaps params\[0\]"):
        opt.step()
    assert torch.equal(base, torch.zeros(8)) and not opt.state


@pytest.mark.parametrize("edit, match", [
    (lambda L: L[1].__setitem__(1, L[1][0]), r"params\[1\] is the same memory as params\[0\]"),
    (lambda L: L[3].__setitem__(0, L[2][0]), r"exp_avg_sqs\[0\] is the same memory as exp_avgs\[0\]"),
    (lambda L: L[0].__setitem__(1, L[4][0]), r"emas\[0\] is the same memory as grads\[1\]"),
    (lambda L: L[4].__setitem__(1, L[4][0].as_strided((4,), (1,), L[4][0].storage_offset() + 2)),
     r"emas\[1\] overlaps emas\[0\]"),
], ids=["param-twice", "m-is-v", "grad-is-ema", "view"])
def test_overlapping_tensors_in_one_call_are_refused(backend, edit, match):
    buf = torch.rand(40)
    lists = [[buf[k * 8 + 4 * i: k * 8 + 4 * i + 4] for i in range(2)] for k in range(5)]
    edit(lists)
    _refused(lambda: multi_tensor_fused_ema_adamw(2048, _flag(), lists, 1e-3, 0.99, 0.9, 0.999,
                                                  1e-8, 1, 1, True, 0.0), lists, RuntimeError, match)


def test_interleaved_and_shared_read_only_views_are_accepted(backend):
    """Two columns of one matrix span overlapping byte ranges but share no element; the same
    grad read twice writes nothing."""
    cols = [torch.rand(4, 2) for _ in range(4)]
    g = torch.rand(4)
    lists = [[g, g], [cols[0][:, 0], cols[0][:, 1]], [cols[1][:, 0], cols[1][:, 1]],
             [cols[2][:, 0], cols[2][:, 1]], [cols[3][:, 0], cols[3][:, 1]]]
    multi_tensor_fused_ema_adamw(2048, _flag(), lists, 1e-3, 0.99, 0.9, 0.999, 1e-8, 1, 1, True,
                                 0.0)


def test_functional_api_refuses_shared_state(backend):
    p = torch.rand(4)
    m = torch.zeros(4)
    with pytest.raises(RuntimeError, match=r"exp_avg_sqs\[0\] is the same memory as exp_avgs\[0\]"):
        fused_ema_adamw([p], [torch.rand(4)], [m], [m], [p.clone()], [torch.tensor(0.0)],
                        lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                        ema_decay=0.99)
    assert torch.equal(m, torch.zeros(4))


def test_check_no_overlap_is_exact_for_strided_views():
    m = torch.zeros(6, 6)
    validation.check_no_overlap("op", {"params": [m[:, ::2], m[:, 1::2]]})
    validation.check_no_overlap("op", {"params": [m[0], m[1], m[2:].t()]})
    with pytest.raises(RuntimeError, match=r"params\[1\] overlaps params\[0\]"):
        validation.check_no_overlap("op", {"params": [m[:, ::2], m[:, 2::3]]})
    with pytest.raises(RuntimeError, match=r"params\[0\] .* share memory"):
        validation.check_no_overlap("op", {"params": [m.view(-1).as_strided((3, 3), (1, 1))]})
    validation.check_no_overlap("op", {"grads": [m.view(-1)[:1].expand(5)], "params": [m[1]]})


# --- partial writes --------------------------------------------------------------------------

def test_leaf_param_requiring_grad_is_updated_alike_outside_no_grad():
    """apex's kernels write raw memory: the front end runs every backend under no_grad."""
    from multi_tensor.backends import forced_backend
    out = {}
    for name in ("reference", "native_cpu"):
        lists = _adam_lists() + [[torch.zeros(4)]]
        lists[1][0].requires_grad_(True)
        with forced_backend(name):
            multi_tensor_fused_ema_adamw(2048, _flag(), lists, 1e-2, 0.99, 0.9, 0.999, 1e-8, 1, 1,
                                         True, 0.0)
        assert lists[1][0].requires_grad and lists[1][0].grad_fn is None
        out[name] = lists
    for a, b in zip(out["reference"], out["native_cpu"]):
        assert_bitwise_equal(a[0].detach(), b[0].detach(), "leaf param run")


def test_expanded_param_is_refused_before_any_write(backend):
    lists = _adam_lists()
    lists[1] = [torch.rand(1).expand(4)]
    _refused(lambda: multi_tensor_adam(2048, _flag(), lists, *ADAM_ARGS), lists, RuntimeError,
             r"params\[0\] .* share memory \(an expanded or stride-0 view\)")


# --- reshaped params -------------------------------------------------------------------------

def test_param_reshaped_in_place_is_refused_naming_it(backend):
    p = torch.nn.Parameter(torch.rand(6))
    opt = FusedEmaAdamW([p], lr=1e-2)
    p.grad = torch.rand(6)
    opt.step()
    p.data = p.data.view(2, 3)
    p.grad = torch.rand(2, 3)
    before = snapshot([p.detach()] + list(opt.state[p].values()))
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] has shape \(6,\) but params\[0\]"):
        opt.step()
    assert_unchanged([p.detach()] + list(opt.state[p].values()), before, "refused step")


# --- a refused step changes nothing ----------------------------------------------------------

def _state_snapshot(opt):
    return {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


def test_refused_step_after_load_changes_no_state(backend):
    half = torch.nn.Parameter(torch.rand(4).half())
    other = torch.nn.Parameter(torch.rand(3))
    opt = FusedEmaAdamW([half, other], lr=1e-2, master_weights=False)
    sd = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.full((4,), 1 / 3),
                        "exp_avg_sq": torch.full((4,), 0.1), "ema": torch.rand(4)},
                    1: {"step": torch.tensor(2.0), "exp_avg": torch.zeros(5),
                        "exp_avg_sq": torch.zeros(5), "ema": torch.zeros(5)}},
          "param_groups": [{**{k: v for k, v in opt.param_groups[0].items() if k != "params"},
                            "params": [0, 1]}]}
    opt.load_state_dict(sd)
    before = _state_snapshot(opt)
    assert opt.state[half]["exp_avg"].dtype == torch.float32
    half.grad, other.grad = torch.rand(4).half(), torch.rand(3)
    with pytest.raises(ValueError, match="shape"):
        opt.step()
    after = _state_snapshot(opt)
    assert after.keys() == before.keys()
    for pid, entry in before.items():
        assert after[pid].keys() == entry.keys()
        for k, v in entry.items():
            assert_bitwise_equal(after[pid][k], v, f"state {k}")


def test_refused_later_group_undoes_the_earlier_groups_new_state(backend):
    a = torch.nn.Parameter(torch.rand(4).bfloat16())
    b = torch.nn.Parameter(torch.rand(4))
    opt = FusedEmaAdamW([{"params": [a], "master_weights": True}, {"params": [b]}], lr=1e-2)
    a.grad = torch.rand(4).bfloat16()
    b.grad = torch.rand(4)
    opt.param_groups[1]["lr"] = float("nan")
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    assert not opt.state and len(opt.state_dict()["state"]) == 0
    opt.param_groups[1]["lr"] = 1e-2
    opt.step()
    assert set(opt.state) == {a, b}


# --- option checks ---------------------------------------------------------------------------

def test_option_replaced_by_nan_is_refused_every_time(backend):
    p = torch.nn.Parameter(torch.rand(4))
    p.grad = torch.rand(4)
    opt = FusedEmaAdamW([p], lr=1e-2)
    opt.step()
    g = opt.param_groups[0]
    for _ in range(20):
        g["lr"] = float("0.5")  # a new object, checked by this step
        opt.step()
        before = p.detach().clone()
        g["lr"] = 0.0           # frees it: the next float takes its address (CPython's free list)
        g["lr"] = float("nan")
        with pytest.raises(ValueError, match="lr"):
            opt.step()
        assert torch.equal(p.detach(), before)
    assert torch.isfinite(p).all()


# --- non-tensors, GradScaler without grads ---------------------------------------------------

@pytest.mark.parametrize("li", [0, 1, 2, 3])
def test_non_tensor_in_any_list_is_a_type_error(backend, li):
    lists = _adam_lists()
    lists[li][0] = "x"
    _refused(lambda: multi_tensor_adam(2048, _flag(), lists, *ADAM_ARGS), lists, TypeError,
             r"\[0\] must be a torch.Tensor, got str")


def test_grad_scaler_step_without_grads():
    p = torch.nn.Parameter(torch.rand(4))
    opt = FusedEmaAdamW([p], lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.tensor(1.0))
    scaler.step(opt)  # found_inf is the int 0 here (a sum over no devices)
    assert not opt.state


# --- RAdam near beta2 = 1 --------------------------------------------------------------------

def _exact_rho(beta2: float, t: int) -> Fraction:
    q = Fraction(beta2)
    qt = q ** t
    return 2 / (1 - q) - 1 - 2 * t * qt / (1 - qt)


@pytest.mark.parametrize("beta2", [0.0, 0.5, 0.9, 0.99, 0.999, 0.9999, 1 - 1e-5, 1 - 1e-6,
                                   0.9999999, 1 - 1e-9, 1 - 2 ** -40, 1 - 2 ** -52])
def test_radam_rho_matches_exact_arithmetic(beta2):
    for t in (1, 2, 3, 4, 5, 6, 7, 8, 11, 64, 100, 333, 1000):
        exact = _exact_rho(beta2, t)
        got = rules.radam_rho(beta2, t)
        assert abs(Fraction(got) - exact) <= exact * Fraction(64, 2 ** 53), (beta2, t, got)
        assert (rules.radam_rect(beta2, t) is not None) == (exact > 5), (beta2, t)


def test_radam_near_beta2_one_follows_torch():
    """rho_5 = 4.9999996 exactly: not rectified at step 5 (torch's own rho_5 is 4.9988)."""
    assert rules.radam_rect(0.9999999, 5) is None and rules.radam_rect(0.9999999, 6) is not None
    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(16))
    theirs = torch.nn.Parameter(ours.detach().clone())
    a = FusedRAdam([ours], lr=1e-2, betas=(0.9, 0.9999999))
    b = torch.optim.RAdam([theirs], lr=1e-2, betas=(0.9, 0.9999999))
    for _ in range(8):
        g = torch.randn(16)
        ours.grad, theirs.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert (ours - theirs).abs().max() < 1e-5
