#!/usr/bin/env python3
"""Check the Ascend NPU backend on an Ascend machine: parity with the reference, and step time.

Run it on a machine with an Atlas A2/A3 (or Ascend 950) NPU, CANN and torch_npu (and, if you
use it, MindSpeed)::

    source /usr/local/Ascend/ascend-toolkit/set_env.sh
    python tools/npu_check.py                       # parity + benchmark on npu:0 (a few minutes)
    python tools/npu_check.py --skip-bench --json npu_check.json
    python tools/npu_check.py --stand-in            # the same script on CPU, CANN emulated

Exit status 0 when every check passes, 1 when one fails (each line says which and by how much).

What it checks (the reference backend runs on the CPU, on copies of the same tensors):

1. ``torch`` path (the default, ``MULTI_TENSOR_NPU_OP=torch``) against the reference over
   ``--parity-steps`` steps: **bitwise**. This is the package's contract; on the NPU it holds
   only if torch_npu's fp32 division and fp64 sqrt are correctly rounded (CANN does not say).
   A mismatch is reported as FAIL with the largest distance in ulps.
2. ``cann`` path (``aclnnApplyFusedEmaAdam`` + one unbiased-EMA ``lerp_``), one step from the
   reference's own state after a few steps, element by element:
   ``m``, ``v``: within 4 ulp; ``var`` (master or param) and ``s``: within
   ``4 ulp(value) + 2^-20 * |change of the step|``.
   Why: the operator evaluates the same formula in fp32 in another order (``(m/bc1) /
   (sqrt(v/bc2) + eps)``, decay inside the update; the backend folds bias correction into lr and
   eps), so even a correctly rounded device differs by a few roundings. m and v are one multiply
   and one multiply-add from the same fp32 inputs (<= 2 roundings each; a fused multiply-add
   or the other association of ``(1-b2)*g*g`` changes the last bit at most twice). The update
   passes through ~8 rounded operations (<= 8 ulp relative if each is within 1 ulp; CANN does
   not document correctly rounded div/sqrt, 2^-20 = 8 ulp leaves room for a 1-ulp sqrt and
   division); it enters ``var`` scaled by lr, so it is bounded relative to the step's change,
   and ``var`` itself adds its own final rounding and the ordering of the decay term (<= 4 ulp
   of the value). bf16 params (masters run in fp32) are compared after rounding: within 1 bf16
   ulp.
3. ``cann`` over ``--parity-steps`` steps: the largest deviation of the params (the fp32
   masters for bf16) relative to how far they moved (information: a few roundings per step, accumulated).
4. EMA of a constant. ``cann``: ``s = var = c`` stays exactly ``c`` (PASS/FAIL).
   ``cann_literal`` (the operator's own EMA ``d*s + (1-d)*var``): its effective coefficients,
   read off one launch (``s = [0, 1]``, ``var = [1, 0]``, ``lr = 0``), and where the EMA of a
   constant settles, ``(1-d)_eff / (1 - d_eff) - 1`` (information; -1.66e-4 at d = 0.9999 if
   the operator rounds ``d`` and ``1 - d`` to fp32 separately).

Benchmark (median ms per optimizer step, ``--steps`` steps after ``--warmup``, grads fixed): ours
(``torch``, ``cann``, ``cann_literal``), MindSpeed's per-tensor ``npu_apply_fused_ema_adamw``
loop (the way MindSpeed's FusedEmaAdamW steps; over this package's binding when MindSpeed is
absent), and torch's fused AdamW (``torch_npu``'s ``_fused_adamw_``) + ``torch._foreach_lerp_``
for the EMA. Also the effective bandwidth: 36 bytes per element (fp32) moved by a fused
AdamW + EMA update, over the step time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import traceback
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from fused_optim import FusedEmaAdamW  # noqa: E402
from multi_tensor import backend_for, forced_backend  # noqa: E402
from multi_tensor.backends import npu, npu_standin  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, ema_decay=0.9999)
M_V_ULPS = 4
VAR_ULPS = 4
UPDATE_REL = 2.0 ** -20


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
        rep.say("stand-in: CPU tensors, the NPU backend's code, CANN's formula emulated in fp32 "
                "(multi_tensor.backends.npu_standin.literal_device_op)")
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


# --- checks ---------------------------------------------------------------------------------------

def check_torch_path(args, device, backend, sync, rep: Report) -> None:
    rep.say("1. torch path (default) vs reference, bitwise")
    shapes = shapes_for(args.parity_numel, args.parity_tensors, seed=3)
    for dtype, master in ((torch.float32, False), (torch.bfloat16, True)):
        ours_p, ours, ref_p, ref = pair(shapes, dtype, master, device, backend, "torch")
        for k in range(args.parity_steps):
            step_both(ours, ref, ours_p, ref_p, make_grads(shapes, dtype, 100 + k), backend,
                      "torch", sync)
        bad, worst = 0, 0.0
        for name, a, b in state_pairs(ours, ref, ours_p, ref_p):
            n = bitwise_mismatches(a, b)
            if n:
                bad += n
                worst = max(worst, ulp_distance(a, b, b.dtype))
        label = f"torch path {dtype_name(dtype, master)}, {args.parity_steps} steps"
        rep.check(label, bad == 0,
                  "bitwise equal" if bad == 0 else
                  f"{bad} elements differ, up to {worst:.1f} ulp (torch_npu's div/sqrt are not "
                  f"correctly rounded here)", mismatches=bad, max_ulp=worst)


def dtype_name(dtype, master) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype] + (
        "+fp32 masters" if master else "")


def check_cann_step(args, device, backend, sync, rep: Report) -> None:
    rep.say("2. cann path, one step from the reference's state, element by element")
    shapes = shapes_for(args.parity_numel, args.parity_tensors, seed=4)
    for mode in ("cann", "cann_literal"):
        for dtype, master in ((torch.float32, False), (torch.bfloat16, True)):
            ours_p, ours, ref_p, ref = pair(shapes, dtype, master, device, backend, mode)
            for k in range(5):  # the reference walks a few steps: realistic m, v, s
                set_grads(ref_p, make_grads(shapes, dtype, 200 + k))
                with forced_backend("reference"):
                    ref.step()
            with torch.no_grad():
                for p, q in zip(ours_p, ref_p):
                    p.copy_(q)
            ours.load_state_dict(ref.state_dict())
            before = {name: b.detach().clone() for name, _, b in state_pairs(ref, ref, ref_p, ref_p)}
            step_both(ours, ref, ours_p, ref_p, make_grads(shapes, dtype, 300), backend, mode, sync)
            path = last_path(ours)
            worst = {"m/v": 0.0, "var/s": 0.0, "param": 0.0}
            for name, a, b in state_pairs(ours, ref, ours_p, ref_p):
                a_c, b_c = a.detach().cpu().double(), b.detach().double()
                if name.startswith(("exp_avg", "exp_avg_sq")):
                    worst["m/v"] = max(worst["m/v"], ulp_distance(a, b, torch.float32) / M_V_ULPS)
                elif name.startswith("ema") and mode == "cann_literal":
                    continue  # the biased EMA: check 4
                elif name.startswith("param") and b.dtype != torch.float32:
                    worst["param"] = max(worst["param"], ulp_distance(a, b, b.dtype))
                else:
                    change = (b_c - before[name].double()).abs()
                    tol = VAR_ULPS * ulp(b_c, torch.float32) + UPDATE_REL * change
                    if a_c.numel():
                        worst["var/s"] = max(worst["var/s"], float(((a_c - b_c).abs() / tol).max()))
            ok = path == mode and worst["m/v"] <= 1.0 and worst["var/s"] <= 1.0 and worst["param"] <= 1.0
            rep.check(f"{mode} {dtype_name(dtype, master)} one step", ok,
                      f"path={path}; m,v at {worst['m/v']:.2f} of 4 ulp; var,s at "
                      f"{worst['var/s']:.2f} of the tolerance; bf16 params within "
                      f"{worst['param']:.1f} ulp", path=path, **worst)


def last_path(opt) -> Optional[str]:
    paths = {b.prepared.last_path for plan in opt._plans.values() for b in plan.buckets
             if hasattr(b.prepared, "last_path")}
    return paths.pop() if len(paths) == 1 else ",".join(sorted(str(p) for p in paths))


def check_cann_drift(args, device, backend, sync, rep: Report) -> None:
    rep.say("3. cann path over many steps (information)")
    shapes = shapes_for(args.parity_numel, args.parity_tensors, seed=5)
    for dtype, master in ((torch.float32, False), (torch.bfloat16, True)):
        ours_p, ours, ref_p, ref = pair(shapes, dtype, master, device, backend, "cann")
        for k in range(args.parity_steps):
            if k == 0:  # after the first step: state (and masters) exist
                start = [weights(ref, q).detach().clone().double() for q in ref_p]
            step_both(ours, ref, ours_p, ref_p, make_grads(shapes, dtype, 400 + k), backend,
                      "cann", sync)
        rel = 0.0
        ours_w = [weights(ours, p) for p in ours_p]
        ref_w = [weights(ref, q) for q in ref_p]
        for p, q, s in zip(ours_w, ref_w, start):
            moved = (q.detach().double() - s).abs().max().item()
            if moved > 0:
                rel = max(rel, (p.detach().cpu().double() - q.detach().double()).abs().max().item()
                          / moved)
        rep.info(f"cann {dtype_name(dtype, master)} {args.parity_steps} steps",
                 f"{'masters' if master else 'params'} deviate by at most {rel:.2e} of how far "
                 f"they moved (steps 2..{args.parity_steps})", rel=rel)


def weights(opt, p) -> torch.Tensor:
    """The weights the update runs on: the fp32 master if there is one, else the param."""
    return opt.state[p].get("master_param", p)


def check_literal_ema(args, device, backend, sync, rep: Report) -> None:
    rep.say("4. EMA of a constant: the operator's biased form vs the unbiased lerp")
    decay = 0.9999
    # cann: s = var = c must stay c exactly (the unbiased form).
    p = torch.nn.Parameter(torch.full((1 << 16,), 0.7).to(device))
    c = float(p.detach()[0].cpu())  # 0.7 as fp32 holds it
    opt = FusedEmaAdamW([p], lr=0.0, weight_decay=0.0, ema_decay=decay)
    p.grad = torch.zeros_like(p)
    with forced_backend(backend), npu.op_mode("cann"):
        opt.step()
    sync()
    delta = float((opt.state[p]["ema"].detach().cpu().double() / c - 1.0).abs().max())
    rep.check("cann EMA of a constant", delta == 0.0,
              f"s = var = c: one step moves s by {delta:.2e} (relative)", delta=delta)
    # cann_literal: the operator's own coefficients, read off one launch with lr = 0:
    # s = [0, 1], var = [1, 0]  ->  s' = [(1-d)_eff, d_eff]; a constant's EMA settles at
    # c * (1-d)_eff / (1 - d_eff) (rounding of each step aside).
    p = torch.nn.Parameter(torch.tensor([1.0, 0.0]).to(device))
    opt = FusedEmaAdamW([p], lr=0.0, weight_decay=0.0, ema_decay=decay)
    opt.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p.detach()),
                        exp_avg_sq=torch.zeros_like(p.detach()),
                        ema=torch.tensor([0.0, 1.0]).to(device))
    p.grad = torch.zeros_like(p)
    with forced_backend(backend), npu.op_mode("cann_literal"):
        opt.step()
    sync()
    omd, d = (float(x) for x in opt.state[p]["ema"].detach().cpu().double())
    steady = omd / (1.0 - d) - 1.0 if d != 1.0 else float("nan")
    rep.info("cann_literal EMA coefficients",
             f"d_eff = {d!r}, (1-d)_eff = {omd!r}: the EMA of a constant settles "
             f"{steady:+.2e} (relative) away from it (d = {decay})", d=d, omd=omd, steady=steady)


# --- benchmark ------------------------------------------------------------------------------------

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


def per_tensor_op(device, rep: Report):
    """MindSpeed's op (or ours, or the CPU emulation) for the per-tensor loop, and its label."""
    if device.type != "npu":
        return npu_standin.literal_device_op, "per-tensor loop (CPU emulation of the op)"
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
        for mode in ("torch", "cann", "cann_literal"):
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


# --- main -----------------------------------------------------------------------------------------

def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="npu:0")
    ap.add_argument("--stand-in", action="store_true",
                    help="run on CPU with the NPU backend's code and CANN's formula emulated")
    ap.add_argument("--numel", type=int, default=None, help="benchmark elements (default 100M; 200k stand-in)")
    ap.add_argument("--tensors", type=int, default=None, help="benchmark tensors (default 200; 20 stand-in)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20; 3 stand-in)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--parity-numel", type=int, default=None, help="default 2M (50k stand-in)")
    ap.add_argument("--parity-tensors", type=int, default=24)
    ap.add_argument("--parity-steps", type=int, default=None, help="default 50 (5 stand-in)")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    small = args.stand_in
    args.numel = args.numel or (200_000 if small else 100_000_000)
    args.tensors = args.tensors or (20 if small else 200)
    args.steps = args.steps or (3 if small else 20)
    args.parity_numel = args.parity_numel or (50_000 if small else 2_000_000)
    args.parity_steps = args.parity_steps or (5 if small else 50)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    rep = Report()
    device, backend, sync = setup(args, rep)
    with contextlib.ExitStack() as stack:
        if args.stand_in:
            stack.enter_context(npu_standin.standin_backend(npu_standin.literal_device_op,
                                                            name=backend))
        environment(device, backend, rep)
        checks = [check_torch_path, check_cann_step, check_cann_drift, check_literal_ema]
        if not args.skip_bench:
            checks.append(benchmark)
        for check in checks:
            try:
                check(args, device, backend, sync, rep)
            except Exception as exc:  # one broken part must not hide the others' results
                rep.check(check.__name__, False, f"raised {type(exc).__name__}: {exc}",
                          traceback=traceback.format_exc())
    rep.say("result: " + ("FAIL" if rep.failed else "PASS"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results=rep.results, failed=rep.failed, args=vars(args)), f, indent=1,
                      default=str)
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
