"""master_weights="remainder": bf16 params + int16 remainders hold the exact fp32 masters.

The encoding (multi_tensor/rules.py, "The remainder encoding"): a bijection of 32-bit words, the
param the master rounded to nearest with ties away from zero. Tested here by default on every
bf16 param pattern x edge remainders and every high half x edge low halves; the full sweep of
all 2**32 (param, remainder) pairs runs with ``FUSED_OPTIM_EXHAUSTIVE=1`` (it takes minutes on a
loaded 2-core machine: vectorised torch on 2**24 words per chunk).

The table: backends x grad dtypes x EMA on/off x AdamW/Adam x GradScaler skips x chunk sizes,
each against ``master_weights=True``: masters (joined), moments and EMA bit for bit, params equal
except at exact ties, where the remainder's param is the neighbour away from zero.
"""
from __future__ import annotations

import importlib
import itertools
import os

import pytest
import torch

import multi_tensor
from fused_optim import FusedAdam, FusedEmaAdamW
from multi_tensor import rules
from multi_tensor.backends import forced_backend, registry

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
I16 = torch.int16


def _bits32(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _words(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """fp32 words from int32 high and low halves (0 .. 0xFFFF each)."""
    return ((((hi ^ 0x8000) - 0x8000) << 16) | lo).view(F32)


def _as_int16(u: torch.Tensor) -> torch.Tensor:
    return ((u ^ 0x8000) - 0x8000).to(I16)


EDGE_R = torch.tensor([0, 1, 2, 0x3FFF, 0x7FFE, 0x7FFF, -0x8000, -0x7FFF, -0x4000, -2, -1],
                      dtype=torch.int32)
EDGE_LO = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF, 0x1234, 0xC000],
                       dtype=torch.int32)


def _check_pairs(p_bits: torch.Tensor, r: torch.Tensor) -> None:
    """join then split gives back every (p, r); the joined words are distinct."""
    p = _as_int16(p_bits)
    x = rules.join_master(p.view(BF16), r.to(I16))
    p2, r2 = rules.split_master(x)
    assert torch.equal(p2.view(I16), p)
    assert torch.equal(r2, r.to(I16))
    words = _bits32(x).flatten()
    assert torch.unique(words).numel() == words.numel()


def test_every_param_with_edge_remainders_round_trips():
    p = torch.arange(65536, dtype=torch.int32)[:, None].expand(65536, EDGE_R.numel())
    r = EDGE_R[None, :].expand_as(p)
    _check_pairs(p.contiguous(), r.contiguous())


def test_every_high_half_rounds_to_nearest_ties_away():
    """For every high half and edge low halves: split gives the round-to-nearest param, ties
    (low half 0x8000) away from zero; RNE (torch's cast) agrees except at ties to an even."""
    hi = torch.arange(65536, dtype=torch.int32)[:, None].expand(65536, EDGE_LO.numel())
    lo = EDGE_LO[None, :].expand_as(hi)
    x = _words(hi.contiguous(), lo.contiguous())
    p, r = rules.split_master(x)
    assert torch.equal(_bits32(rules.join_master(p, r)), _bits32(x))
    finite = torch.isfinite(x)
    tie = lo == 0x8000
    # bf16 bits: +1 is the neighbour away from zero (for either sign)
    away = (hi + 1) & 0xFFFF
    pb = p.view(I16).to(torch.int32) & 0xFFFF
    assert torch.equal(pb[tie], away[tie])
    assert torch.equal(pb[~tie & (lo < 0x8000)], hi[~tie & (lo < 0x8000)])
    assert torch.equal(pb[lo > 0x8000], away[lo > 0x8000])
    rne = x.to(BF16).view(I16).to(torch.int32) & 0xFFFF
    differ = finite & (pb != rne)
    assert torch.equal(differ, finite & tie & (hi % 2 == 0) & (rne != away)), \
        "the param differs from round-to-nearest-even only at exact ties to an even neighbour"
    # nearest: |x - p| <= |x - other neighbour| in fp64, for finite params
    xf = x[finite & torch.isfinite(p.float())].to(F64)
    pf = p[finite & torch.isfinite(p.float())].to(F64)
    ulp = (pf.abs() * 2.0 ** -7).clamp_min(2.0 ** -133)
    assert bool(((xf - pf).abs() <= ulp / 2 * (1 + 2 ** -20)).all())


def test_signed_zeros_subnormals_and_specials_round_trip():
    x = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-39, -1e-39, 1.1754942e-38, float("inf"),
                      -float("inf"), 3.4028235e38, -3.4028235e38, 1.0, -1.0], dtype=F32)
    p, r = rules.split_master(x)
    assert torch.equal(_bits32(rules.join_master(p, r)), _bits32(x))
    assert torch.equal(p.view(I16)[:2], torch.tensor([0, -0x8000], dtype=I16))  # +0, -0


@pytest.mark.skipif(os.environ.get("FUSED_OPTIM_EXHAUSTIVE", "0") in ("", "0"),
                    reason="the full 2**32 sweep runs with FUSED_OPTIM_EXHAUSTIVE=1 (minutes)")
def test_all_2_to_32_pairs():
    """Every bf16 p x every int16 r: split(join(p, r)) == (p, r), so join is injective on the
    2**32 pairs, hence a bijection onto the 2**32 fp32 words: every finite fp32 is reached."""
    r_all = torch.arange(-32768, 32768, dtype=torch.int32).to(I16)
    rows = 256
    for p0 in range(0, 65536, rows):
        p = _as_int16(torch.arange(p0, p0 + rows, dtype=torch.int32))
        P = p[:, None].expand(rows, 65536).contiguous()
        R = r_all[None, :].expand(rows, 65536).contiguous()
        p2, r2 = rules.split_master(rules.join_master(P.view(BF16), R))
        assert torch.equal(p2.view(I16), P) and torch.equal(r2, R), p0


# --- the option ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F16, F32, F64])
def test_remainder_refuses_other_param_dtypes(dtype):
    params = [torch.nn.Parameter(torch.zeros(3, dtype=BF16)),
              torch.nn.Parameter(torch.zeros(3, dtype=dtype))]
    with pytest.raises(ValueError, match=r"params\[1\].*" + str(dtype).split(".")[1]):
        FusedEmaAdamW(params, master_weights="remainder")


@pytest.mark.parametrize("value", ["remainders", "True", 1, 0, None, "fp32"])
def test_master_weights_only_bool_or_remainder(value):
    with pytest.raises(ValueError, match="master_weights must be True"):
        FusedAdam([torch.nn.Parameter(torch.zeros(3, dtype=BF16))], master_weights=value)


@pytest.mark.parametrize("value", [True, False, "remainder"])
def test_master_weights_accepted(value):
    FusedAdam([torch.nn.Parameter(torch.zeros(3, dtype=BF16))], master_weights=value)


# --- the table ----------------------------------------------------------------------------------
def _native_isas():
    """(name, module) of every native build this CPU runs, best first."""
    cpu = importlib.import_module("multi_tensor.backends.cpu")
    if cpu.loaded_module is None:
        return []
    cap = cpu._cpu_capability()
    found = []
    for suffix, _, allowed_by in cpu._CANDIDATES:
        if cap not in allowed_by:
            continue
        try:
            found.append((suffix[3:], importlib.import_module(f"multi_tensor.{suffix}")))
        except ImportError:
            continue
    return found


BACKEND_CASES = (["reference"] + [f"native_cpu:{isa}" for isa, _ in _native_isas()]
                 + ["npu_standin"])


class _backend:
    """Force a backend; ``native_cpu:<isa>`` registers that ISA's build as native_cpu."""

    def __init__(self, case):
        self.case = case

    def __enter__(self):
        name, _, isa = self.case.partition(":")
        self.saved = None
        self.standin = None
        if name == "npu_standin":  # the NPU backend's flat buckets on CPU tensors
            from multi_tensor.testing import npu_standin
            self.standin = npu_standin.standin_backend(mode="exact")  # bitwise, as the table needs
            self.standin.__enter__()
        if isa:
            cpu = importlib.import_module("multi_tensor.backends.cpu")
            mod = dict(_native_isas())[isa]
            self.saved = next(b for b in multi_tensor.registered_backends() if b.name == name)
            registry.register_backend(cpu._make_backend(mod))
        self.forced = forced_backend(name)
        self.forced.__enter__()

    def __exit__(self, *exc):
        self.forced.__exit__(*exc)
        if self.standin is not None:
            self.standin.__exit__(*exc)
        if self.saved is not None:
            registry.register_backend(self.saved)


SHAPES = ((257,), (33, 65), (4096 + 3,), (1,))


def _run(case, master, grad_dtype, ema, adamw, skips, chunk, steps=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(BF16)) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen).to(grad_dtype) for s in SHAPES] for _ in range(steps)]
    for p in params:
        if hasattr(p, "grad_dtype"):
            p.grad_dtype = None  # grads of another dtype than the param's
    kw = dict(lr=3e-3, weight_decay=0.05, adam_w_mode=adamw, master_weights=master,
              chunk_size=chunk)
    opt = (FusedEmaAdamW(params, ema_decay=0.9, **kw) if ema
           else FusedAdam(params, **kw))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6, growth_interval=1) if skips else None
    with _backend(case):
        for k in range(steps):
            for p, g in zip(params, grads[k]):
                p.grad = g.clone()
            if scaler is None:
                opt.step()
                continue
            scale = float(scaler.get_scale())
            for p in params:
                p.grad = (p.grad.float() * scale).to(grad_dtype)
            if k == 1:
                params[0].grad.view(-1)[3] = float("inf")  # this step is skipped
            scaler.scale(torch.ones(()))
            scaler.step(opt)
            scaler.update()
    return params, opt


def _compare(pm, om, pr, orr, ema):
    ties = 0
    for a, b in zip(pm, pr):
        sm, sr = om.state[a], orr.state[b]
        assert "master_param" not in sr and sr["param_remainder"].dtype == I16
        master = sm["master_param"]
        joined = rules.join_master(b.detach(), sr["param_remainder"])
        assert torch.equal(_bits32(joined), _bits32(master))
        for key in ("exp_avg", "exp_avg_sq") + (("ema",) if ema else ()):
            assert torch.equal(_bits32(sm[key]), _bits32(sr[key])), key
        assert float(sm["step"]) == float(sr["step"])
        lo = _bits32(master) & 0xFFFF
        expected, _ = rules.split_master(master)
        assert torch.equal(b.detach().view(I16), expected.view(I16))
        differ = a.detach().view(I16) != b.detach().view(I16)
        assert bool((lo[differ] == 0x8000).all()), "params differ only at exact ties"
        ties += int(differ.sum())
    return ties


TABLE = list(itertools.product(
    BACKEND_CASES, (BF16, F16, F32), (True, False), (True, False), (False, True), (64, 65536)))


@pytest.mark.parametrize("case,grad_dtype,ema,adamw,skips,chunk", TABLE,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_remainder_matches_fp32_masters(case, grad_dtype, ema, adamw, skips, chunk):
    pm, om = _run(case, True, grad_dtype, ema, adamw, skips, chunk)
    pr, orr = _run(case, "remainder", grad_dtype, ema, adamw, skips, chunk)
    _compare(pm, om, pr, orr, ema)
    if skips:
        assert float(orr.state[pr[0]]["step"]) == 3.0  # one of four steps skipped


def test_ties_are_counted():
    """On random data about 2**-16 of the elements land on an exact tie per step, and half of
    those (ties to an odd neighbour agree with round-to-nearest-even) differ from
    master_weights=True's params: counted here on 2**20 elements over 4 steps (about 32)."""
    def run(master):
        gen = torch.Generator().manual_seed(1)
        p = torch.nn.Parameter(torch.randn(1 << 20, generator=gen).to(BF16))
        opt = FusedEmaAdamW([p], lr=1e-3, ema_decay=0.99, master_weights=master)
        for _ in range(4):
            p.grad = torch.randn(1 << 20, generator=gen).to(BF16)
            opt.step()
        return [p], opt
    pm, om = run(True)
    pr, orr = run("remainder")
    ties = _compare(pm, om, pr, orr, True)
    assert 4 <= ties <= 200, ties


# --- state dicts --------------------------------------------------------------------------------
def _trained(master, steps=3, seed=2):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(BF16)) for s in SHAPES]
    opt = FusedEmaAdamW(params, lr=1e-2, ema_decay=0.9, master_weights=master)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(BF16)
        opt.step()
    return params, opt


def _step_both(pa, oa, pb, ob, seed=5):
    gen = torch.Generator().manual_seed(seed)
    for a, b in zip(pa, pb):
        g = torch.randn(a.shape, generator=gen).to(BF16)
        a.grad, b.grad = g.clone(), g.clone()
    oa.step()
    ob.step()


@pytest.mark.parametrize("src,dst", [("remainder", True), (True, "remainder"),
                                     ("remainder", "remainder")])
def test_state_dict_between_masters_and_remainders(src, dst):
    ps, os_ = _trained(src)
    sd = os_.state_dict()
    if src == "remainder":
        assert all(st["param_remainder"].dtype == I16 for st in sd["state"].values())
    # the loading optimizer's params hold the saved params (the model is loaded first)
    pd = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    od = FusedEmaAdamW(pd, lr=1e-2, ema_decay=0.9, master_weights=dst)
    od.load_state_dict(sd)
    for k in range(2):
        _step_both(ps, os_, pd, od, seed=10 + k)
    for a, b in zip(ps, pd):
        ma = (os_.state[a]["master_param"] if src is True
              else rules.join_master(a.detach(), os_.state[a]["param_remainder"]))
        mb = (od.state[b]["master_param"] if dst is True
              else rules.join_master(b.detach(), od.state[b]["param_remainder"]))
        assert torch.equal(_bits32(ma), _bits32(mb))
        assert torch.equal(os_.state[a]["ema"], od.state[b]["ema"])
        assert torch.equal(os_.state[a]["exp_avg_sq"], od.state[b]["exp_avg_sq"])


def test_remainder_state_dict_round_trip_through_torch_save(tmp_path):
    ps, opt = _trained("remainder")
    torch.save(opt.state_dict(), tmp_path / "o.pt")
    sd = torch.load(tmp_path / "o.pt")
    pd = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    od = FusedEmaAdamW(pd, lr=1e-2, ema_decay=0.9, master_weights="remainder")
    od.load_state_dict(sd)
    for a, b in zip(ps, pd):
        assert od.state[b]["param_remainder"].dtype == I16
        assert torch.equal(od.state[b]["param_remainder"], opt.state[a]["param_remainder"])


def test_torch_state_dict_drops_the_remainder():
    ps, opt = _trained("remainder")
    sd = opt.torch_state_dict()
    assert all(set(st) == {"step", "exp_avg", "exp_avg_sq"} for st in sd["state"].values())
    torch.optim.AdamW([torch.nn.Parameter(p.detach().float()) for p in ps]).load_state_dict(sd)


def test_optimizer_state_bytes_per_param():
    """fp32 EMA: 8 (moments) + 4 (EMA) + 2 (remainder) = 14 B/param; bf16 EMA: 12."""
    for ema_dtype, expected in ((F32, 14), (BF16, 12)):
        p = torch.nn.Parameter(torch.zeros(1000, dtype=BF16))
        opt = FusedEmaAdamW([p], ema_decay=0.9, master_weights="remainder", ema_dtype=ema_dtype)
        opt.init_state()
        state = opt.state[p]
        nbytes = sum(t.numel() * t.element_size() for k, t in state.items() if k != "step")
        assert nbytes == expected * p.numel()


def test_triton_backend_prepares_its_remainder_kernel():
    """On CUDA a remainder bucket is the Triton backend's own (the kernel joins and splits in
    its pass), not the reference's. Its results need a GPU or the interpreter: the table for
    Triton is tests/test_triton_interpreter.py's remainder cases (this table's tensors are CPU
    tensors, which the compiled kernels cannot run on)."""
    pytest.importorskip("triton")
    from multi_tensor import schema
    from multi_tensor.backends import triton as triton_backend

    p, r = rules.split_master(torch.randn(300))
    lists = schema.AdamLists(None, [p], [torch.zeros(300)], [torch.zeros(300)], remainders=[r])
    bucket = triton_backend.prepare("adam", lists, 64)
    host = triton_backend.host_module()
    assert host is not None, triton_backend.load_error
    assert isinstance(bucket, host.AdamBucket)
    assert bucket.remainder and not bucket.master
    assert bucket.list_names[-1] == "remainders"
