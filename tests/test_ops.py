"""The engine's ops against the float64 seed formula: multi_tensor_fused_ema_adamw (5- and 6-list
forms), multi_tensor_scale and multi_tensor_l2norm, on every registered backend."""
from __future__ import annotations

import math

import pytest
import torch

from multi_tensor import (MultiTensorApply, multi_tensor_applier, multi_tensor_fused_ema_adamw,
                          multi_tensor_l2norm, multi_tensor_scale)
from seed_reference import (assert_bitwise_equal, assert_close64, assert_unchanged,
                            assert_within_ulps, seed_update, snapshot)

SHAPES = [(), (0,), (1,), (17,), (4, 0), (5, 9), (3, 4, 5), (70, 33)]
LAYOUTS = ("contiguous", "transposed", "sliced")

HYPER = {
    # eps large enough that where it is added (sqrt(v / bc2) + eps) is visible in the result
    "large_eps": dict(lr=1e-2, ema_decay=0.9, beta1=0.9, beta2=0.99, eps=1e-3),
    "typical": dict(lr=3e-3, ema_decay=0.99, beta1=0.8, beta2=0.999, eps=1e-8),
}

FP32_TOL = dict(rtol=1e-6, atol=1e-6)
FP64_TOL = dict(rtol=1e-12, atol=1e-13)


def noop():
    return torch.zeros(1, dtype=torch.int32)


class Slot:
    """A tensor that may be a non-contiguous view into a larger base tensor."""

    def __init__(self, values: torch.Tensor, dtype: torch.dtype, layout: str):
        shape = tuple(values.shape)
        if layout == "transposed" and len(shape) >= 2:
            base = torch.empty(shape[::-1], dtype=dtype).normal_()
            view = lambda b: b.permute(*reversed(range(b.dim())))  # noqa: E731
        elif layout == "sliced" and len(shape) >= 1:
            base = torch.empty(shape[:-1] + (2 * shape[-1] + 1,), dtype=dtype).normal_()
            view = lambda b: b[..., 1::2]  # noqa: E731
        else:
            base = torch.empty(shape, dtype=dtype)
            view = lambda b: b  # noqa: E731
        self.base = base
        self.t = view(base)
        assert self.t.shape == values.shape
        self.t.copy_(values)
        region = torch.zeros(base.shape, dtype=torch.bool)
        view(region).fill_(True)
        self.outside = ~region
        self.outside_before = base[self.outside].clone()

    def check_outside_untouched(self, what):
        assert_bitwise_equal(self.base[self.outside], self.outside_before, f"{what}: base outside the view")


def make_rows(gen, shapes, *, grad_dtype, param_dtype, state_dtype, master, layouts=LAYOUTS):
    """``[dict(grad, param, m, v, s, master)]`` of Slots with random values and random layouts."""
    rows = []
    for i, shape in enumerate(shapes):
        def rnd(scale=1.0):
            return torch.randn(shape, generator=gen, dtype=torch.float64) * scale

        def lay(k):
            return layouts[(i + k) % len(layouts)]

        p = rnd()
        row = {
            "grad": Slot(rnd(), grad_dtype, lay(0)),
            "param": Slot(p, param_dtype, lay(1)),
            "m": Slot(rnd(0.1), state_dtype, lay(2)),
            "v": Slot(rnd(0.1) ** 2, state_dtype, lay(3)),
            "s": Slot(p + rnd(0.01), state_dtype, lay(4)),
        }
        if master:
            row["master"] = Slot(p + rnd(1e-3), torch.float32, lay(5))
        rows.append(row)
    return rows


def tensor_lists(rows, master):
    keys = ["grad", "param", "m", "v", "s"] + (["master"] if master else [])
    return [[r[k].t for r in rows] for k in keys]


def all_slots(rows):
    return [slot for r in rows for slot in r.values()]


def run_and_check(rows, *, master, step, mode, bias_correction, weight_decay, hp, tol,
                  grad_scale=None, scale_shape=(), maximize=False, applier=multi_tensor_applier):
    """One op call, every output checked against the seed formula fed the same inputs."""
    expected = []
    for r in rows:
        weights = r["master"].t if master else r["param"].t
        expected.append(seed_update(
            r["grad"].t, weights, r["m"].t, r["v"].t, r["s"].t, step, hp["lr"], hp["ema_decay"],
            hp["beta1"], hp["beta2"], hp["eps"], mode, bias_correction, weight_decay,
            grad_scale=None if grad_scale is None else float(grad_scale), maximize=maximize))
    grads_before = snapshot(r["grad"].t for r in rows)
    kwargs = {}
    if grad_scale is not None:
        kwargs["grad_scale"] = torch.full(scale_shape, grad_scale, dtype=torch.float32)
    if maximize:
        kwargs["maximize"] = True
    flag = noop()
    applier(multi_tensor_fused_ema_adamw, flag, tensor_lists(rows, master), hp["lr"],
            hp["ema_decay"], hp["beta1"], hp["beta2"], hp["eps"], step, mode, bias_correction,
            weight_decay, **kwargs)
    assert flag.item() == 0
    assert_unchanged([r["grad"].t for r in rows], grads_before, "grads")
    for i, (r, (var_, m_, v_, s_)) in enumerate(zip(rows, expected)):
        weights = r["master"].t if master else r["param"].t
        assert_close64(weights, var_, msg=f"row {i} {'master' if master else 'param'}", **tol)
        assert_close64(r["m"].t, m_, msg=f"row {i} exp_avg", **tol)
        assert_close64(r["v"].t, v_, msg=f"row {i} exp_avg_sq", **tol)
        assert_close64(r["s"].t, s_, msg=f"row {i} ema", **tol)
        if master:
            assert_bitwise_equal(r["param"].t, r["master"].t.to(r["param"].t.dtype),
                                 f"row {i}: param must be the master rounded once")
    for slot in all_slots(rows):
        slot.check_outside_untouched("op")


def new_grads(rows, gen, scale=1.0):
    for r in rows:
        g = r["grad"].t
        g.copy_(torch.randn(g.shape, generator=gen, dtype=torch.float64) * scale)


# ---------------------------------------------------------------------------------------------
# multi_tensor_fused_ema_adamw, [grads, params, exp_avgs, exp_avg_sqs, emas]

@pytest.mark.parametrize("hp_name", sorted(HYPER))
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("mode", [0, 1])
def test_fp32_matches_seed_formula(backend, mode, bias_correction, weight_decay, hp_name):
    gen = torch.Generator().manual_seed(1000 + 8 * mode + 4 * bias_correction + int(weight_decay > 0))
    rows = make_rows(gen, SHAPES, grad_dtype=torch.float32, param_dtype=torch.float32,
                     state_dtype=torch.float32, master=False)
    for step in (1, 2, 3, 10):
        new_grads(rows, gen)
        run_and_check(rows, master=False, step=step, mode=mode, bias_correction=bias_correction,
                      weight_decay=weight_decay, hp=HYPER[hp_name], tol=FP32_TOL)


def test_fp64_tensors_match_seed_formula(backend):
    gen = torch.Generator().manual_seed(7)
    rows = make_rows(gen, SHAPES, grad_dtype=torch.float64, param_dtype=torch.float64,
                     state_dtype=torch.float64, master=False)
    for step, mode in ((1, 1), (2, 0), (3, 1)):
        new_grads(rows, gen)
        run_and_check(rows, master=False, step=step, mode=mode, bias_correction=True,
                      weight_decay=0.02, hp=HYPER["large_eps"], tol=FP64_TOL)


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_grads_fp32_params(backend, grad_dtype):
    gen = torch.Generator().manual_seed(11)
    rows = make_rows(gen, SHAPES, grad_dtype=grad_dtype, param_dtype=torch.float32,
                     state_dtype=torch.float32, master=False)
    for step in (1, 2):
        new_grads(rows, gen)
        run_and_check(rows, master=False, step=step, mode=1, bias_correction=True,
                      weight_decay=0.01, hp=HYPER["large_eps"], tol=FP32_TOL)


def test_worked_example_from_seed(backend):
    """The seed's example: 10x10, grad=var=s=0.5, m=v=0.9, step 1, lr=1e-8, decays 0.9999."""
    def full(x):
        return torch.full((10, 10), x).to(torch.float32)

    grad, var, m, v, s = full(0.5), full(0.5), full(0.9), full(0.9), full(0.5)
    lr, ema_decay, beta1, beta2, eps, mode, bias_correction, weight_decay = \
        1e-8, 0.9999, 0.9999, 0.9999, 1e-8, 1, True, 0.001
    exp_var, exp_m, exp_v, exp_s = seed_update(grad, var, m, v, s, 1, lr, ema_decay, beta1, beta2,
                                               eps, mode, bias_correction, weight_decay)
    multi_tensor_applier(multi_tensor_fused_ema_adamw, noop(), [[grad], [var], [m], [v], [s]], lr,
                         ema_decay, beta1, beta2, eps, 1, mode, bias_correction, weight_decay)
    # The example is meaningful: var moves by about 16 fp32 ulps (lr * ~94.9).
    assert 9e-7 < 0.5 - exp_var[0, 0].item() < 1e-6
    for name, actual, expected in (("var", var, exp_var), ("m", m, exp_m), ("v", v, exp_v),
                                   ("s", s, exp_s)):
        assert actual.dtype == torch.float32
        assert_within_ulps(actual, expected, 1.0, msg=f"worked example {name}")
    assert torch.equal(grad, full(0.5))


# ---------------------------------------------------------------------------------------------
# master-weights form, [grads, params, exp_avgs, exp_avg_sqs, emas, masters]

@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_master_weights_form(backend, param_dtype, grad_dtype, mode):
    gen = torch.Generator().manual_seed(21 + mode)
    rows = make_rows(gen, SHAPES, grad_dtype=grad_dtype, param_dtype=param_dtype,
                     state_dtype=torch.float32, master=True)
    # ema_decay 0.5: an EMA taken from the rounded param instead of the fp32 master would be off
    # by up to half a bf16/fp16 ulp of the param, far outside the fp32 tolerance.
    hp = dict(HYPER["large_eps"], ema_decay=0.5)
    for step in (1, 2, 3):
        new_grads(rows, gen)
        run_and_check(rows, master=True, step=step, mode=mode, bias_correction=True,
                      weight_decay=0.01, hp=hp, tol=FP32_TOL)


def test_master_ema_uses_unrounded_master(backend):
    """A direct check: s' = d*s + (1-d)*master' (fp32), not (1-d)*param' (rounded)."""
    master = torch.tensor([1.0 + 2 ** -12, -3.0 - 2 ** -11, 0.1], dtype=torch.float32)
    param = master.to(torch.bfloat16)
    grad = torch.zeros(3, dtype=torch.bfloat16)
    m, v, s = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    # lr 0, zero grads: master is unchanged, the EMA moves halfway to it
    multi_tensor_applier(multi_tensor_fused_ema_adamw, noop(), [[grad], [param], [m], [v], [s], [master]],
                         0.0, 0.5, 0.9, 0.999, 1e-8, 1, 1, True, 0.0)
    assert_bitwise_equal(s, master * 0.5, "EMA from the fp32 master")
    assert not torch.equal(s, param.float() * 0.5)
    assert_bitwise_equal(param, master.to(torch.bfloat16), "param")


def test_master_param_round_to_nearest_even(backend):
    """The param receives the master rounded once, round-to-nearest-even (as Tensor.to does)."""
    # masters that land exactly on bf16 ties after an lr=0 step (they are unchanged)
    one_ulp = 2 ** -7  # bf16 spacing in [1, 2)
    master = torch.tensor([1 + one_ulp / 2, 1 + 1.5 * one_ulp, 1 + 0.49 * one_ulp, -1 - one_ulp / 2],
                          dtype=torch.float32)
    param = torch.zeros(4, dtype=torch.bfloat16)
    lists = [[torch.zeros(4, dtype=torch.bfloat16)], [param], [torch.zeros(4)], [torch.zeros(4)],
             [torch.zeros(4)], [master]]
    multi_tensor_applier(multi_tensor_fused_ema_adamw, noop(), lists, 0.0, 0.9, 0.9, 0.999, 1e-8, 1,
                         1, True, 0.0)
    expected = torch.tensor([1.0, 1 + 2 * one_ulp, 1.0, -1.0], dtype=torch.bfloat16)
    assert_bitwise_equal(param, expected, "round to nearest even")


# ---------------------------------------------------------------------------------------------
# noop flag, grad_scale, maximize, check_finite

@pytest.mark.parametrize("master", [False, True])
def test_noop_flag_set_changes_nothing(backend, master):
    gen = torch.Generator().manual_seed(31)
    pdtype = torch.bfloat16 if master else torch.float32
    rows = make_rows(gen, SHAPES, grad_dtype=pdtype, param_dtype=pdtype, state_dtype=torch.float32,
                     master=master)
    lists = tensor_lists(rows, master)
    before = [snapshot(ts) for ts in lists]
    flag = torch.ones(1, dtype=torch.int32)
    multi_tensor_applier(multi_tensor_fused_ema_adamw, flag, lists, 1e-2, 0.9, 0.9, 0.99, 1e-8, 1, 1,
                         True, 0.1)
    for ts, saved in zip(lists, before):
        assert_unchanged(ts, saved)
    assert flag.item() == 1


@pytest.mark.parametrize("scale_shape", [(), (1,)], ids=["0-dim", "1-element"])
@pytest.mark.parametrize("scale", [1024.0, 3.0, 0.25])
def test_grad_scale_unscales_inside_the_op(backend, scale, scale_shape):
    """grad_scale: GradScaler's 0-dim scale tensor, or an apex-style 1-element tensor."""
    gen = torch.Generator().manual_seed(41)
    rows = make_rows(gen, SHAPES, grad_dtype=torch.float32, param_dtype=torch.float32,
                     state_dtype=torch.float32, master=False)
    new_grads(rows, gen, scale=scale)
    run_and_check(rows, master=False, step=2, mode=1, bias_correction=True, weight_decay=0.01,
                  hp=HYPER["large_eps"], tol=FP32_TOL, grad_scale=scale, scale_shape=scale_shape)


def test_grad_scale_power_of_two_is_exact(backend):
    """Unscaling by a power of two is exact: the same bits as the unscaled grads."""
    gen = torch.Generator().manual_seed(43)
    shapes = [(5, 9), (17,)]
    a = make_rows(gen, shapes, grad_dtype=torch.float16, param_dtype=torch.bfloat16,
                  state_dtype=torch.float32, master=True, layouts=("contiguous",))
    b_lists = [[t.clone() for t in ts] for ts in tensor_lists(a, True)]
    a_lists = tensor_lists(a, True)
    for g in b_lists[0]:
        g.mul_(2 ** 10)
    args = (1e-2, 0.9, 0.9, 0.99, 1e-8, 3, 1, True, 0.01)
    multi_tensor_applier(multi_tensor_fused_ema_adamw, noop(), a_lists, *args)
    multi_tensor_applier(multi_tensor_fused_ema_adamw, noop(), b_lists, *args,
                         grad_scale=torch.tensor(2.0 ** 10))
    for li in range(1, 6):
        for x, y in zip(a_lists[li], b_lists[li]):
            assert_bitwise_equal(y, x, f"list {li}")


@pytest.mark.parametrize("mode", [0, 1])
def test_maximize(backend, mode):
    gen = torch.Generator().manual_seed(51)
    rows = make_rows(gen, SHAPES, grad_dtype=torch.float32, param_dtype=torch.float32,
                     state_dtype=torch.float32, master=False)
    new_grads(rows, gen)
    run_and_check(rows, master=False, step=1, mode=mode, bias_correction=True, weight_decay=0.05,
                  hp=HYPER["large_eps"], tol=FP32_TOL, maximize=True)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_check_finite_sets_flag_and_changes_nothing(backend, bad):
    gen = torch.Generator().manual_seed(53)
    rows = make_rows(gen, [(5, 9), (17,)], grad_dtype=torch.float32, param_dtype=torch.float32,
                     state_dtype=torch.float32, master=False)
    rows[1]["grad"].t[3] = bad
    lists = tensor_lists(rows, False)
    before = [snapshot(ts) for ts in lists]
    flag = noop()
    multi_tensor_applier(multi_tensor_fused_ema_adamw, flag, lists, 1e-2, 0.9, 0.9, 0.99, 1e-8, 1, 1,
                         True, 0.0, check_finite=True)
    assert flag.item() != 0
    for ts, saved in zip(lists, before):
        assert_unchanged(ts, saved)


# ---------------------------------------------------------------------------------------------
# chunking, direct calls, empty lists

@pytest.mark.parametrize("master", [False, True])
def test_results_independent_of_chunk_size(backend, master):
    gen = torch.Generator().manual_seed(61)
    pdtype = torch.float16 if master else torch.float32
    rows = make_rows(gen, [(0,), (1,), (7,), (3, 5), (70, 33), (1000,)], grad_dtype=pdtype,
                     param_dtype=pdtype, state_dtype=torch.float32, master=master)
    original = tensor_lists(rows, master)
    results = []
    for chunk_size in (1, 7, 2048 * 32):
        lists = [[t.clone() for t in ts] for ts in original]
        for step in (1, 2):
            MultiTensorApply(chunk_size)(multi_tensor_fused_ema_adamw, noop(), lists, 1e-2, 0.9, 0.9,
                                         0.99, 1e-8, step, 1, True, 0.01)
        results.append(lists)
    for other in results[1:]:
        for li in range(1, len(original)):
            for x, y in zip(results[0][li], other[li]):
                assert_bitwise_equal(y, x, f"chunk size changed list {li}")


def test_direct_call_equals_applier(backend):
    gen = torch.Generator().manual_seed(63)
    rows = make_rows(gen, [(5, 9), (17,)], grad_dtype=torch.float32, param_dtype=torch.float32,
                     state_dtype=torch.float32, master=False)
    a = tensor_lists(rows, False)
    b = [[t.clone() for t in ts] for ts in a]
    args = (1e-2, 0.9, 0.9, 0.99, 1e-8, 1, 1, True, 0.01)
    multi_tensor_applier(multi_tensor_fused_ema_adamw, noop(), a, *args)
    multi_tensor_fused_ema_adamw(2048 * 32, noop(), b, *args)
    for li in range(5):
        for x, y in zip(a[li], b[li]):
            assert_bitwise_equal(y, x)


def test_empty_lists_are_a_noop(backend):
    multi_tensor_applier(multi_tensor_fused_ema_adamw, noop(), [[], [], [], [], []], 1e-3, 0.9, 0.9,
                         0.999, 1e-8, 1, 1, True, 0.0)
    multi_tensor_applier(multi_tensor_scale, noop(), [[], []], 2.0)


def test_applier_passes_chunk_size():
    seen = []

    def op(chunk_size, flag, lists, *args, **kwargs):
        seen.append((chunk_size, flag, lists, args, kwargs))
        return "ret"

    flag = noop()
    assert MultiTensorApply(7)(op, flag, [[1]], 2, k=3) == "ret"
    assert seen == [(7, flag, [[1]], (2,), {"k": 3})]
    assert multi_tensor_applier.chunk_size == 2048 * 32
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            MultiTensorApply(bad)


# ---------------------------------------------------------------------------------------------
# multi_tensor_scale and multi_tensor_l2norm

@pytest.mark.parametrize("src_dtype,dst_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float64, torch.float64),
])
def test_multi_tensor_scale(backend, src_dtype, dst_dtype):
    gen = torch.Generator().manual_seed(71)
    shapes = [(0,), (1,), (17,), (5, 9), (70, 33)]
    srcs = [(torch.randn(s, generator=gen, dtype=torch.float64) * 10).to(src_dtype) for s in shapes]
    srcs.append(torch.randn(9, 4, generator=gen).to(src_dtype).t())  # non-contiguous
    dsts = [torch.full(s.shape, 7.0, dtype=dst_dtype) for s in srcs]
    dsts[-1] = torch.zeros(9, 4, dtype=dst_dtype).t()
    saved = snapshot(srcs)
    flag = noop()
    scale = 1.0 / 3.0
    multi_tensor_applier(multi_tensor_scale, flag, [srcs, dsts], scale)
    assert flag.item() == 0
    assert_unchanged(srcs, saved, "srcs")
    for i, (src, dst) in enumerate(zip(srcs, dsts)):
        assert dst.dtype == dst_dtype
        assert_within_ulps(dst, src.double() * scale, 1.0, msg=f"dst[{i}]")


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_multi_tensor_scale_sets_noop_flag_on_nonfinite(backend, bad):
    srcs = [torch.ones(4), torch.arange(6, dtype=torch.float32)]
    srcs[1][2] = bad
    dsts = [torch.zeros(4), torch.zeros(6)]
    flag = noop()
    multi_tensor_applier(multi_tensor_scale, flag, [srcs, dsts], 0.5)
    assert flag.item() != 0
    assert torch.equal(dsts[0], torch.full((4,), 0.5))  # the copy still happens, as in apex


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_multi_tensor_l2norm(backend, dtype):
    gen = torch.Generator().manual_seed(81)
    shapes = [(0,), (1,), (17,), (5, 9), (70, 33)]
    tensors = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    tensors.append(torch.randn(9, 4, generator=gen).to(dtype).t())
    flag = noop()
    total, per = multi_tensor_applier(multi_tensor_l2norm, flag, [tensors])
    assert flag.item() == 0
    exact = torch.stack([t.double().square().sum() for t in tensors])
    assert total.dtype == torch.float32 and total.numel() == 1
    assert_close64(total.reshape(()), exact.sum().sqrt(), rtol=2e-6, atol=0.0, msg="total")
    torch.testing.assert_close(total.reshape(()).double(),
                               torch.linalg.vector_norm(torch.cat([t.reshape(-1).double() for t in tensors])),
                               rtol=2e-6, atol=0.0)
    total2, per2 = multi_tensor_applier(multi_tensor_l2norm, flag, [tensors], True)
    assert_bitwise_equal(total2, total)
    assert per2.dtype == torch.float32 and per2.shape == (len(tensors),)
    assert_close64(per2, exact.sqrt(), rtol=2e-6, atol=0.0, msg="per tensor")
    for i, t in enumerate(tensors):
        torch.testing.assert_close(per2[i].double(), torch.linalg.vector_norm(t.double()),
                                   rtol=2e-6, atol=0.0)


def test_multi_tensor_l2norm_chunk_size_independent(backend):
    gen = torch.Generator().manual_seed(83)
    tensors = [torch.randn(s, generator=gen) for s in [(1000,), (3, 333), (7,)]]
    results = [MultiTensorApply(c)(multi_tensor_l2norm, noop(), [tensors], True) for c in (1, 7, 65536)]
    for total, per in results[1:]:
        assert_bitwise_equal(total, results[0][0])
        assert_bitwise_equal(per, results[0][1])


def test_multi_tensor_l2norm_sets_noop_flag_on_inf(backend):
    tensors = [torch.ones(3), torch.tensor([1.0, float("inf")])]
    flag = noop()
    total, _ = multi_tensor_applier(multi_tensor_l2norm, flag, [tensors])
    assert flag.item() != 0
    assert math.isinf(total.item())
