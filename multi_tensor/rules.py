r"""The update rules: hyperparameters by name, per-step scalars, and the one operation order.

Every backend (the reference, each native CPU build, the GPU kernel) computes exactly what this
page says, so all of them give the same bits for the same inputs.

Hyperparameters travel from the optimizers to the backends as an :class:`AdamHyper` (a frozen
dataclass, fields by name). Per step, :func:`step_scalars` turns it into a :class:`StepScalars`:
every scalar the element math needs, computed once in double precision (Python floats) from the
formula, and then rounded once to the bucket's math type (fp32; fp64 for fp64 tensors) by the
backend. Only correctly rounded double operations are used (``+ - * /``, ``sqrt``, and
``beta ** step`` as :func:`power`'s fixed chain of multiplications), so a device that must
compute the scalars itself (a step counter kept on the device) can reproduce them bit for bit.

The element math, in fp32 (fp64 for fp64 buckets). Each line is one correctly rounded IEEE
operation (round to nearest even; sqrt and division correctly rounded; no fused multiply-add).
``w`` is the weight the update runs on: the fp32 master when the bucket has masters, else the
param. ``c.*`` are the :class:`StepScalars` fields rounded to the math type::

    g  = grad                                  # converted exactly to fp32
    g  = g * inv_scale                         # with a grad_scale: inv_scale = fp32(1) / scale
    g  = -g                                    # maximize
    g  = g + c.l2_wd * w                       # Adam (L2) decay, weight_decay != 0
    m  = c.beta1 * m + c.omb1 * g
    v  = c.beta2 * v + (c.omb2 * g) * g
    u  = m / (sqrt(v) * c.isb2 + c.eps)        # c.use_denom (always, except un-rectified RAdam)
    u  = m                                     # not c.use_denom
    w' = w - c.lr_wd * w                       # decoupled (AdamW) decay, weight_decay != 0
    w' = w' - c.step_size * u                  # (w' is w when there is no decoupled decay)
    s  = s + c.ema_w * (w' - s)                # with an EMA: the unbiased (lerp) form
    param = round(w')                          # with masters: the param gets the master rounded
                                               # once to its dtype; m, v, s, w' stored rounded once

This is the seed operator's formula (SPEC section 2) in exact arithmetic:
``(m / bc1) / (sqrt(v / bc2) + eps) * lr == (lr / bc1) * m / (sqrt(v) * (1 / sqrt(bc2)) + eps)``,
and ``d * s + (1 - d) * p == s + (1 - d) * (p - s)``. It costs one sqrt and one division per
element. The EMA is written in its unbiased form because in fp32 the literal form's two
coefficients ``fp32(d)`` and ``fp32(1 - d)`` do not sum to 1: at d = 0.9999 the EMA of a constant
would converge to c * (1 - 1.7e-4).

RAdam (``torch.optim.RAdam``) is the same element math with other scalars: ``isb2 = 1`` and
``step_size = lr * rect * sqrt(bc2) / bc1`` when ``rho_t > 5``; otherwise ``use_denom`` is off and
``step_size = lr / bc1``. ``rho_t`` comes from :func:`radam_rho`, torch's formula rewritten
without its cancellation near ``beta2 = 1`` (still only ``+ - * /``). Its decoupled decay is
``w - (lr * wd) * w`` like AdamW's (torch forms ``w * (1 - lr * wd)``: the same in exact
arithmetic).

fp64 buckets follow the same order in fp64 with correctly rounded fp64 sqrt and division.

The remainder encoding (``master_weights="remainder"``, bf16 params only). The fp32 master ``x``
is not stored: it is held as the bf16 param ``p`` and an int16 remainder ``r`` (the low 16 bits
of ``x``), and the update above runs on ``w = decode(p, r)`` and stores ``encode(w')``. On the
bits, with ``hi``/``lo`` the high/low 16 bits of ``x`` and arithmetic modulo 2**16 on ``p``::

    encode(x) = (p, r):  p = hi + (lo >= 0x8000),  r = lo (as int16: r < 0 exactly when lo >= 0x8000)
    decode(p, r) = x:    hi = p - (r < 0),         lo = r

So ``p`` is ``x`` rounded to nearest bf16, an exact tie (``lo == 0x8000``) going to the neighbour
away from zero (adding 1 to a bf16 bit pattern increases its magnitude: TransformerEngine's
``store_param_remainders`` rule). It equals the round-to-nearest-even param of
``master_weights=True`` except at exact ties, where it is one bf16 ulp further from zero.
``decode`` inverts ``encode`` on all 2**32 bit patterns (``encode`` is a bijection of 32-bit
words: ``hi`` is recovered from ``p`` and the sign of ``r``), so the masters, moments and EMA are
bit for bit those of ``master_weights=True`` at every step; tests/test_param_remainder.py checks
all 2**32 patterns. Patterns beyond the finite range round-trip too, but the param of a NaN
master whose high half is ``0x7FFF``/``0xFFFF`` with ``lo >= 0x8000`` is ``-0``/``+0`` (the
carry wraps); arithmetic NaNs (low half 0) keep a NaN param. The params of the largest finite
magnitudes (``hi == 0x7F7F`` with ``lo >= 0x8000``) are inf, as round to nearest gives.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Tuple, get_type_hints

import torch

ADAM = "adam"
RADAM = "radam"


@dataclass(frozen=True)
class AdamHyper:
    """The hyperparameters of one Adam-family update, by name.

    ``decoupled``: AdamW's decoupled weight decay (True) or Adam's L2 decay added to the grad.
    ``ema_decay``: None when the op keeps no EMA. ``rule``: :data:`ADAM` or :data:`RADAM`
    (RAdam always bias-corrects; ``bias_correction`` is ignored there).
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float = 0.0
    decoupled: bool = True
    bias_correction: bool = True
    maximize: bool = False
    ema_decay: Optional[float] = None
    rule: str = ADAM


class StepScalars(NamedTuple):
    """Every scalar of one step, in double; a backend rounds each once to its math type.

    The field order is the packed layout every kernel reads (:data:`SCALAR_OFFSET`, :func:`pack`,
    ``csrc/include/step_scalars.h``): a new field may go anywhere in this list and every offset
    follows (regenerate the header with ``python tools/step_scalars_header.py``).
    """

    beta1: float
    omb1: float        # 1 - beta1
    beta2: float
    omb2: float        # 1 - beta2
    l2_wd: float       # weight_decay in L2 mode (else 0)
    lr_wd: float       # lr * weight_decay in decoupled mode (else 0)
    isb2: float        # 1 / sqrt(bc2) (Adam), 1 (RAdam)
    eps: float
    step_size: float   # lr / bc1 (Adam); lr * rect * sqrt(bc2) / bc1 or lr / bc1 (RAdam)
    ema_w: float       # 1 - ema_decay (0 without an EMA)
    l2: bool
    decoupled: bool
    use_denom: bool
    maximize: bool
    ema: bool


def power(x: float, n: int) -> float:
    """``x ** n`` for an integer ``n >= 0`` by binary exponentiation in double.

    A fixed sequence of correctly rounded multiplications (relative error below ``2 * log2(n)``
    ulps of double), so a device can compute the same bits from a step held on the device,
    where ``pow`` libraries differ in their last bit.
    """
    result, base = 1.0, float(x)
    while n:
        if n & 1:
            result *= base
        base *= base
        n >>= 1
    return result


def sma_sums(beta2: float, n: int) -> tuple:
    """``(G, K) = (sum(beta2**m), sum((m + 1) * beta2**m))`` over ``m = 0 .. n - 1``, in double.

    Built like :func:`power`, by binary doubling over the bits of ``n``: a run of length ``a``
    followed by one of length ``b`` has ``G = G_a + beta2**a * G_b`` and
    ``K = K_a + beta2**a * (K_b + a * G_b)``. Every term is positive, so the relative error
    stays within a few ulps per doubling (no cancellation), with only correctly rounded ``+ *``:
    a device computes the same bits (``_sma_sums`` in multi_tensor/backends/triton/kernels.py).
    """
    rp, rg, rk, rl = 1.0, 0.0, 0.0, 0.0          # the result: beta2**len, G, K, len
    bp, bg, bk, bl = float(beta2), 1.0, 1.0, 1.0  # the run of length 2**i
    while n:
        if n & 1:
            rk = rk + rp * (bk + rl * bg)
            rg = rg + rp * bg
            rp = rp * bp
            rl = rl + bl
        bk = bk + bp * (bk + bl * bg)
        bg = bg + bp * bg
        bp = bp * bp
        bl = bl + bl
        n >>= 1
    return rg, rk


def radam_rho(beta2: float, step: int) -> float:
    """RAdam's rho_t (the approximated SMA length), well conditioned.

    torch's ``rho_inf - 2 t beta2**t / (1 - beta2**t)`` subtracts two numbers near
    ``2 / (1 - beta2)`` to get one near ``t``: at beta2 = 1 - 1e-7 it loses 22 bits and decides
    the rectification wrongly (rho_5 = 5.0032, exactly 4.9999996). The same value in exact
    arithmetic is ``2 K / G - 1`` with :func:`sma_sums` (substitute ``1 - beta2**t =
    (1 - beta2) G`` and ``t beta2**t = G - (1 - beta2) K``), which has no cancellation:
    ``2 K / G >= 2``.
    """
    g, k = sma_sums(beta2, step)
    return 2.0 * k / g - 1.0


def radam_rect(beta2: float, step: int) -> Optional[float]:
    """RAdam's rectification term at ``step`` (torch.optim.RAdam's formula with rho_t from
    :func:`radam_rho`), None if rho_t <= 5."""
    rho_inf = 2.0 / (1.0 - beta2) - 1.0
    rho_t = radam_rho(beta2, step)
    if not rho_t > 5.0:
        return None
    return math.sqrt((rho_t - 4.0) * (rho_t - 2.0) * rho_inf
                     / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t))


# The step-independent fields of an Adam hyperparameter set, kept for the few sets in use: an
# optimizer's groups hand the same AdamHyper object to every step (fused_optim.planning), so each
# step computes only the bias corrections. Keyed by the object (the entry keeps it alive, so its
# id is not reused); a new object is a new entry, and the table is emptied when it grows.
_ADAM_CONSTANTS: dict = {}
_ISB2 = StepScalars._fields.index("isb2")
_STEP_SIZE = StepScalars._fields.index("step_size")
_SQUARES = 64  # steps below 2**64 take power()'s factors from a table


def _squares(x: float) -> tuple:
    """``x, x**2, x**4, ...``: the factors :func:`power` multiplies in, each made as it makes it
    (squaring the last), for steps below ``2**_SQUARES``."""
    out, base = [], float(x)
    for _ in range(_SQUARES):
        out.append(base)
        base *= base
    return tuple(out)


# a step's binary digits, least significant first, as bytes 0 and 1 (itertools.compress's mask)
_DIGITS = bytes.maketrans(b"01", b"\0\1")


def _power_by_table(squares: tuple, n: int) -> float:
    """``power(x, n)`` from ``_squares(x)``, bit for bit: the same double products in the same
    order (``1.0`` times the factor of each set bit, lowest first), one C loop
    (``math.prod`` multiplies doubles in order) where :func:`power` runs a Python loop per
    bit, in every step's fixed cost."""
    return _powers_by_table(squares, squares, n)[0]


def _powers_by_table(squares1: tuple, squares2: tuple, n: int) -> tuple:
    """:func:`_power_by_table` of two tables at one ``n`` (the two bias corrections)."""
    if n.bit_length() > _SQUARES:
        return power(squares1[0], n), power(squares2[0], n)
    mask = format(n, "b")[::-1].encode().translate(_DIGITS)
    return (math.prod(itertools.compress(squares1, mask), start=1.0),
            math.prod(itertools.compress(squares2, mask), start=1.0))


def _adam_constants(h: AdamHyper) -> tuple:
    """``(fields, squares of beta1, squares of beta2)`` of ``h`` (see ``_ADAM_CONSTANTS``)."""
    entry = _ADAM_CONSTANTS.get(id(h))
    if entry is not None and entry[0] is h:
        return entry[1]
    if len(_ADAM_CONSTANTS) >= 64:
        _ADAM_CONSTANTS.clear()
    fields = list(_step_scalars(h, 1))  # isb2 and step_size are replaced per step
    constants = (fields, _squares(h.beta1), _squares(h.beta2))
    _ADAM_CONSTANTS[id(h)] = (h, constants)
    return constants


def step_scalars(h: AdamHyper, step: int) -> StepScalars:
    """The scalars of update number ``step`` (>= 1), in double."""
    if h.rule == RADAM:
        return _step_scalars(h, step)
    constants, squares1, squares2 = _adam_constants(h)
    fields = list(constants)
    if h.bias_correction:
        power1, power2 = _powers_by_table(squares1, squares2, step)
        bc1, bc2 = 1.0 - power1, 1.0 - power2
    else:
        bc1, bc2 = 1.0, 1.0
    fields[_ISB2] = 1.0 / math.sqrt(bc2)
    fields[_STEP_SIZE] = h.lr / bc1
    return StepScalars._make(fields)


def _step_scalars(h: AdamHyper, step: int) -> StepScalars:
    """:func:`step_scalars` from the formula, every field computed."""
    wd = float(h.weight_decay)
    has_wd = wd != 0.0
    use_denom = True
    if h.rule == RADAM:
        bc1 = 1.0 - power(h.beta1, step)
        bc2 = 1.0 - power(h.beta2, step)
        rect = radam_rect(h.beta2, step)
        isb2 = 1.0
        if rect is None:
            use_denom = False
            step_size = h.lr / bc1
        else:
            step_size = h.lr * rect * math.sqrt(bc2) / bc1
    else:
        bc1, bc2 = ((1.0 - power(h.beta1, step), 1.0 - power(h.beta2, step))
                    if h.bias_correction else (1.0, 1.0))
        isb2 = 1.0 / math.sqrt(bc2)
        step_size = h.lr / bc1
    ema = h.ema_decay is not None
    return StepScalars(
        beta1=float(h.beta1), omb1=1.0 - h.beta1, beta2=float(h.beta2), omb2=1.0 - h.beta2,
        l2_wd=wd if has_wd and not h.decoupled else 0.0,
        lr_wd=h.lr * wd if has_wd and h.decoupled else 0.0,
        isb2=isb2, eps=float(h.eps), step_size=step_size,
        ema_w=1.0 - h.ema_decay if ema else 0.0,
        l2=has_wd and not h.decoupled, decoupled=has_wd and h.decoupled,
        use_denom=use_denom, maximize=bool(h.maximize), ema=ema)


# --- the remainder encoding (module docstring) -----------------------------------------------
MASTER_REMAINDER = "remainder"  # master_weights="remainder": bf16 params + int16 remainders


def split_master(x: torch.Tensor):
    """``(p, r)``: the bf16 params and int16 remainders that hold the fp32 masters ``x``."""
    if x.dtype != torch.float32:
        raise TypeError(f"split_master: masters must be float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    lo = bits & 0xFFFF
    hi = (bits >> 16) + (lo >> 15)                       # arithmetic shift: the low 16 bits count
    p = (((hi & 0xFFFF) ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16)
    r = ((lo ^ 0x8000) - 0x8000).to(torch.int16)
    return p.view(x.shape), r.view(x.shape)


def join_master(p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The fp32 masters held as bf16 params ``p`` and int16 remainders ``r``."""
    if p.dtype != torch.bfloat16 or r.dtype != torch.int16:
        raise TypeError(f"join_master: expected bf16 params and int16 remainders, got {p.dtype} "
                        f"and {r.dtype}")
    r32 = r.to(torch.int32)
    hi = (p.contiguous().view(torch.int16).to(torch.int32) - (r32 < 0).to(torch.int32)) & 0xFFFF
    bits = (((hi ^ 0x8000) - 0x8000) << 16) | (r32 & 0xFFFF)  # hi as signed: no int32 overflow
    return bits.view(torch.float32).view(p.shape)


# --- the packed layouts -----------------------------------------------------------------------
# The one definition of where each scalar sits for a kernel. Slot i of a packed buffer is field i
# of its NamedTuple, a double rounded once to the buffer's dtype, a flag as 0.0 / 1.0. The Triton
# kernels read the buffers at these offsets; the native kernel reads the StepScalars tuple by the
# same indices through csrc/include/step_scalars.h, which ``python tools/step_scalars_header.py``
# writes from :func:`header_text` (tests/test_scalar_layout.py fails when it is stale).


class DeviceHyper(NamedTuple):
    """The step-independent inputs from which a device computes a step's step-dependent
    :class:`StepScalars` fields (``lr_wd``, ``isb2``, ``step_size``, ``use_denom``) as
    :func:`step_scalars` does: the Triton backend's device-step kernel reads them packed."""

    lr: float
    beta1: float
    beta2: float
    weight_decay: float
    lr_wd_on: bool         # decoupled decay with weight_decay != 0 (lr_wd = lr * weight_decay)
    bias_correction: bool  # always on for RAdam
    radam: bool


def _offsets(fields: Tuple[str, ...]) -> Dict[str, int]:
    return {name: i for i, name in enumerate(fields)}


SCALAR_FIELDS: Tuple[str, ...] = StepScalars._fields
SCALAR_FLAGS: Tuple[str, ...] = tuple(
    name for name, t in get_type_hints(StepScalars).items() if t is bool)
SCALAR_OFFSET: Dict[str, int] = _offsets(SCALAR_FIELDS)
N_SCALARS = len(SCALAR_FIELDS)

HYPER_FIELDS: Tuple[str, ...] = DeviceHyper._fields
HYPER_OFFSET: Dict[str, int] = _offsets(HYPER_FIELDS)
N_HYPER = len(HYPER_FIELDS)


def device_hyper(h: AdamHyper) -> DeviceHyper:
    """The :class:`DeviceHyper` of ``h``."""
    wd = float(h.weight_decay)
    return DeviceHyper(lr=float(h.lr), beta1=float(h.beta1), beta2=float(h.beta2),
                       weight_decay=wd, lr_wd_on=wd != 0.0 and h.decoupled,
                       bias_correction=bool(h.bias_correction or h.rule == RADAM),
                       radam=h.rule == RADAM)


def rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded once to ``dtype`` (nearest even; beyond its range: inf), returned as a
    Python float holding that value."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype).item())


def pack(values: NamedTuple, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The packed buffer of a :class:`StepScalars` (or :class:`DeviceHyper`): a CPU tensor of
    ``dtype`` whose slot i is field i, each double rounded once to ``dtype`` (a flag: 0.0 / 1.0)."""
    return torch.tensor([float(x) for x in values], dtype=torch.float64).to(dtype)


def header_text() -> str:
    """``csrc/include/step_scalars.h``: the native kernel's view of :class:`StepScalars`."""
    def const(name: str) -> str:
        return "kStepScalar" + "".join(part.capitalize() for part in name.split("_"))

    lines = [
        "// Generated from multi_tensor/rules.py by `python tools/step_scalars_header.py`: do not",
        "// edit (tests/test_scalar_layout.py fails when this file differs from what rules.py gives).",
        "//",
        "// multi_tensor.rules.StepScalars in its field order: index i of the Python tuple (and slot i",
        "// of the buffer multi_tensor.rules.pack gives the Triton kernels) holds field i.",
        "#pragma once",
        "",
        "namespace multi_tensor_rules {",
        "",
    ]
    lines += [f"constexpr int {const(name)} = {i};" for i, name in enumerate(SCALAR_FIELDS)]
    lines += [
        f"constexpr int kNumStepScalars = {N_SCALARS};",
        "constexpr const char* kStepScalarNames[kNumStepScalars] = {",
        *[f'    "{name}",' for name in SCALAR_FIELDS],
        "};",
        "",
        "// Each field a double rounded once to T; a flag a bool.",
        "template <typename T>",
        "struct StepScalars {",
        *[f"  {'bool' if name in SCALAR_FLAGS else 'T'} {name};" for name in SCALAR_FIELDS],
        "};",
        "",
        "// Fills c from a source read by index: value(i) gives field i as a double, flag(i) as a bool.",
        "template <typename T, typename Value, typename Flag>",
        "inline void read_step_scalars(StepScalars<T>& c, const Value& value, const Flag& flag) {",
    ]
    for name in SCALAR_FIELDS:
        if name in SCALAR_FLAGS:
            lines.append(f"  c.{name} = flag({const(name)});")
        else:
            lines.append(f"  c.{name} = static_cast<T>(value({const(name)}));")
    lines += ["}", "", "}  // namespace multi_tensor_rules", ""]
    return "\n".join(lines)

