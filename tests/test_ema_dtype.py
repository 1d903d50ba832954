"""``ema_dtype=torch.bfloat16``: a bf16 EMA, updated in fp32 and rounded once to nearest even.

* Every registered backend that runs CPU tensors against an independent IEEE oracle
  (``ieee_oracle.adam_update`` in numpy float32, then ``ieee_oracle.bf16_round``, a numpy
  bit-trick), bit for bit, with rows built to land exactly on bf16 ties (where truncation or
  round-half-up would differ). (Bitwise agreement of every backend with the reference over the
  whole table, bf16-EMA list forms included, is tests/test_backends.py.)
* The op table: a bf16 EMA is accepted beside fp32/fp16/bf16 state, nothing else is.
* The optimizers: ``state["ema"]`` is bf16 for every param dtype that computes in fp32; params,
  moments and masters are exactly those of the fp32-EMA optimizer; the first EMA update is the
  oracle's; ``state_dict`` round trip; a changed ``ema_dtype`` converts at the next step;
  ``swap_ema_weights`` / ``copy_ema_to`` write the bf16 EMA into params of any dtype; the EMA's
  bytes are halved; bad values raise ``ValueError``.
"""
from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch

import multi_tensor
from fused_optim import FusedAdamW, FusedEmaAdamW, FusedRAdam
from ieee_oracle import adam_update, as_numpy, bf16_round
from multi_tensor import rules, schema
from multi_tensor.backends import forced_backend

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
BACKENDS = [b.name for b in multi_tensor.registered_backends() if b.handles("cpu")]


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).reshape(-1)


def torch_bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)


# ---------------------------------------------------------------------------------------------
# the kernels vs the IEEE oracle

def _tie_rows():
    """(s, w) pairs whose EMA at decay 0.5 with lr = 0 (w' = w) is exactly a bf16 tie:
    (s + w) / 2 halfway between two bf16 values. RNE picks the even one."""
    u = 2.0 ** -7  # one bf16 ulp in [1, 2)
    s = [1.0, 1.0 + u, -1.0, -(1.0 + u), 3.0, 1.0 + 2 * u]
    w = [1.0 + u, 1.0 + 2 * u, -(1.0 + u), -(1.0 + 2 * u), 3.0 + 2 * u, 1.0 + 3 * u]
    return torch.tensor(s, dtype=F32), torch.tensor(w, dtype=F32)


# (op, param dtype, masters): a bf16 EMA beside each kind of state
ORACLE_CASES = [("fused_ema_adamw", F32, False), ("fused_ema_adamw", BF16, True),
                ("fused_ema_adamw", F16, False), ("radam_ema", F32, False)]


@pytest.mark.parametrize("op,param_dtype,master", ORACLE_CASES,
                         ids=[f"{o}-{str(p)[6:]}-{'master' if m else 'plain'}"
                              for o, p, m in ORACLE_CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_ema_is_the_fp32_update_rounded_once_to_nearest_even(backend, op, param_dtype,
                                                                     master):
    spec = schema.OPS[op]
    gen = torch.Generator().manual_seed(5)
    n = 3000
    w64 = torch.randn(n, generator=gen, dtype=F64)
    rows = []  # each: (grad, weights fp32, m, v, s bf16, hyper)
    state = F32 if master else param_dtype
    for decay, lr in ((0.9, 1e-2), (0.5, 1e-3)):
        h = rules.AdamHyper(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05,
                            ema_decay=decay, rule=spec.rule)
        g = torch.randn(n, generator=gen, dtype=F64).to(F32)
        m = (torch.randn(n, generator=gen, dtype=F64) * 0.1).to(state)
        v = (torch.randn(n, generator=gen, dtype=F64).abs() * 0.01).to(state)
        s = (w64 + 0.05 * torch.randn(n, generator=gen, dtype=F64)).to(BF16)
        rows.append((g, w64.to(param_dtype), m, v, s, h))
    s_tie, w_tie = _tie_rows()
    if param_dtype == F32:  # lr = 0: w' = w exactly, so the EMA lands on the ties
        h = rules.AdamHyper(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                            ema_decay=0.5, rule=spec.rule)
        rows.append((torch.zeros(6), w_tie, torch.zeros(6), torch.zeros(6), s_tie.to(BF16), h))
    for g, p, m, v, s, h in rows:
        masters = [p.to(F32)] if master else []
        params = [(masters[0] if master else p).to(param_dtype)]
        lists = [[g], params, [m.clone()], [v.clone()], [s.clone()]] + ([masters] if master else [])
        c = rules.step_scalars(h, 3)
        w_np = as_numpy(masters[0] if master else params[0])
        ew, em, ev, es = adam_update(c, as_numpy(g), w_np, as_numpy(m), as_numpy(v), as_numpy(s))
        noop = torch.zeros(1, dtype=torch.int32)
        with forced_backend(backend):
            getattr(multi_tensor, spec.api_name)(
                2048, noop, lists, h.lr, h.ema_decay, h.beta1, h.beta2, h.eps, 3,
                *((1, True, h.weight_decay) if op == "fused_ema_adamw" else (h.weight_decay, True)))
        assert lists[4][0].dtype == BF16
        got, want = torch_bits(lists[4][0]), bf16_bits(bf16_round(es))
        assert np.array_equal(got, want), (
            f"{backend} {op}: {int((got != want).sum())} of {got.size} EMA elements differ from "
            f"the fp32 update rounded once to nearest even")
        weights = lists[-1][0] if master else lists[1][0]  # the weights: the fp32 update too
        want_w = ew if weights.dtype == F32 else ew.astype(np.float16)
        assert np.array_equal(weights.numpy(), want_w), f"{backend} {op}: weights"
    if param_dtype == F32:  # the ties went to the even neighbour
        u = 2.0 ** -7
        assert lists[4][0].tolist() == [1.0, 1.0 + 2 * u, -1.0, -(1.0 + 2 * u), 3.0,
                                        1.0 + 2 * u]



# ---------------------------------------------------------------------------------------------
# the op table

@pytest.mark.parametrize("params,state,ema,ok", [
    (F32, F32, BF16, True), (BF16, F32, BF16, True), (F16, F16, BF16, True),
    (BF16, BF16, BF16, True), (F16, F32, BF16, True),
    (F64, F64, BF16, False), (F32, F32, F16, False), (BF16, F32, F16, False),
    (F16, F16, F32, False), (F32, F32, F64, False),
])
def test_op_table_accepts_a_bf16_ema_and_nothing_else(params, state, ema, ok):
    master = state == F32 and params in (F16, BF16)
    t = lambda dt: [torch.zeros(3, dtype=dt)]  # noqa: E731
    lists = [t(F32 if params != F64 else F64), t(params), t(state), t(state), t(ema)]
    if master:
        lists.append(t(F32))
    spec = schema.OPS["fused_ema_adamw"]
    named = multi_tensor.ops.named_lists(spec, lists)
    if ok:
        schema.check_adam_lists(spec, named)
        return
    with pytest.raises(TypeError, match="emas are"):
        schema.check_adam_lists(spec, named)


def test_op_table_still_rejects_other_state_mixtures():
    t = lambda dt: [torch.zeros(3, dtype=dt)]  # noqa: E731
    with pytest.raises(TypeError, match="exp_avgs are torch.bfloat16"):
        schema.check_adam_lists(schema.OPS["fused_ema_adamw"], multi_tensor.ops.named_lists(
            "fused_ema_adamw", [t(F32), t(F32), t(BF16), t(F32), t(BF16)]))
    with pytest.raises(TypeError, match="exp_avg_sqs are torch.bfloat16"):
        schema.check_adam_lists(schema.OPS["adam"], multi_tensor.ops.named_lists(
            "adam", [t(F32), t(F32), t(F32), t(BF16)]))


# ---------------------------------------------------------------------------------------------
# the optimizers

def make_model(dtype, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in ((37,), (4, 9), (1,))]


def train(params, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


PARAM_CASES = [(F32, True), (BF16, True), (F16, True), (BF16, False), (F16, False)]


@pytest.mark.parametrize("dtype,master", PARAM_CASES,
                         ids=[f"{str(d)[6:]}-{'master' if m else 'plain'}" for d, m in PARAM_CASES])
def test_optimizer_keeps_a_bf16_ema_and_everything_else_unchanged(dtype, master):
    initial, pa, pb = make_model(dtype), make_model(dtype), make_model(dtype)
    oa = FusedEmaAdamW(pa, lr=1e-2, ema_decay=0.5, master_weights=master, ema_dtype=BF16)
    ob = FusedEmaAdamW(pb, lr=1e-2, ema_decay=0.5, master_weights=master)
    train(pa, oa, 1)
    train(pb, ob, 1)
    c = rules.step_scalars(oa._hyper(oa.param_groups[0], 1), 1)
    for p, q, p0 in zip(pa, pb, initial):
        sa, sb = oa.state[p], ob.state[q]
        assert sa["ema"].dtype == BF16
        assert sb["ema"].dtype == (F32 if master or dtype == F32 else dtype)
        assert torch.equal(p, q)  # the EMA's dtype never touches params, moments or masters
        for key in sb:
            if key != "ema":
                assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
        # step 1, from an EMA that starts as the weights rounded once to bf16; the EMA takes
        # the unrounded fp32 update (also without masters)
        w0 = as_numpy(p0)
        s0 = bf16_round(w0)
        zeros = np.zeros_like(w0)
        _, _, _, es = adam_update(c, as_numpy(p.grad), w0, zeros, zeros, s0)
        assert np.array_equal(torch_bits(sa["ema"]), bf16_bits(bf16_round(es)))
    # later steps: params still equal the fp32-EMA optimizer's
    train(pa, oa, 3, seed=2)
    train(pb, ob, 3, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(pa, pb))


def test_ema_bytes_are_halved_and_group_option_saved():
    pa, pb = make_model(F32), make_model(F32)
    oa = FusedEmaAdamW(pa, ema_dtype=BF16)
    ob = FusedEmaAdamW(pb)
    train(pa, oa, 1)
    train(pb, ob, 1)
    nbytes = lambda o: sum(s["ema"].numel() * s["ema"].element_size()  # noqa: E731
                           for s in o.state.values())
    assert nbytes(oa) * 2 == nbytes(ob) > 0
    assert oa.state_dict()["param_groups"][0]["ema_dtype"] == BF16
    assert ob.state_dict()["param_groups"][0]["ema_dtype"] == F32


def test_state_dict_round_trip_keeps_the_bf16_ema_and_continues_bitwise():
    pa = make_model(BF16)
    oa = FusedEmaAdamW(pa, lr=1e-2, ema_decay=0.9, ema_dtype=BF16)
    train(pa, oa, 3)
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    ob = FusedEmaAdamW(pb, lr=1e-2, ema_decay=0.9)  # the saved group's ema_dtype wins
    buf.seek(0)
    ob.load_state_dict(torch.load(buf))
    assert ob.param_groups[0]["ema_dtype"] == BF16
    for p, q in zip(pa, pb):
        assert ob.state[q]["ema"].dtype == BF16
        assert torch.equal(oa.state[p]["ema"], ob.state[q]["ema"])
        assert ob.state[q]["master_param"].dtype == F32
    train(pa, oa, 2, seed=9)
    train(pb, ob, 2, seed=9)
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)
        for key, value in oa.state[p].items():
            assert value.dtype == ob.state[q][key].dtype and torch.equal(value, ob.state[q][key])


def test_changed_ema_dtype_converts_the_existing_ema_at_the_next_step():
    params = make_model(F32)
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.5)
    train(params, opt, 2)
    old = [opt.state[p]["ema"].clone() for p in params]
    opt.param_groups[0]["ema_dtype"] = BF16
    before = [p.detach().clone() for p in params]
    train(params, opt, 1, seed=3)
    for p, s_old, w_old in zip(params, old, before):
        ema = opt.state[p]["ema"]
        assert ema.dtype == BF16
        s0 = bf16_round(as_numpy(s_old))  # converted once (RNE), then the fp32 update
        expected = bf16_round(s0 + np.float32(0.5) * (as_numpy(p) - s0))
        assert np.array_equal(torch_bits(ema), bf16_bits(expected))
    opt.param_groups[0]["ema_dtype"] = torch.float32  # and back: exact widening
    kept = [opt.state[p]["ema"].clone() for p in params]
    opt._plan(opt.param_groups[0], [p.grad for p in params])
    for p, s in zip(params, kept):
        assert opt.state[p]["ema"].dtype == F32 and torch.equal(opt.state[p]["ema"], s.float())


@pytest.mark.parametrize("dtype,master", [(F32, True), (BF16, True), (F16, False), (BF16, False)])
def test_swap_and_copy_write_the_bf16_ema_into_params(dtype, master):
    params = make_model(dtype)
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.5, master_weights=master, ema_dtype=BF16)
    train(params, opt, 3)
    training = [p.detach().clone() for p in params]
    emas = [opt.state[p]["ema"].clone() for p in params]
    with opt.swap_ema_weights():
        for p, s in zip(params, emas):
            assert p.dtype == dtype and torch.equal(p, s.to(dtype))
    assert all(torch.equal(p, t) for p, t in zip(params, training))
    targets = [torch.empty(p.shape, dtype=F64) for p in params]
    opt.copy_ema_to(targets)  # fp64 targets: the bf16 values exactly
    assert all(torch.equal(t, s.to(F64)) for t, s in zip(targets, emas))
    opt.copy_ema_to()
    for p, s in zip(params, emas):
        assert torch.equal(p, s.to(dtype))
        if master and dtype != F32:  # the master becomes the EMA, exactly
            assert torch.equal(opt.state[p]["master_param"], s.float())
    exported = opt.ema_state_dict(torch.nn.ParameterList(params), dtype=torch.float32)
    assert all(torch.equal(v, s.float()) for v, s in zip(exported.values(), emas))


def test_fused_radam_keeps_a_bf16_ema():
    params = make_model(F32)
    opt = FusedRAdam(params, lr=1e-2, ema_decay=0.9, ema_dtype=BF16)
    train(params, opt, 7)
    assert all(opt.state[p]["ema"].dtype == BF16 for p in params)


@pytest.mark.parametrize("value", [torch.float16, torch.float64, "bfloat16", 16])
def test_other_ema_dtypes_are_rejected(value):
    with pytest.raises(ValueError, match="ema_dtype must be"):
        FusedEmaAdamW(make_model(F32), ema_dtype=value)
    opt = FusedEmaAdamW(make_model(F32))
    opt.param_groups[0]["ema_dtype"] = value
    params = opt.param_groups[0]["params"]
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="ema_dtype must be"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("dtype", [F64, torch.complex64])
def test_bf16_ema_of_params_without_fp32_math_is_rejected(dtype):
    p = torch.nn.Parameter(torch.randn(3, dtype=dtype))
    with pytest.raises(ValueError, match=r"params\[0\] of the group is"):
        FusedEmaAdamW([p], ema_dtype=BF16)
    opt = FusedEmaAdamW([torch.nn.Parameter(torch.randn(3))], ema_dtype=BF16)
    with pytest.raises(ValueError, match=r"params\[0\] of the group is"):
        opt.add_param_group({"params": [p]})
    assert len(opt.param_groups) == 1


def test_optimizers_without_an_ema_have_no_ema_dtype():
    opt = FusedAdamW(make_model(F32))
    assert "ema_dtype" not in opt.param_groups[0]
    with pytest.raises(TypeError):
        FusedAdamW(make_model(F32), ema_dtype=BF16)


def test_deepcopy_keeps_the_option():
    opt = FusedEmaAdamW(make_model(F32), ema_dtype=BF16)
    assert copy.deepcopy(opt).param_groups[0]["ema_dtype"] == BF16
