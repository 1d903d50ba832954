"""The native CPU backend (csrc/cpu, multi_tensor/backends/native_cpu.py) against the reference.

Adam-family ops (fused_ema_adamw, adam, radam) and scale must be BITWISE equal to the reference backend (torch.equal) for every
dtype combination, hyperparameter switch, size, layout, chunk size and thread count; l2norm is
compared with a tolerance (it accumulates in fp64 in fixed blocks). Native-specific tests skip
when the extension is not built.

Not tested here: tensors of more than 2**31 elements (too big for the test machine). The kernels
use int64 for every offset, chunk bound and element count (Chunk{int64 row,start,end}, loop
indices, MKL's ILP64 sqrt entry point); that part is covered by code review only.
"""
from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch

import multi_tensor
from multi_tensor import backends
from multi_tensor.backends import native_cpu, reference

NATIVE = native_cpu.loaded_module
needs_native = pytest.mark.skipif(NATIVE is None, reason=f"native CPU extension not built "
                                  f"({native_cpu.load_error}); build: pip install "
                                  f"--no-build-isolation -e .")
pytestmark = needs_native

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
SHAPES = [(1,), (15,), (17,), (4, 33), (0,), (2, 3, 5)]

# (param dtype, grad dtype, master?)
FIVE_LIST = [(p, g, False) for p in (F32, F16, BF16) for g in (F16, BF16, F32)] + [(F64, F64, False)]
SIX_LIST = [(p, g, True) for p in (F16, BF16, F32) for g in (F16, BF16, F32)]
COMBOS = FIVE_LIST + SIX_LIST


def _ids(c):
    p, g, master = c
    return f"{str(p)[6:]}-g{str(g)[6:]}-{'master' if master else 'plain'}"


def make_lists(param_dtype, grad_dtype, master, shapes=SHAPES, seed=0, ema=True):
    gen = torch.Generator().manual_seed(seed)

    def rnd(shape, dtype, positive=False):
        t = torch.randn(shape, generator=gen, dtype=torch.float64)
        return (t.abs() if positive else t).to(dtype)

    state = F32 if master else param_dtype
    grads = [rnd(s, grad_dtype) for s in shapes]
    masters = [rnd(s, F32 if master else F64) for s in shapes]
    params = [m.to(param_dtype) for m in masters] if master else [rnd(s, param_dtype) for s in shapes]
    lists = [grads, params, [rnd(s, state) * 0.1 for s in shapes],
             [rnd(s, state, positive=True) * 0.01 for s in shapes]]
    if ema:
        lists.append([rnd(s, state) for s in shapes])
    if master:
        lists.append(masters)
    return lists


def clone(lists):
    return [[t.clone() for t in ts] for ts in lists]


_INT_VIEW = {F16: torch.int16, BF16: torch.int16, F32: torch.int32, F64: torch.int64}


def _bits(t):
    """The raw bits (so NaN == NaN with the same payload, and -0.0 != 0.0)."""
    return t.contiguous().view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


def assert_bitwise(a_lists, b_lists):
    for li, (a, b) in enumerate(zip(a_lists, b_lists)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(_bits(x), _bits(y)), f"list {li} tensor {i} differs: max |d| = " \
                f"{(x.double() - y.double()).abs().max().item()}"


def hp(mode=1, bias_correction=True, weight_decay=0.01, step=3, lr=1e-3, ema_decay=0.999):
    return dict(lr=lr, ema_decay=ema_decay, beta1=0.9, beta2=0.999, eps=1e-8, step=step,
                mode=mode, bias_correction=bias_correction, weight_decay=weight_decay)


def ema_args(h):
    return (h["lr"], h["ema_decay"], 0.9, 0.999, 1e-8, h["step"], h["mode"], h["bias_correction"],
            h["weight_decay"])


def run_native(lists, h, chunk_size=2048 * 32, noop=None, **kw):
    noop = torch.zeros(1, dtype=torch.int32) if noop is None else noop
    NATIVE.fused_ema_adamw(chunk_size, noop, lists, *ema_args(h), **kw)
    return noop


def run_reference(lists, h, chunk_size=2048 * 32, noop=None, **kw):
    noop = torch.zeros(1, dtype=torch.int32) if noop is None else noop
    with backends.forced_backend("reference"):
        assert backends.backend_for("fused_ema_adamw", "cpu").name == "reference"
        multi_tensor.multi_tensor_fused_ema_adamw(chunk_size, noop, lists, *ema_args(h), **kw)
    return noop


# ------------------------------------------------------------------------------------------------
# registration / environment
# ------------------------------------------------------------------------------------------------

def test_native_backend_registered_for_cpu():
    for op in ("fused_ema_adamw", "adam", "radam", "scale", "l2norm"):
        assert backends.backend_for(op, "cpu").name == "native_cpu"
    assert native_cpu.capability in ("AVX512", "AVX2", "DEFAULT")
    assert NATIVE.capability == native_cpu.capability
    assert native_cpu.load_error is None


def test_env_report_runs():
    from multi_tensor import env
    text = env.report()
    assert "native_cpu" in text and "torch" in text


def _subprocess(code, **env):
    e = dict(os.environ, **env)
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                          text=True, env=e, timeout=120)


def test_disable_native_env_falls_back_silently():
    r = _subprocess("import multi_tensor.backends as b; from multi_tensor.backends import native_cpu;"
                    "print(b.backend_for('fused_ema_adamw','cpu').name, native_cpu.loaded_module)",
                    MULTI_TENSOR_DISABLE_NATIVE="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["reference", "None"]
    assert "native CPU extension" not in r.stderr


@pytest.mark.skipif(native_cpu.capability != "AVX512", reason="needs an AVX512 machine")
def test_aten_cpu_capability_selects_lower_isa_with_identical_bits():
    code = (
        "import torch, sys; sys.path.insert(0, %r); import test_native_cpu as t;"
        "from multi_tensor.backends import native_cpu as n; print(n.capability);"
        "L = t.make_lists(torch.bfloat16, torch.float16, True, shapes=[(77,), (3, 40)]);"
        "t.run_native(L, t.hp(mode=0));"
        "R = t.make_lists(torch.float16, torch.bfloat16, True, shapes=[(77,), (3, 40)], ema=False);"
        "t.run_radam_native(R, t.radam_args(6, decoupled=True));"
        "torch.save([L, R], sys.argv[1] if len(sys.argv) > 1 else %r)"
    )
    results = {}
    for cap in ("avx2", "default"):
        path = os.path.join(REPO, ".pytest_cache", f"native_{cap}.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        r = _subprocess(code % (os.path.dirname(__file__), path), ATEN_CPU_CAPABILITY=cap)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == cap.upper()
        results[cap] = torch.load(path)
    L = make_lists(BF16, F16, True, shapes=[(77,), (3, 40)])
    run_native(L, hp(mode=0))
    R = make_lists(F16, BF16, True, shapes=[(77,), (3, 40)], ema=False)
    run_radam_native(R, radam_args(6, decoupled=True))
    for cap in ("avx2", "default"):
        assert_bitwise(results[cap][0], L)
        assert_bitwise(results[cap][1], R)


# ------------------------------------------------------------------------------------------------
# fused_ema_adamw: bitwise equal to the reference
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("combo", COMBOS, ids=_ids)
def test_bitwise_vs_reference_all_switches(combo):
    p_dt, g_dt, master = combo
    switches = itertools.product((0, 1), (True, False), (0.0, 0.05), (False, True), (False, True))
    for mode, bc, wd, maximize, scaled in switches:
        a = make_lists(p_dt, g_dt, master, seed=mode + 2 * bc)
        b = clone(a)
        for step in (1, 2, 3):
            h = hp(mode=mode, bias_correction=bc, weight_decay=wd, step=step)
            kw = dict(maximize=maximize)
            if scaled:
                kw["grad_scale"] = torch.tensor([512.0 * step])
            run_native(a, h, **kw)
            run_reference(b, h, **kw)
        assert_bitwise(a, b)


@pytest.mark.parametrize("combo", [(F32, F32, False), (BF16, BF16, True), (F16, F32, False),
                                   (F64, F64, False)], ids=_ids)
def test_large_tensor_and_chunk_sizes_threads(combo):
    """65537 elements (crosses the inline threshold), chunk sizes 1/7/65536, 1 and 2 threads."""
    p_dt, g_dt, master = combo
    shapes = [(65537,), (5,), (1,)]
    base = make_lists(p_dt, g_dt, master, shapes=shapes, seed=7)
    expected = clone(base)
    run_reference(expected, hp(mode=0), grad_scale=torch.tensor(8.0))
    threads = torch.get_num_threads()
    try:
        for nthreads, chunk in itertools.product((1, 2), (1, 7, 65536)):
            if chunk == 1 and (nthreads == 1 or p_dt != F32):
                continue  # 65537 one-element chunks: once is enough
            torch.set_num_threads(nthreads)
            got = clone(base)
            run_native(got, hp(mode=0), chunk_size=chunk, grad_scale=torch.tensor(8.0))
            assert_bitwise(got, expected)
    finally:
        torch.set_num_threads(threads)


def test_front_end_resolves_to_native_and_matches():
    a = make_lists(F32, BF16, False, seed=3)
    b = clone(a)
    noop = torch.zeros(1, dtype=torch.int32)
    multi_tensor.multi_tensor_applier(multi_tensor.multi_tensor_fused_ema_adamw, noop, a,
                                      *ema_args(hp()))
    run_reference(b, hp())
    assert_bitwise(a, b)


def test_seed_worked_example():
    n = 10
    lists = [[torch.full((n, n), 0.5)], [torch.full((n, n), 0.5)], [torch.full((n, n), 0.9)],
             [torch.full((n, n), 0.9)], [torch.full((n, n), 0.5)]]
    ref = clone(lists)
    h = dict(lr=1e-8, ema_decay=0.9999, step=1, mode=1, bias_correction=True, weight_decay=0.001)
    args = (1e-8, 0.9999, 0.9999, 0.9999, 1e-8, 1, 1, True, 0.001)
    NATIVE.fused_ema_adamw(2048, torch.zeros(1, dtype=torch.int32), lists, *args)
    with backends.forced_backend("reference"):
        multi_tensor.multi_tensor_fused_ema_adamw(2048, torch.zeros(1, dtype=torch.int32), ref, *args)
    assert_bitwise(lists, ref)
    del h


def _seed_formula_fp64(g, p, m, v, s, lr, ema_decay, beta1, beta2, eps, step, mode, bc, wd):
    g, p, m, v, s = (t.double() for t in (g, p, m, v, s))
    bc1 = 1 - beta1 ** step * bc
    bc2 = 1 - beta2 ** step * bc
    g = g + wd * p * (1 - mode)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    upd = (m / bc1) / (torch.sqrt(v / bc2) + eps) + wd * p * mode
    p = p - lr * upd
    s = ema_decay * s + (1 - ema_decay) * p
    return p, m, v, s


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bc", [True, False])
def test_against_independent_fp64_seed_formula(mode, bc):
    lists = make_lists(F32, F32, False, shapes=[(300,), (7, 9)], seed=11)
    orig = clone(lists)
    args = (1e-2, 0.99, 0.9, 0.999, 1e-8, 4, mode, bc, 0.02)
    NATIVE.fused_ema_adamw(64, torch.zeros(1, dtype=torch.int32), lists, *args)
    for i in range(2):
        want = _seed_formula_fp64(*(orig[k][i] for k in range(5)), *args)
        for got, exp in zip((lists[1][i], lists[2][i], lists[3][i], lists[4][i]), want):
            torch.testing.assert_close(got.double(), exp, rtol=2e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# layouts, empties, flags
# ------------------------------------------------------------------------------------------------

def test_empty_lists_and_empty_tensors():
    NATIVE.fused_ema_adamw(2048, torch.zeros(1, dtype=torch.int32), [[], [], [], [], []], *ema_args(hp()))
    NATIVE.adam(2048, torch.zeros(1, dtype=torch.int32), [[], [], [], []], 1e-3, 0.9, 0.999, 1e-8, 1, 1, True, 0.0)
    lists = make_lists(F32, F32, False, shapes=[(0,), (0, 3)])
    before = clone(lists)
    run_native(lists, hp())
    assert_bitwise(lists, before)


@pytest.mark.parametrize("master", [False, True])
def test_non_contiguous_tensors(master):
    p_dt = BF16 if master else F32
    base = make_lists(p_dt, F16, master, shapes=[(12, 9), (8, 6), (5, 7)], seed=5)

    def views(lists):
        out = []
        for li, ts in enumerate(lists):
            row = []
            for i, t in enumerate(ts):
                if i == 0:
                    row.append(t)                      # contiguous everywhere
                elif i == 1:
                    row.append(t.t().contiguous().t())  # all transposed alike: storage path
                elif li in (0, 2):
                    big = torch.zeros(t.shape[0], t.shape[1] * 2, dtype=t.dtype)
                    big[:, ::2] = t
                    row.append(big[:, ::2])             # strided slice: temporary path
                else:
                    row.append(t.t().contiguous().t() if li == 1 else t)
            out.append(row)
        return out

    a = views(clone(base))
    b = views(clone(base))
    run_native(a, hp(mode=0))
    run_reference(b, hp(mode=0))
    assert_bitwise(a, b)
    # the in-place outputs really are the caller's (non-contiguous) tensors
    c = clone(base)
    run_reference(c, hp(mode=0))
    assert_bitwise([[t.contiguous() for t in ts] for ts in a], c)


@pytest.mark.parametrize("flag_dtype", [torch.int32, torch.float32, torch.bool, torch.int64])
def test_noop_flag_set_changes_nothing(flag_dtype):
    lists = make_lists(F16, F32, True, seed=2)
    before = clone(lists)
    noop = torch.ones(1, dtype=flag_dtype)
    run_native(lists, hp(), noop=noop, check_finite=True)
    assert_bitwise(lists, before)
    assert bool(noop.item())


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("combo", [(F32, F32, False), (BF16, BF16, True), (F64, F64, False)], ids=_ids)
def test_check_finite_sets_flag_and_changes_nothing(bad, combo):
    lists = make_lists(*combo, shapes=[(40000,), (17,)], seed=4)
    lists[0][0][39999] = bad
    before = clone(lists)
    noop = run_native(lists, hp(), check_finite=True)
    assert noop.item() == 1
    assert_bitwise(lists, before)
    # without the injected value: the update runs and equals the reference
    lists[0][0][39999] = 0
    a, b = clone(lists), clone(lists)
    assert run_native(a, hp(), check_finite=True).item() == 0
    run_reference(b, hp(), check_finite=True)
    assert_bitwise(a, b)


# ------------------------------------------------------------------------------------------------
# validation: the right exception, naming the tensor, and nothing modified
# ------------------------------------------------------------------------------------------------

def _bad_cases():
    def base():
        return make_lists(F32, F32, False, shapes=[(3, 4), (5,), (4, 3), (2,)])

    def shape(L):
        L[2][3] = torch.zeros(3)
        return ValueError, r"exp_avgs\[3\] has shape \(3,\) but params\[3\] has shape \(2,\)"

    def length(L):
        L[3].pop()
        return ValueError, "equal lengths"

    def count(L):
        L.pop()
        return ValueError, "tensor_lists must be"

    def not_tensor(L):
        L[4][1] = [1.0]
        return TypeError, r"emas\[1\] must be a torch.Tensor"

    def sparse(L):
        L[0][1] = torch.zeros(5).to_sparse()
        return RuntimeError, r"grads\[1\] is a sparse tensor"

    def integer(L):
        L[2][0] = torch.zeros(3, 4, dtype=torch.int64)
        return TypeError, r"exp_avgs\[0\] must be a floating-point tensor"

    def mixed(L):
        L[1][2] = L[1][2].double()
        return TypeError, r"params\[2\] is torch.float64 but params\[0\] is torch.float32"

    def state_dtype(L):
        for i in range(4):
            L[3][i] = L[3][i].half()
        return TypeError, "exp_avg_sqs are torch.float16 but must be torch.float32"

    def grad_fp64(L):
        for i in range(4):
            L[0][i] = L[0][i].double()
        return TypeError, "grads are torch.float64"

    def device(L):
        L[2][1] = torch.zeros(5, device="meta")
        return RuntimeError, r"exp_avgs\[1\] is on meta but params\[1\] is on cpu"

    def master_fp64(L):
        for k in range(1, 5):
            L[k] = [t.double() for t in L[k]]
        L.append([t.float() for t in L[1]])
        L[0] = [t.double() for t in L[0]]
        return TypeError, "params are float64; fp32 master weights"

    cases = [shape, length, count, not_tensor, sparse, integer, mixed, state_dtype, grad_fp64,
             device, master_fp64]
    return [(c.__name__, base, c) for c in cases]


@pytest.mark.parametrize("name,base,mutate", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_validation_errors_raise_before_any_change(name, base, mutate):
    lists = base()
    exc, msg = mutate(lists)
    snapshot = [[t.clone() if isinstance(t, torch.Tensor) and t.layout == torch.strided
                 and t.device.type == "cpu" else t for t in ts] for ts in lists]
    with pytest.raises(exc, match=msg):
        NATIVE.fused_ema_adamw(2048, torch.zeros(1, dtype=torch.int32), lists, *ema_args(hp()))
    for ts, ss in zip(lists, snapshot):
        for t, s in zip(ts, ss):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu":
                assert torch.equal(t, s)
    # the front-end (which now resolves to native) raises the same type
    with pytest.raises(exc):
        multi_tensor.multi_tensor_fused_ema_adamw(2048, torch.zeros(1, dtype=torch.int32), lists,
                                                  *ema_args(hp()))


def test_bad_scalars():
    lists = make_lists(F32, F32, False)
    with pytest.raises(ValueError, match="step must be a positive integer"):
        NATIVE.fused_ema_adamw(2048, torch.zeros(1, dtype=torch.int32), lists, 1e-3, 0.9, 0.9, 0.99, 1e-8, 0, 1, True, 0.0)
    with pytest.raises(ValueError, match="mode must be"):
        NATIVE.fused_ema_adamw(2048, torch.zeros(1, dtype=torch.int32), lists, 1e-3, 0.9, 0.9, 0.99, 1e-8, 1, 2, True, 0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        NATIVE.fused_ema_adamw(0, torch.zeros(1, dtype=torch.int32), lists, *ema_args(hp()))
    # a 1-element step tensor is accepted
    a, b = clone(lists), clone(lists)
    NATIVE.fused_ema_adamw(2048, torch.zeros(1, dtype=torch.int32), a, 1e-3, 0.9, 0.9, 0.99, 1e-8,
                           torch.tensor([3.0]), 1, True, 0.0)
    NATIVE.fused_ema_adamw(2048, torch.zeros(1, dtype=torch.int32), b, 1e-3, 0.9, 0.9, 0.99, 1e-8, 3, 1, True, 0.0)
    assert_bitwise(a, b)


# ------------------------------------------------------------------------------------------------
# adam, scale, l2norm
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("combo", [(F32, F32, False), (F16, BF16, False), (F64, F64, False),
                                   (BF16, F32, True), (F32, F16, True)], ids=_ids)
@pytest.mark.parametrize("mode", [0, 1])
def test_adam_op_bitwise(combo, mode):
    a = make_lists(*combo, ema=False, seed=9, shapes=SHAPES + [(3000,)])
    b = clone(a)
    args = (1e-3, 0.9, 0.999, 1e-8, 5, mode, True, 0.01)
    NATIVE.adam(7, torch.zeros(1, dtype=torch.int32), a, *args, maximize=True,
                grad_scale=torch.tensor(4.0))
    with backends.forced_backend("reference"):
        multi_tensor.multi_tensor_adam(7, torch.zeros(1, dtype=torch.int32), b, *args,
                                       maximize=True, grad_scale=torch.tensor(4.0))
    assert_bitwise(a, b)


SCALE_DTYPES = [(F32, F32), (F32, F16), (F16, F32), (BF16, BF16), (F32, BF16), (F64, F32),
                (F32, F64), (F64, F16), (BF16, F64), (F64, F64)]


@pytest.mark.parametrize("src_dt,dst_dt", SCALE_DTYPES)
def test_scale_bitwise(src_dt, dst_dt):
    shapes = [(1,), (17,), (65,), (40000,), (0,)]
    srcs = [torch.randn(s, dtype=F64).mul(1000).to(src_dt) for s in shapes]
    a = [torch.empty(s, dtype=dst_dt) for s in shapes]
    b = [torch.empty(s, dtype=dst_dt) for s in shapes]
    na, nb = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    NATIVE.scale(7, na, [srcs, a], 0.37)
    reference.scale(7, nb, [srcs, b], 0.37)
    assert_bitwise([a], [b])
    assert na.item() == nb.item() == 0


def test_scale_nonfinite_noncontiguous_inplace():
    src = torch.randn(6, 10)
    src[2, 3] = float("inf")
    dst = torch.zeros(10, 6).t()  # non-contiguous destination
    dst_ref = torch.zeros(6, 10)
    noop = torch.zeros(1, dtype=torch.int32)
    multi_tensor.multi_tensor_scale(2048, noop, [[src], [dst]], 0.5)
    assert noop.item() == 1  # apex semantics: flagged, but the copy still happens
    reference.scale(2048, torch.zeros(1, dtype=torch.int32), [[src], [dst_ref]], 0.5)
    assert torch.equal(dst, dst_ref)
    # in place (src is dst)
    x = torch.randn(100)
    y = x.clone()
    NATIVE.scale(16, torch.zeros(1, dtype=torch.int32), [[x], [x]], 3.0)
    assert torch.equal(x, y * 3.0)
    with pytest.raises(ValueError, match="has shape"):
        NATIVE.scale(16, noop, [[torch.zeros(3)], [torch.zeros(4)]], 1.0)


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64])
def test_l2norm_vs_reference(dtype):
    shapes = [(1,), (17,), (5000,), (0,), (3, 70)]
    ts = [torch.randn(s, dtype=F64).to(dtype) for s in shapes]
    total, per = multi_tensor.multi_tensor_l2norm(7, torch.zeros(1, dtype=torch.int32), [ts], True)
    rt, rp = reference.l2norm(7, torch.zeros(1, dtype=torch.int32), [ts], True)
    assert total.dtype == per.dtype == torch.float32 and total.dim() == 0 and per.shape == (5,)
    torch.testing.assert_close(total, rt, rtol=1e-6, atol=0)
    torch.testing.assert_close(per, rp, rtol=1e-6, atol=0)
    t2, p2 = NATIVE.l2norm(7, torch.zeros(1, dtype=torch.int32), [ts], False)
    assert torch.equal(t2, total) and p2.numel() == 0


def test_l2norm_deterministic_and_flags():
    ts = [torch.randn(70000), torch.randn(123, 45).t(), torch.randn(9)]
    threads = torch.get_num_threads()
    outs = []
    try:
        for n, chunk in itertools.product((1, 2), (1, 1000, 65536)):
            torch.set_num_threads(n)
            outs.append(NATIVE.l2norm(chunk, torch.zeros(1, dtype=torch.int32), [ts], True))
    finally:
        torch.set_num_threads(threads)
    for t, p in outs[1:]:
        assert torch.equal(t, outs[0][0]) and torch.equal(p, outs[0][1])
    ts[2][4] = float("nan")
    noop = torch.zeros(1, dtype=torch.int32)
    NATIVE.l2norm(2048, noop, [ts], False)
    assert noop.item() == 1
    total, per = NATIVE.l2norm(2048, torch.zeros(1, dtype=torch.int32), [[]], True)
    assert total.item() == 0.0 and per.numel() == 0


# ------------------------------------------------------------------------------------------------
# prepared form
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("combo", [(F32, F32, False), (BF16, F16, True), (F64, F64, False)], ids=_ids)
def test_prepared_equals_op_form(combo):
    a = make_lists(*combo, seed=21)
    b = clone(a)
    prep = backends.prepare("fused_ema_adamw", a[1:], 7, validator=None)
    assert isinstance(prep, NATIVE.PreparedAdamFamily)
    prep.validate(a[0])
    for step in range(1, 4):
        h = hp(step=step, mode=step % 2)
        gs = torch.tensor(2.0 ** step)
        noop = torch.zeros(1, dtype=torch.int32)
        prep(a[0], noop, *ema_args(h), grad_scale=gs, maximize=step == 2, check_finite=True)
        run_native(b, h, chunk_size=7, grad_scale=gs, maximize=step == 2, check_finite=True)
        assert_bitwise(a, b)
    # noop and check_finite
    before = clone(a)
    prep(a[0], torch.ones(1), *ema_args(hp()))
    assert_bitwise(a, before)
    g = [t.clone() for t in a[0]]
    g[1][3] = float("inf")
    noop = torch.zeros(1, dtype=torch.int32)
    prep(g, noop, *ema_args(hp()), check_finite=True)
    assert noop.item() == 1
    assert_bitwise(a[1:], before[1:])


def test_prepared_follows_data_swap_and_validates():
    a = make_lists(F32, F32, False, shapes=[(10,), (4, 5)], seed=1)
    prep = backends.prepare("fused_ema_adamw", a[1:], 2048, validator=None)
    # p.data = new tensor: the prepared form must use the new storage
    new_p = a[1][0].clone() + 1
    a[1][0].data = new_p
    b = clone(a)
    prep(a[0], torch.zeros(1, dtype=torch.int32), *ema_args(hp()))
    run_native(b, hp())
    assert_bitwise(a, b)
    assert a[1][0].data_ptr() == new_p.data_ptr()
    # bad grads: precise errors, nothing modified
    before = clone(a)
    with pytest.raises(ValueError, match=r"params\[1\] has shape"):
        prep([a[0][0], torch.zeros(5, 4)], torch.zeros(1, dtype=torch.int32), *ema_args(hp()))
    with pytest.raises(ValueError, match=r"grads\[1\] has shape"):
        prep.validate([a[0][0], torch.zeros(5, 4)])
    with pytest.raises(TypeError, match="grads are torch.float64"):
        prep([t.double() for t in a[0]], torch.zeros(1, dtype=torch.int32), *ema_args(hp()))
    with pytest.raises(ValueError, match="equal lengths"):
        prep(a[0][:1], torch.zeros(1, dtype=torch.int32), *ema_args(hp()))
    assert_bitwise(a, before)
    # a state tensor swapped to another dtype is caught
    a[2][1].data = a[2][1].data.double()
    with pytest.raises(TypeError, match="exp_avgs"):
        prep(a[0], torch.zeros(1, dtype=torch.int32), *ema_args(hp()))


def test_prepared_adam():
    a = make_lists(F16, F32, True, ema=False, seed=8)
    b = clone(a)
    prep = backends.prepare("adam", a[1:], 2048, validator=None)
    args = (1e-3, 0.9, 0.999, 1e-8, 2, 1, True, 0.1)
    prep(a[0], torch.zeros(1, dtype=torch.int32), *args)
    NATIVE.adam(2048, torch.zeros(1, dtype=torch.int32), b, *args)
    assert_bitwise(a, b)


# ------------------------------------------------------------------------------------------------
# radam: bitwise equal to the reference, every list form
# ------------------------------------------------------------------------------------------------

# (param dtype, grad dtype, master?, ema?): the four list forms x the adam-family dtype combos
RADAM_COMBOS = [c + (e,) for c in COMBOS for e in (False, True)]


def _rids(c):
    return _ids(c[:3]) + ("-ema" if c[3] else "")


def radam_args(step, wd=0.01, decoupled=False, ema=None, lr=1e-3, beta1=0.9, beta2=0.999,
               eps=1e-8):
    return (lr, beta1, beta2, eps, step, wd, decoupled, ema)


def run_radam_native(lists, args, chunk_size=2048 * 32, noop=None, **kw):
    noop = torch.zeros(1, dtype=torch.int32) if noop is None else noop
    NATIVE.radam(chunk_size, noop, lists, *args, **kw)
    return noop


def run_radam_reference(lists, args, chunk_size=2048 * 32, noop=None, **kw):
    noop = torch.zeros(1, dtype=torch.int32) if noop is None else noop
    with backends.forced_backend("reference"):
        assert backends.backend_for("radam", "cpu").name == "reference"
        multi_tensor.multi_tensor_radam(chunk_size, noop, lists, *args, **kw)
    return noop


def test_radam_rectification_boundary():
    """With beta2=0.999, steps 1..5 are un-rectified (rho_t <= 5) and step 6 is rectified."""
    rect = [reference.radam_scalars(0.9, 0.999, t)[3] for t in range(1, 8)]
    assert all(r is None for r in rect[:5]) and all(r is not None for r in rect[5:])


@pytest.mark.parametrize("combo", RADAM_COMBOS, ids=_rids)
def test_radam_bitwise_vs_reference_all_switches(combo):
    """Every list form and dtype combo; decoupled on/off, wd 0/>0, maximize, grad_scale; steps
    1..5 (un-rectified), 6, 7 and 1000 (rectified)."""
    p_dt, g_dt, master, has_ema = combo
    ema = 0.999 if has_ema else None
    switches = itertools.product((False, True), (0.0, 0.05), (False, True), (False, True))
    for decoupled, wd, maximize, scaled in switches:
        a = make_lists(p_dt, g_dt, master, ema=has_ema, seed=decoupled + 2 * maximize)
        b = clone(a)
        for step in (1, 2, 3, 4, 5, 6, 7, 1000):
            args = radam_args(step, wd=wd, decoupled=decoupled, ema=ema)
            kw = dict(maximize=maximize)
            if scaled:
                kw["grad_scale"] = torch.tensor([512.0 * step])
            run_radam_native(a, args, **kw)
            run_radam_reference(b, args, **kw)
        assert_bitwise(a, b)


@pytest.mark.parametrize("beta1,beta2", [(0.0, 0.9), (0.3, 0.99), (0.5, 0.999), (0.9, 0.0),
                                         (0.99, 0.95)])
@pytest.mark.parametrize("combo", [(F32, F32, False, True), (BF16, F16, True, False),
                                   (F64, F64, False, True)], ids=_rids)
def test_radam_betas_both_lerp_branches(combo, beta1, beta2):
    """1 - beta1 below and at/above 0.5 (torch's two lerp formulas); beta2=0 never rectifies."""
    p_dt, g_dt, master, has_ema = combo
    a = make_lists(p_dt, g_dt, master, ema=has_ema, seed=13)
    b = clone(a)
    for step in (1, 2, 3, 8, 30):
        args = radam_args(step, wd=0.1, decoupled=step % 2 == 0, ema=0.9 if has_ema else None,
                          beta1=beta1, beta2=beta2, lr=0.01)
        run_radam_native(a, args)
        run_radam_reference(b, args)
    assert_bitwise(a, b)


@pytest.mark.parametrize("combo", [(F32, F32, False, True), (BF16, BF16, True, True),
                                   (F16, F32, False, False), (F16, BF16, True, False),
                                   (F64, F64, False, True)], ids=_rids)
def test_radam_large_tensor_chunk_sizes_threads(combo):
    """Sizes 1, 17, 65537 (crosses the inline threshold); chunk sizes 1/7/65536; 1 and 2 threads;
    an un-rectified and a rectified step."""
    p_dt, g_dt, master, has_ema = combo
    ema = 0.99 if has_ema else None
    base = make_lists(p_dt, g_dt, master, ema=has_ema, shapes=[(65537,), (17,), (1,)], seed=7)
    steps = (3, 6)
    expected = clone(base)
    for step in steps:
        run_radam_reference(expected, radam_args(step, decoupled=True, ema=ema),
                            grad_scale=torch.tensor(8.0))
    threads = torch.get_num_threads()
    try:
        for nthreads, chunk in itertools.product((1, 2), (1, 7, 65536)):
            if chunk == 1 and (nthreads == 1 or p_dt != F32):
                continue  # 65537 one-element chunks: once is enough
            torch.set_num_threads(nthreads)
            got = clone(base)
            for step in steps:
                run_radam_native(got, radam_args(step, decoupled=True, ema=ema), chunk_size=chunk,
                                 grad_scale=torch.tensor(8.0))
            assert_bitwise(got, expected)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("master,has_ema", [(False, False), (False, True), (True, False),
                                            (True, True)])
def test_radam_non_contiguous_tensors(master, has_ema):
    p_dt = BF16 if master else F32
    base = make_lists(p_dt, F16, master, ema=has_ema, shapes=[(12, 9), (8, 6), (5, 7)], seed=5)

    def views(lists):
        out = []
        for li, ts in enumerate(lists):
            row = []
            for i, t in enumerate(ts):
                if i == 0:
                    row.append(t)
                elif i == 1:
                    row.append(t.t().contiguous().t())  # all transposed alike
                elif li in (0, 2, len(lists) - 1):
                    big = torch.zeros(t.shape[0], t.shape[1] * 2, dtype=t.dtype)
                    big[:, ::2] = t
                    row.append(big[:, ::2])             # strided slices
                else:
                    row.append(t)
            out.append(row)
        return out

    ema = 0.9 if has_ema else None
    a, b = views(clone(base)), views(clone(base))
    for step in (2, 9):
        run_radam_native(a, radam_args(step, ema=ema))
        run_radam_reference(b, radam_args(step, ema=ema))
    assert_bitwise(a, b)
    c = clone(base)
    for step in (2, 9):
        run_radam_reference(c, radam_args(step, ema=ema))
    assert_bitwise([[t.contiguous() for t in ts] for ts in a], c)


def test_radam_front_end_resolves_to_native_and_matches():
    a = make_lists(F32, BF16, False, seed=3)
    b = clone(a)
    assert backends.backend_for("radam", "cpu").name == "native_cpu"
    multi_tensor.multi_tensor_applier(multi_tensor.multi_tensor_radam, torch.zeros(1, dtype=torch.int32),
                                      a, *radam_args(7, ema=0.99))
    run_radam_reference(b, radam_args(7, ema=0.99))
    assert_bitwise(a, b)
    # empty lists and empty tensors
    NATIVE.radam(2048, torch.zeros(1, dtype=torch.int32), [[], [], [], []], *radam_args(1))
    lists = make_lists(F32, F32, False, shapes=[(0,), (0, 3)], ema=False)
    before = clone(lists)
    run_radam_native(lists, radam_args(6))
    assert_bitwise(lists, before)


@pytest.mark.parametrize("combo", [(F32, F32, False, True), (BF16, BF16, True, False),
                                   (F64, F64, False, False)], ids=_rids)
def test_radam_noop_and_check_finite(combo):
    ema = 0.99 if combo[3] else None
    lists = make_lists(*combo[:3], ema=combo[3], shapes=[(40000,), (17,)], seed=4)
    before = clone(lists)
    noop = torch.ones(1, dtype=torch.int32)
    run_radam_native(lists, radam_args(6, ema=ema), noop=noop, check_finite=True)
    assert_bitwise(lists, before)
    lists[0][0][39999] = float("nan")
    noop = run_radam_native(lists, radam_args(6, ema=ema), check_finite=True)
    assert noop.item() == 1
    assert_bitwise(lists[1:], before[1:])
    lists[0][0][39999] = 0
    a, b = clone(lists), clone(lists)
    assert run_radam_native(a, radam_args(6, ema=ema), check_finite=True).item() == 0
    run_radam_reference(b, radam_args(6, ema=ema), check_finite=True)
    assert_bitwise(a, b)


def _radam_bad_cases():
    """(name, ema_decay, make lists, mutate) -> mutate returns (exception, message)."""
    def ema_base():
        return make_lists(F32, F32, False, shapes=[(3, 4), (5,), (4, 3), (2,)])

    def master_base():
        return make_lists(F16, F32, True, shapes=[(3, 4), (5,), (4, 3), (2,)], ema=False)

    generic = {name: mutate for name, _, mutate in _bad_cases()}
    cases = [(name, 0.9, ema_base, generic[name])
             for name in ("shape", "length", "not_tensor", "sparse", "integer", "mixed",
                          "state_dtype", "grad_fp64", "device", "master_fp64")]

    def count_ema(L):
        L.pop()
        return ValueError, r"tensor_lists must be .*\(ema_decay is set\); got 4 lists"

    def six_without_ema(L):
        L.append([t.clone() for t in L[1]])
        return ValueError, r"\(ema_decay is None\); got 6 lists"

    def fifth_is_masters_without_ema(L):
        # fp16 params, fp16 fifth list: fine as emas, but ema_decay=None makes it masters
        for i in range(4):
            L[4][i] = L[4][i].half()
        return TypeError, "masters are torch.float16 but must be torch.float32"

    def fifth_is_emas_with_ema(L):
        # fp32 state of fp16 params: fine with masters, but an ema_decay makes the fifth emas
        return TypeError, "exp_avgs are torch.float32 but must be torch.float16"

    cases += [("count_ema", 0.9, ema_base, count_ema),
              ("six_without_ema", None, master_base, six_without_ema),
              ("fifth_is_masters_without_ema", None, master_base, fifth_is_masters_without_ema),
              ("fifth_is_emas_with_ema", 0.9, master_base, fifth_is_emas_with_ema)]
    return cases


@pytest.mark.parametrize("name,ema,base,mutate", _radam_bad_cases(),
                         ids=[c[0] for c in _radam_bad_cases()])
def test_radam_validation_errors_raise_before_any_change(name, ema, base, mutate):
    lists = base()
    exc, msg = mutate(lists)

    def cpu_dense(t):
        return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu"

    snapshot = [[t.clone() if cpu_dense(t) else t for t in ts] for ts in lists]
    args = radam_args(6, wd=0.1, ema=ema)
    with pytest.raises(exc, match=msg):
        NATIVE.radam(2048, torch.zeros(1, dtype=torch.int32), lists, *args)
    with pytest.raises(exc):
        multi_tensor.multi_tensor_radam(2048, torch.zeros(1, dtype=torch.int32), lists, *args)
    with backends.forced_backend("reference"), pytest.raises(exc):
        multi_tensor.multi_tensor_radam(2048, torch.zeros(1, dtype=torch.int32), lists, *args)
    for ts, ss in zip(lists, snapshot):
        for t, s_ in zip(ts, ss):
            if cpu_dense(t):
                assert torch.equal(t, s_)


def test_radam_bad_scalars():
    lists = make_lists(F32, F32, False, ema=False)
    with pytest.raises(ValueError, match="multi_tensor_radam: step must be a positive integer"):
        NATIVE.radam(2048, torch.zeros(1, dtype=torch.int32), lists, *radam_args(0))
    with pytest.raises(ValueError, match="chunk_size"):
        NATIVE.radam(0, torch.zeros(1, dtype=torch.int32), lists, *radam_args(1))
    a, b = clone(lists), clone(lists)
    NATIVE.radam(2048, torch.zeros(1, dtype=torch.int32), a, *radam_args(torch.tensor([7.0])))
    NATIVE.radam(2048, torch.zeros(1, dtype=torch.int32), b, *radam_args(7))
    assert_bitwise(a, b)


# ------------------------------------------------------------------------------------------------
# radam: prepared form
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("combo", [(F32, F32, False, False), (F32, F32, False, True),
                                   (BF16, F16, True, False), (F16, F32, True, True),
                                   (F64, F64, False, True)], ids=_rids)
def test_radam_prepared_equals_op_form(combo):
    p_dt, g_dt, master, has_ema = combo
    a = make_lists(p_dt, g_dt, master, ema=has_ema, seed=21)
    b = clone(a)
    prep = backends.prepare("radam", a[1:], 7, validator=None)
    assert isinstance(prep, NATIVE.PreparedAdamFamily) and prep.op == "radam"
    prep.validate(a[0])
    for step in range(1, 9):
        args = radam_args(step, wd=0.02, decoupled=step % 2 == 1,
                          ema=(1.0 - 0.5 ** step) * 0.99 if has_ema else None)
        gs = torch.tensor(2.0 ** step)
        prep(a[0], torch.zeros(1, dtype=torch.int32), *args, grad_scale=gs, maximize=step == 3,
             check_finite=True)
        run_radam_native(b, args, chunk_size=7, grad_scale=gs, maximize=step == 3,
                         check_finite=True)
        assert_bitwise(a, b)
    before = clone(a)
    prep(a[0], torch.ones(1), *radam_args(9, ema=0.9 if has_ema else None))
    assert_bitwise(a, before)
    g = [t.clone() for t in a[0]]
    g[1][3] = float("inf")
    noop = torch.zeros(1, dtype=torch.int32)
    prep(g, noop, *radam_args(9, ema=0.9 if has_ema else None), check_finite=True)
    assert noop.item() == 1
    assert_bitwise(a[1:], before[1:])
    # a grad list that does not fit: the op's error, nothing modified
    with pytest.raises(ValueError, match=r"multi_tensor_radam: .*params\[1\] has shape"):
        prep([a[0][0], torch.zeros(99)] + a[0][2:], torch.zeros(1, dtype=torch.int32),
             *radam_args(9, ema=0.9 if has_ema else None))
    assert_bitwise(a, before)


def test_radam_prepared_five_list_form_follows_ema_decay():
    """[params, exp_avgs, exp_avg_sqs, X] with fp32 params: X is masters when ema_decay is None,
    emas when it is a float, call by call, like the op form."""
    a = make_lists(F32, F32, False, ema=True, seed=2)
    b = clone(a)
    prep = backends.prepare("radam", a[1:], 2048, validator=None)
    prep.validate(a[0])
    for step, ema in ((1, None), (2, 0.9), (6, 0.9), (7, None), (8, None), (9, 0.5)):
        prep(a[0], torch.zeros(1, dtype=torch.int32), *radam_args(step, ema=ema))
        run_radam_native(b, radam_args(step, ema=ema))
        assert_bitwise(a, b)
    # without the ema_decay argument: no EMA
    prep(a[0], torch.zeros(1, dtype=torch.int32), *radam_args(10)[:7])
    run_radam_native(b, radam_args(10))
    assert_bitwise(a, b)
    # fp16 params: validate() before any call picks the form the dtypes allow (fp16 state and
    # emas, or fp32 state and masters); a call of the other form raises, changing nothing
    for master, ok_ema in ((False, 0.9), (True, None)):
        L = make_lists(F16, F32, master, ema=not master, seed=3)
        prep = backends.prepare("radam", L[1:], 2048, validator=None)
        prep.validate(L[0])
        bad_ema = None if ok_ema is not None else 0.9
        before = clone(L)
        with pytest.raises(TypeError, match="exp_avgs are torch.float.. but must be"):
            prep(L[0], torch.zeros(1, dtype=torch.int32), *radam_args(6, ema=bad_ema))
        assert_bitwise(L, before)
        M = clone(L)
        prep(L[0], torch.zeros(1, dtype=torch.int32), *radam_args(6, ema=ok_ema))
        run_radam_native(M, radam_args(6, ema=ok_ema))
        assert_bitwise(L, M)
    with pytest.raises(TypeError, match="7 or 8 scalar arguments"):
        prep(L[0], torch.zeros(1, dtype=torch.int32), 1e-3, 0.9)


@pytest.mark.parametrize("dtype,ema", [(F32, 0.999), (BF16, 0.999), (F16, None)])
def test_fused_radam_native_equals_reference_backend(dtype, ema):
    """FusedRAdam end to end (prepared buckets, masters, EMA) on native vs the reference backend."""
    from fused_optim import FusedRAdam
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).to(dtype) for s in [(17,), (4, 33), (1,), (300,)]]
    grads = [[torch.randn(t.shape, generator=gen).to(dtype) for t in init] for _ in range(8)]
    results = []
    for name in ("native_cpu", "reference"):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = FusedRAdam(params, lr=1e-2, weight_decay=0.01, decoupled_weight_decay=dtype == F32,
                         ema_decay=ema)
        with backends.forced_backend(name):
            for gs in grads:
                for p, g in zip(params, gs):
                    p.grad = g.clone()
                opt.step()
        state = [[p.detach() for p in params]]
        for key in ("exp_avg", "exp_avg_sq", "ema", "master_param"):
            if key in opt.state[params[0]]:
                state.append([opt.state[p][key] for p in params])
        results.append(state)
    assert_bitwise(results[0], results[1])


def test_missing_extension_warns_once_and_the_optimizer_runs_on_the_reference():
    code = (
        "import sys\n"
        "for isa in ('avx512', 'avx2', 'default'):\n"
        "    sys.modules['multi_tensor._C_' + isa] = None  # as if never built\n"
        "import torch, multi_tensor\n"
        "from fused_optim import FusedEmaAdamW\n"
        "p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.ones(4)\n"
        "opt = FusedEmaAdamW([p], lr=0.1, weight_decay=0.0)\n"
        "opt.step(); opt.step()\n"
        "print(multi_tensor.backend_for('fused_ema_adamw', 'cpu').name, float(p[0]))\n"
    )
    r = _subprocess(code)
    assert r.returncode == 0, r.stderr
    name, value = r.stdout.split()
    assert name == "reference"
    assert abs(float(value) - 0.8) < 1e-5  # two Adam steps of lr 0.1 on a constant grad
    assert r.stderr.count("the native CPU extension did not load") == 1


def test_optimizer_tests_pass_with_the_extension_disabled():
    """The fallback: the FusedEmaAdamW suite, with native loading switched off, in a fresh process."""
    e = dict(os.environ, MULTI_TENSOR_DISABLE_NATIVE="1")
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(REPO, "tests", "test_fused_ema_adamw.py")],
                       capture_output=True, text=True, env=e, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
