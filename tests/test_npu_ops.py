"""The NPU backend's own scale and l2norm (multi_tensor.backends.npu.ops), and fp32 clipping.

``scale`` is bitwise the reference's; ``l2norm`` is within the bound its module docstring
states of an fp64 oracle (numpy), deterministic and independent of how a buffer is split into
tensors. On the CPU stand-in of the NPU backend, clipped and GradScaler steps run these ops, make
no fp64 tensor (other than host-side scalars) and read nothing back but the norm's finiteness.
"""
from __future__ import annotations

import math
import traceback

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fused_optim import FusedAdamW, FusedEmaAdamW
from multi_tensor import forced_backend, multi_tensor_l2norm, multi_tensor_scale
from multi_tensor.backends import reference
from multi_tensor.backends.npu import ops as npu_ops
from multi_tensor.testing import npu_standin
from multi_tensor.testing.npu_model import DeviceModel

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
U = 2.0 ** -24
STANDIN = "npu_standin"


def bound(n: int) -> float:
    """The relative error bound of npu_ops' norm for n elements (its module docstring)."""
    # three levels of blocks of max(BLOCK, cbrt(n)) elements: the most additions on one path
    block = max(npu_ops.BLOCK, math.ceil(round(n ** (1 / 3), 6)))
    adds, k = 0, n
    for _ in range(2):
        adds += min(k, block) - 1
        k = k // block + 1
    k = adds + k
    return 0.5 * k * U / (1 - k * U) + 64 * 2.0 ** -23 + 2.0 ** -38


def oracle(tensors) -> float:
    return float(np.sqrt(sum(np.sum(t.detach().double().numpy() ** 2) for t in tensors)))


def split(buf: torch.Tensor, sizes):
    out, pos = [], 0
    for n in sizes:
        out.append(buf[pos:pos + n])
        pos += n
    return out


# host reads outside this work: the noop flag (the flat bucket's, npuflat), the planner's first
# step, and GradScaler's found_inf on the CPU (on an NPU it is on the device, read in
# ClippingMixin._overflow unless the clipped step's norm read decides)
OTHER_READS = {"_noop_is_set", "_step_of", "step"}
READ_SITES = OTHER_READS | {"_unscale_factor", "_overflow"}
FREE = ("view", "alias", "slice", "expand", "detach", "as_strided", "scalar_tensor")


class _ToList(TorchFunctionMode):
    """``Tensor.tolist()`` reads without an aten op a dispatch mode sees."""

    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "tolist":
            self.record._read()
        return func(*args, **(kwargs or {}))


class Record(TorchDispatchMode):
    """fp64 tensors made by device ops (host scalars from reference.rounded excepted) and host
    reads (``_local_scalar_dense``, ``tolist``)."""

    def __init__(self):
        super().__init__()
        self.fp64, self.reads, self.ops, self.read_sites = [], 0, 0, []
        self._tolist = _ToList(self)

    def __enter__(self):
        self._tolist.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._tolist.__exit__(*exc)

    def _read(self):
        names = [f.name for f in traceback.extract_stack()]
        self.reads += 1
        self.read_sites.append(next((n for n in reversed(names) if n in READ_SITES), "elsewhere"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(word in str(func) for word in FREE):
            self.ops += 1
        outs = out if isinstance(out, (tuple, list)) else (out,)
        read = func is torch.ops.aten._local_scalar_dense.default
        if read or any(isinstance(t, torch.Tensor) and t.dtype == F64 for t in outs):
            names = [f.name for f in traceback.extract_stack()]
            if "rounded" not in names:
                if read:
                    self.reads += 1
                    self.read_sites.append(next((n for n in reversed(names) if n in READ_SITES),
                                                "elsewhere"))
                else:
                    self.fp64.append(str(func))
        return out


# --- scale -----------------------------------------------------------------------------------

def _scale_lists(kind, src_dtype, dst_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = (5, 0, 300, 1, 4097)
    buf = torch.randn(sum(sizes), generator=g).to(src_dtype) * 3
    dbuf = torch.empty(sum(sizes), dtype=dst_dtype)
    if kind == "flat":
        return split(buf, sizes), split(dbuf, sizes)
    if kind == "in place":
        srcs = split(buf, sizes)
        return srcs, srcs
    return [t.clone() for t in split(buf, sizes)], [torch.empty_like(t, dtype=dst_dtype)
                                                    for t in split(buf, sizes)]


SCALE_CASES = {
    "flat fp32": ("flat", F32, F32), "list fp32": ("list", F32, F32),
    "in place fp32": ("in place", F32, F32), "flat fp16 -> fp32": ("flat", F16, F32),
    "list bf16 -> fp32": ("list", BF16, F32), "flat fp32 -> fp16": ("flat", F32, F16),
    "list fp32 -> bf16": ("list", F32, BF16),
}


@pytest.mark.parametrize("factor", [0.1, 1.0 / 3.0, 65536.0, 1e-30])
@pytest.mark.parametrize("case", sorted(SCALE_CASES))
def test_scale_bitwise_equal_to_reference(case, factor):
    srcs, dsts = _scale_lists(*SCALE_CASES[case])
    want = [torch.empty_like(d) for d in dsts]
    reference.scale(0, torch.zeros(1, dtype=torch.int32), [srcs, want], factor)
    flag = torch.zeros(1, dtype=torch.int32)
    with Record() as rec:
        npu_ops.scale(0, flag, [srcs, dsts], factor)
    for i, (d, w) in enumerate(zip(dsts, want)):
        assert d.dtype == w.dtype and torch.equal(d, w), f"dsts[{i}]"
    assert int(flag) == 0 and rec.fp64 == [] and rec.reads == 0


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("kind", ["flat", "list"])
def test_scale_sets_the_flag_on_the_device(kind, bad):
    srcs, dsts = _scale_lists(kind, F32, F32)
    srcs[2][7] = bad
    flag = torch.zeros(1, dtype=torch.int32)
    with Record() as rec:
        npu_ops.scale(0, flag, [srcs, dsts], 0.5)
    assert int(flag) == 1 and rec.reads == 0


# --- l2norm ----------------------------------------------------------------------------------

NORM_CASES = {  # numel, magnitude of the values
    "one": (1, 1.0), "a block": (1024, 1.0), "a block and one": (1025, 1.0),
    "ragged": (50_001, 1.0), "a million": (1_000_000, 1.0), "large values": (20_000, 1e30),
    "small values": (20_000, 1e-30), "near the fp32 edge": (3000, 3e36),
    "subnormals": (5000, 1e-40), "tiny normals": (5000, 1e-33),
}


@pytest.mark.parametrize("case", sorted(NORM_CASES))
def test_l2norm_within_its_bound_of_an_fp64_oracle(case):
    n, mag = NORM_CASES[case]
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g, dtype=F64) * mag).to(F32)
    want = oracle([x])
    got, per = npu_ops.l2norm(0, torch.zeros(1, dtype=torch.int32), [split(x, (n // 3, n - n // 3))])
    assert got.dtype == F32 and per.numel() == 0
    sub = 2.0 ** -149 if want < 2.0 ** -126 else 0.0  # a subnormal norm: one more rounding
    assert abs(float(got) - want) <= bound(n) * want + sub, (float(got), want)
    ref, _ = reference.l2norm(0, torch.zeros(1, dtype=torch.int32), [[x]])
    assert abs(float(got) - float(ref)) <= bound(n) * float(ref) + 2.0 ** -140


def test_l2norm_does_not_depend_on_the_split_and_is_deterministic():
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(30_000, generator=g)
    flag = torch.zeros(1, dtype=torch.int32)
    results = set()
    for sizes in ((30_000,), (1, 29_999), (10_000,) * 3, (7, 1017, 4000, 24_976)):
        for tensors in (split(buf, sizes), [t.clone() for t in split(buf, sizes)]):
            results.add(npu_ops.l2norm(0, flag, [tensors])[0].item())
    assert len(results) == 1
    assert int(flag) == 0


def test_l2norm_per_tensor_and_mixed_dtypes():
    g = torch.Generator().manual_seed(4)
    ts = [torch.randn(s, generator=g).to(dt)
          for s, dt in (((300,), F16), ((5, 7), BF16), ((2000,), F32))]
    total, per = npu_ops.l2norm(0, torch.zeros(1, dtype=torch.int32), [ts], True)
    assert abs(float(total) - oracle(ts)) <= bound(2335) * oracle(ts)
    for t, got in zip(ts, per):
        assert abs(float(got) - oracle([t])) <= bound(t.numel()) * oracle([t])
    empty = npu_ops.l2norm(0, torch.zeros(1, dtype=torch.int32), [[]], True)
    assert float(empty[0]) == 0.0 and empty[1].numel() == 0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_l2norm_flag_on_the_device_and_nonfinite_norm(bad):
    x = torch.ones(5000)
    x[4321] = bad
    flag = torch.zeros(1, dtype=torch.int32)
    with Record() as rec:
        total, _ = npu_ops.l2norm(0, flag, [split(x, (4000, 1000))])
    assert int(flag) == 1 and not math.isfinite(float(total)) and rec.reads == 0


def test_l2norm_launches_do_not_grow_with_the_number_of_tensors():
    counts = []
    for parts in (1, 10, 100):
        buf = torch.randn(100_000)
        tensors = split(buf, (100_000 // parts,) * parts)
        with Record() as rec:
            npu_ops.l2norm(0, torch.zeros(1, dtype=torch.int32), [tensors])
        counts.append(rec.ops)
        assert rec.fp64 == [] and rec.reads == 0
    assert len(set(counts)) == 1 and counts[0] < 30


def _f32_neighbours(x: float):
    t = torch.tensor(x, dtype=torch.float32)
    return [float(torch.nextafter(t, torch.tensor(d))) for d in (0.0, float("inf"))] + [x]


@pytest.mark.parametrize("edge", [2.0 ** 40, 2.0 ** -30, 2.0 ** -90])
def test_norm_flat_scale_at_its_range_edges(edge):
    # amax on, just below and just above each edge of the scale's ranges: the norm within its
    # bound (the scale an exact power of two wherever the lookup puts amax), no flag
    for amax in _f32_neighbours(edge):
        x = torch.full((3000,), amax / 3, dtype=torch.float32)
        x[1234] = amax
        flag = torch.zeros(1, dtype=torch.int32)
        got = float(npu_ops.norm_flat(x, flag))
        assert abs(got - oracle([x])) <= bound(x.numel()) * oracle([x]), (amax, got)
        assert int(flag) == 0


def test_norm_flat_picks_its_scale_on_the_device_in_fixed_launches():
    # the same ops, none a host read, whatever range amax falls in (or inf/NaN)
    seen = set()
    npu_ops.norm_flat(torch.ones(3))  # the lookup tables, made once per device
    for value in (1.0, 2.0 ** 50, 2.0 ** -50, 2.0 ** -120, float("inf"), float("nan")):
        x = torch.ones(5000)
        x[17] = value
        flag = torch.zeros(1, dtype=torch.int32)
        with DeviceModel() as model:
            npu_ops.norm_flat(x, flag)
        summary = model.summary()
        assert summary.syncs == 0 and summary.fp64_ops == 0
        seen.add(tuple(sorted(summary.ops.items())))
    assert len(seen) == 1
    # the max, the scale (compare, count, lookup) and the flag (test, fill), the scaled
    # squares (2), the three-level sum (blocks, tail, their concatenation, twice; the last
    # sum), sqrt, unscale
    assert sum(dict(seen.pop()).values()) == 17


@pytest.mark.parametrize("numel", [1, 1024, 5000, 1_000_003])
def test_norm_flat_launches_do_not_depend_on_the_size(numel):
    # a capturable clipped step's launches must not grow with its bucket
    x = torch.ones(numel)
    npu_ops.norm_flat(x)
    with DeviceModel() as model:
        got = npu_ops.norm_flat(x)
    assert model.summary().launches == 15, model.summary().ops
    assert abs(float(got) - math.sqrt(numel)) <= bound(numel) * math.sqrt(numel)


def test_fp64_is_refused():
    with pytest.raises(TypeError, match="float64"):
        npu_ops.l2norm(0, torch.zeros(1, dtype=torch.int32), [[torch.ones(3, dtype=F64)]])
    with pytest.raises(TypeError, match="float64"):
        npu_ops.scale(0, torch.zeros(1, dtype=torch.int32), [[torch.ones(3, dtype=F64)],
                                                             [torch.ones(3, dtype=F64)]], 2.0)


def test_the_standin_serves_scale_and_l2norm_and_has_no_fp64():
    with npu_standin.standin_backend(mode="exact") as backend, forced_backend(STANDIN):
        assert backend.fp64 is False
        assert backend.ops["scale"] is npu_ops.scale and backend.ops["l2norm"] is npu_ops.l2norm
        x = [torch.ones(4), torch.ones(5)]
        total, _ = multi_tensor_l2norm(2048, torch.zeros(1, dtype=torch.int32), [x])
        assert float(total) == 3.0
        out = [torch.empty(4), torch.empty(5)]
        multi_tensor_scale(2048, torch.zeros(1, dtype=torch.int32), [x, out], 0.5)
        assert all(torch.equal(o, torch.full_like(o, 0.5)) for o in out)


# --- clipping and GradScaler on the stand-in ---------------------------------------------------

def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _train(cls, backend, *, clip, scaler, steps=6):
    model = _model()
    opt = cls(model.parameters(), lr=1e-2, max_grad_norm=clip)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    gen = torch.Generator().manual_seed(1)
    norms, records = [], []
    for k in range(steps):
        x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y) * 50.0
        (sc.scale(loss) if sc else loss).backward()
        with forced_backend(backend), Record() as rec:
            if sc:
                sc.step(opt)
            else:
                opt.step()
        if sc:
            sc.update()
        records.append(rec)
        if opt.last_grad_norm is not None:
            norms.append(opt.last_grad_norm)
    return [p.detach().clone() for p in model.parameters()], norms, records


class Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("cls", [FusedEmaAdamW, FusedAdamW])
@pytest.mark.parametrize("clip,scaler", [(0.5, False), (0.5, True), (None, True), (1e6, True)])
def test_clipped_and_scaled_steps_on_the_standin(cls, clip, scaler):
    quick = Spy(npu_ops.quick_norm)
    with npu_standin.standin_backend(mode="exact") as backend, \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(npu_ops, "quick_norm", quick)
        spy = backend.ops["l2norm"] = Spy(backend.ops["l2norm"])
        ours, our_norms, records = _train(cls, STANDIN, clip=clip, scaler=scaler)
    ref, ref_norms, _ = _train(cls, "reference", clip=clip, scaler=scaler)
    steps = len(records)
    # the range-safe l2norm at the first step (before the flat grad buffer exists), then the
    # one-read quick norm of that buffer
    assert spy.calls == (1 if clip is not None else 0)
    assert quick.calls == (steps - 1 if clip is not None else 0)
    for rec in records:
        assert rec.fp64 == [], rec.fp64
        sites = [site for site in rec.read_sites if site not in OTHER_READS]
        # one read per step: the norm's finiteness when clipping
        assert sites == (["_unscale_factor"] if clip is not None else []), rec.read_sites
    assert all(n.dtype == F32 for n in our_norms)
    for a, b in zip(our_norms, ref_norms):
        limit = max(bound(400), npu_ops.quick_bound(400))
        assert abs(float(a) - float(b)) <= limit * float(b) + 1e-7 * float(b)
    if clip is None or clip == 1e6:
        # no clip (or a clip factor of 1: the same kernel multiplier), the same math: bitwise
        for a, b in zip(ours, ref):
            assert torch.equal(a, b)
    else:
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)


# --- the clipped step's quick norm and host clip factor ----------------------------------------

QUICK_CASES = {  # numel, magnitude, trusted
    "one": (1, 1.0, True), "a block": (1024, 1.0, True), "a block and one": (1025, 1.0, True),
    "ragged": (50_001, 1.0, True), "a million": (1_000_000, 1.0, True),
    "grad-sized": (20_000, 1e-3, True), "large but safe": (20_000, 1e15, True),
    "squares overflow": (20_000, 1e25, False), "squares underflow": (20_000, 1e-45, False),
    "subnormals": (5000, 1e-40, False),
}


@pytest.mark.parametrize("case", sorted(QUICK_CASES))
def test_quick_norm_within_its_bound_or_not_trusted(case):
    n, mag, trusted = QUICK_CASES[case]
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g, dtype=F64) * mag).to(F32)
    want = oracle([x])
    with Record() as rec:
        got = float(npu_ops.quick_norm(x))
    assert rec.fp64 == [] and rec.reads == 1  # the float() above, nothing inside
    ok = math.isfinite(got) and got >= npu_ops.QUICK_MIN
    assert ok == trusted, (got, want)
    if ok:
        assert abs(got - want) <= npu_ops.quick_bound(n) * want, (got, want)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_quick_norm_of_nonfinite_grads(bad):
    x = torch.ones(5000)
    x[4321] = bad
    got = float(npu_ops.quick_norm(x))
    assert (math.isnan(got) if math.isnan(bad) else got == math.inf)


def test_quick_norm_launches_are_fixed():
    counts = set()
    for n in (0, 1000, 1024, 5000, 100_000, 2 ** 20 - 1):  # below 2^20: one level
        with Record() as rec:
            npu_ops.quick_norm(torch.ones(n))
        counts.add(rec.ops)
    assert len(counts) == 1


def test_quick_bound_formula():
    assert npu_ops.quick_bound(2 ** 20 - 1) < 7.7e-5
    assert npu_ops.quick_bound(2 ** 20) > npu_ops.quick_bound(2 ** 20 - 1)


NORMS = (0.0, 2.0 ** -149, 1e-30, 3e-7, 0.4999, 0.5, 0.50000006, 1.0, 7.25, 1e3, 123456.79, 3e30,
         3.4e38)
SCALES = (None, 1.0, 2.0 ** -3, 2.0 ** 16, 1000.0, 3.0, 2.0 ** -120)
MAXES = (0.5, 1.0, 1e-3, 3.0, 1e30)


def _device_formula(norm, scale, max_grad_norm):
    """The fp32 device formula of ClippingMixin._unscale_factor (fp32_exact's division)."""
    from multi_tensor.backends.npu import fp32_exact
    div = fp32_exact.scalar_div
    n = torch.tensor(norm, dtype=F32)
    s = None if scale is None else torch.tensor(scale, dtype=F32)
    if s is not None:
        n = div(n, s)
    if not torch.isfinite(n):
        return float(n), None
    clip = div(torch.full_like(n, max_grad_norm), n + 1e-6).clamp(max=1.0)
    return float(n), float(div(torch.ones_like(n) if s is None else s, clip))


def test_host_clip_factor_is_bitwise_the_fp32_formula():
    from fused_optim.clipping import host_clip_factor
    for norm in NORMS:
        norm = float(torch.tensor(norm, dtype=F32))
        for scale in SCALES:
            for mx in MAXES:
                got = host_clip_factor(norm, scale, mx)
                want = _device_formula(norm, scale, mx)
                assert got[0] == want[0] or (math.isnan(got[0]) and math.isnan(want[0]))
                assert got[1] == want[1], (norm, scale, mx, got, want)
    assert host_clip_factor(math.inf, None, 1.0)[1] is None
    assert host_clip_factor(math.nan, 2.0, 1.0)[1] is None
    assert host_clip_factor(3e38, 2.0 ** -120, 1.0)[1] is None  # the unscaled norm overflows


def _clip_run(grads_of, mode="cann", steps=3):
    """Clipped FusedEmaAdamW steps on the stand-in, grads from ``grads_of(step)``; the
    optimizer's norms and the read sites of every step."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in ((300,), (7, 50), (1200,))]
    opt = FusedEmaAdamW(params, lr=1e-2, max_grad_norm=0.5)
    norms, sites, weights = [], [], []
    with npu_standin.standin_backend(mode=mode):
        for k in range(steps):
            opt.zero_grad()
            with torch.enable_grad():
                torch.autograd.backward([(p * g).sum() for p, g in zip(params, grads_of(k))])
            with forced_backend(STANDIN), Record() as rec:
                opt.step()
            norms.append(opt.last_grad_norm)
            sites.append([s for s in rec.read_sites if s not in OTHER_READS])
            if mode == "exact":  # (the stand-in's cann operator is the fp64 reference)
                assert rec.fp64 == [], rec.fp64
            weights.append([p.detach().clone() for p in params])
    return norms, sites, weights


def _grads(mag, bad=None):
    def of(k):
        g = torch.Generator().manual_seed(k)
        out = [torch.randn(s, generator=g, dtype=F64).mul(mag).to(F32)
               for s in ((300,), (7, 50), (1200,))]
        if bad is not None and k == 2:
            out[2][17] = bad
        return out
    return of


@pytest.mark.parametrize("mode", ["cann", "exact"])
@pytest.mark.parametrize("mag", [1e-2, 1e25, 1e-45])
def test_clipped_steps_recompute_an_untrusted_quick_norm(mode, mag):
    # grads whose squares overflow or underflow in fp32: the quick norm is not trusted, the
    # range-safe l2norm gives the norm (a second read on those steps), and the step is taken
    norms, sites, weights = _clip_run(_grads(mag), mode)
    for k, (norm, read) in enumerate(zip(norms, sites)):
        want = oracle(_grads(mag)(k))
        assert norm.device.type == "cpu" and norm.dtype == F32
        assert abs(float(norm) - want) <= bound(1650) * want + 2.0 ** -140, (k, float(norm), want)
        # step 1 has no flat grad buffer yet: the range-safe norm at once
        expected = 1 if k == 0 or mag == 1e-2 else 2
        assert read == ["_unscale_factor"] * expected, (k, read)
    assert not all(torch.equal(a, b) for a, b in zip(weights[0], weights[-1]))  # steps ran


@pytest.mark.parametrize("bad,reads", [(float("nan"), 1), (float("inf"), 2)])
def test_clipped_step_with_a_nonfinite_grad_is_skipped(bad, reads):
    norms, sites, weights = _clip_run(_grads(1e-2, bad))
    assert not math.isfinite(float(norms[2]))
    assert sites[2] == ["_unscale_factor"] * reads  # NaN: at once; inf: confirmed range-safe
    assert all(torch.equal(a, b) for a, b in zip(weights[1], weights[2]))  # skipped


def test_a_host_grad_scale_is_a_kernel_scalar(monkeypatch):
    # on an NPU the clip factor stays on the host (a CPU tensor) and is read there: the same
    # bits as the device reciprocal the stand-in computes
    runs = []
    for host in (False, True):
        if host:
            from multi_tensor.backends import npu
            monkeypatch.setattr(npu.FlatAdamBucket, "_host_scale",
                                lambda self, s: None if s is None else float(s.reshape(())))
        _, _, weights = _clip_run(_grads(1.0))
        runs.append(weights[-1])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
