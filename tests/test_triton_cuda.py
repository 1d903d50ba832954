"""The Triton backend on a real CUDA GPU (skipped without one, or without triton).

* every Adam-family op and dtype form, bitwise against the reference backend on the GPU and on
  the CPU; master remainders against fp32 masters on the CPU reference; scale bitwise, l2norm
  close and deterministic;
* a prepared bucket's device steps equal its host-scalar steps, bitwise;
* a full optimizer step under ``torch.amp.GradScaler`` runs with
  ``torch.cuda.set_sync_debug_mode("error")`` (no host sync), overflow steps included;
* an optimizer step captured in a CUDA graph and replayed gives the eager steps' bits.

Run by ``tools/gpu_check.sh`` on a GPU machine; never on CPU CI.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is not installed (tools/bootstrap.sh --test)"),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device: the Triton backend's GPU tests need one"),
]

import fused_optim  # noqa: E402
import multi_tensor  # noqa: E402
from multi_tensor import rules  # noqa: E402
from multi_tensor.backends import backend_for, reference  # noqa: E402
from test_triton_interpreter import (ADAM_OPS, DTYPES, SHAPES, STEPS, SWITCHES,  # noqa: E402
                                     _hyper, assert_lists_equal, assert_remainders_match, bits,
                                     clone, make_lists, ref_adam, remainder_bucket,
                                     remainder_lists, same_bits)

CUDA = torch.device("cuda")


def to(lists, device):
    return [[t.to(device, copy=True) for t in ts] for ts in lists]


def call(op, lists, c, chunk, scale, backend):
    device = lists[1][0].device
    noop = torch.zeros(1, dtype=torch.int32, device=device)
    gs = None if scale is None else torch.tensor([scale], device=device)
    if backend == "triton":
        b = backend_for(op, device)
        assert b.name == "triton", b.name
        b.ops[op](chunk, noop, multi_tensor.ops.named_lists(op, lists), c, gs, False)
    else:
        reference.adam_family(chunk, noop, multi_tensor.ops.named_lists(op, lists), c, gs, False)
    return noop


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("op", ADAM_OPS)
@pytest.mark.parametrize("switch", ["decoupled_scale", "maximize_l2"])
def test_cuda_bitwise_vs_reference(op, dtype, switch):
    kw = SWITCHES[switch]
    h = _hyper(op, **kw)
    scale = kw.get("grad_scale")
    host = make_lists(op, dtype, SHAPES + ((70001,),), grad_scale=scale)
    gpu, gref, cref = to(host, CUDA), to(host, CUDA), clone(host)
    for step in (1, 6):
        c = rules.step_scalars(h, step)
        call(op, gpu, c, 2048, scale, "triton")
        call(op, gref, c, 2048, scale, "reference")
        call(op, cref, c, 2048, scale, "reference")
        torch.cuda.synchronize()
        assert_lists_equal(to(gpu, "cpu"), to(gref, "cpu"), f"{op} {dtype} vs GPU reference")
        assert_lists_equal(to(gpu, "cpu"), cref, f"{op} {dtype} vs CPU reference")


@pytest.mark.parametrize("op,dtype", [("fused_ema_adamw", "bf16_master"),
                                      ("fused_ema_adamw", "bf16_master_ema_bf16"),
                                      ("adam", "bf16_master_g32"), ("radam_ema", "bf16_master")])
def test_cuda_remainder_vs_fp32_masters(op, dtype):
    """master_weights="remainder" on the GPU against fp32 masters on the CPU reference: masters
    (joined), moments and EMA bitwise, the params and remainders the masters' split."""
    scale = SWITCHES["decoupled_scale"]["grad_scale"]
    h = _hyper(op, **SWITCHES["decoupled_scale"])
    want = make_lists(op, dtype, SHAPES + ((70001,),), grad_scale=scale)
    rem = to(remainder_lists(want), CUDA)
    bucket = remainder_bucket(op, rem, 2048)
    for step in STEPS:
        c = rules.step_scalars(h, step)
        assert bucket.bind(rem[0])
        bucket.run(torch.zeros(1, dtype=torch.int32, device=CUDA), c,
                   torch.tensor([scale], device=CUDA))
        ref_adam(want, c, scale)
        torch.cuda.synchronize()
        assert_remainders_match(to(rem, "cpu"), want, f"{op} {dtype} remainder step {step}")


def test_cuda_device_steps_equal_host_steps_and_skip():
    from multi_tensor.backends import triton as triton_gpu
    k = triton_gpu.host_module()
    for op, dtype in (("fused_ema_adamw", "bf16_master"), ("radam_ema", "fp32"), ("adam", "fp64")):
        h = _hyper(op)
        a = to(make_lists(op, dtype, SHAPES), CUDA)
        b = clone(a)
        ba = k.AdamBucket(op, multi_tensor.ops.named_lists(op, a).state(), 65536)
        bb = k.AdamBucket(op, multi_tensor.ops.named_lists(op, b).state(), 65536)
        step = torch.zeros((), device=CUDA)
        zero = torch.zeros(1, dtype=torch.int32, device=CUDA)
        scale = torch.tensor([8.0], device=CUDA)
        for s in range(1, 9):
            assert ba.bind(a[0]) and bb.bind(b[0])
            ba.run(zero, rules.step_scalars(h, s), scale)
            bb.run_device_step(step, h, zero, scale)
        assert_lists_equal(to(b, "cpu"), to(a, "cpu"), f"{op} {dtype} device steps")
        before = clone(b)
        assert bb.bind(b[0])
        bb.run_device_step(step, h, torch.ones(1, device=CUDA), scale)
        assert float(step) == 8.0
        assert_lists_equal(to(b, "cpu"), to(before, "cpu"), f"{op} {dtype} skipped step")


@pytest.mark.parametrize("sdt", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("ddt", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_cuda_scale_bitwise(sdt, ddt):
    g = torch.Generator().manual_seed(1)
    srcs = [(torch.randn(n, generator=g, dtype=torch.float64) * 100).to(sdt) for n in (0, 7, 300001)]
    got = [torch.empty(s.shape, dtype=ddt, device=CUDA) for s in srcs]
    want = [torch.empty(s.shape, dtype=ddt) for s in srcs]
    flag = torch.zeros(1, dtype=torch.int32, device=CUDA)
    multi_tensor.multi_tensor_scale(65536, flag, [[s.to(CUDA) for s in srcs], got], 1.0 / 3.0)
    reference.scale(65536, torch.zeros(1, dtype=torch.int32), [srcs, want], 1.0 / 3.0)
    assert_lists_equal([[t.cpu() for t in got]], [want], f"scale {sdt}->{ddt}")
    assert int(flag.item()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cuda_l2norm(dtype):
    g = torch.Generator().manual_seed(2)
    ts = [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in (0, 5, 1_000_003, 4096)]
    gts = [t.to(CUDA) for t in ts]
    outs = [multi_tensor.multi_tensor_l2norm(c, torch.zeros(1, dtype=torch.int32, device=CUDA),
                                             [gts], True) for c in (7, 65536)]
    for total, per in outs[1:]:
        assert same_bits(total.cpu(), outs[0][0].cpu()) and same_bits(per.cpu(), outs[0][1].cpu())
    rt, rp = reference.l2norm(7, torch.zeros(1, dtype=torch.int32), [ts], True)
    torch.testing.assert_close(outs[0][0].cpu(), rt, rtol=1e-6, atol=0)
    torch.testing.assert_close(outs[0][1].cpu(), rp, rtol=1e-6, atol=0)


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 64)).to(CUDA, dtype)


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_cuda_optimizer_step_is_sync_free_under_grad_scaler(max_grad_norm):
    """GradScaler's found_inf and, when clipping, the norm's finiteness decide the skip on the
    device: no host sync in any step, an overflow step included."""
    model = _model()
    opt = fused_optim.FusedEmaAdamW(model.parameters(), lr=1e-3, ema_decay=0.99,
                                    max_grad_norm=max_grad_norm)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12)
    x = torch.randn(32, 64, device=CUDA)
    buckets = None

    def iteration(poison=False):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        if poison:
            next(model.parameters()).grad.view(-1)[:1].fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    for _ in range(2):  # warm-up: plans, kernel compilation, the step tensors move to the GPU
        iteration()
    buckets = [b for plan in opt._plans.values() for b in plan.buckets]
    assert all(b.prepared.device_steps for b in buckets)
    params_before = [p.detach().clone() for p in model.parameters()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        iteration(poison=True)   # overflow: skipped on the device
        skipped = [p.detach().clone() for p in model.parameters()]
        iteration()
        iteration()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in zip(params_before, skipped):
        assert torch.equal(a, b), "an overflow step changed a param"
    steps = {float(opt.state[p]["step"]) for p in model.parameters()}
    assert steps == {4.0}, f"device step counters {steps}, expected 4 (5 steps, 1 skipped)"


def test_cuda_graph_replay_equals_eager_steps():
    def build():
        model = _model()
        opt = fused_optim.FusedEmaAdamW(model.parameters(), lr=1e-3, ema_decay=0.9,
                                        weight_decay=0.01)
        g = torch.Generator(device=CUDA).manual_seed(3)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, device=CUDA, generator=g) * 1e-2
        return model, opt

    eager_model, eager_opt = build()
    for _ in range(8):
        eager_opt.step()

    model, opt = build()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up steps, outside the capture
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(bits(p.detach()), bits(q.detach())), "graph replay != eager steps"
        for key in ("exp_avg", "exp_avg_sq", "ema", "step"):
            a, b = opt.state[p][key], eager_opt.state[q][key]
            assert same_bits(a.cpu(), b.cpu()), f"state {key} differs after replay"
    assert float(opt.state[next(model.parameters())]["step"]) == 8.0
