"""The table behind tests/test_backends.py, in the style of torch's OptimizerInfo.

Three tables, each declared once:

* :data:`DTYPE_CASES`: the dtype combinations an Adam-family op accepts (multi_tensor/schema.py),
  each with its list form (with or without fp32 masters), and for the ops with an EMA a bf16
  EMA beside state of another dtype (:func:`dtype_cases` gives an op's cases);
* :data:`OP_INFOS`: one :class:`OpInfo` per Adam-family op of ``schema.OPS``: how to call its
  front end, its float64 oracle, and its hyperparameter switches (:class:`HyperCase`);
* the backends: every name in ``multi_tensor.registered_backends()`` (plus ``native_cpu`` when it
  did not register, so that its absence shows as a skip with the reason).

The float64 oracles do not import the package's update rule: fused_ema_adamw and adam are
``seed_reference.seed_update`` (the seed operator transcribed); radam and radam_ema are
:func:`radam_f64`, ``torch.optim.RAdam``'s formula written out in float64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import multi_tensor
from multi_tensor import rules, schema
from seed_reference import seed_update

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

# Backends a test run is expected to have; they are listed (and skipped with the reason) even
# when they did not register.
EXPECTED_BACKENDS = ("reference", "native_cpu")


# --------------------------------------------------------------------------------------------
# dtype combinations

@dataclass(frozen=True)
class DtypeCase:
    """Param and grad dtypes, whether the bucket carries fp32 master weights, and the EMA's
    dtype when it is not the state dtype (a bf16 EMA; ops with an EMA only)."""

    name: str
    param: torch.dtype
    grad: torch.dtype
    master: bool
    ema: Optional[torch.dtype] = None

    @property
    def state(self) -> torch.dtype:
        """The dtype of exp_avgs, exp_avg_sqs (and masters), and of emas unless ``ema``."""
        return F32 if self.master else self.param

    @property
    def ema_dtype(self) -> torch.dtype:
        return self.ema or self.state

    @property
    def math(self) -> torch.dtype:
        return F64 if self.param == F64 else F32


DTYPE_CASES: Tuple[DtypeCase, ...] = (
    DtypeCase("fp32", F32, F32, False),
    DtypeCase("fp64", F64, F64, False),
    DtypeCase("bf16_master", BF16, BF16, True),
    DtypeCase("fp16_master_g32", F16, F32, True),
    DtypeCase("bf16_plain", BF16, BF16, False),
    DtypeCase("fp16_plain", F16, F16, False),
    DtypeCase("fp32_gbf16", F32, BF16, False),
    DtypeCase("fp32_ema_bf16", F32, F32, False, ema=BF16),
    DtypeCase("bf16_master_ema_bf16", BF16, BF16, True, ema=BF16),
    DtypeCase("fp16_plain_ema_bf16", F16, F16, False, ema=BF16),
)
DTYPES: Dict[str, DtypeCase] = {d.name: d for d in DTYPE_CASES}


def dtype_cases(op: "OpInfo") -> Tuple[DtypeCase, ...]:
    """The dtype cases of ``op``: the EMA-dtype cases only for the ops that keep an EMA."""
    return tuple(dc for dc in DTYPE_CASES if dc.ema is None or op.ema)


# --------------------------------------------------------------------------------------------
# hyperparameter switches

@dataclass(frozen=True)
class HyperCase:
    """One setting of the switches, run for each of ``steps`` in turn on the same lists."""

    name: str
    steps: Tuple[int, ...]
    lr: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.05
    decoupled: bool = True
    bias_correction: bool = True
    maximize: bool = False
    grad_scale: Optional[float] = None   # grads are made this much larger, and unscaled in the op
    check_finite: bool = False
    ema_decay: float = 0.9               # used by the ops with an EMA only

    def grad_scale_tensor(self) -> Optional[torch.Tensor]:
        return None if self.grad_scale is None else torch.tensor([self.grad_scale])


ADAM_STEPS = (1, 2, 10)
# beta2 = 0.999: rho_t <= 5 (un-rectified) for steps 1..5, rectified from step 6
RADAM_STEPS = (1, 5, 6, 1000)


def _switches(steps: Tuple[int, ...], adam: bool) -> Tuple[HyperCase, ...]:
    cases = [
        HyperCase("decoupled", steps),
        HyperCase("l2", steps, decoupled=False),
        HyperCase("wd0", steps, weight_decay=0.0),
        HyperCase("maximize_l2", steps, maximize=True, decoupled=False),
        # a scale whose inverse is not a power of two, so the unscale rounds
        HyperCase("grad_scale_check_finite", steps, grad_scale=1536.0, check_finite=True),
        HyperCase("maximize_grad_scale_decoupled", steps, maximize=True, grad_scale=512.0,
                  lr=3e-3, beta1=0.5, beta2=0.99 if adam else 0.999, eps=1e-6),
    ]
    if adam:
        cases.append(HyperCase("no_bias_correction", steps, bias_correction=False))
        cases.append(HyperCase("no_bias_correction_l2", steps, bias_correction=False,
                               decoupled=False))
    return tuple(cases)


# --------------------------------------------------------------------------------------------
# float64 oracles

def radam_f64(g, w, m, v, s, *, lr, beta1, beta2, eps, step, weight_decay, decoupled, maximize,
              grad_scale, ema_decay):
    """One step of ``torch.optim.RAdam`` (plus an EMA ``d * s + (1 - d) * w``) in float64."""
    g, w, m, v = (t.detach().to(F64) for t in (g, w, m, v))
    if grad_scale is not None:
        g = g / grad_scale
    if maximize:
        g = -g
    if weight_decay:
        if decoupled:
            w = w * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * w
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * beta2 ** step / bc2
    if rho_t > 5:
        rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf
                         / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
        # torch: bias_corrected_exp_avg * lr * (sqrt(bc2) / (sqrt(v) + eps)) * rect
        w = w - (m / bc1) * lr * (math.sqrt(bc2) / (torch.sqrt(v) + eps)) * rect
    else:
        w = w - lr * (m / bc1)
    if s is not None:
        s = ema_decay * s.detach().to(F64) + (1 - ema_decay) * w
    return w, m, v, s


def radam_is_rectified(beta2: float, step: int) -> bool:
    """rho_t > 5, from the formula (independent of multi_tensor.rules.radam_rect)."""
    rho_inf = 2 / (1 - beta2) - 1
    return rho_inf - 2 * step * beta2 ** step / (1 - beta2 ** step) > 5


# --------------------------------------------------------------------------------------------
# the ops

@dataclass(frozen=True)
class OpInfo:
    """An Adam-family op of ``schema.OPS``: its front end, its oracle, its switches."""

    name: str
    front_end: Callable          # front_end(chunk_size, noop, lists, h, step, **kw)
    hyper_cases: Tuple[HyperCase, ...] = field(repr=False)

    @property
    def spec(self) -> schema.OpSpec:
        return schema.OPS[self.name]

    @property
    def ema(self) -> bool:
        return self.spec.has_ema

    @property
    def rule(self) -> str:
        return self.spec.rule

    def names(self, master: bool) -> Tuple[str, ...]:
        return multi_tensor.ops.POSITIONAL[self.name][1 if master else 0]

    def named(self, lists) -> schema.AdamLists:
        """Positional (apex) lists of this op by name, through the apex adapter's forms."""
        return multi_tensor.ops.named_lists(self.spec, lists)

    def call(self, chunk_size: int, noop: torch.Tensor, lists, h: HyperCase, step: int, *,
             check_finite: Optional[bool] = None) -> None:
        """Run the op through its public front end (``multi_tensor.multi_tensor_*``)."""
        self.front_end(chunk_size, noop, lists, h, step, grad_scale=h.grad_scale_tensor(),
                       maximize=h.maximize,
                       check_finite=h.check_finite if check_finite is None else check_finite)

    def hyper(self, h: HyperCase) -> rules.AdamHyper:
        return rules.AdamHyper(lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                               weight_decay=h.weight_decay, decoupled=h.decoupled,
                               bias_correction=h.bias_correction, maximize=h.maximize,
                               ema_decay=h.ema_decay if self.ema else None, rule=self.rule)

    def scalars(self, h: HyperCase, step: int) -> rules.StepScalars:
        """What the optimizers hand a prepared bucket's ``run``."""
        return rules.step_scalars(self.hyper(h), step)

    def expected(self, before: Sequence[Sequence[torch.Tensor]], h: HyperCase,
                 step: int) -> Dict[str, List[torch.Tensor]]:
        """The float64 oracle's outputs, by list name, from the lists as they were before."""
        master = len(before) == len(self.names(True))
        idx = {name: i for i, name in enumerate(self.names(master))}
        weights = before[idx["masters" if master else "params"]]
        out: Dict[str, List[torch.Tensor]] = {n: [] for n in idx if n != "grads"}
        for i in range(len(weights)):
            g, w = before[0][i], weights[i]
            m, v = before[idx["exp_avgs"]][i], before[idx["exp_avg_sqs"]][i]
            s = before[idx["emas"]][i] if self.ema else None
            if self.rule == rules.RADAM:
                w2, m2, v2, s2 = radam_f64(
                    g, w, m, v, s, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps, step=step,
                    weight_decay=h.weight_decay, decoupled=h.decoupled, maximize=h.maximize,
                    grad_scale=h.grad_scale, ema_decay=h.ema_decay)
            else:
                w2, m2, v2, s2 = seed_update(
                    g, w, m, v, torch.zeros_like(w) if s is None else s, step, h.lr,
                    h.ema_decay if self.ema else 0.0, h.beta1, h.beta2, h.eps,
                    1 if h.decoupled else 0, h.bias_correction, h.weight_decay,
                    grad_scale=h.grad_scale, maximize=h.maximize)
            out["params"].append(w2)
            out["exp_avgs"].append(m2)
            out["exp_avg_sqs"].append(v2)
            if self.ema:
                out["emas"].append(s2)
            if master:
                out["masters"].append(w2)
        return out


def _fused_ema_adamw(chunk, noop, lists, h, step, **kw):
    multi_tensor.multi_tensor_fused_ema_adamw(chunk, noop, lists, h.lr, h.ema_decay, h.beta1,
                                              h.beta2, h.eps, step, int(h.decoupled),
                                              h.bias_correction, h.weight_decay, **kw)


def _adam(chunk, noop, lists, h, step, **kw):
    multi_tensor.multi_tensor_adam(chunk, noop, lists, h.lr, h.beta1, h.beta2, h.eps, step,
                                   int(h.decoupled), h.bias_correction, h.weight_decay, **kw)


def _radam(chunk, noop, lists, h, step, **kw):
    multi_tensor.multi_tensor_radam(chunk, noop, lists, h.lr, h.beta1, h.beta2, h.eps, step,
                                    h.weight_decay, h.decoupled, **kw)


def _radam_ema(chunk, noop, lists, h, step, **kw):
    multi_tensor.multi_tensor_radam_ema(chunk, noop, lists, h.lr, h.ema_decay, h.beta1, h.beta2,
                                        h.eps, step, h.weight_decay, h.decoupled, **kw)


OP_INFOS: Tuple[OpInfo, ...] = (
    OpInfo("fused_ema_adamw", _fused_ema_adamw, _switches(ADAM_STEPS, adam=True)),
    OpInfo("adam", _adam, _switches(ADAM_STEPS, adam=True)),
    OpInfo("radam", _radam, _switches(RADAM_STEPS, adam=False)),
    OpInfo("radam_ema", _radam_ema, _switches(RADAM_STEPS, adam=False)),
)
OPS: Dict[str, OpInfo] = {o.name: o for o in OP_INFOS}


# --------------------------------------------------------------------------------------------
# tolerances against the float64 oracle
#
# Every output is computed in the math type (fp32; fp64 for fp64 buckets) by at most eight
# correctly rounded operations from the exactly converted inputs and the scalars rounded once, and
# is then rounded once to its storage dtype. So the bound is
#     |got - oracle| <= (MATH_RTOL + store_eps) * |oracle| + MATH_ATOL + store_spacing
# with store_eps the storage dtype's eps (one rounding is half an ulp; a full ulp allows for the
# math error landing on the other side of a rounding boundary) and store_spacing its subnormal
# spacing (fp16 exp_avg_sqs can be subnormal). The math terms are relative to the terms of
# ``beta1 * m + (1 - beta1) * g`` and of the weight update, which are O(1) here; MATH_ATOL covers
# outputs that cancel to near zero. fp32: a few tens of ulps. fp64: the scalars themselves are
# ill-conditioned at RAdam's first rectified step (rho_t = rho_inf - 2t beta2^t / (1 - beta2^t)
# cancels ~1999 - 1993, and rules.power's beta2^t may differ from the oracle's ``beta2 ** t`` in its
# last bit), so the step's own relative error reaches ~1e-11 there: 1e-12 relative to the weights.
# Measured worst cases over the whole table (relative where |oracle| > 0.01, else absolute):
# fp32 1.2e-6 / 1.8e-8; fp64 9.8e-14 / 1.0e-15.
MATH_RTOL = {F32: 4e-6, F64: 1e-12}
MATH_ATOL = {F32: 1e-7, F64: 1e-14}


def tolerance(math_dtype: torch.dtype, store_dtype: torch.dtype) -> Tuple[float, float]:
    rtol, atol = MATH_RTOL[math_dtype], MATH_ATOL[math_dtype]
    if store_dtype != math_dtype:
        info = torch.finfo(store_dtype)
        rtol += info.eps
        atol += info.tiny * info.eps
    return rtol, atol


# --------------------------------------------------------------------------------------------
# inputs

SHAPES = ((1,), (15,), (17,), (4, 33), (0,), (2, 3, 5), (65,))


def make_lists(op: OpInfo, dc: DtypeCase, shapes=SHAPES, seed: int = 0,
               grad_scale: Optional[float] = None) -> List[List[torch.Tensor]]:
    """Lists in the op's form for ``dc``: random weights, moments (v > 0) and EMA near the weights.

    With ``grad_scale`` the grads are that much larger (as under GradScaler).
    """
    gen = torch.Generator().manual_seed(seed)

    def rnd(shape):
        return torch.randn(shape, generator=gen, dtype=F64)

    weights = [rnd(s) for s in shapes]
    grads = [(rnd(s) * (grad_scale or 1.0)).to(dc.grad) for s in shapes]
    state = dc.state
    if dc.master:
        masters = [w.to(F32) for w in weights]
        params = [m.to(dc.param) for m in masters]
    else:
        params = [w.to(dc.param) for w in weights]
    lists = [grads, params, [(rnd(s) * 0.1).to(state) for s in shapes],
             [(rnd(s).abs() * 0.01).to(state) for s in shapes]]
    if op.ema:
        lists.append([(w + 0.01 * rnd(w.shape)).to(dc.ema_dtype) for w in weights])
    if dc.master:
        lists.append(masters)
    return lists


def clone(lists):
    return [[t.clone() for t in ts] for ts in lists]


# --------------------------------------------------------------------------------------------
# backends

def backend_names() -> List[str]:
    """Every registered backend, then the expected ones that did not register (to be skipped)."""
    names = [b.name for b in multi_tensor.registered_backends()]
    return names + [n for n in EXPECTED_BACKENDS if n not in names]


def backend_skip_reason(name: str, op: Optional[str] = None) -> Optional[str]:
    """Why backend ``name`` cannot run ``op`` on CPU tensors here (None: it can)."""
    backends = {b.name: b for b in multi_tensor.registered_backends()}
    backend = backends.get(name)
    if backend is None:
        module = getattr(multi_tensor.backends, name, None)
        error = getattr(module, "load_error", None)
        return (f"backend '{name}' is not registered"
                + (f": {error}" if error else "") + f"; registered: {sorted(backends)}")
    if not backend.handles("cpu"):
        return (f"backend '{name}' serves device types {backend.device_types}, not CPU tensors "
                "(its own device's test suite covers it)")
    if op is not None and op not in backend.ops:
        return f"backend '{name}' does not implement op '{op}'"
    return None


# --------------------------------------------------------------------------------------------
# the ISA sweep (run in subprocesses by tests/test_backends.py, one per ATEN_CPU_CAPABILITY)

ISA_SWITCHES = ("l2", "maximize_grad_scale_decoupled", "no_bias_correction")
ISA_SHAPES = SHAPES + ((3, 1000),)


def isa_sweep(backend: str) -> List[torch.Tensor]:
    """Every op x dtype case x a few switches (every step of each), run on ``backend``; returns
    every tensor of every list afterwards, in a fixed order."""
    from multi_tensor.backends import backend_for, forced_backend

    out: List[torch.Tensor] = []
    with forced_backend(backend):
        for op in OP_INFOS:
            assert backend_for(op.name, "cpu").name == backend
            for dc in dtype_cases(op):
                for k, h in enumerate(h for h in op.hyper_cases if h.name in ISA_SWITCHES):
                    lists = make_lists(op, dc, ISA_SHAPES, seed=k, grad_scale=h.grad_scale)
                    for step in h.steps:
                        op.call(2048, torch.zeros(1, dtype=torch.int32), lists, h, step)
                    out.extend(t for ts in lists for t in ts)
    return out
