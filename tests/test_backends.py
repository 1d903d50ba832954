"""Every registered multi-tensor backend, table-driven (tests/backend_cases.py).

For each backend in ``multi_tensor.registered_backends()`` (so a new backend is one registry entry
and is tested here at once; one that cannot run CPU tensors or lacks an op is skipped with the
reason, and ``native_cpu`` is listed as skipped when its extension did not load), each
Adam-family op x dtype case x hyperparameter switch must be

* BITWISE equal to the reference backend, for every output list (rules.py fixes one operation
  order for all backends), and
* close to an independent float64 oracle (seed_reference.seed_update for fused_ema_adamw / adam,
  torch.optim.RAdam's formula for radam / radam_ema) within backend_cases.tolerance, whose
  derivation is documented there.

Also table-driven: chunk sizes and thread counts give identical bits; non-contiguous layouts and
empty tensors; a set noop_flag changes nothing; check_finite with a non-finite grad sets the flag
and changes nothing; the optimizers' path (prepare_bucket + bind + run) equals the op path
bitwise; scale is bitwise and l2norm close to the reference. Subprocess tests: every native ISA
build (ATEN_CPU_CAPABILITY=avx512/avx2/default) gives the reference's bits, ``python -m
multi_tensor.env`` runs, a missing extension warns once and falls back to the reference,
MULTI_TENSOR_DISABLE_NATIVE=1 falls back silently.

Input validation (the op table's checks, before any tensor changes) is tested in
tests/test_validation.py. Not tested: tensors of more than 2**31 elements (too big for the test
machine; offsets and counts are int64, checked by review).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import backend_cases as C
import multi_tensor
from multi_tensor import build, rules, schema
from multi_tensor.backends import backend_for, forced_backend
from multi_tensor.backends import cpu as native_cpu
from seed_reference import assert_bitwise_equal, assert_close64

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
ALL_BACKENDS = C.backend_names()
# the backends the tests below run; the others are listed once, skipped with the reason, by
# test_backend_runs_cpu_tensors
BACKENDS = [name for name in ALL_BACKENDS if C.backend_skip_reason(name) is None]
CASES = [(op, dc) for op in C.OP_INFOS for dc in C.dtype_cases(op)]
CASE_IDS = [f"{op.name}-{dc.name}" for op, dc in CASES]


def backend_obj(name: str, op: str = None):
    """The registered backend ``name``; skips the test when it cannot run ``op`` on CPU tensors."""
    reason = C.backend_skip_reason(name, op)
    if reason:
        pytest.skip(reason)
    return next(b for b in multi_tensor.registered_backends() if b.name == name)


def run_on(backend: str, op: C.OpInfo, lists, h: C.HyperCase, step: int, chunk_size: int = 2048,
           noop=None, check_finite=None) -> torch.Tensor:
    """One call of ``op``'s front end with every op resolving to ``backend``; returns noop_flag."""
    noop = torch.zeros(1, dtype=torch.int32) if noop is None else noop
    with forced_backend(backend):
        assert backend_for(op.name, "cpu").name == backend
        op.call(chunk_size, noop, lists, h, step, check_finite=check_finite)
    return noop


def assert_lists_bitwise(actual, expected, names, what: str) -> None:
    assert len(actual) == len(expected) == len(names)
    for ts, es, name in zip(actual, expected, names):
        assert len(ts) == len(es)
        for i, (t, e) in enumerate(zip(ts, es)):
            assert_bitwise_equal(t, e, f"{what}: {name}[{i}]")


def assert_matches_oracle(op: C.OpInfo, dc: C.DtypeCase, lists, before, h, step, what) -> None:
    """Every output within backend_cases.tolerance of the float64 oracle; param = round(master)."""
    names = op.names(dc.master)
    expected = op.expected(before, h, step)
    for li, name in enumerate(names[1:], 1):
        for i, (t, e) in enumerate(zip(lists[li], expected[name])):
            rtol, atol = C.tolerance(dc.math, t.dtype)
            assert_close64(t, e, rtol=rtol, atol=atol, msg=f"{what}: {name}[{i}] vs float64 oracle")
    if dc.master:
        for i, (p, m) in enumerate(zip(lists[1], lists[-1])):
            assert_bitwise_equal(p, m.to(dc.param), f"{what}: params[{i}] is masters[{i}] rounded")


def h_named(op: C.OpInfo, name: str) -> C.HyperCase:
    return next(h for h in op.hyper_cases if h.name == name)


def two_steps(op: C.OpInfo):
    """Adam: steps 1, 2. RAdam: the last un-rectified step and the first rectified one."""
    return (5, 6) if op.rule == rules.RADAM else (1, 2)


# ---------------------------------------------------------------------------------------------
# the table itself


def test_table_covers_every_adam_family_op_and_rectification():
    adam_family = {name for name, spec in schema.OPS.items() if spec.rule is not None}
    assert set(C.OPS) == adam_family, "every Adam-family op of schema.OPS needs an OpInfo"
    for op in C.OP_INFOS:
        for dc in C.dtype_cases(op):  # every dtype case is a form the op table accepts
            schema.check_adam_lists(op.spec, op.named(C.make_lists(op, dc, shapes=((2,),))))
        switches = {h.name for h in op.hyper_cases}
        assert {"decoupled", "l2", "wd0"} <= switches
        assert any(h.maximize for h in op.hyper_cases)
        assert any(h.grad_scale for h in op.hyper_cases)
        if op.rule == rules.ADAM:
            assert any(not h.bias_correction for h in op.hyper_cases)
        else:  # every RAdam switch runs un-rectified and rectified steps
            for h in op.hyper_cases:
                rect = [C.radam_is_rectified(h.beta2, t) for t in h.steps]
                assert False in rect and True in rect, h.name
    # the oracle's rectification agrees with the package's
    for beta2 in (0.9, 0.99, 0.999):
        for step in range(1, 40):
            assert (rules.radam_rect(beta2, step) is not None) == C.radam_is_rectified(beta2, step)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_backend_runs_cpu_tensors(backend):
    """Every registered backend is tested in this file unless it cannot run CPU tensors (then its
    device's own suite covers it) or did not register (the reason is shown)."""
    b = backend_obj(backend)
    assert backend in BACKENDS
    with forced_backend(backend):
        for op in b.ops:
            assert backend_for(op, "cpu") is b


@forced_backend(None)  # whatever MULTI_TENSOR_BACKEND says
def test_cpu_ops_resolve_to_the_highest_priority_backend():
    registered = multi_tensor.registered_backends()
    for op in schema.OPS:
        want = next(b for b in registered if op in b.ops and b.handles("cpu"))
        assert backend_for(op, "cpu") is want
        assert backend_for(op, torch.device("cpu")) is want
    if native_cpu.BACKEND is not None:
        assert native_cpu.load_error is None
        assert native_cpu.capability in ("AVX512", "AVX2", "DEFAULT")
        assert native_cpu.loaded_module.capability == native_cpu.capability
        for op in schema.OPS:
            assert backend_for(op, "cpu").name == "native_cpu", op


# ---------------------------------------------------------------------------------------------
# bitwise vs the reference backend, and close to the float64 oracle


@pytest.mark.parametrize("op,dc", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_vs_reference_and_close_to_float64_oracle(backend, op, dc):
    backend_obj(backend, op.name)
    names = op.names(dc.master)
    for k, h in enumerate(op.hyper_cases):
        ref = C.make_lists(op, dc, seed=k, grad_scale=h.grad_scale)
        got = ref if backend == "reference" else C.clone(ref)
        for step in h.steps:
            what = f"{backend} {op.name} {dc.name} {h.name} step {step}"
            before = C.clone(ref)
            assert run_on("reference", op, ref, h, step).item() == 0
            if backend != "reference":
                assert run_on(backend, op, got, h, step).item() == 0
                assert_lists_bitwise(got, ref, names, f"{what}: vs reference")
            assert_lists_bitwise(got[:1], before[:1], names[:1], f"{what}: grads changed")
            assert_matches_oracle(op, dc, got, before, h, step, what)


# ---------------------------------------------------------------------------------------------
# chunk sizes and thread counts

CHUNK_SIZES = (1, 7, 2048, 65536)
THREADS = (1, 2)
# 40000 + 18 elements: above the native launcher's inline threshold (32768), so it forks threads
BIG_SHAPES = ((40000,), (17,), (1,), (0,))
CHUNK_CASES = [("fused_ema_adamw", "fp32"), ("fused_ema_adamw", "fp16_master_g32"),
               ("adam", "bf16_master"), ("adam", "fp32_gbf16"), ("radam", "fp16_plain"),
               ("radam", "fp32"), ("radam_ema", "fp64"), ("radam_ema", "bf16_plain"),
               ("fused_ema_adamw", "fp32_ema_bf16"), ("radam_ema", "fp16_plain_ema_bf16")]


@pytest.mark.parametrize("op_name,dtype_name", CHUNK_CASES,
                         ids=[f"{o}-{d}" for o, d in CHUNK_CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_sizes_and_threads_give_identical_bits(backend, op_name, dtype_name):
    op, dc = C.OPS[op_name], C.DTYPES[dtype_name]
    backend_obj(backend, op.name)
    h = h_named(op, "maximize_grad_scale_decoupled")
    base = C.make_lists(op, dc, BIG_SHAPES, seed=7, grad_scale=h.grad_scale)
    expected = C.clone(base)
    for step in two_steps(op):
        run_on("reference", op, expected, h, step, chunk_size=2048 * 32)
    threads = torch.get_num_threads()
    try:
        for nthreads in THREADS:
            torch.set_num_threads(nthreads)
            for chunk in CHUNK_SIZES:
                got = C.clone(base)
                for step in two_steps(op):
                    run_on(backend, op, got, h, step, chunk_size=chunk)
                assert_lists_bitwise(got, expected, op.names(dc.master),
                                     f"{backend}, {nthreads} threads, chunk size {chunk}")
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# non-contiguous layouts

LAYOUT_SHAPES = ((12, 9), (8, 6), (5, 7), (3, 40))
SENTINEL = -7.0


def _transposed(t):
    return t.t().contiguous().t()  # same values, column-major strides


def _strided(t, keep):
    big = torch.full((t.shape[0], t.shape[1] * 2), SENTINEL, dtype=t.dtype)
    big[:, ::2] = t
    keep.append((big[:, 1::2], big[:, 1::2].clone()))
    return big[:, ::2]  # every other column: not dense


def _offset(t, keep):
    big = torch.full((t.shape[0] + 1, t.shape[1]), SENTINEL, dtype=t.dtype)
    big[1:] = t
    keep.append((big[:1], big[:1].clone()))
    return big[1:]  # contiguous, at a storage offset


def _layout(name, li, n_lists, row, t, keep):
    """The view of list ``li``, row ``row`` in layout ``name`` (same values as ``t``)."""
    if name == "transposed_all":   # every tensor of a row alike: one flat index serves all
        return _transposed(t)
    if name == "transposed_grads":  # the grads' layout differs from the state's
        return _transposed(t) if li == 0 else t
    if name == "expanded_grads":    # stride-0 grads (read only): one value per row
        return t[:1, :1].expand(t.shape) if li == 0 else t
    if name == "strided":
        return _strided(t, keep)
    if name == "offset":
        return _offset(t, keep)
    # "mixed": a different layout per row, and within row 2 only some lists are strided
    if row == 1:
        return _transposed(t)
    if row == 2 and li in (0, 2, n_lists - 1):
        return _strided(t, keep)
    if row == 3:
        return _offset(t, keep)
    return t


LAYOUTS = ("transposed_all", "transposed_grads", "expanded_grads", "strided", "offset", "mixed")
LAYOUT_CASES = [("fused_ema_adamw", "fp32"), ("adam", "bf16_master"),
                ("radam", "fp16_master_g32"), ("radam_ema", "fp32_gbf16"), ("radam_ema", "fp64")]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op_name,dtype_name", LAYOUT_CASES,
                         ids=[f"{o}-{d}" for o, d in LAYOUT_CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_layouts(backend, op_name, dtype_name, layout):
    """Views are updated in place (equal to the reference on contiguous copies), and the memory
    around them is untouched."""
    op, dc = C.OPS[op_name], C.DTYPES[dtype_name]
    backend_obj(backend, op.name)
    h = h_named(op, "grad_scale_check_finite")
    lists = C.make_lists(op, dc, LAYOUT_SHAPES, seed=5, grad_scale=h.grad_scale)
    keep = []
    views = [[_layout(layout, li, len(lists), row, t, keep) for row, t in enumerate(ts)]
             for li, ts in enumerate(lists)]
    assert any(not v.is_contiguous() or v.storage_offset() for ts in views for v in ts)
    expected = [[v.contiguous().clone() for v in ts] for ts in views]  # the same values, dense
    for step in two_steps(op):
        run_on("reference", op, expected, h, step)
        assert run_on(backend, op, views, h, step).item() == 0
    assert_lists_bitwise([[v.contiguous() for v in ts] for ts in views], expected,
                         op.names(dc.master), f"{backend} {layout}")
    for around, saved in keep:
        assert_bitwise_equal(around, saved, "memory next to a view changed")


# ---------------------------------------------------------------------------------------------
# empty lists and tensors, noop_flag, check_finite


@pytest.mark.parametrize("op", C.OP_INFOS, ids=lambda o: o.name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_lists_and_empty_tensors(backend, op):
    b = backend_obj(backend, op.name)
    h = op.hyper_cases[0]
    n_lists = len(op.names(False))
    assert run_on(backend, op, [[] for _ in range(n_lists)], h, 1).item() == 0
    for dc in (C.DTYPES["fp32"], C.DTYPES["bf16_master"]):
        lists = C.make_lists(op, dc, shapes=((0,), (0, 3), (2, 0, 4)))
        before = C.clone(lists)
        assert run_on(backend, op, lists, h, 1).item() == 0
        assert_lists_bitwise(lists, before, op.names(dc.master), f"{backend} empty tensors")
        prepared = b.prepare_bucket(op.name, op.named(lists).state(), 2048)
        assert prepared.bind(lists[0])
        prepared.run(torch.zeros(1, dtype=torch.int32), op.scalars(h, 1), None, True)
        assert_lists_bitwise(lists, before, op.names(dc.master), f"{backend} prepared, empty")
    prepared = b.prepare_bucket(op.name, op.named([[] for _ in range(n_lists)]).state(), 2048)
    assert prepared.bind([])
    prepared.run(torch.zeros(1, dtype=torch.int32), op.scalars(h, 1))


@pytest.mark.parametrize("flag_dtype", [torch.int32, torch.float32, torch.bool])
@pytest.mark.parametrize("op", C.OP_INFOS, ids=lambda o: o.name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_noop_flag_set_changes_nothing(backend, op, flag_dtype):
    backend_obj(backend, op.name)
    dc = C.DTYPES["bf16_master"]
    h = h_named(op, "grad_scale_check_finite")
    lists = C.make_lists(op, dc, BIG_SHAPES, seed=2, grad_scale=h.grad_scale)
    before = C.clone(lists)
    noop = torch.ones(1, dtype=flag_dtype)
    run_on(backend, op, lists, h, 6, noop=noop)
    assert_lists_bitwise(lists, before, op.names(dc.master), f"{backend} with noop_flag set")
    assert bool(noop.item())


BAD_GRAD_CASES = [("fused_ema_adamw", "fp32"), ("adam", "bf16_master"), ("radam", "fp64"),
                  ("radam_ema", "fp16_master_g32"), ("adam", "fp16_plain")]
CHECK_SHAPES = ((40000,), (17,), (9, 12))


# (value, where): the last element of the 40000-element row (the native kernel's threaded path,
# last chunk), or inside a grad whose layout differs from its param's (run on a contiguous copy)
BAD_VALUES = [(float("inf"), "big_row_last"), (float("-inf"), "transposed_grad"),
              (float("nan"), "big_row_last"), (float("nan"), "transposed_grad")]


@pytest.mark.parametrize("bad,where", BAD_VALUES, ids=[f"{b}-{w}" for b, w in BAD_VALUES])
@pytest.mark.parametrize("op_name,dtype_name", BAD_GRAD_CASES,
                         ids=[f"{o}-{d}" for o, d in BAD_GRAD_CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_check_finite_sets_flag_and_changes_nothing(backend, op_name, dtype_name, bad, where):
    op, dc = C.OPS[op_name], C.DTYPES[dtype_name]
    backend_obj(backend, op.name)
    h = h_named(op, "grad_scale_check_finite")
    lists = C.make_lists(op, dc, CHECK_SHAPES, seed=4, grad_scale=h.grad_scale)
    lists[0][2] = _transposed(lists[0][2])  # the grad's layout differs from its param's
    at = (0, (39999,)) if where == "big_row_last" else (2, (8, 0))
    good = lists[0][at[0]][at[1]].item()
    lists[0][at[0]][at[1]] = bad
    before = C.clone(lists)
    assert run_on(backend, op, lists, h, 6, check_finite=True).item() == 1
    assert_lists_bitwise(lists, before, op.names(dc.master), f"{backend} non-finite grad")
    # the same call without the bad value runs, as on the reference
    lists[0][at[0]][at[1]] = good
    expected = C.clone(lists)
    assert run_on(backend, op, lists, h, 6, check_finite=True).item() == 0
    assert run_on("reference", op, expected, h, 6, check_finite=True).item() == 0
    assert_lists_bitwise(lists, expected, op.names(dc.master), f"{backend} finite grads")
    assert not torch.equal(lists[1][0], before[1][0])


# ---------------------------------------------------------------------------------------------
# the optimizers' path: prepare_bucket + bind + run


def _grads_for(op, dc, seed, h, shapes=C.SHAPES):
    return C.make_lists(op, dc, shapes, seed=seed, grad_scale=h.grad_scale)[0]


@pytest.mark.parametrize("op,dc", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_prepared_bucket_equals_op_path(backend, op, dc):
    b = backend_obj(backend, op.name)
    names = op.names(dc.master)
    lists = C.make_lists(op, dc, seed=21)
    state, op_state = C.clone(lists[1:]), C.clone(lists[1:])
    prepared = b.prepare_bucket(op.name, op.named([lists[0]] + state).state(), 7)
    for k, h in enumerate(op.hyper_cases):
        step = h.steps[k % len(h.steps)]
        grads = _grads_for(op, dc, 100 + k, h)
        noop = torch.zeros(1, dtype=torch.int32)
        assert prepared.bind(grads)
        prepared.run(noop, op.scalars(h, step), h.grad_scale_tensor(), h.check_finite)
        assert noop.item() == 0
        assert run_on(backend, op, [grads] + op_state, h, step, chunk_size=7).item() == 0
        assert_lists_bitwise(state, op_state, names[1:], f"{backend} prepared, {h.name}")
    h = h_named(op, "grad_scale_check_finite")
    scalars = op.scalars(h, 7)
    before = C.clone(state)
    # noop_flag set: nothing changes
    assert prepared.bind(_grads_for(op, dc, 200, h))
    prepared.run(torch.ones(1), scalars, h.grad_scale_tensor(), False)
    assert_lists_bitwise(state, before, names[1:], f"{backend} prepared, noop_flag set")
    # check_finite and an inf grad: the flag is set, nothing changes
    grads = _grads_for(op, dc, 201, h)
    grads[3][1, 7] = float("inf")
    noop = torch.zeros(1, dtype=torch.int32)
    assert prepared.bind(grads)
    prepared.run(noop, scalars, h.grad_scale_tensor(), True)
    assert noop.item() == 1
    assert_lists_bitwise(state, before, names[1:], f"{backend} prepared, inf grad")
    # grads that do not fit are refused: count, shape, dtype
    grads = _grads_for(op, dc, 202, h)
    assert not prepared.bind(grads[:-1])
    assert not prepared.bind(grads[:3] + [torch.zeros(33, 4, dtype=dc.grad)] + grads[4:])
    wrong = torch.float32 if dc.param == torch.float64 else torch.float64
    assert not prepared.bind([g.to(wrong) for g in grads])
    # ... and the bucket still works afterwards; `p.data = x` (same shape) is followed
    for ts in (state, op_state):
        ts[0][3].data = ts[0][3].data.clone() * 0.5
    assert prepared.bind(grads)
    prepared.run(torch.zeros(1, dtype=torch.int32), scalars, h.grad_scale_tensor(), True)
    run_on(backend, op, [grads] + op_state, h, 7, chunk_size=7)
    assert_lists_bitwise(state, op_state, names[1:], f"{backend} prepared, after refused binds")


@pytest.mark.parametrize("backend", BACKENDS)
def test_prepared_bucket_after_a_refused_bind_of_resized_state(backend):
    """A row's tensors all replaced by larger ones (``p.data = x`` on each), then a refused bind
    (another row's grad does not fit): a later bind either refuses too, or the run updates every
    element of the resized row, as the op path does."""
    b = backend_obj(backend, "adam")
    op, dc = C.OPS["adam"], C.DTYPES["fp32"]
    h = op.hyper_cases[0]
    state = C.make_lists(op, dc, shapes=((10,), (10,)), seed=1)[1:]
    prepared = b.prepare_bucket("adam", op.named([[None, None]] + state).state(), 2048)
    assert prepared.bind([torch.ones(10), torch.ones(10)])
    for t in (state[0][0], state[1][0], state[2][0]):
        t.data = torch.full((20,), 0.5)
    assert not prepared.bind([torch.ones(20), torch.ones(3)])
    grads = [torch.ones(20), torch.ones(10)]
    if not prepared.bind(grads):
        return  # refusing is fine: the optimizer plans afresh
    expected = C.clone(state)
    prepared.run(torch.zeros(1, dtype=torch.int32), op.scalars(h, 1), None, False)
    run_on("reference", op, [grads] + expected, h, 1)
    assert_lists_bitwise(state, expected, op.names(False)[1:], f"{backend} resized row")


# ---------------------------------------------------------------------------------------------
# scale and l2norm against the reference

SCALE_DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.float16),
                (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16),
                (torch.float32, torch.bfloat16), (torch.float64, torch.float32),
                (torch.float32, torch.float64), (torch.float64, torch.float16),
                (torch.bfloat16, torch.float64), (torch.float64, torch.float64)]


def _scale_oracle(src: torch.Tensor, dst_dtype: torch.dtype, factor: float) -> torch.Tensor:
    """apex scale in numpy: the product in fp32 (fp64 when the source or the destination is
    fp64), one IEEE rounding, then rounded once to ``dst_dtype`` (round to nearest even)."""
    import numpy as np

    from ieee_oracle import bf16_round
    k = np.float64 if torch.float64 in (src.dtype, dst_dtype) else np.float32
    prod = src.to(torch.float64).numpy().astype(k) * k(factor)
    if dst_dtype == torch.bfloat16:
        return torch.from_numpy(bf16_round(prod.astype(np.float32))).to(torch.bfloat16)
    kind = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
    return torch.from_numpy(np.ascontiguousarray(prod.astype(kind[dst_dtype])))


# torch's fp64 -> fp16 conversion goes through fp32 (two roundings): 3 of 40,000 products here
# land on a different fp16 than the one correctly rounded value the scale op promises. Strict:
# it fails as soon as the op rounds once.
_DOUBLE_ROUNDED = pytest.mark.xfail(strict=True, reason="fp64 -> fp16 is rounded twice (via fp32)")
SCALE_CASES = [pytest.param(s, d, marks=_DOUBLE_ROUNDED)
               if (s, d) == (torch.float64, torch.float16) else (s, d) for s, d in SCALE_DTYPES]


@pytest.mark.parametrize("src_dtype,dst_dtype", SCALE_CASES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_bitwise_vs_oracle(backend, src_dtype, dst_dtype):
    backend_obj(backend, "scale")
    gen = torch.Generator().manual_seed(31)
    shapes = [(1,), (17,), (65,), (40000,), (0,), (9, 4), (6, 10)]
    srcs = [(torch.randn(s, generator=gen, dtype=torch.float64) * 1000).to(src_dtype)
            for s in shapes]
    srcs[-2] = srcs[-2].t()  # a non-contiguous source
    dsts = [torch.full(s.shape, 7.0, dtype=dst_dtype) for s in srcs]
    dsts[-1] = torch.full((10, 6), 7.0, dtype=dst_dtype).t()  # a non-contiguous destination
    noop = torch.zeros(1, dtype=torch.int32)
    with forced_backend(backend):
        assert backend_for("scale", "cpu").name == backend
        multi_tensor.multi_tensor_scale(7, noop, [srcs, dsts], 0.37)
    assert noop.item() == 0
    for i, (a, src) in enumerate(zip(dsts, srcs)):
        assert_bitwise_equal(a, _scale_oracle(src, dst_dtype, 0.37), f"{backend} scale dst[{i}]")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("backend", BACKENDS)
def test_l2norm_close_to_reference_and_independent_of_chunks_and_threads(backend, dtype):
    """Close to the reference (which sums in fp64), and bitwise the same for every chunk size and
    thread count."""
    backend_obj(backend, "l2norm")
    gen = torch.Generator().manual_seed(41)
    ts = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)
          for s in [(1,), (17,), (40000,), (0,), (3, 70)]]
    ts.append(torch.randn(45, 123, generator=gen).to(dtype).t())
    ref_total, ref_per = multi_tensor.backends.reference.l2norm(
        2048, torch.zeros(1, dtype=torch.int32), [ts], True)
    results = []
    threads = torch.get_num_threads()
    try:
        with forced_backend(backend):
            for nthreads in THREADS:
                torch.set_num_threads(nthreads)
                for chunk in CHUNK_SIZES:
                    results.append(multi_tensor.multi_tensor_l2norm(
                        chunk, torch.zeros(1, dtype=torch.int32), [ts], True))
    finally:
        torch.set_num_threads(threads)
    total, per = results[0]
    assert total.dtype == per.dtype == torch.float32 and per.shape == (len(ts),)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
    torch.testing.assert_close(per, ref_per, rtol=1e-6, atol=0)
    for t, p in results[1:]:
        assert_bitwise_equal(t, total, "l2norm total depends on chunks/threads")
        assert_bitwise_equal(p, per, "l2norm per-tensor depends on chunks/threads")
    ts[2][123] = float("nan")
    noop = torch.zeros(1, dtype=torch.int32)
    with forced_backend(backend):
        multi_tensor.multi_tensor_l2norm(2048, noop, [ts], False)
    assert noop.item() == 1


# ---------------------------------------------------------------------------------------------
# subprocesses: ISA builds, env report, fallbacks


# settings of this process that would change what a fresh one loads; each test sets its own
_LOAD_SETTINGS = ("MULTI_TENSOR_DISABLE_NATIVE", "MULTI_TENSOR_BACKEND", "ATEN_CPU_CAPABILITY")


def _env(**env):
    """The environment of a fresh process: no load settings of ours, and never a first-use
    compile of the extension (multi_tensor/build.py): the tests use what is built."""
    e = {k: v for k, v in os.environ.items() if k not in _LOAD_SETTINGS}
    e["FUSED_OPTIM_NO_JIT"] = "1"
    e.update(env)
    e["PYTHONPATH"] = os.pathsep.join([REPO, TESTS, e.get("PYTHONPATH", "")])
    return e


def _subprocess(code, *args, **env):
    return subprocess.run([sys.executable, "-W", "always", "-c", code, *args],
                          capture_output=True, text=True, env=_env(**env), timeout=300, cwd=REPO)


_ISA_RANK = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}
_ISA_CODE = (
    "import sys, torch, backend_cases as C\n"
    "from multi_tensor.backends import cpu as native_cpu\n"
    "print(native_cpu.capability)\n"
    "torch.save(C.isa_sweep('native_cpu'), sys.argv[1])\n"
)


ISAS = ("avx512", "avx2", "default")


def _built_ahead_of_time(isa) -> bool:
    """Whether ``multi_tensor._C_<isa>`` is built ahead of time. A build made on first use is
    found too (it sits in sys.modules, loaded from the cache), but the subprocesses here
    (FUSED_OPTIM_NO_JIT) load only what was built ahead of time."""
    spec = importlib.util.find_spec(f"multi_tensor._C_{isa}")
    return spec is not None and os.path.realpath(str(spec.origin)) != os.path.realpath(
        build.cache_path(isa))


def _isa_skip_reason(isa):
    if native_cpu.loaded_module is None:
        return f"the native CPU extension did not load: {native_cpu.load_error}"
    if not _built_ahead_of_time(isa):
        return f"multi_tensor._C_{isa} is not built ahead of time (the tests do not compile it)"
    cpu = str(torch.backends.cpu.get_cpu_capability()).upper()
    if _ISA_RANK[isa.upper()] > _ISA_RANK.get(cpu, 0):
        return f"this CPU (capability {cpu}) cannot run the {isa} build"
    return None


@pytest.fixture(scope="module")
def isa_sweeps(tmp_path_factory):
    """The sweep of every runnable ISA build, the subprocesses run at once; and the reference's."""
    tmp = tmp_path_factory.mktemp("isa")
    procs = {}
    for isa in ISAS:
        if _isa_skip_reason(isa) is None:
            path = str(tmp / f"sweep_{isa}.pt")
            procs[isa] = (path, subprocess.Popen(
                [sys.executable, "-c", _ISA_CODE, path], stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env(ATEN_CPU_CAPABILITY=isa)))
    reference = C.isa_sweep("reference")
    results = {}
    for isa, (path, proc) in procs.items():
        out, err = proc.communicate(timeout=300)
        results[isa] = (proc.returncode, out, err, path)
    return reference, results


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_build_gives_the_reference_bits(isa, isa_sweeps):
    reason = _isa_skip_reason(isa)
    if reason:
        pytest.skip(reason)
    reference, results = isa_sweeps
    returncode, out, err, path = results[isa]
    assert returncode == 0, err[-3000:]
    assert out.split()[0] == isa.upper(), out
    got = torch.load(path)
    assert len(got) == len(reference)
    for i, (a, e) in enumerate(zip(got, reference)):
        assert_bitwise_equal(a, e, f"{isa} build, sweep tensor {i}")


def test_env_report_runs():
    r = subprocess.run([sys.executable, "-m", "multi_tensor.env"], capture_output=True, text=True,
                       cwd=REPO, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    jit_only = not any(_built_ahead_of_time(isa) for isa in ISAS)
    for b in multi_tensor.registered_backends():
        if not (b.name == "native_cpu" and jit_only):  # the subprocess cannot load it
            assert b.name in r.stdout
    assert "torch" in r.stdout and "op resolution" in r.stdout


def test_disable_native_env_falls_back_silently():
    r = _subprocess("import multi_tensor; from multi_tensor.backends import cpu as native_cpu;"
                    "print('native_cpu' in [b.name for b in multi_tensor.registered_backends()],"
                    " multi_tensor.backend_for('radam_ema', 'cpu').name, native_cpu.loaded_module)",
                    MULTI_TENSOR_DISABLE_NATIVE="1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["False", "reference", "None"]
    assert "native CPU extension did not load" not in r.stderr


def test_missing_extension_warns_once_and_the_optimizer_runs_on_the_reference():
    code = (
        "import sys\n"
        "for isa in ('avx512', 'avx2', 'default'):\n"
        "    sys.modules['multi_tensor._C_' + isa] = None  # as if never built\n"
        "import torch, multi_tensor\n"
        "from fused_optim import FusedEmaAdamW, FusedRAdam\n"
        "p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.ones(4)\n"
        "opt = FusedEmaAdamW([p], lr=0.1, weight_decay=0.0)\n"
        "opt.step(); opt.step()\n"
        "q = torch.nn.Parameter(torch.ones(4)); q.grad = torch.ones(4)\n"
        "FusedRAdam([q], lr=0.1, ema_decay=0.9).step()\n"
        "print(multi_tensor.backend_for('fused_ema_adamw', 'cpu').name, float(p[0]))\n"
    )
    r = _subprocess(code)
    assert r.returncode == 0, r.stderr[-3000:]
    name, value = r.stdout.split()
    assert name == "reference"
    assert abs(float(value) - 0.8) < 1e-5  # two Adam steps of lr 0.1 on a constant grad
    assert r.stderr.count("the native CPU extension did not load") == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_split_of_a_large_bucket_changes_no_bit(backend):
    """Above the inline threshold the native launcher gives threads equal element shares and
    cuts chunks where they fall: any split, chunk size or thread count gives the same bits."""
    backend_obj(backend, "fused_ema_adamw")  # skips where the backend cannot run the op
    op, dc = C.OPS["fused_ema_adamw"], C.DTYPES["fp32"]
    shapes = ((300_001,), (7,), (65_537,), (1,), (120_000,))
    outs = []
    threads = torch.get_num_threads()
    try:
        for n_threads, chunk in ((1, 65536), (2, 65536), (2, 1000), (2, 1 << 22)):
            torch.set_num_threads(n_threads)
            lists = C.make_lists(op, dc, shapes=shapes, seed=3)
            run_on(backend, op, lists, op.hyper_cases[0], 4, chunk_size=chunk)
            outs.append(lists)
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        assert_lists_bitwise(outs[0], other, [str(i) for i in range(len(other))],
                             f"{backend} split")
