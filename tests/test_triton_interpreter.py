"""The Triton backend's real kernels on CPU tensors, under ``TRITON_INTERPRET=1``.

Triton fixes interpreter mode when ``@triton.jit`` runs, so the cases run in their own process
with ``TRITON_INTERPRET=1``: each case is one pytest test (``test_kernel_under_interpreter[name]``,
selectable with ``-k``), run there by pytest (see the end of this file). Every case compares with
the reference backend bit for bit (l2norm: to 1e-6, and bit for bit across chunk sizes), or with
the IEEE oracle (``ieee_oracle.py``).

What the interpreter cannot show (so ``test_triton_ptx.py`` checks the compiled PTX instead):
it runs ``/``, ``tl.sqrt``, ``tl.div_rn`` and ``tl.sqrt_rn`` all as exact numpy operations and
never contracts a multiply-add, so exactness on a GPU rests on the PTX. Interpreter gaps the
kernels are written around (the same code runs on the GPU):

* fp32 -> bf16 casts truncate: bf16 is rounded with integer operations (NaN -> 0x7FC0);
* scalars loaded from memory are 1-element arrays, so ``range()`` over loaded bounds fails
  with the numpy here (2.4: "only 0-dimensional arrays can be converted to Python scalars"): the
  chunk loops are ``while`` loops;
* ``tl.load(ptr, mask=None, other=0)`` is accepted by the interpreter but refused by the
  compiler; ``tl.multiple_of`` inside a jit helper is silently dropped when compiled (so the
  hints are written in the kernels' bodies and checked in the PTX);
* a mask combining a block with a scalar flag is refused: the noop flag is folded into the
  chunk's end (``end = start`` when set);
* ``tl.multiple_of`` hints are no-ops (they matter only to the compiled kernel; the host picks
  ``ALIGN_ALL`` only when they hold, and ``ALIGN_CHUNK`` kernels test each chunk themselves);
* Triton's unary minus is ``0 - x`` (+0 stays +0): negation flips the sign bit instead.

Skips (with the reason) when triton is not installed. Runs in about a minute on 2 cores.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Callable, Dict

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import multi_tensor  # noqa: E402
from multi_tensor import rules, schema, tensor_facts  # noqa: E402
from multi_tensor.backends import reference, registry  # noqa: E402
from multi_tensor.ops import named_lists  # noqa: E402

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
ADAM_OPS = ("fused_ema_adamw", "adam", "radam", "radam_ema")
# name: (param dtype, grad dtype, fp32 masters[, EMA dtype when not the state dtype])
DTYPES = {
    "fp32": (F32, F32, False),
    "fp64": (F64, F64, False),
    "bf16_master": (BF16, BF16, True),
    "bf16_master_g32": (BF16, F32, True),
    "fp16_master_g32": (F16, F32, True),
    "bf16_plain": (BF16, BF16, False),
    "fp16_plain": (F16, F16, False),
    "fp32_gbf16": (F32, BF16, False),
    "fp32_gfp16": (F32, F16, False),
}
# a bf16 EMA beside state of another dtype (ops with an EMA only)
EMA_DTYPES = {
    "fp32_ema_bf16": (F32, F32, False, BF16),
    "bf16_master_ema_bf16": (BF16, BF16, True, BF16),
    "fp16_plain_ema_bf16": (F16, F16, False, BF16),
}
# (0,) and (4, 0): empty rows; 3000: two whole 1024-blocks and a masked tail in a 2048 chunk
SHAPES = ((1,), (15,), (0,), (4, 33), (2, 3, 5), (3000,), (4, 0), (1030,))
SMALL = ((1,), (15,), (0,), (4, 9), (33,))
SWITCHES = {
    "decoupled_scale": dict(grad_scale=1536.0),
    "l2": dict(decoupled=False),
    "wd0": dict(weight_decay=0.0),
    "maximize_l2": dict(maximize=True, decoupled=False),
    "maximize_scale_decoupled": dict(maximize=True, grad_scale=512.0, lr=3e-3, beta1=0.5,
                                     eps=1e-6),
    "no_bias_correction": dict(bias_correction=False),
    "no_bias_correction_l2": dict(bias_correction=False, decoupled=False),
}
STEPS = (1, 6)  # RAdam with beta2 = 0.999: un-rectified at step 1..5, rectified from 6


# ---------------------------------------------------------------------------------------------
# helpers (run in the subprocess)

def _k():
    from multi_tensor.backends import triton as triton_gpu
    k = triton_gpu.host_module()
    assert k is not None, triton_gpu.load_error
    return k


def _hyper(op: str, **kw) -> rules.AdamHyper:
    spec = schema.OPS[op]
    args = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, decoupled=True,
                bias_correction=True, maximize=False)
    args.update({k: v for k, v in kw.items() if k != "grad_scale"})
    return rules.AdamHyper(ema_decay=0.9 if spec.has_ema else None, rule=spec.rule, **args)


def make_lists(op: str, dtype: str, shapes=SHAPES, seed: int = 0, grad_scale=None):
    p_dt, g_dt, master, *ema_dt = {**DTYPES, **EMA_DTYPES}[dtype]
    s_dt = F32 if master else p_dt
    e_dt = ema_dt[0] if ema_dt else s_dt
    gen = torch.Generator().manual_seed(seed)

    def rnd(shape):
        return torch.randn(shape, generator=gen, dtype=F64)

    w = [rnd(s) for s in shapes]
    lists = [[(rnd(s) * (grad_scale or 1.0)).to(g_dt) for s in shapes],
             [x.to(p_dt) for x in w],
             [(rnd(s) * 0.1).to(s_dt) for s in shapes],
             [(rnd(s).abs() * 0.01).to(s_dt) for s in shapes]]
    if schema.OPS[op].has_ema:
        lists.append([(x + 0.01 * rnd(x.shape)).to(e_dt) for x in w])
    if master:
        lists.append([x.to(F32) for x in w])
    return lists


def clone(lists):
    return [[t.clone() for t in ts] for ts in lists]


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_lists_equal(got, want, what: str) -> None:
    for li, (gs, ws) in enumerate(zip(got, want)):
        for i, (g, w) in enumerate(zip(gs, ws)):
            if not same_bits(g, w):
                diff = int((bits(g) != bits(w)).sum()) if g.shape == w.shape else -1
                raise AssertionError(f"{what}: list {li} tensor {i} {tuple(g.shape)} {g.dtype}: "
                                     f"{diff} elements differ from the reference")


def run_adam(op, lists, scalars, chunk, grad_scale=None, check_finite=False, noop=None):
    noop = torch.zeros(1, dtype=torch.int32) if noop is None else noop
    gs = None if grad_scale is None else torch.tensor([grad_scale])
    bucket = _k().AdamBucket(op, named_lists(op, lists).state(), chunk)
    assert bucket.bind(lists[0])
    bucket.run(noop, scalars, gs, check_finite)
    return noop


def ref_adam(lists, scalars, grad_scale=None, check_finite=False, noop=None):
    noop = torch.zeros(1, dtype=torch.int32) if noop is None else noop
    gs = None if grad_scale is None else torch.tensor([grad_scale])
    op = "fused_ema_adamw" if scalars.ema else "adam"  # radam's lists are named alike
    reference.adam_family(2048, noop, named_lists(op, lists), scalars, gs, check_finite)
    return noop


def compare_adam(op, dtype, switch="decoupled_scale", chunk=2048, shapes=SHAPES, steps=STEPS):
    kw = SWITCHES[switch]
    h = _hyper(op, **kw)
    scale = kw.get("grad_scale")
    lists = make_lists(op, dtype, shapes, grad_scale=scale)
    got, want = clone(lists), clone(lists)
    for step in steps:
        c = rules.step_scalars(h, step)
        run_adam(op, got, c, chunk, scale)
        ref_adam(want, c, scale)
        assert_lists_equal(got, want, f"{op} {dtype} {switch} step {step}")
    changed = any(not same_bits(a, b) for a, b in zip(got[1], lists[1]) if a.numel())
    assert changed, "the params did not change: nothing was tested"


# ---------------------------------------------------------------------------------------------
# the cases

CASES: Dict[str, Callable[[], None]] = {}


def case(name: str):
    def register(fn):
        CASES[name] = fn
        return fn
    return register


for _op in ADAM_OPS:
    for _dt in list(DTYPES) + (list(EMA_DTYPES) if schema.OPS[_op].has_ema else []):
        case(f"adam-{_op}-{_dt}")(lambda op=_op, dt=_dt: compare_adam(op, dt))
    for _sw in SWITCHES:
        if _sw.startswith("no_bias") and schema.OPS[_op].rule == rules.RADAM:
            continue
        for _dt in ("fp32", "bf16_master"):
            case(f"switch-{_op}-{_sw}-{_dt}")(
                lambda op=_op, sw=_sw, dt=_dt: compare_adam(op, dt, sw, chunk=64, shapes=SMALL))

for _chunk in (1, 7, 1024, 65536):
    case(f"chunk-{_chunk}")(lambda c=_chunk: compare_adam(
        "fused_ema_adamw", "bf16_master", chunk=c,
        shapes=((3,), (0,), (20,), (4, 5)) if c < 16 else SHAPES))


@case("noop-set-changes-nothing")
def _noop_set():
    for op in ("fused_ema_adamw", "radam"):
        lists = make_lists(op, "bf16_master", SMALL)
        got = clone(lists)
        run_adam(op, got, rules.step_scalars(_hyper(op), 3), 64,
                 noop=torch.ones(1, dtype=torch.int32))
        assert_lists_equal(got, lists, f"{op} with the noop flag set")


@case("check-finite")
def _check_finite():
    for bad in (float("inf"), float("nan"), float("-inf")):
        for dtype in ("fp32", "bf16_master", "fp16_plain"):
            lists = make_lists("adam", dtype, SMALL)
            lists[0][3].view(-1)[5] = bad
            got = clone(lists)
            flag = run_adam("adam", got, rules.step_scalars(_hyper("adam"), 2), 64, 1024.0,
                            check_finite=True)
            assert int(flag.item()) == 1, f"{dtype} {bad}: noop flag not set"
            assert_lists_equal(got, lists, f"check_finite {dtype} {bad}")
    lists = make_lists("adam", "fp32", SMALL)  # finite grads: the step runs and equals the ref
    got, want = clone(lists), clone(lists)
    c = rules.step_scalars(_hyper("adam"), 2)
    assert int(run_adam("adam", got, c, 64, check_finite=True).item()) == 0
    ref_adam(want, c, check_finite=True)
    assert_lists_equal(got, want, "check_finite with finite grads")


def _ieee_case(name: str, dtype: str):
    from ieee_oracle import adam_update, as_numpy, bf16_round
    from test_numerics import CASES as NUMERIC_CASES, sqrt_disagreeing_inputs

    spec = NUMERIC_CASES[name]
    op = schema.OPS[spec["op"]]
    step = spec.get("step", 3)
    c = rules.step_scalars(rules.AdamHyper(**spec["hyper"]), step)
    n = 1000
    math_t = F64 if dtype == "fp64" else F32
    np_t = np.float64 if dtype == "fp64" else np.float32
    gen = torch.Generator().manual_seed(1)
    v = (sqrt_disagreeing_inputs(n, math_t).to(F64) / c.beta2).to(math_t)
    g = torch.randn(n, generator=gen, dtype=F64) * 1e-3
    g[: n // 2] = 0.0
    w = torch.randn(n, generator=gen, dtype=F64)
    m = torch.randn(n, generator=gen, dtype=F64) * 0.1
    s = w + torch.randn(n, generator=gen, dtype=F64) * 0.01
    master = dtype == "bf16_master"
    lists = [[g.to(BF16 if master else math_t)], [w.to(BF16) if master else w.to(math_t)],
             [m.to(math_t)], [v.clone()]]
    if op.has_ema:
        lists.append([s.to(math_t)])
    if master:
        lists.append([w.to(F32)])
    weights = lists[-1][0] if master else lists[1][0]
    expected = adam_update(c, as_numpy(lists[0][0], np_t), as_numpy(weights, np_t),
                           as_numpy(lists[2][0], np_t), as_numpy(lists[3][0], np_t),
                           as_numpy(lists[4][0], np_t) if op.has_ema else None, dtype=np_t)
    run_adam(op.name, lists, c, 2048)
    got = {"w": weights, "m": lists[2][0], "v": lists[3][0]}
    if op.has_ema:
        got["s"] = lists[4][0]
    for key, arr in zip(("w", "m", "v", "s"), expected):
        if key in got:
            diff = int((got[key].numpy().view(arr.dtype) != arr).sum())
            assert diff == 0, f"{name} {dtype}: {key} differs from the IEEE oracle in {diff} of {n}"
    if master:
        assert np.array_equal(lists[1][0].float().numpy().view(np.int32),
                              bf16_round(expected[0]).view(np.int32))


for _name in ("adamw", "adam_l2_maximize", "radam_ema"):
    for _dt in ("fp32", "fp64", "bf16_master"):
        case(f"ieee-oracle-{_name}-{_dt}")(lambda n=_name, d=_dt: _ieee_case(n, d))


def _layout_case(kind: str):
    """Dense permuted layouts run in place; other layouts run on staged dense copies."""
    gen = torch.Generator().manual_seed(3)
    views = []  # (base, view) of every sliced tensor, to check outside the views afterwards

    def make(dt):
        if kind == "channels_last":  # dense, permuted: in place (grads too)
            return torch.randn(2, 3, 4, 5, generator=gen).to(dt).to(
                memory_format=torch.channels_last)
        if kind == "transposed":  # dense, permuted state; contiguous grads: grads staged
            return torch.randn(7, 5, generator=gen).to(dt).t()
        base = torch.randn(6, 21, generator=gen).to(dt)  # not dense: staged, view written back
        views.append((base, base[:, 1::2]))
        return views[-1][1]

    lists = [[], [], [], [], [], []]
    for row in range(3):
        flat = row == 2
        p = torch.randn(40, generator=gen).to(BF16) if flat else make(BF16)
        g = torch.randn(p.shape, generator=gen).to(BF16)
        if kind == "channels_last" and not flat:
            g = g.to(memory_format=torch.channels_last)
        state = [torch.randn(p.shape, generator=gen) if flat else make(F32) for _ in range(4)]
        state[1].abs_()
        state[3].copy_(p.float())  # the master
        for li, t in enumerate([g, p] + state):
            lists[li].append(t)
    outside = [(b, b[:, ::2].clone()) for b, _ in views]
    want = clone(lists)
    c = rules.step_scalars(_hyper("fused_ema_adamw"), 2)
    run_adam("fused_ema_adamw", lists, c, 16, 256.0)
    ref_adam(want, c, 256.0)
    assert_lists_equal(lists, want, f"layout {kind}")
    for base, before in outside:
        assert same_bits(base[:, ::2], before), "elements outside a sliced view changed"


for _kind in ("channels_last", "transposed", "sliced"):
    case(f"layout-{_kind}")(lambda k=_kind: _layout_case(k))


def _offset_view(t: torch.Tensor, offset: int) -> torch.Tensor:
    """``t``'s values in a view at element ``offset`` of a larger buffer (a grad in a flat
    DDP/FSDP buffer)."""
    buf = torch.zeros(t.numel() + offset, dtype=t.dtype)
    buf[offset:] = t.reshape(-1)
    return buf[offset:].view(t.shape)


def _chunk_alignment_case(dtype: str, row: int, moved: str):
    """One tensor of list ``moved`` (grads or exp_avgs) is a view at element offset 1 of a
    larger buffer (16-byte misaligned) in a bucket whose other tensors are aligned, and one
    grad a view at an offset of 16 bytes (aligned): the launch decides per chunk, the chunks of
    the aligned tensors take the 128-bit path (the misalignment the kernel reads is 0 for
    them), the misaligned tensor's chunks do not (its list's bit), and every step (with the
    non-finite scan) gives the reference's bits. A vector path taken by a misaligned chunk
    would read re-derived (rounded-down) offsets, so the bitwise comparison also checks the
    branch taken. Rebound to aligned grads, a grads-only misalignment leaves the bucket fully
    aligned (no branch)."""
    from multi_tensor.backends.triton.kernels import ALIGN_ALL, ALIGN_CHUNK
    k = _k()
    op = "fused_ema_adamw"
    h = _hyper(op)
    lists = make_lists(op, dtype, SHAPES)
    li = {"grads": 0, "exp_avgs": 2}[moved]
    lists[li][row] = _offset_view(lists[li][row], 1)
    other = 3 if row != 3 else 5
    lists[0][other] = _offset_view(lists[0][other], 16 // lists[0][other].element_size())
    want = clone(lists)
    bucket = k.AdamBucket(op, named_lists(op, lists).state(), 2048)
    zero = torch.zeros(1, dtype=torch.int32)
    chunk_rows = bucket._rows
    for step in (1, 2):
        assert bucket.bind(lists[0])
        assert bucket.align_mode() == ALIGN_CHUNK, bucket.align_mode()
        mis = bucket.chunk_misalignment()
        want_mis = np.where(chunk_rows == row, 1 << li, 0)
        assert mis.tolist() == want_mis.tolist(), (mis.tolist(), want_mis.tolist())
        assert (mis == 0).sum() >= 3 and (mis != 0).sum() >= 1, "nothing was tested"
        c = rules.step_scalars(h, step)
        bucket.run(zero, c, None, True)
        ref_adam(want, c, None, True)
        assert int(zero.item()) == 0
        assert_lists_equal(lists, want, f"{dtype} misaligned {moved}[{row}] step {step}")
    grads = [g.clone() for g in lists[0]]  # fresh allocations: all aligned
    assert bucket.bind(grads)
    assert bucket.align_mode() == (ALIGN_ALL if moved == "grads" else ALIGN_CHUNK)
    assert bool(np.all(bucket.chunk_misalignment() == (0 if moved == "grads" else
                                                      np.where(chunk_rows == row, 1 << li, 0))))
    c = rules.step_scalars(h, 3)
    bucket.run(zero, c, None, True)
    ref_adam([grads] + want[1:], c, None, True)
    assert_lists_equal(lists[1:], want[1:], f"{dtype} misaligned {moved}[{row}] rebound")
    # a non-finite value in the misaligned grad is found by the per-chunk scan
    if moved == "grads":
        bad = list(lists[0])
        bad[row].view(-1)[-1] = float("inf")  # in place: the misaligned view itself
        assert bucket.bind(bad)
        before = clone(lists)
        bucket.run(zero, rules.step_scalars(h, 4), None, True)
        assert int(zero.item()) == 1, "the non-finite grad was not found"
        assert_lists_equal(lists[1:], before[1:], "a non-finite step changed the state")


# (3000,): two chunks of 2048 (a whole-block loop and a tail each side), (1,): the first row
for _dt in ("fp32", "bf16_master", "fp32_gbf16", "fp16_plain_ema_bf16", "fp64"):
    for _row in (5, 0):
        case(f"chunk-alignment-grad{_row}-{_dt}")(
            lambda d=_dt, r=_row: _chunk_alignment_case(d, r, "grads"))
    case(f"chunk-alignment-exp_avg5-{_dt}")(
        lambda d=_dt: _chunk_alignment_case(d, 5, "exp_avgs"))


@case("bucket-rebind-and-refuse")
def _bucket_rebind():
    k = _k()
    op = "fused_ema_adamw"
    lists = make_lists(op, "bf16_master", SHAPES)
    want = clone(lists)
    bucket = k.AdamBucket(op, named_lists(op, lists).state(), 2048)
    h = _hyper(op)
    noop = torch.zeros(1, dtype=torch.int32)
    for step in (1, 2, 3):
        grads = [g.clone() for g in lists[0]]  # new tensors, new addresses every step
        if step == 3:
            grads = [g.float() for g in grads]  # the grads' dtype may change (fp32 now)
        assert bucket.bind(grads)
        assert bucket.bind(grads)  # the cheap path: same objects, same addresses
        c = rules.step_scalars(h, step)
        bucket.run(noop, c)
        ref_adam([grads] + want[1:], c)
    assert_lists_equal(lists[1:], want[1:], "prepared bucket across rebinds")
    n = len(SHAPES)
    assert not bucket.bind(lists[0][:-1]), "a shorter grad list bound"
    assert not bucket.bind([g.to(F64) for g in lists[0]]), "fp64 grads bound to a bf16 bucket"
    assert not bucket.bind([None] + lists[0][1:]), "a None grad bound"
    bad = list(lists[0])
    bad[1] = torch.zeros(16, dtype=BF16)
    assert not bucket.bind(bad), "a grad of another shape bound"
    assert len(bad) == n
    for what, odd in (("dtype", lambda g: g.to(F16)), ("layout", lambda g: g.to_sparse()),
                      ("device", lambda g: torch.empty(g.shape, dtype=g.dtype, device="meta")),
                      ("None", lambda g: None)):
        bad = list(lists[0])
        bad[3] = odd(bad[3])  # one grad in the middle
        assert not bucket.bind(bad), f"a grad of another {what} bound"


@case("device-step-scalars")
def _device_scalars():
    """The device's scalars equal rules.step_scalars rounded once, bit for bit, at every step."""
    k = _k()
    hypers = [_hyper("adam"), _hyper("adam", bias_correction=False),
              _hyper("adam", decoupled=False, maximize=True), _hyper("adam", weight_decay=0.0),
              _hyper("radam"), _hyper("radam", decoupled=False),
              rules.AdamHyper(lr=0.3, beta1=0.5, beta2=0.98, eps=1e-6, weight_decay=0.1,
                              rule=rules.RADAM, ema_decay=0.99),
              # beta2 near 1: rho_t from rules.sma_sums, where rho_5 = 4.9999996 is not rectified
              rules.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.9999999, eps=1e-8, rule=rules.RADAM)]
    steps = list(range(1, 8)) + [12, 1000, 65537, 999_983, 16_000_000]
    for dtype, p in ((F32, F32), (F64, F64)):
        lists = make_lists("adam", "fp32" if dtype == F32 else "fp64", ((4,),))
        bucket = k.AdamBucket("adam", named_lists("adam", lists).state(), 64)
        for h in hypers:
            for lr_tensor in ((False, True) if h.rule == rules.RADAM or h.lr == 0.01 else (False,)):
                lr = torch.tensor(h.lr, dtype=F32) if lr_tensor else None
                hh = h if lr is None else rules.AdamHyper(**{**h.__dict__, "lr": float(lr)})
                for s in steps:
                    step = torch.tensor(float(s - 1), dtype=F32)
                    assert bucket.bind([g.clone() for g in lists[0]])
                    bucket.run_device_step(step, hh, torch.zeros(1, dtype=torch.int32), None, lr)
                    assert float(step) == float(s)
                    want = rules.pack(rules.step_scalars(hh, s), dtype)
                    got = bucket._scal
                    if not same_bits(got, want):
                        bad = (bits(got) != bits(want)).nonzero().flatten().tolist()
                        raise AssertionError(f"{h} lr_tensor={lr_tensor} step {s} {dtype}: "
                                             f"scalar slots {bad} differ: {got} vs {want}")


@case("scalar-offsets")
def _scalar_offsets():
    """Each StepScalars field read at its own offset (tests/test_scalar_layout.py's sets)."""
    import test_scalar_layout
    test_scalar_layout.check_backend(lambda op, lists, c: run_adam(op, lists, c, 64), "triton")


@case("device-step-results")
def _device_results():
    """run_device_step == run with the host's scalars; a set noop keeps the step and the data."""
    k = _k()
    for op, dtype in (("fused_ema_adamw", "bf16_master"), ("radam_ema", "fp32"),
                      ("adam", "fp64")):
        h = _hyper(op)
        lists = make_lists(op, dtype, SMALL)
        a, b = clone(lists), clone(lists)
        ba = k.AdamBucket(op, named_lists(op, a).state(), 64)
        bb = k.AdamBucket(op, named_lists(op, b).state(), 64)
        step = torch.tensor(0.0)
        zero = torch.zeros(1, dtype=torch.int32)
        for s in range(1, 8):
            assert ba.bind(a[0]) and bb.bind(b[0])
            ba.run(zero, rules.step_scalars(h, s), torch.tensor([8.0]))
            bb.run_device_step(step, h, zero, torch.tensor([8.0]))
            assert_lists_equal(b, a, f"{op} {dtype} device step {s}")
        before = clone(b)
        assert bb.bind(b[0])
        bb.run_device_step(step, h, torch.ones(1, dtype=F32))  # found_inf set: a skipped step
        assert float(step) == 7.0, "the device step advanced on a skipped step"
        assert_lists_equal(b, before, f"{op} {dtype} skipped device step")


for _s in (F32, F16, BF16, F64):
    for _d in (F32, F16, BF16, F64):
        @case(f"scale-{str(_s)[6:]}-{str(_d)[6:]}")
        def _scale(sdt=_s, ddt=_d):
            from multi_tensor.backends import triton as triton_gpu
            gen = torch.Generator().manual_seed(5)
            shapes = ((0,), (5,), (3000,), (4, 7))
            srcs = [(torch.randn(s, generator=gen, dtype=F64) * 1e3).to(sdt) for s in shapes]
            for factor in (1.0 / 3.0, 65504.5, 1e-30):
                got = [torch.full(s, 7.0, dtype=ddt) for s in shapes]
                want = [t.clone() for t in got]
                fg, fw = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
                triton_gpu.scale(1024, fg, [srcs, got], factor)
                reference.scale(1024, fw, [srcs, want], factor)
                assert_lists_equal([got], [want], f"scale {sdt}->{ddt} by {factor}")
                assert int(fg.item()) == int(fw.item()) == 0
            bad = [t.clone() for t in srcs]
            bad[2][17] = float("nan")
            fg = torch.zeros(1, dtype=torch.int32)
            out = [torch.zeros(s, dtype=ddt) for s in shapes]
            triton_gpu.scale(1024, fg, [bad, out], 2.0)
            assert int(fg.item()) == 1, "a NaN source did not set the noop flag"


for _dt in (F32, F16, BF16, F64):
    @case(f"l2norm-{str(_dt)[6:]}")
    def _l2norm(dt=_dt):
        from multi_tensor.backends import triton as triton_gpu
        gen = torch.Generator().manual_seed(6)
        shapes = ((0,), (5,), (9000,), (4, 7), (1,))
        ts = [torch.randn(s, generator=gen, dtype=F64).to(dt) for s in shapes]
        outs = []
        for chunk in (1, 64, 65536):
            flag = torch.zeros(1, dtype=torch.int32)
            outs.append(triton_gpu.l2norm(chunk, flag, [ts], True))
            assert int(flag.item()) == 0
        for total, per in outs[1:]:
            assert same_bits(total, outs[0][0]) and same_bits(per, outs[0][1]), \
                "l2norm depends on chunk_size"
        rt, rp = reference.l2norm(64, torch.zeros(1, dtype=torch.int32), [ts], True)
        total, per = outs[0]
        assert total.dtype == F32 and total.shape == () and per.shape == (len(ts),)
        torch.testing.assert_close(total, rt, rtol=1e-6, atol=0)
        torch.testing.assert_close(per, rp, rtol=1e-6, atol=0)
        total2, per2 = triton_gpu.l2norm(64, torch.zeros(1, dtype=torch.int32), [ts], False)
        assert same_bits(total2, total) and per2.numel() == 0
        bad = [t.clone() for t in ts]
        bad[2][100] = float("inf")
        flag = torch.zeros(1, dtype=torch.int32)
        triton_gpu.l2norm(64, flag, [bad], False)
        assert int(flag.item()) == 1, "an inf input did not set the noop flag"


@case("l2norm-empty-and-mixed")
def _l2norm_mixed():
    from multi_tensor.backends import triton as triton_gpu
    total, per = triton_gpu.l2norm(64, torch.zeros(1, dtype=torch.int32), [[]], True)
    assert float(total) == 0.0 and per.numel() == 0
    ts = [torch.full((10,), 3.0), torch.full((10,), 4.0, dtype=BF16),
          torch.randn(8, 6).t(), torch.randn(6, 8)[:, ::2]]
    total, per = triton_gpu.l2norm(64, torch.zeros(1, dtype=torch.int32), [ts], True)
    rt, rp = reference.l2norm(64, torch.zeros(1, dtype=torch.int32), [ts], True)
    torch.testing.assert_close(total, rt, rtol=1e-6, atol=0)
    torch.testing.assert_close(per, rp, rtol=1e-6, atol=0)


def _cpu_clone_backend():
    """The triton backend, registered for CPU tensors (interpreter) under another name."""
    from multi_tensor.backends import triton as triton_gpu
    return registry.register_backend(registry.Backend(
        name="triton_interp", device_types=("cpu",), priority=1000,
        ops={"scale": triton_gpu.scale, "l2norm": triton_gpu.l2norm},
        prepare=triton_gpu.prepare, adam_ops=schema.ADAM_OPS,
        description="the triton backend on CPU tensors (interpreter)"))


@case("apex-five-lists-same-on-every-backend")
def _apex_five_lists():
    """The apex calls of tests/test_apex_lists.py on the triton buckets: the declared error (in
    the reference's words) for an EMA op without a decay, the numpy oracle's bits otherwise (a
    refusal of a valid call fails)."""
    import apex_lists_cases
    _cpu_clone_backend()
    for run in apex_lists_cases.CALLS:
        got = apex_lists_cases.outcome(run, "triton_interp")
        apex_lists_cases.assert_expected(got, run, f"{run.__name__}: triton_interp")
        if run in apex_lists_cases.REFUSED:
            assert got == apex_lists_cases.outcome(run, "reference"), (run.__name__, got)


def _optimizer_case(cls_name: str, dtype: str, scheduled: bool = False, capturable: bool = False):
    """A fused optimizer on the triton buckets (device steps) == on the reference, bitwise.

    ``capturable``: on the triton buckets the optimizer is capturable with ``lr`` a tensor that
    is changed in place before the third step (read by the kernel, no host value); the
    reference runs the same steps with float lrs."""
    import fused_optim
    _cpu_clone_backend()
    p_dt = {"fp32": F32, "bf16": BF16, "fp16": F16, "fp64": F64}[dtype]

    def build(backend):
        gen = torch.Generator().manual_seed(11)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(p_dt))
                  for s in ((5, 7), (13,), (1,), (2000,))]
        cls = getattr(fused_optim, cls_name)
        kw = dict(lr=1e-2, weight_decay=0.05)
        if cls_name == "FusedEmaAdamW":
            kw.update(ema_decay=0.9)
            if scheduled:
                kw.update(ema_schedule="warmup")
        if capturable and backend == "triton_interp":
            kw.update(capturable=True, lr=torch.tensor(1e-2))
        opt = cls(params, **kw)
        return params, opt

    results = []
    for backend in ("triton_interp", "reference"):
        with multi_tensor.backends.forced_backend(backend):
            params, opt = build(backend)
            gen = torch.Generator().manual_seed(12)
            for step in range(4):
                if capturable and step == 2:
                    lr = opt.param_groups[0]["lr"]
                    if isinstance(lr, torch.Tensor):
                        lr.fill_(3e-3)
                    else:
                        opt.param_groups[0]["lr"] = 3e-3
                for p in params:
                    p.grad = (torch.randn(p.shape, generator=gen) * 64.0).to(p_dt)
                opt.grad_scale = torch.tensor(64.0)  # 0-dim, as GradScaler sets them
                opt.found_inf = torch.tensor(1.0 if step == 2 else 0.0)  # step 3 is skipped
                opt.step()
            kinds = {type(b.prepared).__name__ for plan in opt._plans.values()
                     for b in plan.buckets}
            results.append((params, opt, kinds))
    (pa, oa, ka), (pb, ob, kb) = results
    assert ka == {"AdamBucket"}, f"the optimizer did not use the triton buckets: {ka}"
    for x, y in zip(pa, pb):
        assert same_bits(x.detach(), y.detach()), f"{cls_name} {dtype}: params differ"
        sa, sb = oa.state[x], ob.state[y]
        assert set(sa) == set(sb)
        for key in sa:
            assert same_bits(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), \
                f"{cls_name} {dtype}: state {key} differs"
        assert float(sa["step"]) == 3.0, "a skipped step advanced the step"


for _cls in ("FusedEmaAdamW", "FusedAdamW", "FusedRAdam"):
    for _dt in ("fp32", "bf16"):
        case(f"optimizer-{_cls}-{_dt}")(lambda c=_cls, d=_dt: _optimizer_case(c, d))
case("optimizer-FusedEmaAdamW-warmup-schedule-host-steps")(
    lambda: _optimizer_case("FusedEmaAdamW", "fp32", scheduled=True))
for _cls in ("FusedEmaAdamW", "FusedAdamW", "FusedAdam"):
    case(f"optimizer-{_cls}-capturable-tensor-lr")(
        lambda c=_cls: _optimizer_case(c, "bf16", capturable=True))


@case("bind-refuses-moved-param-or-state")
def _bind_moved():
    """``p.data = new`` or ``state.data = new`` (same shape, new storage): bind refuses at
    once, with the same grads or new ones (as after ``zero_grad(set_to_none=True)``); a new
    bucket then runs on the new storage, and the storage the tensor left is not written."""
    k = _k()
    op = "fused_ema_adamw"
    h = _hyper(op)
    for li, what in ((1, "param"), (2, "exp_avg"), (4, "ema"), (5, "master")):
        lists = make_lists(op, "bf16_master", SMALL)
        want = clone(lists)
        bucket = k.AdamBucket(op, named_lists(op, lists).state(), 64)
        zero = torch.zeros(1, dtype=torch.int32)
        assert bucket.bind(lists[0])
        bucket.run(zero, rules.step_scalars(h, 1))
        ref_adam(want, rules.step_scalars(h, 1))
        moved = lists[li][1]
        left = moved.data  # the storage the tensor leaves
        left_bits = bits(left).clone()
        moved.data = moved.data.clone()  # the same object, new storage
        assert not bucket.bind(lists[0]), f"bound after the {what}'s storage moved"
        lists[0] = [g.clone() for g in lists[0]]
        want[0] = [g.clone() for g in want[0]]
        assert not bucket.bind(lists[0]), f"bound afresh after the {what}'s storage moved"
        bucket = k.AdamBucket(op, named_lists(op, lists).state(), 64)
        assert bucket.bind(lists[0])
        bucket.run(zero, rules.step_scalars(h, 2))
        ref_adam(want, rules.step_scalars(h, 2))
        assert_lists_equal(lists, want, f"after the {what} moved")
        assert same_bits(bits(left), left_bits), f"the storage the {what} left was written"
        assert not same_bits(moved, left), "nothing was tested: the step changed nothing"


@case("optimizer-moved-param-replans")
def _optimizer_moved():
    """An optimizer on the triton buckets: after ``p.data = p.data.clone()`` the step updates the
    new storage (a new plan), bit for bit as the reference does."""
    import fused_optim
    _cpu_clone_backend()
    results = []
    for backend in ("triton_interp", "reference"):
        with multi_tensor.backends.forced_backend(backend):
            gen = torch.Generator().manual_seed(3)
            params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((5,), (40,))]
            opt = fused_optim.FusedEmaAdamW(params, lr=1e-2, ema_decay=0.9)
            left = []
            for step in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                if step == 1:
                    left.append(params[1].data)
                    params[1].data = params[1].data.clone()
                opt.step()
            results.append((params, opt, left[0]))
    (pa, oa, la), (pb, ob, lb) = results
    for x, y in zip(pa, pb):
        assert same_bits(x.detach(), y.detach()), "params differ after a param moved"
        for key in oa.state[x]:
            assert same_bits(torch.as_tensor(oa.state[x][key]), torch.as_tensor(ob.state[y][key]))
    assert same_bits(la, lb), "the storage the param left was written"


@case("capture-then-rebind-gets-a-fresh-table")
def _capture_rebind():
    """A bucket marked captured (as a launch under CUDA graph capture marks it) gets a fresh
    pointer table and scalar buffers on a re-bind to grads at new addresses; the captured ones
    keep their contents (a replay reads them). Without a capture the table is rewritten in
    place. Results stay bitwise those of the reference."""
    k = _k()
    op = "fused_ema_adamw"
    h = _hyper(op)
    lists = make_lists(op, "bf16_master", SHAPES)
    want = clone(lists)
    bucket = k.AdamBucket(op, named_lists(op, lists).state(), 2048)
    zero = torch.zeros(1, dtype=torch.int32)
    step = torch.tensor(0.0, dtype=F64)
    grads = [g.clone() for g in lists[0]]
    s = 0
    for captured in (False, True, False, True):
        table, scal, hyp = bucket._table, bucket._scal, bucket._hyp
        saved = table.clone()
        grads = [g.clone() for g in grads]  # new addresses
        assert bucket.bind(grads)
        if captured:
            assert bucket._table is not table and bucket._scal is not scal \
                and bucket._hyp is not hyp, "a captured bucket's buffers were reused on re-bind"
            assert same_bits(table, saved), "the captured table was rewritten"
            assert any(t is table for t in bucket._retired), "the captured table was let go"
            assert not same_bits(bucket._table[0], saved[0]), "the fresh table kept old offsets"
        else:
            assert bucket._table is table, "a table not captured was replaced"
        s += 1
        bucket.run_device_step(step, h, zero)
        ref_adam([grads] + want[1:], rules.step_scalars(h, s))
        assert_lists_equal(lists[1:], want[1:], f"step {s} after a re-bind (captured={captured})")
        if not captured:
            bucket.mark_captured()  # the next re-bind follows a capture
    # the host-scalar path after a capture uses fresh scalars too
    bucket.mark_captured()
    scal = bucket._scal
    assert bucket.bind(grads)
    s += 1
    bucket.run(zero, rules.step_scalars(h, s))
    ref_adam([grads] + want[1:], rules.step_scalars(h, s))
    assert bucket._scal is not scal
    assert_lists_equal(lists[1:], want[1:], "host-scalar step after a capture")


@case("device-step-float64-past-2^24")
def _device_step_f64():
    """A float64 device step counts exactly past 2**24 (float32 does not): the scalars at those
    steps equal rules.step_scalars bit for bit."""
    k = _k()
    h = rules.AdamHyper(lr=1e-3, beta1=0.9, beta2=1 - 1e-9, eps=1e-8, weight_decay=0.1)
    lists = make_lists("adam", "fp32", ((4,),))
    bucket = k.AdamBucket("adam", named_lists("adam", lists).state(), 64)
    for s in (2**24 + 1, 2**24 + 3, 2**25 + 7, 2**31 - 1, 2**31 + 5, 2**32 - 1):
        step = torch.tensor(float(s - 1), dtype=F64)
        assert bucket.bind([g.clone() for g in lists[0]])
        bucket.run_device_step(step, h, torch.zeros(1, dtype=torch.int32))
        assert float(step) == float(s)
        assert same_bits(bucket._scal, rules.pack(rules.step_scalars(h, s), F32)), f"step {s}"


@case("optimizer-step-exact-past-2^24")
def _optimizer_big_step():
    """An optimizer whose steps pass 2**24 (loaded at 2**24 - 1), with a re-plan on the way
    (a param without a grad for a step): the same bits as the reference's host steps, and
    ``state["step"]`` a float32 scalar tensor as torch's."""
    import fused_optim
    _cpu_clone_backend()
    results = []
    for backend in ("triton_interp", "reference"):
        with multi_tensor.backends.forced_backend(backend):
            gen = torch.Generator().manual_seed(4)
            params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((6,), (30,))]
            opt = fused_optim.FusedAdamW(params, lr=1e-2, betas=(0.9, 1 - 1e-9))
            for p in params:
                p.grad = torch.zeros_like(p)
            opt.init_state()
            sd = opt.state_dict()
            for entry in sd["state"].values():
                entry["step"] = torch.tensor(float(2**24 - 1))
            opt.load_state_dict(sd)
            for step in range(6):
                for i, p in enumerate(params):
                    p.grad = None if (step == 3 and i == 0) else torch.randn(p.shape, generator=gen)
                opt.step()
            results.append((params, opt))
    (pa, oa), (pb, ob) = results
    for x, y in zip(pa, pb):
        assert same_bits(x.detach(), y.detach()), "params differ past 2**24 steps"
        st = oa.state[x]["step"]
        assert st.dtype == F32 and st.shape == (), st
        assert float(st) == float(ob.state[y]["step"])
    counts = sorted(b.exact_step() for plan in oa._plans.values() for b in plan.buckets)
    assert counts == [2**24 - 1 + 5, 2**24 - 1 + 6], counts  # params[0] missed a step


class _HostSteps:
    """A triton bucket that keeps its steps on the host (``device_steps`` False): the clipped
    step then reads the norm's finiteness on the host."""

    device_steps = False

    def __init__(self, bucket):
        self._bucket = bucket

    def __getattr__(self, name):
        if name == "run_device_step":
            raise AttributeError(name)
        return getattr(self._bucket, name)


def _host_steps_backend():
    from multi_tensor.backends import triton as triton_gpu
    return registry.register_backend(registry.Backend(
        name="triton_interp_host_steps", device_types=("cpu",), priority=999,
        ops={"scale": triton_gpu.scale, "l2norm": triton_gpu.l2norm},
        prepare=lambda *a, **k: _HostSteps(triton_gpu.prepare(*a, **k)),
        adam_ops=schema.ADAM_OPS,
        description="the triton backend on CPU tensors, steps on the host (interpreter)"))


def _clip_case(cls_name: str):
    """max_grad_norm on the triton buckets, with and without capturable=True: the skip decided
    on the device (no host read in a steady-state step), the same bits as the host-read path of
    the same kernels (buckets that keep their steps on the host), a step with a non-finite grad
    skipped by all."""
    _cpu_clone_backend()
    _host_steps_backend()
    try:
        results = _clip_runs(cls_name)
    finally:
        registry.unregister_backend("triton_interp_host_steps")
    (pb, ob, nb) = results[-1]  # the host-read path
    for pa, oa, na in results[:-1]:
        for x, y in zip(pa, pb):
            assert same_bits(x.detach(), y.detach()), f"{cls_name}: params differ"
            for key in oa.state[x]:
                assert same_bits(torch.as_tensor(oa.state[x][key]).to(F32),
                                 torch.as_tensor(ob.state[y][key]).to(F32)), f"{cls_name}: {key}"
            assert float(oa.state[x]["step"]) == 3.0, "a skipped step advanced the step"
        for a, b in zip(na[:2], nb[:2]):
            assert same_bits(a, b)


def _clip_runs(cls_name: str) -> list:
    import fused_optim
    results = []
    for backend, capturable in (("triton_interp", True), ("triton_interp", False),
                                ("triton_interp_host_steps", False)):
        with multi_tensor.backends.forced_backend(backend):
            gen = torch.Generator().manual_seed(9)
            params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(BF16))
                      for s in ((5, 7), (13,), (1,), (5000,))]
            lr = torch.tensor(1e-2)  # a float32 lr: the host path gets its value
            kw = dict(lr=lr if capturable else float(lr), weight_decay=0.05,
                      max_grad_norm=0.5, capturable=capturable)
            if cls_name == "FusedEmaAdamW":
                kw.update(ema_decay=0.9)
            opt = getattr(fused_optim, cls_name)(params, **kw)
            if backend == "triton_interp":
                # the clip (norm, factor, skip) with no host read; CPU tensor options are read
                # on the host by design (a device lr would not be), so only the clip is guarded
                unscale = opt._unscale_factor

                def guarded(*a, unscale=unscale):
                    with _no_host_reads():
                        return unscale(*a)
                opt._unscale_factor = guarded
            norms = []
            for step in range(5):
                for p in params:
                    p.grad = (torch.randn(p.shape, generator=gen) * 64.0).to(BF16)
                if step == 2:
                    params[3].grad[7] = float("inf")
                opt.grad_scale = torch.tensor(64.0)
                # (a CPU found_inf is read on the host by design: a device one would not be)
                opt.found_inf = torch.tensor(1.0) if step == 4 else None
                opt.step()
                norms.append(torch.as_tensor(opt.last_grad_norm).clone())
            kinds = {type(b.prepared).__name__ for plan in opt._plans.values()
                     for b in plan.buckets}
            assert kinds == {"AdamBucket" if backend == "triton_interp" else "_HostSteps"}, kinds
            results.append((params, opt, norms))
    return results


class _no_host_reads:
    """Refuses reading a tensor's value on the host (item, bool, float, int, tolist)."""

    NAMES = ("item", "__bool__", "__float__", "__int__", "tolist")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def refuse(name):
            def f(self, *a, **k):
                raise AssertionError(f"a host read (Tensor.{name}) in a capturable step")
            return f
        for n in self.NAMES:
            setattr(torch.Tensor, n, refuse(n))
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)
        return False


for _cls in ("FusedEmaAdamW", "FusedAdamW"):
    case(f"optimizer-{_cls}-clipping-on-device")(lambda c=_cls: _clip_case(c))


@case("op-path-checks-once-per-bucket")
def _op_path_checks():
    """The apex op on the same tensors each call: checked when its bucket is made, not again
    while they are unchanged; a moved grad or state tensor is checked again (and refused when
    bad), and every call gives the reference's bits."""
    from multi_tensor import ops, plan
    _cpu_clone_backend()
    calls = []
    orig = schema.check_adam_lists

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)
    lists = make_lists("fused_ema_adamw", "fp32", SMALL)
    want = clone(lists)
    noop = torch.zeros(1, dtype=torch.int32)
    args = (1e-3, 0.99, 0.9, 0.999, 1e-8)
    checked = []
    schema.check_adam_lists = counting
    try:
        with multi_tensor.backends.forced_backend("triton_interp"):
            plan.clear_cache()
            for step in range(1, 6):
                if step == 3:
                    lists[2][1].data = lists[2][1].data.clone()  # an exp_avg moves
                if step == 4:
                    lists[0] = [g.clone() for g in lists[0]]  # new grads
                before = len(calls)
                ops.multi_tensor_fused_ema_adamw(64, noop, lists, *args, step, 1, True, 0.01)
                checked.append(len(calls) - before)
                with multi_tensor.backends.forced_backend("reference"):
                    ops.multi_tensor_fused_ema_adamw(64, noop, want, *args, step, 1, True, 0.01)
                assert_lists_equal(lists, want, f"op path call {step}")
            assert checked == [1, 0, 1, 1, 0], f"the calls that checked their lists: {checked}"
            bad = [list(ts) for ts in lists]
            bad[0][2] = bad[0][2].to(F64)
            try:
                ops.multi_tensor_fused_ema_adamw(64, noop, bad, *args, 6, 1, True, 0.01)
            except (TypeError, ValueError):
                pass
            else:
                raise AssertionError("an fp64 grad in an fp32 bucket was not refused")
    finally:
        schema.check_adam_lists = orig
        plan.clear_cache()


@case("optimizer-steady-state-bind-sees-every-change")
def _steady_state_changes():
    """The eager step's steady state (the same grad objects, written in place) on the triton
    buckets: a grad re-pointed in place (``g.data = new``), a param re-pointed (``p.data =
    new``), a grad replaced and the state replaced by ``load_state_dict`` are each seen at the
    next step (a new grads' row, or a new plan), and every step gives the reference's bits."""
    import fused_optim
    _cpu_clone_backend()
    results = []
    for backend in ("triton_interp", "reference"):
        with multi_tensor.backends.forced_backend(backend):
            gen = torch.Generator().manual_seed(5)
            params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((5,), (40,), (7,))]
            opt = fused_optim.FusedEmaAdamW(params, lr=1e-2, ema_decay=0.9)
            for p in params:
                p.grad = torch.zeros(p.shape)
            seen = []
            for step in range(6):
                for p in params:
                    p.grad.copy_(torch.randn(p.shape, generator=gen))  # in place: same objects
                if step == 2:
                    params[1].grad.data = params[1].grad.data.clone()
                if step == 3:
                    params[0].data = params[0].data.clone()
                if step == 4:
                    params[2].grad = params[2].grad.clone()
                if step == 5:
                    opt.load_state_dict(opt.state_dict())
                opt.step()
                bucket = next(iter(opt._plans.values())).buckets[0].prepared
                seen.append(bucket)
            results.append((params, opt, seen))
    (pa, oa, seen), (pb, ob, _) = results
    assert {type(b).__name__ for b in seen} == {"AdamBucket"}, seen
    new_plan = [a is not b for a, b in zip(seen, seen[1:])]
    # steps 1, 2 (a grad re-pointed: the same bucket, its grads' row rewritten), 4 (a grad
    # replaced): the same bucket; 3 (a param re-pointed), 5 (the state loaded): a new plan
    assert new_plan == [False, False, True, False, True], new_plan
    assert tensor_facts.as_array(seen[2]._g_addr)[1] == pa[1].grad.data_ptr(), \
        "the re-pointed grad was not rebound"
    for x, y in zip(pa, pb):
        assert same_bits(x.detach(), y.detach()), "params differ from the reference"
        for key in oa.state[x]:
            assert same_bits(torch.as_tensor(oa.state[x][key]),
                             torch.as_tensor(ob.state[y][key])), f"state {key} differs"


@contextlib.contextmanager
def _python_facts():
    """The binds' tensor facts from the pure-Python twins (a build without the extension)."""
    native, tensor_facts._NATIVE = tensor_facts._NATIVE, None
    try:
        yield
    finally:
        tensor_facts._NATIVE = native


@case("optimizer-steady-state-bind-python-facts")
def _steady_state_changes_python_facts():
    """The same changes seen with the tensor facts from Python."""
    with _python_facts():
        _steady_state_changes()


def _new_grads_every_step():
    """``zero_grad(set_to_none=True)`` before every step (torch's default): each step's grads
    are new tensors, bound through ``_bind_slow``; one grad a transposed view (a staged copy),
    one of the wrong dtype or shape refused before anything changes; the reference's bits."""
    import fused_optim
    _cpu_clone_backend()
    results = []
    shapes = ((5,), (40, 3), (7,))
    for backend in ("triton_interp", "reference"):
        with multi_tensor.backends.forced_backend(backend):
            gen = torch.Generator().manual_seed(6)
            params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
            opt = fused_optim.FusedEmaAdamW(params, lr=1e-2, ema_decay=0.9)
            seen = []
            for step in range(5):
                opt.zero_grad(set_to_none=True)
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                if step == 2:
                    params[1].grad = torch.randn(3, 40, generator=gen).t()
                opt.step()
                seen.append(next(iter(opt._plans.values())).buckets[0].prepared)
            for bad in (torch.randn(7, dtype=torch.float64), torch.randn(8)):
                params[2].grad.data = bad  # (torch refuses such a .grad)
                before = [p.detach().clone() for p in params]
                try:
                    opt.step()
                except (RuntimeError, ValueError, TypeError):
                    pass
                else:
                    raise AssertionError(f"a grad of {bad.dtype} {tuple(bad.shape)} was taken")
                assert all(same_bits(a, p.detach()) for a, p in zip(before, params))
            results.append((params, opt, seen))
    (pa, oa, seen), (pb, ob, _) = results
    assert {type(b).__name__ for b in seen} == {"AdamBucket"}, seen
    assert all(b is seen[0] for b in seen), "new grads made a new plan"
    for x, y in zip(pa, pb):
        assert same_bits(x.detach(), y.detach()), "params differ from the reference"
        for key in oa.state[x]:
            assert same_bits(torch.as_tensor(oa.state[x][key]),
                             torch.as_tensor(ob.state[y][key])), f"state {key} differs"


@case("optimizer-new-grads-every-step")
def _new_grads_native():
    _new_grads_every_step()


@case("optimizer-new-grads-every-step-python-facts")
def _new_grads_python():
    with _python_facts():
        _new_grads_every_step()


@case("bind-refuses-grads-without-data")
def _bind_refuses_storageless():
    """Grads without data (FakeTensor; DTensor's wrapper reports address 0 alike) never bind a
    triton bucket: the op path sends them to the backend that runs them (the reference)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    k = _k()
    op = "fused_ema_adamw"
    lists = make_lists(op, "fp32", SMALL)
    bucket = k.AdamBucket(op, named_lists(op, lists).state(), 64)
    assert bucket.bind(lists[0])
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = [torch.empty(g.shape) for g in lists[0]]
    assert not bucket.bind(fake), "grads without data were bound"


@case("op-path-sees-every-change")
def _op_path_changes():
    """The apex op on the same list objects: a param re-pointed (``p.data = new``), a grad
    re-pointed in place (the same object) and a state tensor replaced in its list are each
    checked again at the next call (the steady calls are not), with the reference's bits."""
    from multi_tensor import ops, plan
    _cpu_clone_backend()
    calls = []
    orig = schema.check_adam_lists

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)
    lists = make_lists("fused_ema_adamw", "fp32", SMALL)
    want = clone(lists)
    noop = torch.zeros(1, dtype=torch.int32)
    args = (1e-3, 0.99, 0.9, 0.999, 1e-8)
    checked = []
    schema.check_adam_lists = counting
    try:
        with multi_tensor.backends.forced_backend("triton_interp"):
            plan.clear_cache()
            for step in range(1, 7):
                if step == 3:
                    lists[1][3].data = lists[1][3].data.clone()  # a param re-pointed
                if step == 4:
                    lists[0][1].data = lists[0][1].data.clone()  # a grad re-pointed in place
                if step == 5:
                    lists[3][0] = lists[3][0].clone()  # an exp_avg_sq replaced
                before = len(calls)
                ops.multi_tensor_fused_ema_adamw(64, noop, lists, *args, step, 1, True, 0.01)
                checked.append(len(calls) - before)
                with multi_tensor.backends.forced_backend("reference"):
                    ops.multi_tensor_fused_ema_adamw(64, noop, want, *args, step, 1, True, 0.01)
                assert_lists_equal(lists, want, f"op path call {step}")
            assert checked == [1, 0, 1, 1, 1, 0], f"the calls that checked their lists: {checked}"
    finally:
        schema.check_adam_lists = orig
        plan.clear_cache()


@case("custom-op-steps-on-the-device")
def _custom_op_device_steps():
    """torch.ops.fused_optim.adam_step_ on the triton buckets: after the first call (which
    reads the steps once) the steps, found_inf and a tensor lr on the params' device are read
    on the device only (no host read), with the reference's bits; found_inf set changes
    nothing; a step written by someone else is read again (rows split by step); a param or a
    grad re-pointed (``t.data = new``) is bound afresh."""
    import fused_optim.custom_ops  # noqa: F401
    from multi_tensor import plan
    _cpu_clone_backend()
    lists = make_lists("fused_ema_adamw", "fp32", SMALL)
    want = clone(lists)
    out = {}
    for backend, ls in (("triton_interp", lists), ("reference", want)):
        steps = [torch.tensor(0.0) for _ in ls[1]]
        lr = torch.tensor(1e-2)
        found = torch.zeros(1)
        plan.clear_cache()
        with multi_tensor.backends.forced_backend(backend):
            for call in range(7):
                found.fill_(1.0 if call == 2 else 0.0)
                if call == 3:
                    lr.fill_(3e-3)
                if call == 4:
                    steps[1].fill_(7.0)
                if call == 5:
                    ls[1][3].data = ls[1][3].data.clone()  # a param re-pointed
                if call == 6:
                    ls[0][1].data = ls[0][1].data.clone()  # a grad re-pointed in place
                quiet = backend == "triton_interp" and call in (1, 2, 3)
                with _no_host_reads() if quiet else contextlib.nullcontext():
                    torch.ops.fused_optim.adam_step_(
                        "fused_ema_adamw", *ls, [], steps, 0.0, lr, 0.9, 0.999, 1e-8, 0.05,
                        True, True, False, 0.9, "constant", 0, 1.0, 1.0, 0.0, 1,
                        torch.tensor(2.0), found, 64)
        out[backend] = [float(t) for t in steps]
    plan.clear_cache()
    assert out["triton_interp"] == out["reference"] == [6.0, 10.0, 6.0, 6.0, 6.0], out
    assert_lists_equal(lists, want, "custom op")


@case("grad-norm-table-kept-while-grads-stay")
def _grad_norm_kept():
    """AdamBucket.grad_norm keeps its l2norm table while the grads stay where they are, makes
    a new one when they move, and gives l2norm's bits."""
    k = _k()
    from multi_tensor.backends import triton as triton_gpu
    op = "adam"
    lists = make_lists(op, "fp32", SHAPES)
    bucket = k.AdamBucket(op, named_lists(op, lists).state(), 2048)
    grads = lists[0]
    for moved in (False, False, True):
        if moved:
            grads = [g.clone() * 3 for g in grads]
        before = bucket._norm
        assert bucket.bind(grads)
        flag = torch.zeros(1, dtype=torch.int32)
        got = bucket.grad_norm(flag)
        want, _ = triton_gpu.l2norm(64, torch.zeros(1, dtype=torch.int32), [grads], False)
        assert same_bits(got, want) and int(flag.item()) == 0
        if before is not None:
            assert (bucket._norm is before) == (not moved)
    bad = [g.clone() for g in grads]
    bad[5][3] = float("nan")
    assert bucket.bind(bad)
    flag = torch.zeros(1, dtype=torch.int32)
    bucket.grad_norm(flag)
    assert int(flag.item()) == 1


class _launches:
    """Records the launches of triton_host (kernel name, ALIGN mode, the list base tensors)."""

    def __enter__(self):
        from multi_tensor.backends.triton import host as triton_host
        self.host, self.saved, self.seen = triton_host, triton_host._launch, []

        def record(kernel, grid, device, *args, **kwargs):
            self.seen.append((kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__,
                              kwargs.get("ALIGN"), args))
            return self.saved(kernel, grid, device, *args, **kwargs)
        triton_host._launch = record
        return self

    def __exit__(self, *exc):
        self.host._launch = self.saved
        return False

    def of(self, name: str):
        return [(align, args) for k, align, args in self.seen if k == name]


def _scale_one_unaligned(sdt, ddt):
    """scale with one tensor of each list at a misaligned address (a view at element offset 1;
    the src's first, so the first tensor is not the base) in lists of aligned ones: one launch
    decided per chunk (ALIGN_CHUNK), both bases at aligned addresses, some chunks aligned and
    some not in the table the kernel tests, the reference's bits (a misaligned chunk on the
    128-bit path would read rounded-down offsets), a NaN in the misaligned view found. Fully
    aligned lists: ALIGN_ALL (ALIGN_CHUNK with a chunk size that is not a multiple of 16);
    every src misaligned: ALIGN_NONE; the same bits each time."""
    from multi_tensor.backends import triton as triton_gpu
    from multi_tensor.backends.triton.kernels import ALIGN_ALL, ALIGN_CHUNK, ALIGN_NONE
    gen = torch.Generator().manual_seed(7)
    shapes = ((3000,), (5,), (2048,), (4, 7), (1030,))
    base = [(torch.randn(s, generator=gen, dtype=F64) * 1e3).to(sdt) for s in shapes]
    width = {F64: 2, F32: 4, F16: 8, BF16: 8}
    want = [torch.full(s, 7.0, dtype=ddt) for s in shapes]
    reference.scale(1024, torch.zeros(1, dtype=torch.int32), [base, want], 1.0 / 3.0)
    one = list(base)
    one[0] = _offset_view(base[0], 1)
    every = [_offset_view(t, 1) for t in base]
    for srcs, dst_row, chunk, mode in ((one, 4, 1024, ALIGN_CHUNK), (base, None, 1024, ALIGN_ALL),
                                       (base, None, 1000, ALIGN_CHUNK),
                                       (every, None, 1024, ALIGN_NONE)):
        got = [torch.full(s, 7.0, dtype=ddt) for s in shapes]
        if dst_row is not None:
            got[dst_row] = _offset_view(got[dst_row], 1)
        flag = torch.zeros(1, dtype=torch.int32)
        with _launches() as rec:
            triton_gpu.scale(chunk, flag, [srcs, got], 1.0 / 3.0)
        (align, args), = rec.of("_scale_kernel")
        what = f"scale {sdt}->{ddt} chunk {chunk}"
        assert align == mode, (what, align, mode)
        assert_lists_equal([got], [want], what)
        assert int(flag.item()) == 0
        if mode == ALIGN_NONE:
            continue
        table, src_base, dst_base = args[0], args[3], args[4]
        assert src_base.data_ptr() % 16 == 0 and dst_base.data_ptr() % 16 == 0, what
        vec = ((table[0] % width[sdt] == 0) & (table[1] % width[ddt] == 0)
               & (table[3] % 16 == 0))
        if mode == ALIGN_CHUNK:
            assert bool(vec.any()) and not bool(vec.all()), (what, vec.tolist())
        else:
            assert bool(vec.all()), (what, vec.tolist())
    bad = list(one)
    bad[0] = _offset_view(base[0], 1)
    bad[0][2999] = float("nan")
    flag = torch.zeros(1, dtype=torch.int32)
    triton_gpu.scale(1024, flag, [bad, [torch.zeros(s, dtype=ddt) for s in shapes]], 2.0)
    assert int(flag.item()) == 1, "a NaN in the misaligned source did not set the noop flag"


for _s, _d in ((F32, F32), (BF16, F32), (F32, F16), (F16, F16), (F64, F64), (F64, BF16)):
    case(f"scale-one-unaligned-{str(_s)[6:]}-{str(_d)[6:]}")(
        lambda s=_s, d=_d: _scale_one_unaligned(s, d))


def _l2norm_one_unaligned(dt):
    """l2norm with one tensor at a misaligned address (the first, so the first tensor is not
    the base) in a list of aligned ones: one sum-of-squares launch decided per block
    (ALIGN_CHUNK) from an aligned base, some blocks aligned and some not in the table the kernel
    tests; the bits of the same values in aligned tensors (ALIGN_ALL) and all misaligned
    (ALIGN_NONE), so the sum does not depend on the path, and the reference's bits; an inf in
    the misaligned view found."""
    from multi_tensor.backends import triton as triton_gpu
    from multi_tensor.backends.triton.kernels import ALIGN_ALL, ALIGN_CHUNK, ALIGN_NONE
    gen = torch.Generator().manual_seed(8)
    # 9000: two whole 4096-blocks and a tail; 8193: a one-element block
    shapes = ((9000,), (5,), (4096,), (4, 7), (8193,), (0,))
    aligned = [torch.randn(s, generator=gen, dtype=F64).to(dt) for s in shapes]
    one = list(aligned)
    one[0] = _offset_view(aligned[0], 1)
    every = [_offset_view(t, 1) for t in aligned]
    rt, rp = reference.l2norm(64, torch.zeros(1, dtype=torch.int32), [aligned], True)
    width = {F64: 2, F32: 4, F16: 8, BF16: 8}[dt]
    results = []
    for ts, mode in ((one, ALIGN_CHUNK), (aligned, ALIGN_ALL), (every, ALIGN_NONE)):
        flag = torch.zeros(1, dtype=torch.int32)
        with _launches() as rec:
            total, per = triton_gpu.l2norm(64, flag, [ts], True)
        (align, args), = rec.of("_sumsq_kernel")
        assert align == mode, (dt, align, mode)
        assert int(flag.item()) == 0
        if mode != ALIGN_NONE:
            table, base = args[0], args[2]
            assert base.data_ptr() % 16 == 0, "the sum of squares' base is misaligned"
            vec = table[0] % width == 0
            assert bool(vec.all()) == (mode == ALIGN_ALL) and bool(vec.any()), vec.tolist()
        results.append((total, per))
    for total, per in results:
        assert same_bits(total, results[0][0]) and same_bits(per, results[0][1]), \
            f"l2norm {dt}: the sum depends on the alignment"
        assert same_bits(total, rt) and same_bits(per, rp), \
            f"l2norm {dt}: {float(total)!r} {float(rt)!r}"
    bad = list(one)
    bad[0] = _offset_view(aligned[0], 1)
    bad[0][8999] = float("inf")
    flag = torch.zeros(1, dtype=torch.int32)
    triton_gpu.l2norm(64, flag, [bad], False)
    assert int(flag.item()) == 1, "an inf in the misaligned tensor did not set the noop flag"


for _dt in (F32, BF16, F16, F64):
    case(f"l2norm-one-unaligned-{str(_dt)[6:]}")(lambda d=_dt: _l2norm_one_unaligned(d))


@case("clipped-step-keeps-its-norm-scratch")
def _norm_scratch():
    """A clipped step with the same grads allocates no new l2norm scratch: the bucket's plan,
    its blocks' and tensors' sums are the same objects; the norms it returns are fresh (a
    norm kept from one step is not overwritten by the next)."""
    import fused_optim
    k = _k()
    op = "adam"
    lists = make_lists(op, "fp32", SHAPES)
    bucket = k.AdamBucket(op, named_lists(op, lists).state(), 2048)
    grads = lists[0]
    assert bucket.bind(grads)
    first = bucket.grad_norm(torch.zeros(1, dtype=torch.int32))
    plan = bucket._norm
    scratch = (plan.partial, plan.per64, plan.per32)
    kept = first.clone()
    for g in grads:
        g.mul_(2.0)  # the same grads, new values
    assert bucket.bind(grads)
    second = bucket.grad_norm(torch.zeros(1, dtype=torch.int32))
    assert bucket._norm is plan and (plan.partial, plan.per64, plan.per32) == scratch
    assert all(a is b for a, b in zip((plan.partial, plan.per64, plan.per32), scratch))
    assert second is not first and same_bits(first, kept), "a returned norm was overwritten"
    assert same_bits(second, first * 2), (float(second), float(first))
    # the optimizer's clipped step, twice with the same grad tensors
    _cpu_clone_backend()
    with multi_tensor.backends.forced_backend("triton_interp"):
        gen = torch.Generator().manual_seed(10)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((5, 7), (5000,))]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt = fused_optim.FusedAdamW(params, lr=1e-2, max_grad_norm=0.5)
        opt.step()
        norm1 = opt.last_grad_norm
        value1 = norm1.clone()
        buckets = [b.active for plan in opt._plans.values() for b in plan.buckets]
        assert buckets and all(type(b).__name__ == "AdamBucket" for b in buckets), buckets
        plans = [(b._norm, b._norm.partial, b._norm.per64) for b in buckets]
        for p in params:
            p.grad.mul_(3.0)
        opt.step()
        for b, (nplan, partial, per64) in zip(buckets, plans):
            assert b._norm is nplan and b._norm.partial is partial and b._norm.per64 is per64, \
                "a clipped step allocated new l2norm scratch"
        assert same_bits(norm1, value1), "last_grad_norm of the first step was overwritten"
        assert not same_bits(opt.last_grad_norm, norm1)


# ---------------------------------------------------------------------------------------------
# master remainders: bf16 params + int16 remainders, against fp32 masters (master_weights=True)
# on the reference: masters (joined), moments and EMA bit for bit, the params and remainders the
# split of the reference's masters (so the params equal its params except at exact ties, where
# they are the neighbour away from zero)

def _placed(t: torch.Tensor, off: int) -> torch.Tensor:
    """A copy of ``t`` ``off`` elements into a fresh buffer (off > 0: a misaligned address)."""
    buf = torch.zeros(t.numel() + off + 8, dtype=t.dtype)
    v = buf[off:off + t.numel()].view(t.shape)
    v.copy_(t)
    return v


def remainder_lists(lists, offset=lambda li, i, last: 0):
    """The remainder form of masters-form ``lists`` ([grads, params, m, v, (emas), masters]):
    [grads, params, m, v, (emas), remainders], the params and remainders split from the masters;
    tensor i of list li placed ``offset(li, i, index of the remainders)`` elements into a
    buffer of its own."""
    split = [rules.split_master(x) for x in lists[-1]]
    out = [list(ts) for ts in lists[:-1]] + [[r for _, r in split]]
    out[1] = [p for p, _ in split]
    return [[_placed(t.clone(), offset(li, i, len(out) - 1)) for i, t in enumerate(ts)]
            for li, ts in enumerate(out)]


def remainder_bucket(op, rem, chunk):
    has_ema = schema.OPS[op].has_ema
    lists = schema.AdamLists(grads=None, params=rem[1], exp_avgs=rem[2], exp_avg_sqs=rem[3],
                             emas=rem[4] if has_ema else None, remainders=rem[-1])
    return _k().AdamBucket(op, lists, chunk)


def assert_remainders_match(rem, want, what: str) -> int:
    """rem (remainder form) against want (masters form, after the same steps); returns how many
    params differ from the masters form's (each at an exact tie, counted)."""
    assert_lists_equal(rem[2:-1], want[2:-1], what)  # moments and EMA
    ties = 0
    for i, (p, r, x, pw) in enumerate(zip(rem[1], rem[-1], want[-1], want[1])):
        assert same_bits(rules.join_master(p, r), x), f"{what}: tensor {i}: masters differ"
        ps, rs = rules.split_master(x)
        assert same_bits(p, ps) and same_bits(r, rs), f"{what}: tensor {i}: not the split"
        differ = bits(p) != bits(pw)
        lo = bits(x).to(torch.int64) & 0xFFFF
        assert bool((lo[differ] == 0x8000).all()), f"{what}: tensor {i}: a param off a tie"
        ties += int(differ.sum())
    return ties


def compare_remainder(op, dtype, switch="decoupled_scale", chunk=2048, shapes=SHAPES,
                      offset=lambda li, i, last: 0, align=None):
    kw = SWITCHES[switch]
    h = _hyper(op, **kw)
    scale = kw.get("grad_scale")
    want = make_lists(op, dtype, shapes, grad_scale=scale)
    rem = remainder_lists(want, offset)
    bucket = remainder_bucket(op, rem, chunk)
    noop = torch.zeros(1, dtype=torch.int32)
    gs = None if scale is None else torch.tensor([scale])
    before = clone(rem)
    for step in STEPS:
        c = rules.step_scalars(h, step)
        assert bucket.bind(rem[0])
        if align is not None:  # the ALIGN mode the placement is meant to exercise
            assert bucket.align_mode() == getattr(_k(), align), (bucket.align_mode(), align)
        bucket.run(noop, c, gs)
        ref_adam(want, c, scale)
        assert_remainders_match(rem, want, f"remainder {op} {dtype} {switch} step {step}")
    assert any(not same_bits(a, b) for a, b in zip(rem[1], before[1]) if a.numel()), \
        "the params did not change: nothing was tested"


REM_DTYPES = {"fused_ema_adamw": ("bf16_master", "bf16_master_g32", "bf16_master_ema_bf16"),
              "adam": ("bf16_master", "bf16_master_g32"),
              "radam_ema": ("bf16_master",), "radam": ("bf16_master_g32",)}
for _op, _dts in REM_DTYPES.items():
    for _dt in _dts:
        case(f"remainder-{_op}-{_dt}")(lambda op=_op, dt=_dt: compare_remainder(op, dt))
for _op in ("fused_ema_adamw", "adam"):
    for _sw in ("l2", "maximize_l2", "wd0", "no_bias_correction"):
        case(f"remainder-switch-{_op}-{_sw}")(lambda op=_op, sw=_sw: compare_remainder(
            op, "bf16_master", sw, chunk=64, shapes=SMALL))
for _chunk in (1, 7, 1024, 65536):
    case(f"remainder-chunk-{_chunk}")(lambda c=_chunk: compare_remainder(
        "fused_ema_adamw", "bf16_master", chunk=c,
        shapes=((3,), (0,), (20,), (4, 5)) if c < 16 else SHAPES))
# misaligned tensors: some in every list (the choice made per chunk), all (element by element),
# only one remainder (its own bit of the chunks' misalignment row)
for _name, _off, _mode in (("some", lambda li, i, last: i % 3, "ALIGN_CHUNK"),
                           ("all", lambda li, i, last: 1 + i % 3, "ALIGN_NONE"),
                           ("remainder", lambda li, i, last: 5 * (li == last and i == 5),
                            "ALIGN_CHUNK")):
    for _op, _dt in (("fused_ema_adamw", "bf16_master"), ("adam", "bf16_master_g32")):
        case(f"remainder-unaligned-{_name}-{_op}")(
            lambda op=_op, dt=_dt, off=_off, mode=_mode: compare_remainder(
                op, dt, offset=off, align=mode))


@case("remainder-skip")
def _remainder_skip():
    """GradScaler's skip (the noop flag set, or found by check_finite): nothing changes."""
    for op in ("fused_ema_adamw", "adam"):
        want = make_lists(op, "bf16_master", SMALL, grad_scale=1024.0)
        rem = remainder_lists(want)
        before = clone(rem)
        bucket = remainder_bucket(op, rem, 64)
        c = rules.step_scalars(_hyper(op), 3)
        assert bucket.bind(rem[0])
        bucket.run(torch.ones(1, dtype=torch.int32), c, torch.tensor([1024.0]))
        assert_lists_equal(rem, before, f"{op} remainder with the noop flag set")
        rem[0][3].view(-1)[5] = float("inf")
        flag = torch.zeros(1, dtype=torch.int32)
        assert bucket.bind(rem[0])
        bucket.run(flag, c, torch.tensor([1024.0]), True)
        assert int(flag.item()) == 1, f"{op}: the inf grad was not found"
        assert_lists_equal(rem[1:], before[1:], f"{op} remainder with an inf grad")


@case("remainder-ties")
def _remainder_ties():
    """Masters an update leaves alone (zero grad and moment, no decay) at exact ties and edge
    low halves, ±0, subnormals, the largest finite values: the kernel's split writes the params
    away from zero at ties (the masters form's round to even), the rest as the masters form."""
    op = "adam"
    h = _hyper(op, weight_decay=0.0)
    gen = torch.Generator().manual_seed(5)
    n = 4096
    hi = torch.randint(0, 0x7F7F, (n,), generator=gen, dtype=torch.int32)
    hi = hi | (torch.randint(0, 2, (n,), generator=gen, dtype=torch.int32) << 15)
    edge = torch.tensor([0x8000, 0x7FFF, 0x8001, 0, 1, 0xFFFF, 0xC000], dtype=torch.int32)
    lo = edge[torch.randint(0, len(edge), (n,), generator=gen)]
    hi[:8] = torch.tensor([0, 0x8000, 0, 0x8000, 0x7F7F, 0xFF7F, 0x0001, 0x8001])
    lo[:8] = torch.tensor([0, 0, 0x8000, 0x8000, 0xFFFF, 0xFFFF, 0x8000, 0x8000])
    x = ((((hi ^ 0x8000) - 0x8000) << 16) | lo).view(F32)
    live = torch.arange(n) >= n - 512  # the last 512 elements do move
    g = torch.where(live, torch.randn(n, generator=gen), 0.0).to(BF16)
    m = torch.where(live, torch.randn(n, generator=gen) * 0.1, 0.0)
    v = torch.rand(n, generator=gen) * 0.01
    want = [[g], [x.to(BF16)], [m], [v], [x.clone()]]
    rem = remainder_lists(want)
    bucket = remainder_bucket(op, rem, 2048)
    c = rules.step_scalars(h, 2)
    assert bucket.bind(rem[0])
    bucket.run(torch.zeros(1, dtype=torch.int32), c)
    ref_adam(want, c)
    ties = assert_remainders_match(rem, want, "remainder ties")
    still = (bits(want[-1][0]).to(torch.int64) & 0xFFFF == 0x8000) & ~live
    even = ((bits(want[-1][0]).to(torch.int64) >> 16) & 1) == 0
    assert ties >= int((still & even).sum()) > 100, ties


# ---------------------------------------------------------------------------------------------
# the tests: each case is one test, run by pytest in a TRITON_INTERPRET=1 process
#
# In a process started with TRITON_INTERPRET=1 (``TRITON_INTERPRET=1 python -m pytest
# tests/test_triton_interpreter.py -k chunk``) every test runs its case right there. Anywhere else
# the interpreter cannot be switched on any more once a kernel module has been imported, so the
# first test of this module starts ONE such pytest process for the cases this session selected
# (``-k``, node ids: only those run) and each test reports its case's outcome from that
# process's JUnit XML (the failure's text is pytest's own report of the assertion).

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
_TEST = "test_kernel_under_interpreter"


def _triton_missing():
    import importlib.util
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed; install it with tools/bootstrap.sh --test"
    return None


def _junit_outcomes(path: str) -> Dict[str, tuple]:
    """``{case name: (kind, text)}`` from pytest's JUnit XML, kind in ok / failed / skipped."""
    import xml.etree.ElementTree as ET
    out = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        name = tc.get("name", "")
        if not name.startswith(_TEST + "["):
            continue
        case_name = name[len(_TEST) + 1:-1]
        kind, text = "ok", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                kind, text = "failed", (child.get("message") or "") + "\n" + (child.text or "")
            elif child.tag == "skipped":
                kind, text = "skipped", child.get("message") or ""
        out[case_name] = (kind, text)
    return out


@pytest.fixture(scope="module")
def interpreter_outcomes(request, tmp_path_factory):
    """The outcomes of this session's selected cases, run by pytest in one TRITON_INTERPRET=1
    process (None inside such a process: the cases run right there)."""
    missing = _triton_missing()
    if missing:
        pytest.skip(missing)
    if IN_INTERPRETER:
        return None
    here = os.path.abspath(__file__)
    names = [item.callspec.params["name"] for item in request.session.items
             if item.originalname == _TEST and os.path.abspath(str(item.fspath)) == here]
    out = tmp_path_factory.mktemp("triton_interp") / "junit.xml"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ROOT,
         f"--junitxml={out}", *[f"{here}::{_TEST}[{n}]" for n in names]],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if not out.exists() or proc.returncode not in (0, 1):  # 1: some case failed (reported below)
        pytest.fail(f"the interpreter's pytest process failed (rc {proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return _junit_outcomes(str(out))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_under_interpreter(interpreter_outcomes, name):
    if IN_INTERPRETER:
        CASES[name]()
        return
    outcomes = interpreter_outcomes
    assert name in outcomes, f"case {name} did not run in the interpreter's process"
    kind, text = outcomes[name]
    if kind == "skipped":
        pytest.skip(text)
    assert kind == "ok", f"under TRITON_INTERPRET=1:\n{text}"
