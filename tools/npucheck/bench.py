"""Check 5 of tools/npu_check.py: the step time of ours and of the per-tensor and torch peers."""
from __future__ import annotations

import math
from typing import Dict

import torch

from fused_optim import FusedEmaAdamW
from multi_tensor import forced_backend
from multi_tensor.backends import npu
from multi_tensor.testing import npu_standin

from .common import (
    HYPER, Report, dtype_name, last_path, make_grads, make_params, set_grads, shapes_for, timed)


# --- benchmark ------------------------------------------------------------------------------------
def per_tensor_op(device, rep: Report):
    """MindSpeed's op (or ours, or the CPU emulation) for the per-tensor loop, and its label."""
    if device.type != "npu":
        return npu_standin.cann_device_op, "per-tensor loop (CPU emulation of the op)"
    try:
        fn, source = npu.load_device_op()
    except Exception as exc:
        rep.say(f"  (no per-tensor operator: {type(exc).__name__}: {exc})")
        return None, None
    label = ("MindSpeed per-tensor npu_apply_fused_ema_adamw loop" if source == "mindspeed"
             else "per-tensor loop over this package's binding (MindSpeed absent)")
    return fn, label


def benchmark(args, device, backend, sync, rep: Report) -> None:
    rep.say(f"5. step time: {args.tensors} tensors, {args.numel:,} elements, median of "
            f"{args.steps} steps")
    shapes = shapes_for(args.numel, args.tensors, seed=7)
    numel = sum(math.prod(s) for s in shapes)
    gb = numel * 36 / 1e9
    results: Dict[str, float] = {}

    def record(label, ms):
        results[label] = ms
        rep.say(f"  {label:<62} {ms:9.3f} ms  {gb / (ms / 1e3):8.1f} GB/s")

    grads = make_grads(shapes, torch.float32, 9)
    def ours(dtype, master, mode):
        params = make_params(shapes, dtype, device, seed=8)
        set_grads(params, [g.to(dtype) for g in grads])
        opt = FusedEmaAdamW(params, master_weights=master, **HYPER)

        def step():
            with forced_backend(backend), npu.op_mode(mode):
                opt.step()
        ms = timed(step, args.steps, args.warmup, sync)
        record(f"ours {mode} ({dtype_name(dtype, master)}; ran {last_path(opt)})", ms)

    for dtype, master in ((torch.float32, False), (torch.bfloat16, True)):
        for mode in ("exact", "cann", "cann_literal"):
            ours(dtype, master, mode)

    fn, label = per_tensor_op(device, rep)
    if fn is not None:
        params = make_params(shapes, torch.float32, device, seed=8)
        gs = [g.to(device) for g in grads]
        ms_, vs_ = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        ss_ = [p.detach().clone() for p in params]
        step_t = torch.ones(1, dtype=torch.int64, device=device)

        def loop():
            step_t.add_(1)
            with torch.no_grad():
                for p, g, m, v, s in zip(params, gs, ms_, vs_, ss_):
                    fn(g, p.data, m, v, s, step_t, 1e-3, 0.9999, 0.9, 0.999, 1e-8, 1, True, 0.01)
        record(f"{label} (fp32)", timed(loop, args.steps, args.warmup, sync))
        del params, gs, ms_, vs_, ss_

    params = make_params(shapes, torch.float32, device, seed=8)
    set_grads(params, grads)
    emas = [p.detach().clone() for p in params]
    kind = "fused"
    try:
        adamw = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
        adamw.step()
    except Exception:
        kind = "foreach"
        adamw = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
    detached = [p.detach() for p in params]

    def torch_step():
        adamw.step()
        torch._foreach_lerp_(emas, detached, 1.0 - 0.9999)
    record(f"torch AdamW({kind}=True) + _foreach_lerp_ EMA (fp32)",
           timed(torch_step, args.steps, args.warmup, sync))
    rep.results["bench_ms"] = results
    rep.results["bench_elements"] = numel
