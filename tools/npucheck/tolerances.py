"""The cann paths' tolerances: the error bound of each sum (``cann_bounds``), the rounding
allowances behind it, and their measurement on the stand-in (``--derive-tolerances``)."""
from __future__ import annotations

from typing import Dict

import torch

from multi_tensor import forced_backend, multi_tensor_fused_ema_adamw
from multi_tensor.backends import npu, registry
from multi_tensor.testing import npu_standin
from multi_tensor.rules import AdamHyper, step_scalars

from .common import Report

# --- the cann tolerances ---------------------------------------------------------------------------
# The cann paths differ from the reference by (a) the kernel's complements, formed in fp32 on the
# device as 1 - fp32(beta) where the reference rounds 1 - beta once from double (a known relative
# gap per coefficient, gap_units), and (b) a different sequence of fp32 roundings. A ulp count of
# the result alone cannot bound either: m = b1*m + (1-b1)*g cancels (m near 0 carries the full
# absolute error of its terms), and var moves by the update, not by its own ulp. So each bound is
# the standard error bound of the sum it comes from, in units of U (fp32's unit roundoff) times
# the magnitudes of the summands (all from the reference's state, in float64 on the host):
#
#   m:   U * (gap_units(b1) * |(1-b1) g| + ROUNDING["m"] * (|b1 m0| + |(1-b1) g|))
#   v:   U * (gap_units(b2) * |(1-b2) g^2| + ROUNDING["v"] * (|b2 v0| + |(1-b2) g^2|))
#   var: U * ROUNDING["w"] * (|var'| + |decay| + |adam|)
#        + |adam| * tol_v / (2 v')  + step_size * tol_m / (sqrt(v') isb2 + eps)
#        (adam = step_size m'/(sqrt(v') isb2 + eps), decay = lr*wd*var0: m's and v's errors
#        carried through the update, plus the update's own roundings and the folded scalars)
#   s (cann, the lerp):  U * ROUNDING["s"] * (|s'| + w |var' - s0|) + w * tol_var   (w = 1 - d)
#   s (cann_literal, s*d + var'*(1-d) with 1 - fp32(d)):
#        U * ROUNDING["s_literal"] * (|s0 d| + |var' (1-d)| + |s'|)
#        + |(1-d)_dev - w| * |var' - s0| + (1-d)_dev * tol_var
#
# ROUNDING = MARGIN x DERIVED, DERIVED = the largest rounding coefficient measured on the stand-in
# (cann_device_op, the kernel's source operation by operation) against the reference, rounded up
# to a quarter, by ``python tools/npu_check.py --stand-in --derive-tolerances`` (7 hyperparameter
# sets x 3 seeds x warm-up 0/1/5/40 steps x fp32 and bf16+fp32 masters x cann and cann_literal,
# 20,000 elements each, 336 runs): m 3.207, v 4.048, var 2.767, s 1.987, s_literal 1.305. The
# error analysis allows (each rounding at most U times its result, both sides counted) m <= 4
# (two products and a sum per side), v <= 6 (one more product), s <= 4 (the lerp's difference,
# product and sum) and s_literal <= 4; var's measured 2.8 sits within the update's chain of six
# roundings and three rounded folded scalars. The complement gaps are not allowances: they are
# the exact difference of the two complements (gap_units), which check 9 confirms on hardware.
MARGIN = 2.0
DERIVED = dict(m=3.25, v=4.25, w=3.0, s=2.25, s_literal=1.5)
"""Measured maxima of the rounding coefficients (``--derive-tolerances``, stand-in)."""
ROUNDING = {k: MARGIN * v for k, v in DERIVED.items()}
U = 2.0 ** -24


def gap_units(beta: float) -> float:
    """How far the kernel's ``1 - fp32(beta)`` is from the reference's ``fp32(1 - beta)``, relative
    to the coefficient, in units of U (0.9: 3.75, 0.999: 216.8)."""
    ref = npu_standin.f32(1.0 - beta)
    return abs(npu_standin.device_complement(beta) - ref) / ref / U if ref else 0.0


def cann_bounds(before, g, after, c, literal: bool, rounding=None):
    """Absolute tolerances (float64 tensors) of one cann step, per quantity (see above).

    ``before``/``after``: dicts ``w, m, v, s`` of float64 tensors (the reference's state before
    the step and after it), ``g``: the step's grads (float64), ``c``: its StepScalars.
    """
    rounding = rounding or ROUNDING
    f32 = npu_standin.f32
    w0, m0, v0, s0 = (before[k] for k in "wmvs")
    w1, m1, v1, s1 = (after[k] for k in "wmvs")
    if c.l2:
        g = g.abs() + abs(f32(c.l2_wd)) * w0.abs()
    gm, gv = g * f32(c.omb1), g * g * f32(c.omb2)
    tol = {}
    tol["m"] = U * (gap_units(c.beta1) * gm.abs()
                    + rounding["m"] * ((m0 * f32(c.beta1)).abs() + gm.abs()))
    tol["v"] = U * (gap_units(c.beta2) * gv.abs()
                    + rounding["v"] * ((v0 * f32(c.beta2)).abs() + gv.abs()))
    denom = v1.clamp_min(0).sqrt() * c.isb2 + c.eps
    adam = c.step_size * m1.abs() / denom
    decay = abs(c.lr_wd) * w0.abs()
    rel_v = torch.where(v1 > 0, tol["v"] / (2 * v1.clamp_min(1e-300)), torch.zeros_like(v1))
    carried = adam * rel_v + c.step_size * tol["m"] / denom
    tol["w"] = U * rounding["w"] * (w1.abs() + decay + adam) + carried
    ew = f32(c.ema_w)
    if literal:
        d = f32(1.0 - c.ema_w)
        omd = npu_standin.device_complement(1.0 - c.ema_w)
        tol["s"] = (U * rounding["s_literal"] * ((s0 * d).abs() + (w1 * omd).abs() + s1.abs())
                    + abs(omd - ew) * (w1 - s0).abs() + omd * tol["w"])
    else:
        tol["s"] = U * rounding["s"] * (s1.abs() + ew * (w1 - s0).abs()) + ew * tol["w"]
    return tol


def rounding_needed(before, g, after, ours, c, literal: bool) -> Dict[str, float]:
    """The smallest rounding coefficients with which ``ours`` meets :func:`cann_bounds` (the
    measured quantity behind ROUNDING): each quantity's excess over its carried terms, in units
    of U times its summands, maximised over the elements."""
    out = {}
    for q in "mvws":
        key = "s_literal" if q == "s" and literal else q
        carried = cann_bounds(before, g, after, c, literal, rounding={**ROUNDING, key: 0.0})[q]
        unit = cann_bounds(before, g, after, c, literal, rounding={**ROUNDING, key: 1.0})[q]
        scale = unit - carried  # U * the summands of this quantity
        err = (ours[q] - after[q]).abs()
        need = torch.where(err > carried, (err - carried) / scale.clamp_min(1e-300),
                           torch.zeros_like(err))
        out[key] = float(need.max()) if need.numel() else 0.0
    return out


DERIVE_HYPERS = [  # lr, beta1, beta2, eps, weight_decay, ema_decay, mode (1 AdamW, 0 Adam + L2)
    (1e-3, 0.9, 0.999, 1e-8, 0.01, 0.9999, 1),
    (3e-4, 0.9, 0.95, 1e-8, 0.1, 0.999, 1),
    (1e-2, 0.8, 0.99, 1e-6, 0.0, 0.99, 1),
    (1e-3, 0.95, 0.9999, 1e-8, 0.05, 0.99999, 1),
    (5e-4, 0.9, 0.98, 1e-5, 0.01, 0.9995, 0),
    (1e-1, 0.5, 0.5, 1e-3, 0.5, 0.5, 1),
    (1e-4, 0.99, 0.999, 1e-12, 1e-4, 0.9999, 0),
]
DERIVE_WARMUPS = (0, 1, 5, 40)


def hyper_of(hp) -> AdamHyper:
    lr, b1, b2, eps, wd, d, mode = hp
    return AdamHyper(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, decoupled=mode == 1,
                     ema_decay=d)


def _grads(n: int, gen: torch.Generator) -> torch.Tensor:
    """Grads over four decades with sign changes and zeros (m cancels, v jumps)."""
    scale = 10.0 ** torch.randint(-4, 1, (n,), generator=gen).double()
    g = torch.randn(n, generator=gen, dtype=torch.float64) * scale
    g[torch.rand(n, generator=gen) < 0.01] = 0.0
    return g.float()


class _Counting:
    """Wraps the backend's device operator for a check, counting launches."""

    def __init__(self, backend_name: str, device):
        self.backend = next(b for b in registry.registered_backends() if b.name == backend_name)
        self.holder = self.backend.device_op
        self.fn, self.why = self.holder.get(device)
        self.launches = 0

    def __enter__(self):
        if self.fn is not None:
            inner = self.fn

            def counted(*a, **k):
                self.launches += 1
                return inner(*a, **k)
            self.holder._fn = counted
        return self

    def __exit__(self, *exc):
        if self.fn is not None:
            self.holder._fn = self.fn


def one_cann_step(device, backend, sync, hp, dtype, master, warm, seed, literal, n):
    """The reference walks ``warm`` steps from zeros; then one step on each side from that state.

    Returns ``(before, grads, after_ref, ours, params_ours, params_ref, c, launches)``: float64
    CPU tensors (``w, m, v, s``: the weights the update runs on, masters for bf16).
    """
    h = hyper_of(hp)
    gen = torch.Generator().manual_seed(seed)
    param = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    work = torch.float32
    state = dict(m=torch.zeros(n, dtype=work), v=torch.zeros(n, dtype=work),
                 s=param.to(work).clone(), w=param.to(work).clone())
    noop = torch.zeros(1, dtype=torch.int32)

    def lists(g, p, st):
        ls = [[g], [p], [st["m"]], [st["v"]], [st["s"]]]
        return ls + [[st["w"]]] if master else ls

    def call(g, p, st, step, be):
        with forced_backend(be):
            multi_tensor_fused_ema_adamw(2048 * 32, noop.to(p.device), lists(g, p, st), h.lr,
                                         h.ema_decay, h.beta1, h.beta2, h.eps, step,
                                         1 if h.decoupled else 0, True, h.weight_decay)
    for k in range(warm):
        call(_grads(n, gen).to(dtype), param, state, k + 1, "reference")
        if not master:
            state["w"] = param.to(work)
    g = _grads(n, gen).to(dtype)
    dev = {k: t.to(device).clone() for k, t in state.items()}
    p_dev = param.to(device).clone()
    if not master:
        dev["w"] = p_dev
    before = {k: t.double() for k, t in state.items()}
    ref_p = param.clone()
    ref = {k: t.clone() for k, t in state.items()}
    if not master:
        ref["w"] = ref_p
    with _Counting(backend, device) as counter, npu.op_mode("cann_literal" if literal else "cann"):
        call(g.to(device), p_dev, dev, warm + 1, backend)
    sync()
    call(g, ref_p, ref, warm + 1, "reference")
    after = {k: t.double() for k, t in ref.items()}
    ours = {k: t.detach().cpu().double() for k, t in dev.items()}
    c = step_scalars(h, warm + 1)
    return (before, g.double(), after, ours, p_dev.detach().cpu(), ref_p, c, counter.launches)


def derive_tolerances(args, device, backend, sync, rep: Report) -> None:
    """The measurement behind DERIVED (``--derive-tolerances``)."""
    rep.say(f"derive: the rounding coefficients cann_bounds() needs, {len(DERIVE_HYPERS)} "
            f"hyperparameter sets x {args.derive_seeds} seeds x warm-up {DERIVE_WARMUPS}, "
            f"fp32 and bf16+fp32 masters, {args.derive_numel:,} elements")
    need = {k: 0.0 for k in ROUNDING}
    ratio = {k: 0.0 for k in ROUNDING}
    runs = 0
    for i, hp in enumerate(DERIVE_HYPERS):
        for literal in (False, True):
            for dtype, master in ((torch.float32, False), (torch.bfloat16, True)):
                for warm in DERIVE_WARMUPS:
                    for seed in range(args.derive_seeds):
                        before, g, after, ours, *_, c, launches = one_cann_step(
                            device, backend, sync, hp, dtype, master, warm,
                            1000 * i + 10 * warm + seed, literal, args.derive_numel)
                        if launches != 1:
                            raise RuntimeError(f"the operator did not run ({launches} launches)")
                        runs += 1
                        for k, x in rounding_needed(before, g, after, ours, c, literal).items():
                            need[k] = max(need[k], x)
                        tol = cann_bounds(before, g, after, c, literal)
                        for q in "mvws":
                            key = "s_literal" if q == "s" and literal else q
                            r = float(((ours[q] - after[q]).abs() / tol[q].clamp_min(1e-300)).max())
                            ratio[key] = max(ratio[key], r)
    for k in ROUNDING:
        rep.info(f"derived rounding {k}", f"needs {need[k]:.3f} (DERIVED {DERIVED[k]}, used "
                 f"{ROUNDING[k]}); worst error at {ratio[k]:.3f} of its bound", need=need[k],
                 ratio=ratio[k])
    rep.check("derived tolerances hold", all(need[k] <= DERIVED[k] for k in ROUNDING),
              f"{runs} runs; every measured coefficient within DERIVED", need=need, runs=runs)
