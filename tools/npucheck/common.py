"""What every part of tools/npu_check.py shares: the report, the device, the workloads."""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from fused_optim import FusedEmaAdamW
from multi_tensor import backend_for, forced_backend
from multi_tensor.backends import npu

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, ema_decay=0.9999)


class Report:
    def __init__(self):
        self.lines: List[str] = []
        self.results: Dict[str, object] = {}
        self.failed = False

    def say(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def check(self, name: str, ok: bool, detail: str, **data) -> None:
        self.failed |= not ok
        self.results[name] = dict(ok=ok, detail=detail, **data)
        self.say(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}")

    def info(self, name: str, detail: str, **data) -> None:
        self.results[name] = dict(detail=detail, **data)
        self.say(f"  [info] {name}: {detail}")

# --- setup ----------------------------------------------------------------------------------------

def setup(args, rep: Report) -> Tuple[torch.device, str, Callable[[], None]]:
    """The device, the backend name our optimizer is forced to, and a synchronize function."""
    if args.stand_in:
        rep.say("stand-in: CPU tensors, the NPU backend's code, CANN's kernel emulated in fp32 "
                "(multi_tensor.testing.npu_standin.cann_device_op)")
        return torch.device("cpu"), "npu_standin", lambda: None
    try:
        import torch_npu  # noqa: F401
    except Exception as exc:
        raise SystemExit(f"torch_npu does not import ({type(exc).__name__}: {exc}); run this on an "
                         f"Ascend machine after sourcing CANN's set_env.sh, or use --stand-in")
    device = torch.device(args.device)
    torch.npu.set_device(device)
    return device, "npu", torch.npu.synchronize


def environment(device: torch.device, backend: str, rep: Report) -> None:
    rep.say("environment")
    rep.say(f"  torch {torch.__version__}")
    if device.type == "npu":
        import torch_npu

        rep.say(f"  torch_npu {getattr(torch_npu, '__version__', '?')}")
        rep.say(f"  device {device}: {torch_npu.npu.get_device_name(device.index or 0)}")
        cann = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME") or "?"
        version = "?"
        for name in ("version.cfg", "compiler/version.info", "runtime/version.info"):
            path = os.path.join(cann, name)
            if os.path.isfile(path):
                with open(path) as f:
                    version = " ".join(f.read().split())[:120]
                break
        rep.say(f"  CANN {cann} ({version})")
        try:
            import mindspeed  # noqa: F401
            rep.say("  MindSpeed: installed (its npu_apply_fused_ema_adamw binding is preferred)")
        except Exception:
            rep.say("  MindSpeed: not installed (this package's binding is built on first use)")
    resolved = backend_for("fused_ema_adamw", device).name if device.type == "npu" else backend
    rep.say(f"  fused_ema_adamw resolves to backend '{resolved}' for {device.type}")


# --- workloads ------------------------------------------------------------------------------------

def shapes_for(numel: int, tensors: int, seed: int = 0) -> List[Tuple[int, ...]]:
    """``tensors`` shapes, log-uniform sizes summing to about ``numel`` (matrices and vectors)."""
    g = torch.Generator().manual_seed(seed)
    logs = torch.rand(tensors, generator=g, dtype=torch.float64) * 6.0
    weights = torch.exp(logs)
    sizes = [max(1, int(numel * w / weights.sum())) for w in weights.tolist()]
    shapes = []
    for i, n in enumerate(sizes):
        if i % 3 == 2 or n < 4096:
            shapes.append((n,))
        else:
            rows = 64
            shapes.append((rows, max(1, n // rows)))
    return shapes


def make_params(shapes, dtype, device, seed: int) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dtype).to(device))
            for s in shapes]


def make_grads(shapes, dtype, seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 0.01).to(dtype) for s in shapes]


def set_grads(params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g.to(p.device)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fi = torch.finfo(dtype)
    a = x.double().abs().clamp_min(fi.tiny)
    return torch.pow(2.0, torch.floor(torch.log2(a))) * fi.eps


def ulp_distance(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float:
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.numel() == 0:
        return 0.0
    return float(((a.double() - b.double()).abs() / ulp(b, dtype)).max())


def bitwise_mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype in (torch.float16, torch.bfloat16):
        a, b = a.view(torch.int16), b.view(torch.int16)
    elif a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    else:
        a, b = a.view(torch.int64), b.view(torch.int64)
    return int((a != b).sum())


def pair(shapes, dtype, master: bool, device, backend: str, mode: str):
    """Our optimizer on ``device`` and the reference on CPU, from identical params."""
    ours_p = make_params(shapes, dtype, device, seed=1)
    ref_p = make_params(shapes, dtype, torch.device("cpu"), seed=1)
    ours = FusedEmaAdamW(ours_p, master_weights=master, **HYPER)
    ref = FusedEmaAdamW(ref_p, master_weights=master, **HYPER)
    return ours_p, ours, ref_p, ref


def step_both(ours, ref, ours_p, ref_p, grads, backend: str, mode: str, sync) -> None:
    set_grads(ours_p, grads)
    set_grads(ref_p, grads)
    with forced_backend(backend), npu.op_mode(mode):
        ours.step()
    sync()
    with forced_backend("reference"):
        ref.step()


def state_pairs(ours, ref, ours_p, ref_p):
    """(name, ours tensor, reference tensor) for params and every state entry."""
    for i, (p, q) in enumerate(zip(ours_p, ref_p)):
        yield f"param[{i}]", p, q
        for key, value in ours.state[p].items():
            if key != "step":
                yield f"{key}[{i}]", value, ref.state[q][key]


def dtype_name(dtype, master) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype] + (
        "+fp32 masters" if master else "")


def last_path(opt) -> Optional[str]:
    paths = {b.prepared.last_path for plan in opt._plans.values() for b in plan.buckets
             if hasattr(b.prepared, "last_path")}
    return paths.pop() if len(paths) == 1 else ",".join(sorted(str(p) for p in paths))


def timed(fn, steps: int, warmup: int, sync) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3
