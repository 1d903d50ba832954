"""Bad input gets a clear error naming the tensor and the problem, raised before any tensor is
modified (SPEC section 5): the ops, the functional API and FusedEmaAdamW."""
from __future__ import annotations

import pytest
import torch

import fused_optim
from fused_optim import FusedEmaAdamW, fused_ema_adamw, npu_apply_fused_ema_adamw
from multi_tensor import (multi_tensor_applier, multi_tensor_fused_ema_adamw,
                          multi_tensor_l2norm, multi_tensor_scale)
from seed_reference import assert_unchanged, snapshot

NAMES = ["grads", "params", "exp_avgs", "exp_avg_sqs", "emas", "masters"]
SHAPES = [(3, 4), (5,)]
GOOD_ARGS = dict(lr=1e-2, ema_decay=0.9, beta1=0.9, beta2=0.99, eps=1e-8, step=1, mode=1,
                 bias_correction=True, weight_decay=0.01)


def good_lists(master=False):
    gen = torch.Generator().manual_seed(0)
    pdtype = torch.bfloat16 if master else torch.float32
    lists = [[torch.randn(s, generator=gen).to(pdtype) for s in SHAPES],       # grads
             [torch.randn(s, generator=gen).to(pdtype) for s in SHAPES]]       # params
    lists += [[torch.rand(s, generator=gen) for s in SHAPES] for _ in range(3)]  # m, v, s (fp32)
    if not master:
        lists[2:] = [[t.to(pdtype) for t in ts] for ts in lists[2:]]
    else:
        lists.append([p.float() for p in lists[1]])                             # masters
    return lists


def call_op(lists, **overrides):
    a = dict(GOOD_ARGS, **overrides)
    multi_tensor_applier(multi_tensor_fused_ema_adamw, torch.zeros(1, dtype=torch.int32), lists,
                         a["lr"], a["ema_decay"], a["beta1"], a["beta2"], a["eps"], a["step"],
                         a["mode"], a["bias_correction"], a["weight_decay"])


def flat(lists):
    return [t for ts in lists for t in ts if isinstance(t, torch.Tensor)]


def expect_error_and_no_change(lists, exc, match, **overrides):
    tensors = flat(lists)
    saved = snapshot(tensors)
    with pytest.raises(exc, match=match):
        call_op(lists, **overrides)
    assert_unchanged(tensors, saved, "after a rejected call")
    return saved


# ---------------------------------------------------------------------------------------------
# the op: tensor lists

def _set(li, i, make):
    def edit(lists):
        lists[li][i] = make(lists[li][i])
    return edit


def _drop(li):
    def edit(lists):
        del lists[li][-1]
    return edit


def _retype_list(li, dtype):
    def edit(lists):
        lists[li] = [t.to(dtype) for t in lists[li]]
    return edit


def _sparse(t):
    return t.to_sparse()


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


TENSOR_CASES = [
    # (id, master form, edit, exception, match)
    ("length-exp_avgs", False, _drop(2), ValueError, r"exp_avgs=1"),
    ("length-grads", False, _drop(0), ValueError, r"grads=1"),
    ("length-masters", True, _drop(5), ValueError, r"masters=1"),
    ("shape-exp_avg_sqs", False, _set(3, 1, lambda t: torch.zeros(6)), ValueError, r"exp_avg_sqs\[1\].*shape"),
    ("shape-grads", False, _set(0, 1, lambda t: torch.zeros(5, 1)), ValueError, r"grads\[1\].*shape"),
    ("shape-emas", False, _set(4, 0, lambda t: torch.zeros(4, 3)), ValueError, r"emas\[0\].*shape"),
    ("shape-masters", True, _set(5, 1, lambda t: torch.zeros(4)), ValueError, r"masters\[1\].*shape"),
    ("mixed-dtype-params", False, _set(1, 1, lambda t: t.double()), TypeError, r"params\[1\]"),
    ("mixed-dtype-emas", False, _set(4, 1, lambda t: t.half()), TypeError, r"emas\[1\]"),
    ("mixed-dtype-grads", False, _set(0, 1, lambda t: t.bfloat16()), TypeError, r"grads\[1\]"),
    ("state-dtype-exp_avgs", False, _retype_list(2, torch.float64), TypeError, r"exp_avgs"),
    ("grads-fp64-for-fp32", False, _retype_list(0, torch.float64), TypeError, r"grads"),
    ("master-form-exp_avgs-bf16", True, _retype_list(2, torch.bfloat16), TypeError, r"exp_avgs.*float32"),
    ("master-form-emas-fp16", True, _retype_list(4, torch.float16), TypeError, r"emas.*float32"),
    ("master-form-masters-bf16", True, _retype_list(5, torch.bfloat16), TypeError, r"masters.*float32"),
    ("master-form-fp64-params", True, _retype_list(1, torch.float64), TypeError, r"params.*float64"),
    ("device-emas-meta", False, _set(4, 1, _meta), RuntimeError, r"emas\[1\].*meta"),
    ("device-grads-meta", False, _set(0, 1, _meta), RuntimeError, r"grads\[1\].*meta"),
    ("device-params-meta", False, _set(1, 1, _meta), RuntimeError, r"params\[1\].*meta"),
    ("device-masters-meta", True, _set(5, 0, _meta), RuntimeError, r"masters\[0\].*meta"),
    ("sparse-grads", False, _set(0, 1, _sparse), RuntimeError, r"grads\[1\].*sparse"),
    ("sparse-grads-first", False, _set(0, 0, _sparse), RuntimeError, r"grads\[0\].*sparse"),
    ("int-params", False, _set(1, 1, lambda t: t.to(torch.int32)), TypeError, r"params\[1\].*float"),
    ("int-grads", False, _set(0, 1, lambda t: t.to(torch.int64)), TypeError, r"grads\[1\].*float"),
    ("bool-exp_avgs", False, _set(2, 1, lambda t: t > 0), TypeError, r"exp_avgs\[1\].*float"),
    ("not-a-tensor", False, _set(4, 1, lambda t: t.tolist()), TypeError, r"emas\[1\].*Tensor"),
    ("none-grad", False, _set(0, 1, lambda t: None), TypeError, r"grads\[1\]"),
]


@pytest.mark.parametrize("case_id,master,edit,exc,match", TENSOR_CASES, ids=[c[0] for c in TENSOR_CASES])
def test_op_rejects_bad_tensor_lists(backend, case_id, master, edit, exc, match):
    lists = good_lists(master)
    edit(lists)
    expect_error_and_no_change(lists, exc, match)


@pytest.mark.parametrize("n_lists", [0, 1, 4, 7])
def test_op_rejects_wrong_number_of_lists(backend, n_lists):
    full = good_lists(master=True) + [good_lists()[0]]
    lists = full[:n_lists]
    expect_error_and_no_change(lists, ValueError, r"tensor_lists")


def test_op_rejects_lists_not_a_list(backend):
    with pytest.raises((TypeError, ValueError), match=r"tensor_lists"):
        call_op("not lists")


# ---------------------------------------------------------------------------------------------
# the op: scalars

SCALAR_CASES = [
    ("step", 0, r"step"), ("step", -1, r"step"), ("step", 1.5, r"step"), ("step", True, r"step"),
    ("step", False, r"step"), ("step", torch.tensor([0]), r"step"), ("step", "2", r"step"),
    ("lr", -1e-3, r"lr"), ("lr", float("nan"), r"lr"), ("lr", float("inf"), r"lr"),
    ("eps", -1e-8, r"eps"),
    ("beta1", 1.0, r"beta1"), ("beta1", -0.1, r"beta1"), ("beta2", 1.0, r"beta2"),
    ("beta2", 1.5, r"beta2"), ("ema_decay", 1.0, r"ema_decay"), ("ema_decay", -0.5, r"ema_decay"),
    ("ema_decay", float("nan"), r"ema_decay"), ("weight_decay", -0.1, r"weight_decay"),
    ("mode", 2, r"mode"), ("mode", -1, r"mode"),
]


@pytest.mark.parametrize("name,value,match", SCALAR_CASES,
                         ids=[f"{n}={v!r}" for n, v, _ in SCALAR_CASES])
@pytest.mark.parametrize("master", [False, True])
def test_op_rejects_bad_scalars(backend, master, name, value, match):
    lists = good_lists(master)
    expect_error_and_no_change(lists, ValueError, match, **{name: value})


def test_op_rejects_bad_scalars_even_with_empty_lists(backend):
    with pytest.raises(ValueError, match="step"):
        call_op([[], [], [], [], []], step=0)
    with pytest.raises(ValueError, match="lr"):
        call_op([[], [], [], [], []], lr=-1.0)


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5])
def test_op_rejects_bad_chunk_size(backend, chunk_size):
    lists = good_lists()
    saved = snapshot(flat(lists))
    with pytest.raises(ValueError, match="chunk_size"):
        multi_tensor_fused_ema_adamw(chunk_size, torch.zeros(1, dtype=torch.int32), lists,
                                     *[GOOD_ARGS[k] for k in ("lr", "ema_decay", "beta1", "beta2",
                                                              "eps", "step", "mode",
                                                              "bias_correction", "weight_decay")])
    assert_unchanged(flat(lists), saved)


def test_valid_edge_values_are_accepted(backend):
    """The boundaries of the allowed ranges: lr=0, eps=0, beta=0, ema_decay=0, weight_decay=0."""
    lists = good_lists()
    call_op(lists, lr=0.0, eps=0.0, beta1=0.0, beta2=0.0, ema_decay=0.0, weight_decay=0.0)
    call_op(lists, step=torch.tensor([3], dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# scale / l2norm

def test_scale_rejects_bad_lists(backend):
    flag = torch.zeros(1, dtype=torch.int32)
    srcs, dsts = [torch.ones(3), torch.ones(4)], [torch.zeros(3), torch.zeros(5)]
    saved = snapshot(srcs + dsts)
    with pytest.raises(ValueError, match=r"dsts\[1\].*shape"):
        multi_tensor_applier(multi_tensor_scale, flag, [srcs, dsts], 2.0)
    assert_unchanged(srcs + dsts, saved)
    with pytest.raises(ValueError, match=r"lengths|dsts"):
        multi_tensor_applier(multi_tensor_scale, flag, [srcs, dsts[:1]], 2.0)
    with pytest.raises(ValueError, match=r"tensor_lists|srcs"):
        multi_tensor_applier(multi_tensor_scale, flag, [srcs, dsts, dsts], 2.0)
    dsts2 = [torch.zeros(3), torch.empty(4, device="meta")]
    with pytest.raises(RuntimeError, match=r"dsts\[1\].*meta"):
        multi_tensor_applier(multi_tensor_scale, flag, [srcs, dsts2], 2.0)
    with pytest.raises(TypeError, match=r"dsts\[0\]"):
        multi_tensor_applier(multi_tensor_scale, flag, [srcs, [torch.zeros(3, dtype=torch.int32),
                                                              torch.zeros(4)]], 2.0)
    assert_unchanged(srcs + dsts, saved)
    assert flag.item() == 0


def test_l2norm_rejects_bad_lists(backend):
    flag = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"tensor_lists|tensors"):
        multi_tensor_applier(multi_tensor_l2norm, flag, [[torch.ones(3)], [torch.ones(3)]])
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        multi_tensor_applier(multi_tensor_l2norm, flag, [[torch.ones(3), torch.ones(3, dtype=torch.int64)]])


# ---------------------------------------------------------------------------------------------
# the functional API

def seed_tensors():
    gen = torch.Generator().manual_seed(1)
    ts = [torch.randn(4, 5, generator=gen) for _ in range(5)]
    ts[3].abs_()
    return ts


NPU_CASES = [
    ("shape-m", lambda ts: ts.__setitem__(2, torch.zeros(5, 4)), {}, ValueError, r"\bm\b.*shape"),
    ("shape-grad", lambda ts: ts.__setitem__(0, torch.zeros(20)), {}, ValueError, r"grad.*shape"),
    ("dtype-s", lambda ts: ts.__setitem__(4, ts[4].double()), {}, TypeError, r"\bs\b.*float64"),
    ("dtype-grad-bf16", lambda ts: ts.__setitem__(0, ts[0].bfloat16()), {}, TypeError, r"grad"),
    ("int-var", lambda ts: ts.__setitem__(1, ts[1].to(torch.int32)), {}, TypeError, r"var|float"),
    ("not-tensor-v", lambda ts: ts.__setitem__(3, 1.0), {}, TypeError, r"\bv\b"),
    ("device-m-meta", lambda ts: ts.__setitem__(2, _meta(ts[2])), {}, RuntimeError, r"\bm\b|meta|device"),
    ("step-0", None, {"step": torch.tensor([0], dtype=torch.int64)}, ValueError, r"step"),
    ("step-int-0", None, {"step": 0}, ValueError, r"step"),
    ("step-float-tensor", None, {"step": torch.tensor([1.0])}, TypeError, r"step"),
    ("step-shape", None, {"step": torch.tensor([1, 2])}, ValueError, r"step"),
    ("step-bool", None, {"step": True}, ValueError, r"step"),
    ("lr-negative", None, {"lr": -1.0}, ValueError, r"lr"),
    ("eps-negative", None, {"eps": -1.0}, ValueError, r"eps"),
    ("beta1-1", None, {"beta1": 1.0}, ValueError, r"beta1"),
    ("beta2-negative", None, {"beta2": -0.5}, ValueError, r"beta2"),
    ("ema_decay-1", None, {"ema_decay": 1.0}, ValueError, r"ema_decay"),
    ("mode-3", None, {"mode": 3}, ValueError, r"mode"),
]


@pytest.mark.parametrize("case_id,edit,kwargs,exc,match", NPU_CASES, ids=[c[0] for c in NPU_CASES])
def test_npu_apply_rejects_bad_input(backend, case_id, edit, kwargs, exc, match):
    ts = seed_tensors()
    if edit is not None:
        edit(ts)
    kwargs = dict(kwargs)
    step = kwargs.pop("step", torch.tensor([1], dtype=torch.int64))
    tensors = [t for t in ts if isinstance(t, torch.Tensor)]
    saved = snapshot(tensors)
    with pytest.raises(exc, match=match):
        npu_apply_fused_ema_adamw(*ts, step, **kwargs)
    assert_unchanged(tensors, saved)


def test_functional_list_api_rejects_bad_second_bucket(backend):
    """fused_ema_adamw buckets rows; a bad row in a later bucket leaves earlier buckets unchanged."""
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(3, generator=gen), torch.randn(4, generator=gen).bfloat16()]
    grads = [torch.randn(3, generator=gen), torch.randn(5, generator=gen).bfloat16()]  # bad shape
    ms = [torch.zeros(3), torch.zeros(4)]
    vs = [torch.zeros(3), torch.zeros(4)]
    ss = [params[0].clone(), params[1].float()]
    steps = [torch.tensor(0.0), torch.tensor(0.0)]
    masters = [None, params[1].float()]
    tensors = params + grads + ms + vs + ss + steps + [masters[1]]
    saved = snapshot(tensors)
    with pytest.raises(ValueError, match=r"grads\[0\].*shape"):
        fused_ema_adamw(params, grads, ms, vs, ss, steps, masters, lr=1e-2, beta1=0.9, beta2=0.99,
                        eps=1e-8, weight_decay=0.0, ema_decay=0.9)
    assert_unchanged(tensors, saved)
    with pytest.raises(ValueError, match=r"lr"):
        grads[1] = torch.randn(4).bfloat16()
        fused_ema_adamw(params, grads, ms, vs, ss, steps, masters, lr=-1e-2, beta1=0.9, beta2=0.99,
                        eps=1e-8, weight_decay=0.0, ema_decay=0.9)
    assert_unchanged(tensors, saved)


# ---------------------------------------------------------------------------------------------
# FusedEmaAdamW

CTOR_CASES = [
    (dict(lr=-1e-3), r"lr"), (dict(lr=float("nan")), r"lr"), (dict(eps=-1.0), r"eps"),
    (dict(betas=(1.0, 0.999)), r"beta1"), (dict(betas=(0.9, 1.0)), r"beta2"),
    (dict(betas=(-0.1, 0.999)), r"beta1"), (dict(betas=(0.9,)), r"betas"),
    (dict(betas=0.9), r"betas"), (dict(ema_decay=1.0), r"ema_decay"),
    (dict(ema_decay=-0.01), r"ema_decay"), (dict(weight_decay=-1e-2), r"weight_decay"),
    (dict(chunk_size=0), r"chunk_size"), (dict(chunk_size=1.5), r"chunk_size"),
]


@pytest.mark.parametrize("kwargs,match", CTOR_CASES, ids=[repr(k) for k, _ in CTOR_CASES])
def test_constructor_rejects_bad_hyperparameters(backend, kwargs, match):
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=match):
        FusedEmaAdamW([p], **kwargs)


def test_constructor_rejects_bad_group_and_non_float_params(backend):
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="ema_decay"):
        FusedEmaAdamW([{"params": [p], "ema_decay": 1.5}])
    with pytest.raises(TypeError, match=r"params.*\[0\]|int64|floating"):
        FusedEmaAdamW([torch.zeros(3, dtype=torch.int64)])


def test_add_param_group_rejects_bad_hyperparameters_and_stays_usable(backend):
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))
    opt = FusedEmaAdamW([a], lr=1e-2)
    a.grad = torch.ones(3)
    opt.step()
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [b], "lr": -1.0})
    assert len(opt.param_groups) == 1, "a rejected group must not stay in param_groups"
    b.grad = torch.ones(4)
    opt.step()  # still works; b is not optimized
    assert int(opt.state[a]["step"]) == 2 and len(opt.state[b]) == 0
    with pytest.raises(TypeError):
        opt.add_param_group({"params": [torch.zeros(2, dtype=torch.int32)]})
    assert len(opt.param_groups) == 1


def two_bucket_setup():
    """Bucket 1: fp32 params; bucket 2: bf16 params (with masters). One good step done."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=gen)),
              torch.nn.Parameter(torch.randn(5, generator=gen)),
              torch.nn.Parameter(torch.randn(3, 4, generator=gen).bfloat16()),
              torch.nn.Parameter(torch.randn(6, generator=gen).bfloat16())]
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.9)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    return params, opt


def _opt_tensors(params, opt):
    return list(params) + [v for p in params for v in opt.state[p].values()]


def _bad_data(make):
    def edit(p):
        p.grad.data = make(p)
    return edit


BAD_GRADS = [
    ("sparse", lambda p: setattr(p, "grad", torch.zeros_like(p).to_sparse()), RuntimeError, r"sparse"),
    ("shape", _bad_data(lambda p: torch.zeros(7, dtype=p.dtype)), ValueError, r"grads\[\d+\].*shape"),
    ("fp64", _bad_data(lambda p: torch.zeros(p.shape, dtype=torch.float64)), TypeError, r"grads"),
    ("int", _bad_data(lambda p: torch.zeros(p.shape, dtype=torch.int32)), TypeError, r"grads\[\d+\]"),
]


@pytest.mark.parametrize("case_id,make_bad,exc,match", BAD_GRADS, ids=[c[0] for c in BAD_GRADS])
def test_bad_grad_in_second_bucket_changes_nothing(backend, case_id, make_bad, exc, match):
    params, opt = two_bucket_setup()
    make_bad(params[3])
    tensors = _opt_tensors(params, opt)
    saved = snapshot(tensors)
    with pytest.raises(exc, match=match):
        opt.step()
    assert_unchanged(tensors, saved, "after a rejected step")
    assert [int(opt.state[p]["step"]) for p in params] == [1, 1, 1, 1]
    # the optimizer recovers once the grad is fixed
    params[3].grad = torch.ones(params[3].shape, dtype=params[3].dtype)
    opt.step()
    assert [int(opt.state[p]["step"]) for p in params] == [2, 2, 2, 2]
    for p, before in zip(params, saved):
        assert not torch.equal(p, before)


def test_bad_hyperparameter_in_second_group_changes_nothing(backend):
    """A group edited into an invalid state (e.g. by a scheduler or by hand) is caught before the
    first group is updated."""
    gen = torch.Generator().manual_seed(4)
    a, b = torch.nn.Parameter(torch.randn(3, generator=gen)), torch.nn.Parameter(torch.randn(4, generator=gen))
    opt = FusedEmaAdamW([{"params": [a]}, {"params": [b]}], lr=1e-2)
    a.grad, b.grad = torch.ones(3), torch.ones(4)
    opt.step()
    for key, value, match in (("lr", -1.0, "lr"), ("ema_decay", 1.0, "ema_decay"),
                              ("betas", (0.9, 1.0), "beta2"), ("eps", -1.0, "eps")):
        good = opt.param_groups[1][key]
        opt.param_groups[1][key] = value
        tensors = _opt_tensors([a, b], opt)
        saved = snapshot(tensors)
        with pytest.raises(ValueError, match=match):
            opt.step()
        assert_unchanged(tensors, saved, f"bad {key} in group 1")
        opt.param_groups[1][key] = good
    opt.step()
    assert int(opt.state[a]["step"]) == 2 and int(opt.state[b]["step"]) == 2


def test_sparse_grad_for_new_param_is_rejected(backend):
    p = torch.nn.Parameter(torch.randn(4, 3))
    q = torch.nn.Parameter(torch.randn(2))
    opt = FusedEmaAdamW([q, p])
    q.grad = torch.ones(2)
    p.grad = torch.zeros(4, 3).to_sparse()
    saved = snapshot([p, q])
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert_unchanged([p, q], saved)


@pytest.mark.parametrize("bad", ["not lists", [torch.zeros(2)], None])
def test_tensor_lists_that_are_not_lists_of_lists_are_rejected(bad):
    import multi_tensor as mt
    noop = torch.zeros(1, dtype=torch.int32)
    calls = {
        "multi_tensor_scale": lambda: mt.multi_tensor_scale(8, noop, bad, 2.0),
        "multi_tensor_l2norm": lambda: mt.multi_tensor_l2norm(8, noop, bad),
        "multi_tensor_adam": lambda: mt.multi_tensor_adam(8, noop, bad, 1e-3, 0.9, 0.999, 1e-8,
                                                          1, 1, True, 0.0),
        "multi_tensor_fused_ema_adamw": lambda: mt.multi_tensor_fused_ema_adamw(
            8, noop, bad, 1e-3, 0.99, 0.9, 0.999, 1e-8, 1, 1, True, 0.0),
    }
    for op, call in calls.items():
        with pytest.raises(TypeError, match=f"{op}: tensor_lists must be a list of lists"):
            call()


@pytest.mark.parametrize("make", [
    lambda ps: fused_optim.FusedEmaAdamW(ps, lr=torch.tensor(1e-2), capturable=True),
    lambda ps: fused_optim.FusedAdamW(ps, capturable=True),
    lambda ps: fused_optim.FusedAdam(ps, capturable=True),
    lambda ps: fused_optim.FusedRAdam(ps, capturable=True),
], ids=["FusedEmaAdamW", "FusedAdamW", "FusedAdam", "FusedRAdam"])
def test_capturable_without_device_steps_raises_before_any_value_changes(make):
    """capturable=True needs device-side steps (the Triton backend on CUDA): on CPU the first
    step raises naming the param and the reason before any param or state value changes (the
    state entries exist, at step 0, as torch's optimizers leave them when they raise for it)."""
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    opt = make(params)
    assert opt.param_groups[0]["capturable"] is True
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"capturable=True .* param_groups\[0\]\[.params.\]"
                                         r"\[0\] .*keeps steps on the host"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(float(s["step"]) == 0 for s in opt.state.values())
