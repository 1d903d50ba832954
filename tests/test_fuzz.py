"""Seeded random cases, each run crash-isolated: numerics against an independent oracle, AMP
skips, state dict round trips and bad inputs; and the same numerics drawn by hypothesis.

Every case is drawn from its own ``random.Random(case number)``, so a case is reproduced by its
number alone: ``python tests/test_fuzz.py 17 18`` runs case 17 and prints what it did. The cases
run in a worker subprocess that prints ``START n`` before case ``n`` and ``OK n`` or
``FAIL n <why>`` after it; when the worker dies (a segfault, an abort), the case it started is
reported as a crash and a new worker continues with the next one.

Whether a call is valid is decided here, from SPEC.md's rules (:func:`spec_invalid`), never by
the package's checks. A case is mishandled when the process crashes; when a backend refuses a
valid call (however alike the backends refuse it) or accepts an invalid one; when the backends
refuse an invalid call with different exception types, or a refusal changed any tensor; when a
numerics result differs in any bit from the oracle (:func:`oracle`: numpy, one IEEE rounding per
line of README's update table, its scalars from the documented formulas in
``tests/ieee_oracle.py``, fp32 or fp64); or when the reference and native CPU backends (forced
with :func:`multi_tensor.backends.registry.forced_backend`) differ. The test fails on any
mishandled case.
"""
from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
import traceback

N_CASES = 400
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BACKENDS = ("reference", "native_cpu")


# ---------------------------------------------------------------------------------------------
# the worker side (imports torch lazily: the pytest side only starts subprocesses)

def _bits(t):
    import torch
    t = t.detach()
    if t.is_floating_point():
        ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
        t = t.contiguous().view(ints[t.element_size()])
    return t


def _same(a, b) -> bool:
    import torch
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(_bits(a), _bits(b)))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b or (a != a and b != b)


class Mishandled(AssertionError):
    pass


OPS = ("fused_ema_adamw", "adam", "radam", "radam_ema")
CONFIGS = {  # name: (param dtype, state dtype, masters)
    "fp32": ("float32", "float32", False), "fp64": ("float64", "float64", False),
    "fp16": ("float16", "float16", False), "bf16": ("bfloat16", "bfloat16", False),
    "bf16_master": ("bfloat16", "float32", True), "fp16_master": ("float16", "float32", True),
}


def _random_lists(rng, op):
    import torch
    cfg = rng.choice(list(CONFIGS))
    pdt, sdt, master = (getattr(torch, n) if isinstance(n, str) else n for n in CONFIGS[cfg])
    gdt = torch.float64 if pdt == torch.float64 else (
        pdt if rng.random() < 0.5 else rng.choice([torch.float32, torch.float16, torch.bfloat16]))
    ema = op.endswith("ema") or op == "fused_ema_adamw"
    edt = torch.bfloat16 if ema and pdt != torch.float64 and rng.random() < 0.2 else sdt
    gen = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    shapes = [rng.choice([(rng.randrange(0, 70),), (rng.randrange(1, 9), rng.randrange(1, 9)),
                          (2, rng.randrange(0, 5), 3)]) for _ in range(rng.randrange(1, 4))]
    rows = []
    for shape in shapes:
        p = torch.randn(shape, generator=gen, dtype=torch.float64)
        row = [torch.randn(shape, generator=gen, dtype=torch.float64).mul(rng.choice([1e-3, 1, 30]))
               .to(gdt), p.to(pdt), torch.randn(shape, generator=gen, dtype=torch.float64).mul(0.1)
               .to(sdt), torch.rand(shape, generator=gen, dtype=torch.float64).mul(0.01).to(sdt)]
        if ema:
            row.append(p.to(edt))
        if master:
            row.append(p.to(torch.float32))
        if len(shape) == 2 and rng.random() < 0.3:  # one layout for the row: transposed
            row = [t.t().contiguous().t() for t in row]
        rows.append(row)
    lists = [list(col) for col in zip(*rows)]
    return lists, f"{cfg} grads {str(gdt)[6:]} ema {str(edt)[6:]} shapes {shapes}"


def _random_hyper(rng, op):
    h = dict(lr=rng.choice([0.0, 1e-3, 0.1, 3.0]), beta1=rng.choice([0.0, 0.5, 0.9]),
             beta2=rng.choice([0.0, 0.9, 0.999, 0.9999999]), eps=rng.choice([0.0, 1e-8, 1e-3]),
             step=rng.choice([1, 2, 5, 6, 7, 100, 10 ** 6]), mode=rng.choice([0, 1]),
             bias_correction=rng.random() < 0.8, weight_decay=rng.choice([0.0, 0.01, 0.5]),
             ema_decay=rng.choice([0.0, 0.5, 0.9999]), maximize=rng.random() < 0.2,
             check_finite=rng.random() < 0.3, grad_scale=None)
    if rng.random() < 0.3:
        h["grad_scale"] = rng.choice([(), (1,)]), rng.choice([1.0, 512.0, 3.0])
    return h


def _call(op, lists, h, flag, chunk=2048):
    import torch
    import multi_tensor as mt
    kw = dict(maximize=h["maximize"], check_finite=h["check_finite"])
    gs = h["grad_scale"]
    if isinstance(gs, tuple):
        kw["grad_scale"] = torch.full(gs[0], gs[1], dtype=torch.float32)
    elif gs is not None:
        kw["grad_scale"] = gs
    if op == "fused_ema_adamw":
        mt.multi_tensor_fused_ema_adamw(chunk, flag, lists, h["lr"], h["ema_decay"], h["beta1"],
                                        h["beta2"], h["eps"], h["step"], h["mode"],
                                        h["bias_correction"], h["weight_decay"], **kw)
    elif op == "adam":
        mt.multi_tensor_adam(chunk, flag, lists, h["lr"], h["beta1"], h["beta2"], h["eps"],
                             h["step"], h["mode"], h["bias_correction"], h["weight_decay"], **kw)
    elif op == "radam":
        mt.multi_tensor_radam(chunk, flag, lists, h["lr"], h["beta1"], h["beta2"], h["eps"],
                              h["step"], h["weight_decay"], h["mode"] == 1, **kw)
    else:
        mt.multi_tensor_radam_ema(chunk, flag, lists, h["lr"], h["ema_decay"], h["beta1"],
                                  h["beta2"], h["eps"], h["step"], h["weight_decay"],
                                  h["mode"] == 1, **kw)


def _per_backend(fn, names=BACKENDS):
    """``fn()`` under each backend: {name: (result or None, exception or None)}."""
    from multi_tensor.backends.registry import forced_backend
    out = {}
    for name in names:
        with forced_backend(name):
            try:
                out[name] = (fn(), None)
            except Exception as exc:  # judged by the caller: by validity, then alike
                out[name] = (None, exc)
    return out


def _all_ran(out, what):
    """A valid input: every backend must have run it (a refusal is mishandling, however alike)."""
    refused = {name: exc for name, (_, exc) in out.items() if exc is not None}
    if refused:
        raise Mishandled(f"{what}: a valid input refused by " + ", ".join(
            f"{name} ({exc!r})" for name, exc in refused.items()))


def _agree(out, what):
    (ra, ea), (rb, eb) = out["reference"], out["native_cpu"]
    if (ea is None) != (eb is None):
        raise Mishandled(f"{what}: reference {'refused: ' + repr(ea) if ea else 'accepted'}, "
                         f"native_cpu {'refused: ' + repr(eb) if eb else 'accepted'}")
    if ea is not None:
        if type(ea) is not type(eb):
            raise Mishandled(f"{what}: refused as {type(ea).__name__} by the reference and as "
                             f"{type(eb).__name__} by native_cpu")
        return
    if not _same(ra, rb):
        raise Mishandled(f"{what}: reference and native_cpu results differ")


# --- what SPEC.md accepts, decided here (never by the package's own checks) --------------------

EMA_OPS = ("fused_ema_adamw", "radam_ema")
FLOATS16 = ("float16", "bfloat16")


def _dtype_name(t) -> str:
    return str(t.dtype)[len("torch."):]


def _span(t):
    """(storage address, first byte, one past the last byte) of a nonempty strided tensor."""
    size = t.element_size()
    lo = t.storage_offset() * size
    hi = lo + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * size
    return t.untyped_storage().data_ptr(), lo, hi


def spec_invalid(op, lists, h, flag):
    """Why SPEC.md (sections 3 and 5; README's bf16 EMA and op list) refuses the call, or None
    when it is valid. Lists: [grads, params, exp_avgs, exp_avg_sqs] + emas (the EMA ops) +
    masters (optional); every list one dtype; params fp16/bf16/fp32/fp64; without masters the
    state has the params' dtype, with masters (not for fp64) it is fp32; an fp32-math EMA may be
    bf16; grads fp16/bf16/fp32 (fp64 for fp64 params); no written tensor shares memory with
    another tensor of the call; noop_flag and grad_scale 1-element tensors; hyperparameters in
    torch's ranges."""
    import math
    import torch
    if not isinstance(flag, torch.Tensor) or flag.numel() != 1 or flag.is_meta:
        return "noop_flag is not a 1-element tensor"
    ema = op in EMA_OPS
    if not isinstance(lists, list) or not all(isinstance(ts, list) for ts in lists):
        return "tensor_lists is not a list of lists"
    base = 5 if ema else 4
    if len(lists) not in (base, base + 1):
        return f"{len(lists)} lists"
    master = len(lists) == base + 1
    names = ["grads", "params", "exp_avgs", "exp_avg_sqs"] + ["emas"] * ema + ["masters"] * master
    named = dict(zip(names, lists))
    if len({len(ts) for ts in lists}) != 1:
        return "list lengths differ"
    for name, ts in named.items():
        for t in ts:
            if (not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta
                    or not t.is_floating_point()):
                return f"{name}: not a dense float tensor with storage"
        if len({t.dtype for t in ts}) > 1:
            return f"{name}: mixed dtypes"
    for row in zip(*lists):
        if len({tuple(t.shape) for t in row}) != 1:
            return "shapes differ in a row"
    if not lists[0]:
        return None
    dt = {name: _dtype_name(ts[0]) for name, ts in named.items()}
    p = dt["params"]
    if p not in ("float16", "bfloat16", "float32", "float64"):
        return "params dtype"
    state = "float32" if master else p
    if master and p == "float64":
        return "masters for fp64 params"
    for name in ("exp_avgs", "exp_avg_sqs", "masters"):
        if name in dt and dt[name] != state:
            return f"{name} dtype"
    if ema and dt["emas"] != state and not (dt["emas"] == "bfloat16" and p != "float64"):
        return "emas dtype"
    if dt["grads"] not in (("float64",) if p == "float64" else ("float16", "bfloat16", "float32")):
        return "grads dtype"
    slots = [(name, t) for name, ts in named.items() for t in ts if t.numel()]
    for name, t in slots:
        if name != "grads" and any(n > 1 and st == 0 for n, st in zip(t.shape, t.stride())):
            return f"{name}: internal overlap"
    spans = [(name, _span(t)) for name, t in slots]
    for i, (na, (sa, la, ha)) in enumerate(spans):
        for nb, (sb, lb, hb) in spans[i + 1:]:
            if sa == sb and la < hb and lb < ha and (na != "grads" or nb != "grads"):
                return f"{na} and {nb} share memory"

    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    if not (number(h["lr"]) and h["lr"] >= 0 and number(h["eps"]) and h["eps"] >= 0
            and number(h["weight_decay"]) and h["weight_decay"] >= 0):
        return "lr, eps or weight_decay"
    if not all(number(h[b]) and 0 <= h[b] < 1 for b in ("beta1", "beta2")):
        return "betas"
    if not (isinstance(h["step"], int) and h["step"] >= 1):
        return "step"
    if op in ("fused_ema_adamw", "adam") and h["mode"] not in (0, 1):
        return "mode"
    if ema and not (number(h["ema_decay"]) and 0 <= h["ema_decay"] < 1):  # the betas' range
        return "ema_decay"
    gs = h["grad_scale"]
    if gs is not None:
        if isinstance(gs, tuple):  # (shape, value): _call makes the fp32 tensor
            gs = torch.full(gs[0], gs[1], dtype=torch.float32)
        if not isinstance(gs, torch.Tensor) or gs.numel() != 1 or not gs.is_floating_point():
            return "grad_scale is not a 1-element float tensor"
    return None


# --- the independent oracle: numpy, one IEEE rounding per line (tests/ieee_oracle.py) ------------

def _to_np(t, kind):
    import torch
    return t.detach().to("cpu", torch.float64).numpy().astype(kind)


def _round_to(x, dtype_name):
    """Round math-type values once to a storage dtype (round to nearest even), as a float64 array
    of the stored values."""
    import numpy as np
    from ieee_oracle import bf16_round
    if dtype_name == "bfloat16":
        return bf16_round(x.astype(np.float32)).astype(np.float64)
    kind = {"float16": np.float16, "float32": np.float32, "float64": np.float64}[dtype_name]
    return x.astype(kind).astype(np.float64)


def oracle(op, lists, h):
    """What the call must leave: (the lists' values as float64 arrays, NaN wherever NaN; the
    flag's value), computed from the documented update (README "The update", SPEC section 2)."""
    import numpy as np
    import ieee_oracle
    ema = op in EMA_OPS
    master = len(lists) == (6 if ema else 5)
    start = [[_to_np(t, np.float64) for t in ts] for ts in lists]
    if h["check_finite"] and not all(np.isfinite(g).all() for g in start[0]):
        return start, 1
    k = np.float64 if str(lists[1][0].dtype) == "torch.float64" else np.float32
    radam = op.startswith("radam")
    c = ieee_oracle.scalars(
        rule="radam" if radam else "adam", lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"],
        eps=h["eps"], step=h["step"], weight_decay=h["weight_decay"], decoupled=h["mode"] == 1,
        bias_correction=h["bias_correction"], maximize=h["maximize"],
        ema_decay=h["ema_decay"] if ema else None)
    inv = None
    if h["grad_scale"] is not None:
        inv = k(1) / k(np.float32(h["grad_scale"][1]))  # the fp32 scale, exact in the math type
    out = [list(ts) for ts in start]
    w_list = 5 if master and ema else 4 if master else 1
    for i in range(len(lists[0])):
        g = start[0][i].astype(k)
        w, m, v = start[w_list][i].astype(k), start[2][i].astype(k), start[3][i].astype(k)
        s = start[4][i].astype(k) if ema else None
        w2, m2, v2, s2 = ieee_oracle.adam_update(c, g, w, m, v, s, dtype=k, inv_scale=inv)
        stored = lambda li, x: _round_to(np.asarray(x), str(lists[li][i].dtype)[6:])  # noqa: E731
        out[2][i], out[3][i] = stored(2, m2), stored(3, v2)
        if ema:
            out[4][i] = stored(4, s2)
        out[w_list][i] = stored(w_list, w2)
        out[1][i] = stored(1, w2)  # with masters the param gets the master rounded once
    return out, 0


def _same_values(got, want) -> bool:
    """Bitwise equal as float64 values (exact for every float dtype), every NaN equal to every NaN
    (numpy and torch need not agree on a NaN's payload), +0 and -0 distinct."""
    import numpy as np
    return got.shape == want.shape and bool(np.all(
        (np.isnan(got) & np.isnan(want)) | ((got == want) & (np.signbit(got) == np.signbit(want)))))


def _check_oracle(out, op, lists, h, what):
    import numpy as np
    want, want_flag = oracle(op, lists, h)
    for name, (res, _) in out.items():
        got, flag = res
        if int(flag.item()) != want_flag:
            raise Mishandled(f"{what}: {name} left noop_flag {int(flag.item())}, the oracle "
                             f"{want_flag}")
        for li, (ts, ws) in enumerate(zip(got, want)):
            for i, (t, w) in enumerate(zip(ts, ws)):
                if not _same_values(_to_np(t, np.float64).reshape(w.shape), w):
                    raise Mishandled(f"{what}: {name}: list {li} tensor {i} differs from the "
                                     f"numpy oracle")


def case_numerics(rng):
    import torch
    op = rng.choice(OPS)
    lists, desc = _random_lists(rng, op)
    h = _random_hyper(rng, op)
    if h["check_finite"] and rng.random() < 0.5 and lists[0][0].numel():
        g = lists[0][0]
        where = torch.unravel_index(torch.tensor(rng.randrange(g.numel())), g.shape)
        g[tuple(where)] = rng.choice([float("inf"), float("nan")])
    chunk = rng.choice([7, 64, 2048])
    what = f"{op} {desc} {h}"
    # each backend gets clones (an fp64 param and its EMA start as one tensor here: not then)
    why = spec_invalid(op, [[t.clone() for t in ts] for ts in lists], h,
                       torch.zeros(1, dtype=torch.int32))
    if why is not None:
        raise Mishandled(f"{what}: the generator made an input SPEC.md refuses ({why})")

    def run():
        mine = [[t.clone() for t in ts] for ts in lists]  # clone keeps a transposed layout
        flag = torch.zeros(1, dtype=torch.int32)
        _call(op, mine, h, flag, chunk=chunk)
        return mine, flag
    out = _per_backend(run)
    _all_ran(out, what)
    _check_oracle(out, op, lists, h, what)
    _agree(out, what)
    return f"numerics {op} {desc}"


def _make_optimizer(rng):
    import torch
    import fused_optim as fo
    cls = rng.choice([fo.FusedEmaAdamW, fo.FusedAdam, fo.FusedAdamW, fo.FusedRAdam])
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16])
    kw = dict(lr=rng.choice([1e-3, 0.05]), weight_decay=rng.choice([0.0, 0.01]),
              betas=(0.9, rng.choice([0.99, 0.999, 0.9999999])))
    if dtype != torch.float32 and cls is not fo.FusedRAdam:
        kw["master_weights"] = rng.random() < 0.7
    if cls is fo.FusedEmaAdamW:
        kw["ema_decay"] = rng.choice([0.9, 0.999])
    seed = rng.randrange(2 ** 31)
    n = rng.randrange(1, 4)
    shapes = [(rng.randrange(1, 40),) for _ in range(n)]
    return cls, dtype, kw, seed, shapes


def _params(dtype, seed, shapes):
    import helpers  # tests/helpers.py (the worker puts tests/ on sys.path)
    return helpers.make_params(shapes, dtype, seed)


def _grads(step, dtype, seed, shapes, inf_at):
    import torch
    gen = torch.Generator().manual_seed(seed + 1000 * step)
    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    if step == inf_at:
        grads[0].view(-1)[0] = float("inf")
    return grads


def case_optimizer(rng):
    """Steps under GradScaler (some with an inf grad: skipped), a state dict round trip in the
    middle: the resumed optimizer must continue bit for bit, on both backends alike."""
    import torch
    cls, dtype, kw, seed, shapes = _make_optimizer(rng)
    steps = rng.randrange(2, 6)
    inf_at = rng.choice([None, rng.randrange(steps)])
    cut = rng.randrange(1, steps)
    amp = rng.random() < 0.6

    def train(resume: bool):
        params = _params(dtype, seed, shapes)
        opt = cls(params, **kw)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if amp else None
        for s in range(steps):
            if resume and s == cut:
                saved = copy.deepcopy(opt.state_dict())
                params = [torch.nn.Parameter(p.detach().clone()) for p in params]
                opt = cls(params, **kw)
                opt.load_state_dict(saved)
            grads = _grads(s, dtype, seed, shapes, inf_at)
            for p, g in zip(params, grads):
                p.grad = g * scaler.get_scale() if amp else g
            if amp:
                scaler.scale(torch.ones(()))
                scaler.step(opt)
                scaler.update()
            elif s != inf_at:
                opt.step()
        state = {i: dict(opt.state[p]) for i, p in enumerate(params)}
        return [p.detach() for p in params], state

    what = f"{cls.__name__} {dtype} {kw} steps {steps} inf at {inf_at} amp {amp}"
    straight = _per_backend(lambda: train(False))
    _all_ran(straight, what)  # every optimizer, dtype and option drawn here is a valid use
    _agree(straight, what)
    out = _per_backend(lambda: train(True))
    _all_ran(out, what + f" resumed at {cut}")
    _agree(out, what + f" resumed at {cut}")
    for name in BACKENDS:
        if not _same(out[name][0], straight[name][0]):
            raise Mishandled(f"{what}: {name}: resuming from a state dict at step {cut} changed "
                             f"the result")
    return f"optimizer {what}"


def _bad_edits(rng, op, lists, h):
    """One bad input: (description, edit of (lists, h) in place, chunk size)."""
    import torch
    n_lists = len(lists)
    li = rng.randrange(n_lists)
    i = rng.randrange(len(lists[li]))
    t = lists[li][i]
    written = [k for k in range(1, n_lists)]
    choices = [
        ("grad_scale empty", lambda: h.update(grad_scale=torch.tensor([]))),
        ("grad_scale of 2", lambda: h.update(grad_scale=torch.tensor([2.0, 3.0]))),
        ("grad_scale float", lambda: h.update(grad_scale=2.0)),
        ("grad_scale int tensor", lambda: h.update(grad_scale=torch.tensor([2]))),
        ("lr nan", lambda: h.update(lr=float("nan"))),
        ("beta1 1", lambda: h.update(beta1=1.0)),
        ("eps -1", lambda: h.update(eps=-1.0)),
        ("step 0", lambda: h.update(step=0)),
        ("non-tensor", lambda: lists[li].__setitem__(i, "x")),
        ("None tensor", lambda: lists[li].__setitem__(i, None)),
        ("shape", lambda: lists[li].__setitem__(i, torch.zeros(t.numel() + 1, dtype=t.dtype))),
        ("int tensor", lambda: lists[li].__setitem__(i, torch.zeros(t.shape, dtype=torch.int32))),
        ("extra list", lambda: lists.append([x.clone() for x in lists[1]])),
        ("missing list", lambda: lists.pop()),
        ("sparse grad", lambda: lists[0].__setitem__(i, lists[0][i].to_sparse())),
        ("expanded param", lambda: lists[1].__setitem__(
            i, torch.zeros(1, dtype=lists[1][i].dtype).expand(lists[1][i].shape))),
        ("param twice", lambda: lists[1].__setitem__(i, lists[1][(i + 1) % len(lists[1])])),
        ("state aliases param", lambda: lists[rng.choice(written)].__setitem__(i, lists[1][i])),
        ("grad aliases state", lambda: lists[0].__setitem__(i, lists[rng.choice(written)][i])),
        ("meta tensor", lambda: lists[li].__setitem__(i, t.to("meta"))),
    ]
    if op in ("fused_ema_adamw", "adam"):
        choices.append(("mode None", lambda: h.update(mode=None)))
        choices.append(("mode 2", lambda: h.update(mode=2)))
    return rng.choice(choices)


def case_bad_input(rng):
    """A valid call with one edit, judged by :func:`spec_invalid`: when the edit made it invalid
    every backend refuses it with the same exception type, without a crash and with no tensor
    changed; when the call is still valid (a 5th list read as masters, a list's one tensor
    "repeated" onto itself) every backend runs it."""
    import torch
    op = rng.choice(OPS)
    lists, desc = _random_lists(rng, op)
    h = _random_hyper(rng, op)
    h["check_finite"] = False
    flag_kind = rng.choice(["good", "good", "good", "None", "empty", "int"])
    name, edit = _bad_edits(rng, op, lists, h)
    edit()
    if flag_kind != "good":
        name += f" / flag {flag_kind}"
    # the same tensors go to both backends: a refusal must leave every one unchanged
    tensors = [t for ts in lists if isinstance(ts, list) for t in ts
               if isinstance(t, torch.Tensor) and not t.is_meta and not t.is_sparse]
    before = [t.clone() for t in tensors]

    def make_flag():
        return {"good": torch.zeros(1, dtype=torch.int32), "None": None,
                "empty": torch.zeros(0, dtype=torch.int32), "int": 0}[flag_kind]

    def run():
        _call(op, lists, h, make_flag())
        for t, b in zip(tensors, before):
            t.copy_(b)  # an accepted call must be repeatable on the other backend
    why = spec_invalid(op, lists, h, make_flag())  # some edits leave a valid call (a 5th list: masters)
    out = _per_backend(run)
    what = f"input {name!r} for {op} {desc}"
    for backend, (_, exc) in out.items():
        changed = [k for k, (t, b) in enumerate(zip(tensors, before)) if not _same(t, b)]
        if exc is not None and changed:
            raise Mishandled(f"{what}: {backend} refused ({exc!r}) after writing tensors {changed}")
    if why is None:
        _all_ran(out, what + " (valid by SPEC.md)")
    else:
        accepted = [backend for backend, (_, exc) in out.items() if exc is None]
        if accepted:
            raise Mishandled(f"{what}: invalid by SPEC.md ({why}) but accepted by {accepted}")
    _agree({k: (None, e) for k, (_, e) in out.items()}, what)
    return f"{what}: " + (f"refused ({why}): {type(out['reference'][1]).__name__}"
                          if why else "valid, run by both")


KINDS = (case_numerics, case_numerics, case_optimizer, case_bad_input, case_bad_input)


def run_case(n: int) -> str:
    rng = random.Random(n)
    kind = rng.choice(KINDS)
    if os.environ.get("FUZZ_CRASH_CASE") == str(n):  # the isolation's own test
        import ctypes
        ctypes.string_at(0)
    return kind(rng)


def worker(first: int, last: int, verbose: bool) -> None:
    sys.path[:0] = [ROOT, HERE]
    import torch
    import multi_tensor  # noqa: F401
    import warnings
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    for n in range(first, last):
        print(f"START {n}", flush=True)
        try:
            what = run_case(n)
            print(f"OK {n}" + (f" {what}" if verbose else ""), flush=True)
        except Mishandled as exc:
            print(f"FAIL {n} {exc}".replace("\n", " "), flush=True)
        except Exception:
            why = traceback.format_exc().strip().splitlines()
            print(f"FAIL {n} the case itself raised: {why[-1]} (at {why[-3].strip()})", flush=True)


# ---------------------------------------------------------------------------------------------
# the pytest side

def run_isolated(first: int, last: int, env=None, timeout: float = 240.0):
    """{case: None (handled) or why not}, every case in [first, last), restarting the worker
    after a crash."""
    results = {}
    n = first
    while n < last:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(n), str(last)],
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        started = None
        for line in proc.stdout.splitlines():
            kind, _, rest = line.partition(" ")
            num, _, why = rest.partition(" ")
            if kind == "START":
                started = int(num)
            elif kind in ("OK", "FAIL"):
                results[int(num)] = None if kind == "OK" else why
                started = None
        if started is None:
            if proc.returncode != 0:
                raise AssertionError(f"the fuzz worker failed outside a case (rc "
                                     f"{proc.returncode}): {proc.stderr[-2000:]}")
            break
        results[started] = (f"the process died (rc {proc.returncode}, signal "
                            f"{-proc.returncode if proc.returncode < 0 else 'none'}): "
                            f"{proc.stderr.strip().splitlines()[-1:] or ''}")
        n = started + 1
    return results


def _native_registered() -> bool:
    sys.path[:0] = [ROOT]
    import multi_tensor
    return "native_cpu" in [b.name for b in multi_tensor.registered_backends()]


def test_fuzz_cases_are_handled():
    import pytest
    if not _native_registered():
        pytest.skip("native CPU backend not built: nothing to compare the reference with")
    results = run_isolated(0, N_CASES)
    assert len(results) == N_CASES
    bad = {n: why for n, why in results.items() if why is not None}
    assert not bad, f"{len(bad)} of {N_CASES} cases mishandled (rerun one with `python " \
        f"tests/test_fuzz.py N N+1`):\n" + "\n".join(f"case {n}: {w}" for n, w in sorted(bad.items()))


def _hypothesis_numerics():
    """The numerics check in this process, its inputs drawn by hypothesis (shrunk to a smallest
    failing example): every registered backend runs the valid call and equals the oracle."""
    import random as _random
    from hypothesis import given, settings, strategies as st

    unit = st.sampled_from([0.0, 0.5, 0.9, 0.999]) | st.floats(0.0, 1.0, exclude_max=True)

    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @given(op=st.sampled_from(OPS), seed=st.integers(0, 2 ** 31 - 1),
           lr=st.sampled_from([0.0, 1e-3, 3.0]) | st.floats(0.0, 10.0),
           beta1=unit, beta2=unit | st.sampled_from([0.9999999]),
           eps=st.sampled_from([0.0, 1e-8]) | st.floats(0.0, 1e-2),
           step=st.integers(1, 40) | st.integers(1, 10 ** 7),
           weight_decay=st.sampled_from([0.0, 0.01]) | st.floats(0.0, 1.0),
           ema_decay=unit, mode=st.sampled_from([0, 1]),
           bias_correction=st.booleans(), maximize=st.booleans(),
           grad_scale=st.none() | st.tuples(st.sampled_from([(), (1,)]),
                                            st.sampled_from([1.0, 3.0, 65536.0])))
    def check(op, seed, grad_scale, **h):
        import torch
        h.update(grad_scale=grad_scale, check_finite=False)
        lists, desc = _random_lists(_random.Random(seed), op)
        what = f"{op} {desc} {h}"
        assert spec_invalid(op, [[t.clone() for t in ts] for ts in lists], h,
                            torch.zeros(1, dtype=torch.int32)) is None

        def run():
            mine = [[t.clone() for t in ts] for ts in lists]
            flag = torch.zeros(1, dtype=torch.int32)
            _call(op, mine, h, flag)
            return mine, flag
        names = [b for b in BACKENDS if b in [x.name for x in multi_tensor.registered_backends()]]
        out = _per_backend(run, names)
        _all_ran(out, what)
        _check_oracle(out, op, lists, h, what)
    import multi_tensor
    check()


def test_numerics_match_the_oracle_hypothesis():
    sys.path[:0] = [ROOT, HERE]
    _hypothesis_numerics()


def test_the_oracle_scalars_are_the_rules_scalars():
    """The oracle's scalars (from the documented formulas) against multi_tensor.rules', over
    steps where RAdam's rectification turns on and beta2 near 1: the two sides are written
    apart, so a change to either shows here before it shows as a bit in a fuzz case."""
    sys.path[:0] = [ROOT, HERE]
    import ieee_oracle
    from multi_tensor import rules
    for rule in (rules.ADAM, rules.RADAM):
        for beta2 in (0.0, 0.9, 0.999, 0.9999999):
            for step in (1, 2, 5, 6, 7, 100, 10 ** 6):
                for wd, decoupled in ((0.0, True), (0.01, True), (0.01, False)):
                    h = rules.AdamHyper(lr=3e-3, beta1=0.9, beta2=beta2, eps=1e-8,
                                        weight_decay=wd, decoupled=decoupled, ema_decay=0.999,
                                        rule=rule, bias_correction=step % 2 == 0)
                    want = rules.step_scalars(h, step)
                    got = ieee_oracle.scalars(
                        rule=rule, lr=h.lr, beta1=h.beta1, beta2=beta2, eps=h.eps, step=step,
                        weight_decay=wd, decoupled=decoupled, bias_correction=h.bias_correction,
                        ema_decay=h.ema_decay)
                    for name in want._fields:
                        if name in ("l2_wd", "lr_wd"):  # the oracle's flags gate these
                            continue
                        assert getattr(got, name) == getattr(want, name), (rule, beta2, step, name)


def test_a_crashing_case_is_reported_and_the_rest_still_run():
    results = run_isolated(3, 6, env={"FUZZ_CRASH_CASE": "4"})
    assert sorted(results) == [3, 4, 5]
    assert "the process died" in results[4] and "signal 11" in results[4]


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), verbose=os.environ.get("FUZZ_VERBOSE") == "1")
