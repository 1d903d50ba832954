"""Checks 1-4 and 6-13 of tools/npu_check.py (its docstring says what each one settles)."""
from __future__ import annotations

import math
import traceback

import torch

from fused_optim import FusedEmaAdamW
from multi_tensor import forced_backend
from multi_tensor.backends import npu, registry
from multi_tensor.testing import npu_standin

from .common import (
    HYPER, Report, bitwise_mismatches, dtype_name, make_grads, make_params, pair, set_grads,
    shapes_for, state_pairs, step_both, timed, ulp_distance)
from .tolerances import cann_bounds, one_cann_step


# --- checks ---------------------------------------------------------------------------------------

def check_exact_path(args, device, backend, sync, rep: Report) -> None:
    rep.say("1. exact path (MULTI_TENSOR_NPU_OP=exact) vs reference, bitwise")
    shapes = shapes_for(args.parity_numel, args.parity_tensors, seed=3)
    for dtype, master in ((torch.float32, False), (torch.bfloat16, True)):
        ours_p, ours, ref_p, ref = pair(shapes, dtype, master, device, backend, "exact")
        for k in range(args.parity_steps):
            step_both(ours, ref, ours_p, ref_p, make_grads(shapes, dtype, 100 + k), backend,
                      "exact", sync)
        bad, worst = 0, 0.0
        for name, a, b in state_pairs(ours, ref, ours_p, ref_p):
            n = bitwise_mismatches(a, b)
            if n:
                bad += n
                worst = max(worst, ulp_distance(a, b, b.dtype))
        label = f"exact path {dtype_name(dtype, master)}, {args.parity_steps} steps"
        rep.check(label, bad == 0,
                  "bitwise equal" if bad == 0 else
                  f"{bad} elements differ, up to {worst:.1f} ulp (torch_npu's div/sqrt are not "
                  f"correctly rounded here)", mismatches=bad, max_ulp=worst)


def check_cann_step(args, device, backend, sync, rep: Report) -> None:
    rep.say("2. cann paths, one step from the reference's state, against cann_bounds()")
    hp = (HYPER["lr"], *HYPER["betas"], HYPER["eps"], HYPER["weight_decay"], HYPER["ema_decay"], 1)
    for literal in (False, True):
        mode = "cann_literal" if literal else "cann"
        for dtype, master in ((torch.float32, False), (torch.bfloat16, True)):
            worst = {q: 0.0 for q in "mvws"}
            param_ulp, launches = 0.0, 0
            for seed, warm in ((11, 0), (12, 5)):
                before, g, after, ours, p_ours, p_ref, c, n_launch = one_cann_step(
                    device, backend, sync, hp, dtype, master, warm, seed, literal,
                    args.parity_numel)
                launches += n_launch
                tol = cann_bounds(before, g, after, c, literal)
                for q in "mvws":
                    ratio = ((ours[q] - after[q]).abs() / tol[q].clamp_min(1e-300)).max()
                    worst[q] = max(worst[q], float(ratio))
                if master:
                    param_ulp = max(param_ulp, ulp_distance(p_ours, p_ref, p_ref.dtype))
            ok = launches == 2 and all(r <= 1.0 for r in worst.values()) and param_ulp <= 1.0
            rep.check(f"{mode} {dtype_name(dtype, master)} one step", ok,
                      f"launches={launches} (want 2); m {worst['m']:.2f}, v {worst['v']:.2f}, "
                      f"var {worst['w']:.2f}, s {worst['s']:.2f} of their bounds"
                      + (f"; bf16 params within {param_ulp:.1f} ulp" if master else ""),
                      launches=launches, param_ulp=param_ulp, **worst)


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


EMA_DECAYS = (0.99, 0.999, 0.9999, 0.99999)


def _op_of(backend: str, device):
    """The backend's device operator for direct calls (the stand-in's emulation on CPU)."""
    holder = next(b for b in registry.registered_backends() if b.name == backend).device_op
    fn, why = holder.get(device)
    if fn is None:
        raise RuntimeError(why)
    return fn


def ema_of_constant(fn, device, decay: float, steps: int, start: float, sync,
                    n: int = 4096) -> float:
    """The operator's own EMA of constant weights (lr = 0: ``var`` stays ``c``), ``s`` started at
    ``start * c``: the largest ``|s / c - 1|`` after ``steps`` launches, c in [0.5, 2)."""
    gen = torch.Generator().manual_seed(17)
    c = (0.5 + 1.5 * torch.rand(n, generator=gen)).to(device)
    var, s = c.clone(), (c * start).to(device)
    zero = torch.zeros(n, device=device)
    m, v, g = zero.clone(), zero.clone(), zero.clone()
    step = torch.ones(1, dtype=torch.int64, device=device)
    for _ in range(steps):
        fn(g, var, m, v, s, step, 0.0, decay, 0.9, 0.999, 1e-8, 1, False, 0.0)
    sync()
    if not torch.equal(var, c):
        raise RuntimeError("lr = 0 moved var")
    return float((s.double() / c.double() - 1.0).abs().max().cpu())


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
    # s = [0, 1], var = [1, 0]  ->  s' = [(1-d)_eff, d_eff]; a constant's EMA has its fixed point
    # at c * (1-d)_eff / (1 - d_eff), i.e. at c when d_eff + (1-d)_eff = 1 exactly, which holds
    # for the kernel's 1 - fp32(d) (exact for d in [0.5, 1]); a double complement rounded to
    # fp32 would put it at -1.66e-4 (d = 0.9999).
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
             f"d_eff = {d!r}, (1-d)_eff = {omd!r}: d_eff + (1-d)_eff - 1 = {d + omd - 1.0:+.2e}; "
             f"the fixed point of a constant's EMA is {steady:+.2e} (relative) from it "
             f"(d = {decay})", d=d, omd=omd, steady=steady)
    # Where the operator's EMA of a constant goes: started at c, and 1% below it.
    fn = _op_of(backend, device)
    drift = {}
    for dd in EMA_DECAYS:
        at_c = ema_of_constant(fn, device, dd, args.ema_steps, 1.0, sync)
        below = ema_of_constant(fn, device, dd, args.ema_steps, 0.99, sync)
        drift[str(dd)] = dict(from_c=at_c, from_099c=below)
        rep.info(f"cann_literal EMA of a constant, d = {dd}",
                 f"after {args.ema_steps} launches: |s/c - 1| <= {at_c:.2e} from s = c, "
                 f"{below:.2e} from s = 0.99 c (the exact EMA: {0.01 * dd ** args.ema_steps:.2e})",
                 from_c=at_c, from_099c=below, steps=args.ema_steps)
    rep.results["cann_literal_ema_drift"] = drift


# --- what only hardware settles (each also runs on the stand-in where it can) --------------------

def check_fp64_foreach(args, device, backend, sync, rep: Report) -> None:
    rep.say("6. fp64 on the device: torch._foreach_sqrt on fp64 tensors")
    x = [torch.full((16,), 4.0, dtype=torch.float64, device=device) for _ in range(3)]
    try:
        out = torch._foreach_sqrt(x)
        sync()
        ok = all(bool((t.cpu() == 2.0).all()) for t in out)
        rep.info("fp64 foreach", f"works ({'correct' if ok else 'WRONG values'})",
                 supported=True, correct=ok)
    except Exception as exc:  # aclnnForeachSqrt rejects fp64: error 161002
        text = f"{type(exc).__name__}: {exc}"
        rep.info("fp64 foreach", "raises" + (" error 161002" if "161002" in text else "")
                 + f" ({text.splitlines()[0][:160]})", supported=False, error=text[:2000])


def _hard_fp32(n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` positive finite fp32 values: random bit patterns (every binade, subnormals) plus
    hard cases: squares of midpoints of neighbouring floats (sqrt near a tie), 1 +- k ulp,
    powers of two, the extremes."""
    bits = torch.randint(1, 0x7F800000, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    k = torch.randint(1 << 23, 1 << 24, (n // 4,), generator=gen, dtype=torch.int64).double()
    mid = ((k + 0.5) ** 2 * 2.0 ** -46).float()  # near-ties of sqrt in [1, 4)
    one = 1.0 + torch.arange(-64, 64, dtype=torch.float64) * 2.0 ** -23
    fi = torch.finfo(torch.float32)
    special = torch.tensor([fi.tiny, fi.max, fi.eps, 2.0 ** -149, 1.0, 2.0, 0.5, 3.0],
                           dtype=torch.float64)
    pow2 = 2.0 ** torch.arange(-126, 128, dtype=torch.float64)
    return torch.cat([x, mid, one.float(), special.float(), pow2.float()])


def check_sqrt_div_rounding(args, device, backend, sync, rep: Report) -> None:
    rep.say("7. fp32 sqrt and division on the device against an IEEE oracle")
    gen = torch.Generator().manual_seed(23)
    x = _hard_fp32(args.rounding_samples, gen)
    y = _hard_fp32(args.rounding_samples, gen)[: x.numel()]
    if y.numel() < x.numel():
        x = x[: y.numel()]
    # the oracle: fp64 sqrt / division of fp32 inputs, rounded once to fp32, is correctly rounded
    # (53 >= 2 * 24 + 2 bits: no double-rounding error for sqrt and division)
    want_sqrt = x.double().sqrt().float()
    want_div = (x.double() / y.double()).float()
    # results that over- or underflow fp32 are left out of the division (their rounding is not
    # the question here)
    fi = torch.finfo(torch.float32)
    q = x.double() / y.double()
    keep = (q.abs() <= fi.max) & (q.abs() >= fi.tiny)
    verdict = {}
    got_sqrt = torch.sqrt(x.to(device)).cpu()
    got_div = (x.to(device) / y.to(device)).cpu()
    sync()
    for name, got, want, mask in (("sqrt", got_sqrt, want_sqrt, None),
                                  ("div", got_div, want_div, keep)):
        if mask is not None:
            got, want = got[mask], want[mask]
        bad = int((got.view(torch.int32) != want.view(torch.int32)).sum())
        worst = ulp_distance(got, want, torch.float32) if bad else 0.0
        rep.info(f"fp32 {name} correctly rounded",
                 f"{'yes' if bad == 0 else 'NO'}: {bad} of {got.numel():,} differ from the IEEE "
                 f"oracle" + (f", up to {worst:.1f} ulp" if bad else ""),
                 mismatches=bad, samples=got.numel(), max_ulp=worst)
        verdict[name] = bad == 0
    if args.sqrt_exhaustive:
        bad = _sqrt_every_fp32(device, sync)
        rep.info("fp32 sqrt on every positive fp32", f"{bad:,} of 2,139,095,039 wrong",
                 mismatches=bad)
        verdict["sqrt"] = verdict["sqrt"] and bad == 0
    # the exact path may use the device's own sqrt and division only where both are IEEE
    safe = verdict["sqrt"] and verdict["div"] and args.sqrt_exhaustive
    rep.info(f"{npu.IEEE_ENV}=1",
             "may be set on this device and CANN version (sqrt: every fp32; division: the "
             "samples above)" if safe else
             "must not be set" + ("" if args.sqrt_exhaustive else
                                  " (or run with --sqrt-exhaustive: sqrt on every fp32)"),
             safe=safe)


def _sqrt_every_fp32(device, sync, chunk: int = 1 << 24) -> int:
    """The device's fp32 sqrt against the oracle (fp64 sqrt rounded once) on every positive
    finite fp32, ``chunk`` bit patterns per launch."""
    bad, top = 0, 0x7F800000
    for lo in range(1, top, chunk):
        bits = torch.arange(lo, min(lo + chunk, top), dtype=torch.int32)
        x = bits.view(torch.float32)
        got = torch.sqrt(x.to(device)).cpu()
        sync()
        want = x.double().sqrt().float()
        bad += int((got.view(torch.int32) != want.view(torch.int32)).sum())
    return bad


def check_binding_builds(args, device, backend, sync, rep: Report) -> None:
    rep.say("8. the built-in binding builds, links and finds aclnnApplyFusedEmaAdam")
    if device.type != "npu":
        rep.info("built-in binding", "skipped (needs torch_npu and CANN)", skipped=True)
        return
    from multi_tensor.backends.npu import builder as npu_builder
    from multi_tensor.backends.npu import loader as npu_loader

    try:
        module = npu_builder.FusedEmaAdamBuilder().load(verbose=False)
        npu_loader.probe(module.npu_apply_fused_ema_adamw, device)
        rep.check("built-in binding", True, "built, linked, the probe launch ran")
    except Exception as exc:
        rep.check("built-in binding", False, f"{type(exc).__name__}: {exc}",
                  traceback=traceback.format_exc())


def check_complements(args, device, backend, sync, rep: Report) -> None:
    rep.say("9. the operator's complements 1 - beta1, 1 - beta2, 1 - ema_decay, read off one launch")
    fn = _op_of(backend, device)
    b1, b2, d = HYPER["betas"][0], HYPER["betas"][1], HYPER["ema_decay"]
    one = torch.ones(1, device=device)
    # grad = 1, m = v = 0 -> m' = (1-b1), v' = (1-b2) exactly; lr = 0 keeps var = 1, s = 0 -> s' = (1-d)
    var, m, v, s = one.clone(), 0 * one, 0 * one, 0 * one
    fn(one.clone(), var, m, v, s, torch.ones(1, dtype=torch.int64, device=device), 0.0, d, b1, b2,
       1e-8, 1, False, 0.0)
    sync()
    got = {"1-beta1": float(m.cpu()), "1-beta2": float(v.cpu()), "1-ema_decay": float(s.cpu())}
    models = {"fp32 (1 - fp32(x), the kernel's source)": npu_standin.device_complement,
              "double (fp32(1 - x))": lambda x: npu_standin.f32(1.0 - x)}
    which = [name for name, f in models.items()
             if all(got[k] == f(x) for k, x in (("1-beta1", b1), ("1-beta2", b2), ("1-ema_decay", d)))]
    rep.check("operator complements", bool(which),
              f"{got}: " + (f"as {which[0]}" if which else "neither model"),
              got=got, model=which[0] if which else None)


def check_convert_copy(args, device, backend, sync, rep: Report) -> None:
    rep.say("10. the cost of a dtype-converting copy (bf16 -> fp32) against a same-dtype copy")
    n = args.copy_numel
    src16 = torch.randn(n, device=device).to(torch.bfloat16)
    src32 = torch.randn(n, device=device)
    dst = torch.empty(n, device=device)
    ms_conv = timed(lambda: dst.copy_(src16), args.steps, args.warmup, sync)
    ms_same = timed(lambda: dst.copy_(src32), args.steps, args.warmup, sync)
    rep.info("converting copy", f"{n:,} elements: bf16->fp32 {ms_conv:.3f} ms "
             f"({n * 6 / ms_conv / 1e6:.1f} GB/s), fp32->fp32 {ms_same:.3f} ms "
             f"({n * 8 / ms_same / 1e6:.1f} GB/s); ratio {ms_conv / ms_same:.2f}",
             ms_convert=ms_conv, ms_same=ms_same, numel=n)


def check_huge_launch(args, device, backend, sync, rep: Report) -> None:
    rep.say("11. one operator launch over more than 2^31 elements")
    n = 2 ** 31 + 4096
    need = 5 * 4 * n + (1 << 30)
    free = None
    if device.type == "npu":
        import torch_npu

        free = torch_npu.npu.mem_get_info(device)[0]
    if free is None or free < need:
        rep.info("launch over 2^31 elements", f"skipped: needs {need / 2 ** 30:.0f} GiB free on "
                 f"the device" + (f", {free / 2 ** 30:.0f} GiB are" if free is not None else
                                  " (not on the stand-in)"), skipped=True)
        return
    fn = _op_of(backend, device)
    g = torch.ones(n, device=device)
    var, m, v, s = torch.ones(n, device=device), torch.zeros(n, device=device), \
        torch.zeros(n, device=device), torch.zeros(n, device=device)
    fn(g, var, m, v, s, torch.ones(1, dtype=torch.int64, device=device), 1e-3, 0.9, 0.9, 0.999,
       1e-8, 1, False, 0.0)
    sync()
    idx = torch.tensor([0, 2 ** 31 - 1, 2 ** 31, n - 1], device=device)
    rows = torch.stack([t.index_select(0, idx) for t in (var, m, v, s)]).cpu()
    ok = bool((rows == rows[:, :1]).all()) and float(rows[0, 0]) < 1.0
    rep.check("launch over 2^31 elements", ok, f"elements 0, 2^31-1, 2^31, n-1 of var, m, v, s: "
              f"{rows.tolist()}", values=rows.tolist())
    del g, var, m, v, s


def check_quick_norm(args, device, backend, sync, rep: Report) -> None:
    rep.say("12. the clipped step's one-read grad norm (npu_ops.quick_norm): deterministic, "
            "within its bound, inf on overflow")
    from multi_tensor.backends.npu import ops as npu_ops

    gen = torch.Generator().manual_seed(31)
    worst, runs_differ = 0.0, 0
    for n in (1, 1023, 1024, 4097, 1 << 18, (1 << 20) - 3):
        for scale in (1e-12, 1.0, 1e12):
            x = torch.randn(n, generator=gen) * scale
            want = float(x.double().norm())
            xd = x.to(device)
            a, b = npu_ops.quick_norm(xd), npu_ops.quick_norm(xd)
            sync()
            runs_differ += int(a.cpu().view(torch.int32) != b.cpu().view(torch.int32))
            got = float(a.cpu())
            if want >= npu_ops.QUICK_MIN and math.isfinite(got):
                worst = max(worst, abs(got - want) / want / npu_ops.quick_bound(n))
    big = torch.full((4096,), 3e38, device=device)
    overflow = float(npu_ops.quick_norm(big).cpu())
    nan = torch.ones(4096, device=device)
    nan[7] = float("nan")
    nan_out = float(npu_ops.quick_norm(nan).cpu())
    sync()
    ok = runs_differ == 0 and worst <= 1.0 and math.isinf(overflow) and math.isnan(nan_out)
    rep.check("quick norm", ok,
              f"repeat runs differ: {runs_differ}; worst error {worst:.3f} of the bound; "
              f"overflow -> {overflow}, NaN -> {nan_out}",
              runs_differ=runs_differ, worst_of_bound=worst, overflow=overflow)


def check_capturable(args, device, backend, sync, rep: Report) -> None:
    rep.say("13. capturable=True: the device step counter, the operator's own bias correction, "
            "a cancelled step")
    shapes = shapes_for(args.parity_numel, args.parity_tensors, seed=9)
    steps = max(args.parity_steps, 4)
    for dtype, master in ((torch.float32, False), (torch.bfloat16, True)):
        ours_p = make_params(shapes, dtype, device, 13)
        plain_p = make_params(shapes, dtype, device, 13)
        ours = FusedEmaAdamW(ours_p, master_weights=master, capturable=True, **HYPER)
        plain = FusedEmaAdamW(plain_p, master_weights=master, **HYPER)
        changed, rel, start = None, 0.0, None
        with forced_backend(backend), npu.op_mode("cann"):
            for k in range(steps):
                grads = make_grads(shapes, dtype, 700 + k)
                cancel = k == 2
                set_grads(ours_p, grads)
                set_grads(plain_p, grads)
                for opt in (ours, plain):
                    opt.grad_scale = torch.ones((), device=device)
                    opt.found_inf = torch.tensor([1.0 if cancel else 0.0], device=device)
                if cancel:
                    before = [t.detach().clone() for t in ours_p] + [
                        t.detach().clone() for p in ours_p for t in ours.state[p].values()]
                    ours_p[0].grad.view(-1)[0] = float("inf")
                ours.step()
                plain.step()
                sync()
                if cancel:
                    after = list(ours_p) + [t for p in ours_p for t in ours.state[p].values()]
                    changed = sum(bitwise_mismatches(a, b) for a, b in zip(before, after))
                if k == 0:
                    start = [weights(plain, q).detach().cpu().double() for q in plain_p]
        for p, q, s0 in zip(ours_p, plain_p, start):
            a, b = weights(ours, p).detach().cpu().double(), weights(plain, q).detach().cpu().double()
            moved = (b - s0).abs().max().item()
            if moved > 0:
                rel = max(rel, (a - b).abs().max().item() / moved)
        name = dtype_name(dtype, master)
        rep.check(f"capturable {name}: cancelled step", changed == 0,
                  f"{changed} elements changed by the cancelled step", changed=changed)
        rep.info(f"capturable {name}: against the plain cann path",
                 f"{'masters' if master else 'params'} differ by at most {rel:.2e} of how far "
                 f"they moved over {steps} steps (one cancelled)", rel=rel)
