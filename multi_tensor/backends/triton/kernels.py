"""The Triton kernels of the ``triton`` backend (what is compiled; the host side that feeds them
is :mod:`multi_tensor.backends.triton.host`, the ahead-of-time variant list
:mod:`multi_tensor.backends.triton.aot`).

Imported only through :mod:`multi_tensor.backends.triton` when the first CUDA bucket is
prepared or op called (this module imports triton). Everything here also runs on CPU tensors under
``TRITON_INTERPRET=1`` (how the tests check the kernels without a GPU).

Multi-tensor launch
-------------------
A bucket (or an op call) is cut into chunks of ``chunk_size`` elements per tensor; empty tensors
have no chunk. Per chunk, an int64 *pointer table* holds one address per list, the tensor's numel
and the chunk's start offset. The table is column-major (``table[row, chunk]``), so the grads'
addresses are one contiguous row that can be rewritten alone. An address is stored as an element
offset from the list's *base pointer* (a tensor of that list at a 16-byte aligned address where
it has one, passed as a kernel argument): Triton then knows the base's 16-byte alignment, so an
offset that is a multiple of the list's vector width is an aligned address. Every elementwise
kernel (the Adam family, the non-finite scan, scale, the sum of squares) takes a constexpr
``ALIGN``: ``ALIGN_ALL`` (the host has checked every address and chunk start: 128-bit loads and
stores with no branch), ``ALIGN_CHUNK`` (some are aligned: the kernel decides per chunk from the
table, so one tensor at a misaligned address, such as a grad view into a flat DDP/FSDP buffer,
costs only its own chunks the vector path) or ``ALIGN_NONE`` (element by element). Offsets are
64-bit, the grid is the number of chunks: one launch per bucket, for any number of tensors.

Exactness
---------
Every kernel mirrors :mod:`multi_tensor.rules` (and ``csrc/include/adam_rule.h``) line for line:
fp32 math with ``tl.div_rn``/``tl.sqrt_rn`` (fp64 buckets: ``/`` and ``tl.sqrt``, which are IEEE
in fp64), every kernel is launched with ``enable_fp_fusion=False`` (no multiply-add contraction),
negation flips the sign bit, fp32 -> bf16 rounds to nearest even with integer operations (NaN ->
0x7FC0; the interpreter's own cast truncates), fp32 -> fp16 converts with ``rtne``. Master
remainders are joined with their bf16 params into the fp32 masters, and split back, with integer
operations (:func:`multi_tensor.rules.join_master` / ``split_master``: ties away from zero).
Scalars are rounded once from double, on the host (``torch`` casts) or on the device
(``cvt.rn``).

Device-side steps
-----------------
A prepared bucket keeps a device buffer of the step's scalars. :meth:`AdamBucket.run` fills it
from the host's :class:`~multi_tensor.rules.StepScalars` (a pinned, non-blocking copy);
:meth:`AdamBucket.run_device_step` instead launches :func:`_step_scalars_kernel`, which advances a
step counter held on the device (unless the noop flag, e.g. GradScaler's ``found_inf``, is set)
and computes the scalars from it in fp64 exactly as :func:`multi_tensor.rules.step_scalars` does
(:func:`multi_tensor.rules.power`'s multiplications, IEEE division and sqrt). Neither reads
anything back to the host, so a step is sync-free and can be captured in a CUDA graph.
"""
from __future__ import annotations

import os
from typing import Dict, NamedTuple

import torch
import triton
import triton.language as tl

from ... import rules

# dtype codes (constexpr kernel arguments); I16: raw 16-bit words (a bf16 param's bits or a
# master remainder), loaded sign-extended to int32 and stored truncated, never converted
F32, F16, BF16, F64, I16 = 0, 1, 2, 3, 4
DTYPE_CODE = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16, torch.float64: F64}
ELEMENT_SIZE = {F32: 4, F16: 2, BF16: 2, F64: 8, I16: 2}
# alignment modes (the ALIGN constexpr of the elementwise kernels): no chunk vectorised, the
# choice made per chunk, every chunk vectorised (no branch)
ALIGN_NONE, ALIGN_CHUNK, ALIGN_ALL = 0, 1, 2

BLOCK = int(os.environ.get("MULTI_TENSOR_TRITON_BLOCK", "1024"))
NUM_WARPS = int(os.environ.get("MULTI_TENSOR_TRITON_WARPS", "4"))
NORM_BLOCK = 4096      # l2norm: fixed blocks, so the result does not depend on chunk_size
NORM_RBLOCK = 1024     # l2norm: the combine's vector width
COMPILE_OPTIONS = dict(enable_fp_fusion=False)

# The kernels' offsets into the packed buffers, from multi_tensor.rules (the one layout): the
# scalars buffer (math dtype, rules.pack of a StepScalars) and the hyperparameter buffer (fp64,
# rules.pack of a DeviceHyper) the device step kernel reads.
_S, _H = rules.SCALAR_OFFSET, rules.HYPER_OFFSET
S_BETA1 = tl.constexpr(_S["beta1"])
S_OMB1 = tl.constexpr(_S["omb1"])
S_BETA2 = tl.constexpr(_S["beta2"])
S_OMB2 = tl.constexpr(_S["omb2"])
S_L2_WD = tl.constexpr(_S["l2_wd"])
S_LR_WD = tl.constexpr(_S["lr_wd"])
S_ISB2 = tl.constexpr(_S["isb2"])
S_EPS = tl.constexpr(_S["eps"])
S_STEP_SIZE = tl.constexpr(_S["step_size"])
S_EMA_W = tl.constexpr(_S["ema_w"])
S_L2 = tl.constexpr(_S["l2"])
S_DECOUPLED = tl.constexpr(_S["decoupled"])
S_USE_DENOM = tl.constexpr(_S["use_denom"])
S_MAXIMIZE = tl.constexpr(_S["maximize"])
H_LR = tl.constexpr(_H["lr"])
H_BETA1 = tl.constexpr(_H["beta1"])
H_BETA2 = tl.constexpr(_H["beta2"])
H_WEIGHT_DECAY = tl.constexpr(_H["weight_decay"])
H_LR_WD_ON = tl.constexpr(_H["lr_wd_on"])
H_BIAS_CORRECTION = tl.constexpr(_H["bias_correction"])
H_RADAM = tl.constexpr(_H["radam"])
STEP_BITS = 32  # the device step counter's binary exponentiation covers steps < 2**32


# ---------------------------------------------------------------------------------------------
# element helpers

@triton.jit
def _ld(base, delta, offs, mask, DT: tl.constexpr, MATH: tl.constexpr):
    """Load elements ``base[delta + offs]`` of dtype code DT, converted exactly to MATH (I16:
    the words as int32, sign-extended)."""
    ptr = base + delta + offs
    if mask is None:  # whole blocks
        raw = tl.load(ptr)
    else:
        raw = tl.load(ptr, mask=mask, other=0)
    if DT == 4:
        x = raw.to(tl.int32)
    elif DT == 2:  # bf16, through its bits (base is an int16 view)
        x = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True).to(MATH)
    else:
        x = raw.to(tl.float32 if DT != 3 else tl.float64).to(MATH)
    return x


@triton.jit
def _bits(x, DT: tl.constexpr):
    """``x`` (fp32 or fp64) as dtype code DT's storage, rounded once to nearest even (I16: an
    integer's low 16 bits)."""
    if DT == 4:
        return x.to(tl.int16)
    elif DT == 3:
        return x.to(tl.float64)
    elif DT == 0:
        return x.to(tl.float32)
    elif DT == 1:
        return x.to(tl.float32).to(tl.float16, fp_downcast_rounding="rtne")
    else:
        xf = x.to(tl.float32)
        bits = xf.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(xf != xf, 0x7FC0, r)
        return r.to(tl.int16)


@triton.jit
def _st(base, delta, offs, x, mask, DT: tl.constexpr):
    """Store ``x`` (fp32 or fp64) to dtype code DT, rounded once to nearest even."""
    tl.store(base + delta + offs, _bits(x, DT), mask=mask)


@triton.jit
def _ld_halves(base, delta, r8, end, MASKED: tl.constexpr, DT: tl.constexpr,
               MATH: tl.constexpr, R: tl.constexpr):
    """Rows of 8 elements (``r8``: each row's first offset, [R, 1]) as two [R, 4] halves, each
    thread holding whole rows: a 16-bit list is loaded 8 elements (128 bits) at a time and split
    in registers, a 32-bit list 4 elements (128 bits) per half. Every list then has the same
    elements in the same thread, so no layout conversion (through shared memory) is needed."""
    if DT == 1 or DT == 2 or DT == 4:
        offs = r8 + tl.arange(0, 8)[None, :]
        x = _ld(base, delta, offs, offs < end if MASKED else None, DT, MATH)
        lo, hi = tl.split(tl.permute(tl.reshape(x, (R, 2, 4)), (0, 2, 1)))
    elif DT == 3:  # quarters of 2 (128 bits), joined in registers into halves
        lo = _ld_pair64(base, delta, r8, end, MASKED, MATH, R)
        hi = _ld_pair64(base, delta, r8 + 4, end, MASKED, MATH, R)
    else:
        offs = r8 + tl.arange(0, 4)[None, :]
        lo = _ld(base, delta, offs, offs < end if MASKED else None, DT, MATH)
        offs = offs + 4
        hi = _ld(base, delta, offs, offs < end if MASKED else None, DT, MATH)
    return lo, hi


@triton.jit
def _ld_pair64(base, delta, r4, end, MASKED: tl.constexpr, MATH: tl.constexpr, R: tl.constexpr):
    offs = r4 + tl.arange(0, 2)[None, :]
    a = _ld(base, delta, offs, offs < end if MASKED else None, 3, MATH)
    offs = offs + 2
    b = _ld(base, delta, offs, offs < end if MASKED else None, 3, MATH)
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (R, 4))


@triton.jit
def _st_pair64(base, delta, r4, x, end, MASKED: tl.constexpr, R: tl.constexpr):
    a, b = tl.split(tl.permute(tl.reshape(x, (R, 2, 2)), (0, 2, 1)))
    offs = r4 + tl.arange(0, 2)[None, :]
    tl.store(base + delta + offs, a, mask=offs < end if MASKED else None)
    offs = offs + 2
    tl.store(base + delta + offs, b, mask=offs < end if MASKED else None)


@triton.jit
def _st_halves(base, delta, r8, lo, hi, end, MASKED: tl.constexpr, DT: tl.constexpr,
               R: tl.constexpr):
    """The store of :func:`_ld_halves`: a 16-bit list's halves joined in registers into rows of
    8 (one 128-bit store), a 32-bit list's halves stored 4 elements at a time."""
    if DT == 1 or DT == 2 or DT == 4:
        offs = r8 + tl.arange(0, 8)[None, :]
        x = tl.reshape(tl.permute(tl.join(_bits(lo, DT), _bits(hi, DT)), (0, 2, 1)), (R, 8))
        tl.store(base + delta + offs, x, mask=offs < end if MASKED else None)
    elif DT == 3:
        _st_pair64(base, delta, r8, lo.to(tl.float64), end, MASKED, R)
        _st_pair64(base, delta, r8 + 4, hi.to(tl.float64), end, MASKED, R)
    else:
        offs = r8 + tl.arange(0, 4)[None, :]
        _st(base, delta, offs, lo, offs < end if MASKED else None, DT)
        offs = offs + 4
        _st(base, delta, offs, hi, offs < end if MASKED else None, DT)


@triton.jit
def _join(p, r):
    """multi_tensor.rules.join_master in integer operations: the fp32 master held as the bf16
    param bits ``p`` and the remainder ``r`` (both int32, sign-extended). A negative remainder
    means the param was rounded up (away from zero) from the master's top half: one less."""
    hi = (p - (r < 0).to(tl.int32)) & 0xFFFF
    bits = (hi.to(tl.uint32) << 16) | (r & 0xFFFF).to(tl.uint32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _split(x):
    """multi_tensor.rules.split_master in integer operations: (param bits, remainder) of the
    fp32 master ``x``, as int32 whose low 16 bits are stored. The param is the top half
    rounded to nearest on the magnitude, ties away from zero (the low half's top bit carries);
    the remainder is the low half, so a carry shows as a negative remainder."""
    bits = x.to(tl.uint32, bitcast=True)
    lo = bits & 0xFFFF
    hi = ((bits >> 16) + (lo >> 15)) & 0xFFFF
    return hi.to(tl.int32), lo.to(tl.int32)


@triton.jit
def _neg(x, IS64: tl.constexpr):
    """-x by flipping the sign bit (Triton's unary minus is 0 - x, which maps +0 to +0)."""
    if IS64:
        return (x.to(tl.int64, bitcast=True) ^ -9223372036854775808).to(tl.float64, bitcast=True)
    else:
        return (x.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)


@triton.jit
def _div(a, b, IS64: tl.constexpr):
    if IS64:
        return a / b  # fp64 division is IEEE (div.rn.f64)
    else:
        return tl.div_rn(a, b)


@triton.jit
def _sqrt(x, IS64: tl.constexpr):
    if IS64:
        return tl.sqrt(x)  # fp64 sqrt is IEEE (sqrt.rn.f64)
    else:
        return tl.sqrt_rn(x)


# ---------------------------------------------------------------------------------------------
# the Adam family

@triton.jit
def _adam_math(g, w, m, v, s, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2, eps, step_size,
               ema_w, l2, decoupled, use_denom, maximize, inv_scale, EMA: tl.constexpr,
               HAS_SCALE: tl.constexpr, IS64: tl.constexpr):
    # multi_tensor/rules.py, line for line (csrc/include/adam_rule.h adam_update)
    if HAS_SCALE:
        g = g * inv_scale
    g = tl.where(maximize, _neg(g, IS64), g)
    g = tl.where(l2, g + l2_wd * w, g)
    m = beta1 * m + omb1 * g
    v = beta2 * v + (omb2 * g) * g
    u = tl.where(use_denom, _div(m, _sqrt(v, IS64) * isb2 + eps, IS64), m)
    wn = tl.where(decoupled, w - lr_wd * w, w)
    wn = wn - step_size * u
    if EMA:
        s = s + ema_w * (wn - s)
    return m, v, wn, s


@triton.jit
def _adam_block(offs, mask, g_base, g_d, p_base, p_d, m_base, m_d, v_base, v_d, s_base, s_d,
                w_base, w_d, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2, eps, step_size, ema_w,
                l2, decoupled, use_denom, maximize, inv_scale,
                G_DT: tl.constexpr, P_DT: tl.constexpr, S_DT: tl.constexpr, E_DT: tl.constexpr,
                EMA: tl.constexpr, MASTER: tl.constexpr, REM: tl.constexpr,
                HAS_SCALE: tl.constexpr, MATH: tl.constexpr, IS64: tl.constexpr):
    # one block, every list with the same layout (the lists' vector widths agree: see
    # _adam_kernel). E_DT: the EMA's storage (S_DT, or bf16 beside fp32/fp16 state): loaded
    # exactly, rounded once on store. Every list is loaded first, the EMA with the others.
    # REM: w_base holds the masters' remainders, joined with the params' bits into the masters.
    g = _ld(g_base, g_d, offs, mask, G_DT, MATH)
    if MASTER:
        w = _ld(w_base, w_d, offs, mask, 0, MATH)
    elif REM:
        w = _join(_ld(p_base, p_d, offs, mask, 4, MATH), _ld(w_base, w_d, offs, mask, 4, MATH))
    else:
        w = _ld(p_base, p_d, offs, mask, P_DT, MATH)
    m = _ld(m_base, m_d, offs, mask, S_DT, MATH)
    v = _ld(v_base, v_d, offs, mask, S_DT, MATH)
    s = w
    if EMA:
        s = _ld(s_base, s_d, offs, mask, E_DT, MATH)
    m, v, wn, s = _adam_math(g, w, m, v, s, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2, eps,
                             step_size, ema_w, l2, decoupled, use_denom, maximize, inv_scale,
                             EMA, HAS_SCALE, IS64)
    _st(m_base, m_d, offs, m, mask, S_DT)
    _st(v_base, v_d, offs, v, mask, S_DT)
    if EMA:
        _st(s_base, s_d, offs, s, mask, E_DT)
    if MASTER:
        _st(w_base, w_d, offs, wn, mask, 0)
    if REM:
        ph, rl = _split(wn)
        _st(p_base, p_d, offs, ph, mask, 4)
        _st(w_base, w_d, offs, rl, mask, 4)
    else:
        _st(p_base, p_d, offs, wn, mask, P_DT)


@triton.jit
def _adam_rows(r8, end, MASKED: tl.constexpr, g_base, g_d, p_base, p_d, m_base, m_d, v_base,
               v_d, s_base, s_d, w_base, w_d, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2, eps,
               step_size, ema_w, l2, decoupled, use_denom, maximize, inv_scale,
               G_DT: tl.constexpr, P_DT: tl.constexpr, S_DT: tl.constexpr, E_DT: tl.constexpr,
               EMA: tl.constexpr, MASTER: tl.constexpr, REM: tl.constexpr,
               HAS_SCALE: tl.constexpr, R: tl.constexpr):
    """_adam_block for lists of 16-bit and 32-bit dtypes together: rows of 8 elements per
    thread, each list loaded and stored in 128-bit vectors (_ld_halves), the math on halves."""
    F: tl.constexpr = tl.float32
    g0, g1 = _ld_halves(g_base, g_d, r8, end, MASKED, G_DT, F, R)
    if MASTER:
        w0, w1 = _ld_halves(w_base, w_d, r8, end, MASKED, 0, F, R)
    elif REM:
        p0, p1 = _ld_halves(p_base, p_d, r8, end, MASKED, 4, F, R)
        q0, q1 = _ld_halves(w_base, w_d, r8, end, MASKED, 4, F, R)
        w0 = _join(p0, q0)
        w1 = _join(p1, q1)
    else:
        w0, w1 = _ld_halves(p_base, p_d, r8, end, MASKED, P_DT, F, R)
    m0, m1 = _ld_halves(m_base, m_d, r8, end, MASKED, S_DT, F, R)
    v0, v1 = _ld_halves(v_base, v_d, r8, end, MASKED, S_DT, F, R)
    s0 = w0
    s1 = w1
    if EMA:
        s0, s1 = _ld_halves(s_base, s_d, r8, end, MASKED, E_DT, F, R)
    m0, v0, w0, s0 = _adam_math(g0, w0, m0, v0, s0, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2,
                                eps, step_size, ema_w, l2, decoupled, use_denom, maximize,
                                inv_scale, EMA, HAS_SCALE, False)
    m1, v1, w1, s1 = _adam_math(g1, w1, m1, v1, s1, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2,
                                eps, step_size, ema_w, l2, decoupled, use_denom, maximize,
                                inv_scale, EMA, HAS_SCALE, False)
    _st_halves(m_base, m_d, r8, m0, m1, end, MASKED, S_DT, R)
    _st_halves(v_base, v_d, r8, v0, v1, end, MASKED, S_DT, R)
    if EMA:
        _st_halves(s_base, s_d, r8, s0, s1, end, MASKED, E_DT, R)
    if MASTER:
        _st_halves(w_base, w_d, r8, w0, w1, end, MASKED, 0, R)
    if REM:
        p0, q0 = _split(w0)
        p1, q1 = _split(w1)
        _st_halves(p_base, p_d, r8, p0, p1, end, MASKED, 4, R)
        _st_halves(w_base, w_d, r8, q0, q1, end, MASKED, 4, R)
    else:
        _st_halves(p_base, p_d, r8, w0, w1, end, MASKED, P_DT, R)


@triton.jit
def _adam_vec(start, end, vec, g_base, g_d, p_base, p_d, m_base, m_d, v_base, v_d, s_base, s_d,
              w_base, w_d, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2, eps, step_size, ema_w,
              l2, decoupled, use_denom, maximize, inv_scale,
              G_DT: tl.constexpr, P_DT: tl.constexpr, S_DT: tl.constexpr, E_DT: tl.constexpr,
              EMA: tl.constexpr, MASTER: tl.constexpr, REM: tl.constexpr,
              HAS_SCALE: tl.constexpr, CHECK: tl.constexpr, TAIL: tl.constexpr,
              BLOCK: tl.constexpr):
    """The whole blocks of one chunk from ``start`` in 128-bit vectors; returns how many
    elements they cover (0 when ``vec`` is false). CHECK: ``vec`` says whether this chunk is
    aligned (every list's offset a multiple of its vector width, 16 bytes, and ``start`` a
    multiple of 16); else the host has checked every chunk. TAIL: the chunk's tail too, one
    masked block in the same layout (else the caller runs it element by element). The offsets are re-derived as
    multiples (``(d >> k) << k``: equal to ``d`` in an aligned chunk, a multiple of the width
    whatever ``d`` is), so the alignment the compiler sees holds by construction and is not
    carried onto the values the element-by-element loop uses (a hint marks the op that made a
    value, for every use of it)."""
    IS64: tl.constexpr = P_DT == 3
    MATH: tl.constexpr = tl.float64 if P_DT == 3 else tl.float32
    # log2 of each list's vector width (16 bytes: 8 16-bit, 4 32-bit or 2 64-bit elements)
    SG: tl.constexpr = 3 if G_DT == 1 or G_DT == 2 else (1 if G_DT == 3 else 2)
    SP: tl.constexpr = 3 if P_DT == 1 or P_DT == 2 else (1 if P_DT == 3 else 2)
    SS: tl.constexpr = 3 if S_DT == 1 or S_DT == 2 else (1 if S_DT == 3 else 2)
    SE: tl.constexpr = 3 if E_DT == 1 or E_DT == 2 else (1 if E_DT == 3 else 2)
    # each list's own offset (an absent list's stand-in is not derived: it stays the value it
    # stands in for)
    g_d = (g_d >> SG) << SG
    p_d = (p_d >> SP) << SP
    m_d = (m_d >> SS) << SS
    v_d = (v_d >> SS) << SS
    if EMA:
        s_d = (s_d >> SE) << SE
    if MASTER:
        w_d = (w_d >> 2) << 2
    if REM:
        w_d = (w_d >> 3) << 3
    first = (start >> 4) << 4
    # One vector width per loop for every list: when 16-bit and 32-bit lists meet, rows of 8
    # elements per thread (_adam_rows: one 128-bit vector of a 16-bit list, two of a 32-bit
    # one); else one element layout for all (a 1-D block: the same 128-bit width for lists of
    # one size). fp64 runs half blocks: 8 elements per thread of 6 lists, each with its own
    # 64-bit address, would not fit in the register budget.
    HAS16: tl.constexpr = (G_DT == 1 or G_DT == 2 or P_DT == 1 or P_DT == 2 or S_DT == 1
                           or S_DT == 2 or (EMA and (E_DT == 1 or E_DT == 2)))
    HAS32: tl.constexpr = (G_DT == 0 or P_DT == 0 or S_DT == 0 or MASTER
                           or (EMA and E_DT == 0))
    ROWS: tl.constexpr = HAS16 and HAS32
    IB: tl.constexpr = BLOCK // 2 if IS64 else BLOCK
    base = first
    if CHECK:
        base = tl.where(vec, first, end)  # not aligned: no whole block here
    if ROWS:
        R: tl.constexpr = BLOCK // 8
        rows = tl.arange(0, R)[:, None] * 8
        while base + BLOCK <= end:
            # (base: a multiple of 16 plus whole blocks)
            _adam_rows(tl.multiple_of(base, 16) + rows, end, False, g_base, g_d, p_base, p_d,
                       m_base, m_d, v_base, v_d, s_base, s_d, w_base, w_d, beta1, omb1, beta2,
                       omb2, l2_wd, lr_wd, isb2, eps, step_size, ema_w, l2, decoupled,
                       use_denom, maximize, inv_scale, G_DT, P_DT, S_DT, E_DT, EMA, MASTER, REM,
                       HAS_SCALE, R)
            base += BLOCK
        if TAIL and base < end:  # one masked block
            _adam_rows(base + rows, end, True, g_base, g_d, p_base, p_d, m_base, m_d, v_base,
                       v_d, s_base, s_d, w_base, w_d, beta1, omb1, beta2, omb2, l2_wd, lr_wd,
                       isb2, eps, step_size, ema_w, l2, decoupled, use_denom, maximize,
                       inv_scale, G_DT, P_DT, S_DT, E_DT, EMA, MASTER, REM, HAS_SCALE, R)
    else:
        while base + IB <= end:
            offs = tl.multiple_of(base, 16) + tl.arange(0, IB)
            _adam_block(offs, None, g_base, g_d, p_base, p_d, m_base, m_d, v_base, v_d, s_base,
                        s_d, w_base, w_d, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2, eps,
                        step_size, ema_w, l2, decoupled, use_denom, maximize, inv_scale,
                        G_DT, P_DT, S_DT, E_DT, EMA, MASTER, REM, HAS_SCALE, MATH, IS64)
            base += IB
        if TAIL and base < end:  # one masked block
            offs = base + tl.arange(0, IB)
            _adam_block(offs, offs < end, g_base, g_d, p_base, p_d, m_base, m_d, v_base, v_d,
                        s_base, s_d, w_base, w_d, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2,
                        eps, step_size, ema_w, l2, decoupled, use_denom, maximize, inv_scale,
                        G_DT, P_DT, S_DT, E_DT, EMA, MASTER, REM, HAS_SCALE, MATH, IS64)
    if CHECK:
        base = tl.where(vec, base, first)
    return base - first


@triton.jit
def _adam_rest(base, end, g_base, g_d, p_base, p_d, m_base, m_d, v_base, v_d, s_base, s_d,
               w_base, w_d, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2, eps, step_size, ema_w,
               l2, decoupled, use_denom, maximize, inv_scale,
               G_DT: tl.constexpr, P_DT: tl.constexpr, S_DT: tl.constexpr, E_DT: tl.constexpr,
               EMA: tl.constexpr, MASTER: tl.constexpr, REM: tl.constexpr,
               HAS_SCALE: tl.constexpr, RB: tl.constexpr):
    """``base <= i < end`` element by element: whole blocks of RB elements unmasked, then one
    masked block (every list in the same 1-D layout, one element per access)."""
    IS64: tl.constexpr = P_DT == 3
    MATH: tl.constexpr = tl.float64 if P_DT == 3 else tl.float32
    while base + RB <= end:  # whole blocks, unmasked
        offs = base + tl.arange(0, RB)
        _adam_block(offs, None, g_base, g_d, p_base, p_d, m_base, m_d, v_base, v_d, s_base,
                    s_d, w_base, w_d, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2, eps,
                    step_size, ema_w, l2, decoupled, use_denom, maximize, inv_scale,
                    G_DT, P_DT, S_DT, E_DT, EMA, MASTER, REM, HAS_SCALE, MATH, IS64)
        base += RB
    if base < end:  # the tail: one masked block
        offs = base + tl.arange(0, RB)
        _adam_block(offs, offs < end, g_base, g_d, p_base, p_d, m_base, m_d, v_base, v_d,
                    s_base, s_d, w_base, w_d, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2,
                    eps, step_size, ema_w, l2, decoupled, use_denom, maximize, inv_scale,
                    G_DT, P_DT, S_DT, E_DT, EMA, MASTER, REM, HAS_SCALE, MATH, IS64)


@triton.jit(do_not_specialize=["n_chunks", "chunk"])
def _adam_kernel(table, n_chunks, chunk, g_base, p_base, m_base, v_base, s_base, w_base, scal,
                 noop, gscale, G_DT: tl.constexpr, P_DT: tl.constexpr, S_DT: tl.constexpr,
                 E_DT: tl.constexpr, EMA: tl.constexpr, MASTER: tl.constexpr, REM: tl.constexpr,
                 HAS_SCALE: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    """One Adam-family update per chunk. w_base: the fp32 masters (MASTER), the int16 master
    remainders beside bf16 params (REM: joined with the params' bits into the masters and
    split back, rules.join_master / split_master), else unused."""
    IS64: tl.constexpr = P_DT == 3
    MATH: tl.constexpr = tl.float64 if P_DT == 3 else tl.float32
    NL: tl.constexpr = 4 + EMA + MASTER + REM
    VG: tl.constexpr = 8 if G_DT == 1 or G_DT == 2 else (2 if G_DT == 3 else 4)
    pid = tl.program_id(0).to(tl.int64)
    n = n_chunks.to(tl.int64)
    g_d = tl.load(table + pid)
    p_d = tl.load(table + n + pid)
    m_d = tl.load(table + 2 * n + pid)
    v_d = tl.load(table + 3 * n + pid)
    s_d = p_d
    w_d = p_d
    if EMA:
        s_d = tl.load(table + 4 * n + pid)
    if MASTER or REM:
        w_d = tl.load(table + (NL - 1) * n + pid)
    numel = tl.load(table + NL * n + pid)
    start = tl.load(table + (NL + 1) * n + pid)
    end = tl.minimum(start + chunk.to(tl.int64), numel)
    end = tl.where(tl.load(noop) != 0, start, end)  # noop set (or found_inf): change nothing
    beta1 = tl.load(scal + S_BETA1)
    omb1 = tl.load(scal + S_OMB1)
    beta2 = tl.load(scal + S_BETA2)
    omb2 = tl.load(scal + S_OMB2)
    l2_wd = tl.load(scal + S_L2_WD)
    lr_wd = tl.load(scal + S_LR_WD)
    isb2 = tl.load(scal + S_ISB2)
    eps = tl.load(scal + S_EPS)
    step_size = tl.load(scal + S_STEP_SIZE)
    ema_w = tl.load(scal + S_EMA_W)
    l2 = tl.load(scal + S_L2) != 0
    decoupled = tl.load(scal + S_DECOUPLED) != 0
    use_denom = tl.load(scal + S_USE_DENOM) != 0
    maximize = tl.load(scal + S_MAXIMIZE) != 0
    inv_scale = beta1
    if HAS_SCALE:
        inv_scale = _div(tl.full((), 1.0, MATH), tl.load(gscale).to(MATH), IS64)
    # ALIGN (ALIGN_ALL, ALIGN_CHUNK, ALIGN_NONE): every chunk's whole blocks in 128-bit
    # vectors (the host has checked every offset), the choice made per chunk, or none; the rest
    # of a chunk (and a chunk that is not aligned) element by element. Per chunk: the table's
    # misalignment row (the state lists' offsets and the start, fixed while the bucket is bound)
    # and the grads' offset, tested here because the grads move between steps (a re-bind
    # rewrites only their offsets; a captured graph replays the offsets it captured: the test
    # follows both with no table write).
    if ALIGN == 2:
        _adam_vec(start, end, start == start, g_base, g_d, p_base, p_d, m_base, m_d, v_base,
                  v_d, s_base, s_d, w_base, w_d, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2,
                  eps, step_size, ema_w, l2, decoupled, use_denom, maximize, inv_scale, G_DT,
                  P_DT, S_DT, E_DT, EMA, MASTER, REM, HAS_SCALE, False, True, BLOCK)
    else:
        base = start
        if ALIGN == 1:
            vec = (tl.load(table + (NL + 2) * n + pid) == 0) & ((g_d & (VG - 1)) == 0)
            base += _adam_vec(start, end, vec, g_base, g_d, p_base, p_d, m_base, m_d, v_base,
                              v_d, s_base, s_d, w_base, w_d, beta1, omb1, beta2, omb2, l2_wd,
                              lr_wd, isb2, eps, step_size, ema_w, l2, decoupled, use_denom,
                              maximize, inv_scale, G_DT, P_DT, S_DT, E_DT, EMA, MASTER, REM,
                              HAS_SCALE, True, False, BLOCK)
        # the element-by-element blocks: half blocks; beside _adam_vec, a size of their own
        # (fp64: a quarter block, as _adam_vec runs half blocks there). Two loops on blocks of
        # one size share their ranges and constants (merged as equal values), and with them one
        # layout: the vector one, converted through shared memory at every scalar access.
        RB: tl.constexpr = BLOCK // 4 if IS64 and ALIGN == 1 else BLOCK // 2
        _adam_rest(base, end, g_base, g_d, p_base, p_d, m_base, m_d, v_base, v_d, s_base, s_d,
                   w_base, w_d, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2, eps, step_size,
                   ema_w, l2, decoupled, use_denom, maximize, inv_scale, G_DT, P_DT, S_DT, E_DT,
                   EMA, MASTER, REM, HAS_SCALE, RB)


@triton.jit
def _flag_if(noop, bad, V: tl.constexpr):
    """noop = 1 if any lane of ``bad`` (a 1-D block, V consecutive elements per thread, or
    rows) is set: each thread's lanes combined in its registers, then a masked store of the one
    flag by every thread that saw one (all write the same value); a reduction across warps
    would go through shared memory and barriers."""
    if len(bad.shape) == 1:
        bad = tl.reshape(bad, (bad.shape[0] // V, V))
    r = tl.max(bad, axis=1)
    tl.store(noop + tl.zeros(r.shape, dtype=tl.int32), tl.full(r.shape, 1, tl.int32),
             mask=r != 0)


@triton.jit(do_not_specialize=["n_chunks", "chunk"])
def _nonfinite_kernel(table, n_chunks, chunk, g_base, noop, NL: tl.constexpr,
                      G_DT: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    """check_finite: sets ``noop`` to 1 if any grad holds an inf or NaN (before the update).
    ALIGN as _adam_kernel's; a chunk is aligned when the grad's offset is a multiple of its
    vector width and the chunk's start a multiple of 16 (tested here, per chunk)."""
    MATH: tl.constexpr = tl.float32 if G_DT != 3 else tl.float64
    VG: tl.constexpr = 8 if G_DT == 1 or G_DT == 2 else (2 if G_DT == 3 else 4)
    SG: tl.constexpr = 3 if G_DT == 1 or G_DT == 2 else (1 if G_DT == 3 else 2)
    pid = tl.program_id(0).to(tl.int64)
    n = n_chunks.to(tl.int64)
    g_d = tl.load(table + pid)
    numel = tl.load(table + NL * n + pid)
    start = tl.load(table + (NL + 1) * n + pid)
    end = tl.minimum(start + chunk.to(tl.int64), numel)
    end = tl.where(tl.load(noop) != 0, start, end)
    base = start
    if ALIGN != 0:
        # whole blocks in 128-bit loads, from offsets re-derived as multiples (as _adam_vec)
        first = (start >> 4) << 4
        gv = (g_d >> SG) << SG
        b = first
        if ALIGN == 1:
            vec = ((g_d & (VG - 1)) == 0) & ((start & 15) == 0)
            b = tl.where(vec, first, end)  # not aligned: no whole block here
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        while b + BLOCK <= end:
            offs = tl.multiple_of(b, 16) + tl.arange(0, BLOCK)
            g = _ld(g_base, gv, offs, None, G_DT, MATH)
            f = g - g  # NaN exactly where g is inf or NaN
            bad = bad | (f != f).to(tl.int32)
            b += BLOCK
        if ALIGN == 2 and b < end:  # the tail: one masked block in the same layout
            offs = b + tl.arange(0, BLOCK)
            g = _ld(g_base, gv, offs, offs < end, G_DT, MATH)
            f = g - g
            bad = bad | (f != f).to(tl.int32)
        _flag_if(noop, bad, VG)
        if ALIGN == 1:
            b = tl.where(vec, b, start)
        base = b
    if ALIGN != 2:
        # the rest element by element: whole blocks unmasked, then one masked block; beside
        # the vector loop, in half blocks (blocks of one size would share the accumulator's
        # zeros and their ranges, merged as equal values, and with them the vector layout,
        # converted through shared memory)
        RB: tl.constexpr = BLOCK // 2 if ALIGN == 1 else BLOCK
        bad = tl.zeros([RB], dtype=tl.int32)
        while base + RB <= end:
            offs = base + tl.arange(0, RB)
            g = _ld(g_base, g_d, offs, None, G_DT, MATH)
            f = g - g
            bad = bad | (f != f).to(tl.int32)
            base += RB
        if base < end:
            offs = base + tl.arange(0, RB)
            g = _ld(g_base, g_d, offs, offs < end, G_DT, MATH)
            f = g - g
            bad = bad | (f != f).to(tl.int32)
        _flag_if(noop, bad, 1)


@triton.jit
def _power(x, n, NBITS: tl.constexpr):
    """multi_tensor.rules.power: x ** n by binary exponentiation, the same multiplications."""
    result = tl.full((), 1.0, tl.float64)
    base = x
    for i in tl.static_range(NBITS):
        result = tl.where(((n >> i) & 1) != 0, result * base, result)
        base = base * base
    return result


@triton.jit
def _sma_sums(q, n, NBITS: tl.constexpr):
    """multi_tensor.rules.sma_sums: RAdam's (G, K) by binary doubling, the same operations."""
    one = tl.full((), 1.0, tl.float64)
    rp = one
    rg = one - one
    rk = one - one
    rl = one - one
    bp = q
    bg = one
    bk = one
    bl = one
    for i in tl.static_range(NBITS):
        on = ((n >> i) & 1) != 0
        rk = tl.where(on, rk + rp * (bk + rl * bg), rk)
        rg = tl.where(on, rg + rp * bg, rg)
        rp = tl.where(on, rp * bp, rp)
        rl = tl.where(on, rl + bl, rl)
        bk = bk + bp * (bk + bl * bg)
        bg = bg + bp * bg
        bp = bp * bp
        bl = bl + bl
    return rg, rk


@triton.jit
def _step_scalars_kernel(hyp, step, noop, lr_ptr, scal, LR_TENSOR: tl.constexpr,
                         NBITS: tl.constexpr):
    """Advance the device step (unless noop is set) and write its scalars, in fp64 as
    multi_tensor.rules.step_scalars computes them, rounded once to the buffer's dtype."""
    skip = tl.load(noop) != 0
    s = tl.load(step)
    s_new = tl.where(skip, s, s + 1.0)
    tl.store(step, s_new)
    t = tl.maximum(s_new, 1.0).to(tl.int64)
    if LR_TENSOR:
        lr = tl.load(lr_ptr).to(tl.float64)
    else:
        lr = tl.load(hyp + H_LR)
    beta1 = tl.load(hyp + H_BETA1)
    beta2 = tl.load(hyp + H_BETA2)
    wd = tl.load(hyp + H_WEIGHT_DECAY)
    lr_wd_on = tl.load(hyp + H_LR_WD_ON) != 0
    bias_correction = tl.load(hyp + H_BIAS_CORRECTION) != 0
    radam = tl.load(hyp + H_RADAM) != 0
    one = tl.full((), 1.0, tl.float64)
    b1t = _power(beta1, t, NBITS)
    b2t = _power(beta2, t, NBITS)
    bc1 = one - b1t
    bc2 = one - b2t
    # Adam
    bc1a = tl.where(bias_correction, bc1, one)
    bc2a = tl.where(bias_correction, bc2, one)
    isb2_adam = one / tl.sqrt(bc2a)
    step_adam = lr / bc1a
    # RAdam (rules.radam_rect)
    rho_inf = 2.0 / (one - beta2) - 1.0
    sma_g, sma_k = _sma_sums(beta2, t, NBITS)
    rho_t = (2.0 * sma_k) / sma_g - 1.0
    rect = tl.sqrt(((rho_t - 4.0) * (rho_t - 2.0)) * rho_inf
                   / (((rho_inf - 4.0) * (rho_inf - 2.0)) * rho_t))
    rectified = rho_t > 5.0
    step_radam = tl.where(rectified, ((lr * rect) * tl.sqrt(bc2)) / bc1, lr / bc1)
    isb2 = tl.where(radam, one, isb2_adam)
    step_size = tl.where(radam, step_radam, step_adam)
    use_denom = tl.where(radam, tl.where(rectified, 1.0, 0.0), 1.0)
    lr_wd = tl.where(lr_wd_on, lr * wd, 0.0)
    out = scal.dtype.element_ty
    tl.store(scal + S_LR_WD, lr_wd.to(out))
    tl.store(scal + S_ISB2, isb2.to(out))
    tl.store(scal + S_STEP_SIZE, step_size.to(out))
    tl.store(scal + S_USE_DENOM, use_denom.to(out))


# ---------------------------------------------------------------------------------------------
# scale and l2norm

@triton.jit
def _scale_block(src_base, s_d, dst_base, d_d, offs, mask, f, bad, S_DT: tl.constexpr,
                 D_DT: tl.constexpr, MATH: tl.constexpr):
    x = _ld(src_base, s_d, offs, mask, S_DT, MATH)
    d = x - x
    bad = bad | (d != d).to(tl.int32)
    y = x * f
    if D_DT != 3:
        y = y.to(tl.float32)  # fp64 products reach fp16/bf16 through fp32, as torch's copy_
    _st(dst_base, d_d, offs, y, mask, D_DT)
    return bad


@triton.jit
def _scale_rows(src_base, s_d, dst_base, d_d, r8, end, MASKED: tl.constexpr, f, bad,
                S_DT: tl.constexpr, D_DT: tl.constexpr, MATH: tl.constexpr, R: tl.constexpr):
    x0, x1 = _ld_halves(src_base, s_d, r8, end, MASKED, S_DT, MATH, R)
    d = x0 - x0
    bad = bad | (d != d).to(tl.int32)
    d = x1 - x1
    bad = bad | (d != d).to(tl.int32)
    y0 = x0 * f
    y1 = x1 * f
    if D_DT != 3:
        y0 = y0.to(tl.float32)  # fp64 products reach fp16/bf16 through fp32, as torch's copy_
        y1 = y1.to(tl.float32)
    _st_halves(dst_base, d_d, r8, y0, y1, end, MASKED, D_DT, R)
    return bad


@triton.jit(do_not_specialize=["n_chunks", "chunk"])
def _scale_kernel(table, n_chunks, chunk, src_base, dst_base, factor, noop,
                  S_DT: tl.constexpr, D_DT: tl.constexpr, ALIGN: tl.constexpr,
                  BLOCK: tl.constexpr):
    """dst = round(opmath(src) * opmath(scale)); opmath is fp64 if either side is fp64.
    ALIGN as _adam_kernel's; a chunk is aligned when both offsets are multiples of their
    lists' vector widths and the chunk's start a multiple of 16 (tested here, per chunk: the
    table holds both offsets, so no misalignment row is needed)."""
    IS64: tl.constexpr = S_DT == 3 or D_DT == 3
    MATH: tl.constexpr = tl.float64 if IS64 else tl.float32
    VS: tl.constexpr = 8 if S_DT == 1 or S_DT == 2 else (2 if S_DT == 3 else 4)
    VD: tl.constexpr = 8 if D_DT == 1 or D_DT == 2 else (2 if D_DT == 3 else 4)
    SS: tl.constexpr = 3 if S_DT == 1 or S_DT == 2 else (1 if S_DT == 3 else 2)
    SD: tl.constexpr = 3 if D_DT == 1 or D_DT == 2 else (1 if D_DT == 3 else 2)
    pid = tl.program_id(0).to(tl.int64)
    n = n_chunks.to(tl.int64)
    s_d = tl.load(table + pid)
    d_d = tl.load(table + n + pid)
    numel = tl.load(table + 2 * n + pid)
    start = tl.load(table + 3 * n + pid)
    end = tl.minimum(start + chunk.to(tl.int64), numel)
    f = tl.load(factor).to(MATH)  # the double rounded once (cvt.rn), as torch's scalar
    base = start
    if ALIGN != 0:
        # whole blocks in 128-bit vectors: ALIGN_ALL, the offsets as the host checked them;
        # ALIGN_CHUNK, re-derived as multiples (as _adam_vec), so that the alignment the
        # compiler sees holds by construction, and not carried onto the element loop's values
        if ALIGN == 2:
            sv = tl.multiple_of(s_d, VS)
            dv = tl.multiple_of(d_d, VD)
            b = tl.multiple_of(start, 16)
        else:
            sv = (s_d >> SS) << SS
            dv = (d_d >> SD) << SD
            vec = ((s_d & (VS - 1)) == 0) & ((d_d & (VD - 1)) == 0) & ((start & 15) == 0)
            b = tl.where(vec, (start >> 4) << 4, end)  # not aligned: no whole block here
        if VS != VD:  # lists of different widths: rows of 8 per thread, as _adam_rows
            R: tl.constexpr = BLOCK // 8
            rows = tl.arange(0, R)[:, None] * 8
            bad = tl.zeros([R, 4], dtype=tl.int32)
            while b + BLOCK <= end:
                bad = _scale_rows(src_base, sv, dst_base, dv, tl.multiple_of(b, 16) + rows,
                                  end, False, f, bad, S_DT, D_DT, MATH, R)
                b += BLOCK
            if ALIGN == 2 and b < end:  # the tail: one masked block in the same layout
                bad = _scale_rows(src_base, sv, dst_base, dv, b + rows, end, True, f, bad,
                                  S_DT, D_DT, MATH, R)
            _flag_if(noop, bad, 4)
        else:
            bad = tl.zeros([BLOCK], dtype=tl.int32)
            while b + BLOCK <= end:
                offs = tl.multiple_of(b, 16) + tl.arange(0, BLOCK)
                bad = _scale_block(src_base, sv, dst_base, dv, offs, None, f, bad, S_DT, D_DT,
                                   MATH)
                b += BLOCK
            if ALIGN == 2 and b < end:  # the tail: one masked block in the same layout
                offs = b + tl.arange(0, BLOCK)
                bad = _scale_block(src_base, sv, dst_base, dv, offs, offs < end, f, bad, S_DT,
                                   D_DT, MATH)
            _flag_if(noop, bad, VS)
        if ALIGN == 1:
            b = tl.where(vec, b, start)
        base = b
    if ALIGN != 2:
        # the rest element by element: whole blocks unmasked, then one masked block; beside
        # the vector loop, in half blocks (blocks of one size would share the flag's zeros and
        # their ranges, merged as equal values, and with them the vector layout, converted
        # through shared memory)
        RB: tl.constexpr = BLOCK // 2 if ALIGN == 1 else BLOCK
        bad = tl.zeros([RB], dtype=tl.int32)
        while base + RB <= end:
            offs = base + tl.arange(0, RB)
            bad = _scale_block(src_base, s_d, dst_base, d_d, offs, None, f, bad, S_DT, D_DT,
                               MATH)
            base += RB
        if base < end:
            offs = base + tl.arange(0, RB)
            bad = _scale_block(src_base, s_d, dst_base, d_d, offs, offs < end, f, bad, S_DT,
                               D_DT, MATH)
        _flag_if(noop, bad, 1)


@triton.jit
def _sumsq_lanes(base, d, offs, mask, acc, bad, DT: tl.constexpr):
    """acc += x * x lane by lane (fp64), bad |= x is not finite."""
    x = _ld(base, d, offs, mask, DT, tl.float64)
    acc = acc + x * x
    f = x - x  # NaN exactly where x is inf or NaN
    bad = bad | (f != f).to(tl.int32)
    return acc, bad


@triton.jit(do_not_specialize=["n_blocks"])
def _sumsq_kernel(table, n_blocks, base, partial, noop, DT: tl.constexpr, NB: tl.constexpr,
                  ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    """l2norm phase 1: the fp64 sum of squares of one fixed block of NB elements. ALIGN as
    _adam_kernel's; a block is aligned when its tensor's offset is a multiple of the vector
    width (its start is a multiple of NB, so of 16), tested here, per block.

    Both paths add the same lanes in the same order: BLOCK lanes, lane j adding the squares of
    elements start + j, start + j + BLOCK, ... in that order, then the lanes summed by tl.sum
    (whose tree on a GPU follows the path's layout: each path's is that of its ALIGN_ALL or
    ALIGN_NONE variant). So a block runs wholly in one path (the vector path takes its tail
    too, in its own layout), and the
    element-by-element path beside the vector one runs the same lanes as [2, BLOCK // 2]
    (lane (h, j) is lane h * BLOCK // 2 + j): blocks of one shape would share the zeros and
    ranges, merged as equal values, and with them the vector layout, converted through shared
    memory at every load."""
    V: tl.constexpr = 8 if DT == 1 or DT == 2 else (2 if DT == 3 else 4)
    S: tl.constexpr = 3 if DT == 1 or DT == 2 else (1 if DT == 3 else 2)
    tl.static_assert(NB % 16 == 0)
    pid = tl.program_id(0).to(tl.int64)
    n = n_blocks.to(tl.int64)
    d = tl.load(table + pid)
    numel = tl.load(table + n + pid)
    start = tl.load(table + 2 * n + pid)
    out = tl.load(table + 3 * n + pid)
    end = tl.minimum(start + NB, numel)
    if ALIGN != 0:
        # 128-bit loads: ALIGN_ALL, the offset as the host checked it; ALIGN_CHUNK, re-derived
        # as a multiple (as _adam_vec). (start: a multiple of NB, so of 16)
        b = tl.multiple_of(start, 16)
        e = end
        if ALIGN == 2:
            dv = tl.multiple_of(d, V)
        else:
            dv = (d >> S) << S
            vec = (d & (V - 1)) == 0
            e = tl.where(vec, end, start)  # not aligned: nothing here
        acc = tl.zeros([BLOCK], dtype=tl.float64)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        while b + BLOCK <= e:  # whole blocks, unmasked
            acc, bad = _sumsq_lanes(base, dv, tl.multiple_of(b, 16) + tl.arange(0, BLOCK),
                                    None, acc, bad, DT)
            b += BLOCK
        if b < e:  # the tail: one masked block in the same layout
            offs = b + tl.arange(0, BLOCK)
            acc, bad = _sumsq_lanes(base, dv, offs, offs < e, acc, bad, DT)
        total = tl.sum(acc, axis=0)
        _flag_if(noop, bad, V)
    if ALIGN != 2:
        # element by element (beside the vector path: the blocks it did not take)
        b = start
        e = end
        if ALIGN == 1:
            e = tl.where(vec, start, end)
            H: tl.constexpr = BLOCK // 2
            lanes = tl.arange(0, 2)[:, None] * H + tl.arange(0, H)[None, :]
            acc2 = tl.zeros([2, H], dtype=tl.float64)
            bad2 = tl.zeros([2, H], dtype=tl.int32)
            while b + BLOCK <= e:  # whole blocks, unmasked
                acc2, bad2 = _sumsq_lanes(base, d, b + lanes, None, acc2, bad2, DT)
                b += BLOCK
            if b < e:  # the tail: one masked block
                offs = b + lanes
                acc2, bad2 = _sumsq_lanes(base, d, offs, offs < e, acc2, bad2, DT)
            total = tl.where(vec, total, tl.sum(tl.reshape(acc2, [BLOCK]), axis=0))
            _flag_if(noop, tl.reshape(bad2, [BLOCK]), 1)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float64)
            bad = tl.zeros([BLOCK], dtype=tl.int32)
            while b + BLOCK <= e:  # whole blocks, unmasked
                acc, bad = _sumsq_lanes(base, d, b + tl.arange(0, BLOCK), None, acc, bad, DT)
                b += BLOCK
            if b < e:  # the tail: one masked block
                offs = b + tl.arange(0, BLOCK)
                acc, bad = _sumsq_lanes(base, d, offs, offs < e, acc, bad, DT)
            total = tl.sum(acc, axis=0)
            _flag_if(noop, bad, 1)
    tl.store(partial + out, total)


@triton.jit(do_not_specialize=["n_rows"])
def _rowsum_kernel(partial, rows, n_rows, per64, per32, RB: tl.constexpr):
    """l2norm phase 2: each tensor's blocks summed in a fixed order; its norm in fp32."""
    pid = tl.program_id(0).to(tl.int64)
    first = tl.load(rows + pid)
    count = tl.load(rows + n_rows.to(tl.int64) + pid)
    acc = tl.zeros([RB], dtype=tl.float64)
    last = first + count
    b = first
    while b < last:
        offs = b + tl.arange(0, RB)
        acc = acc + tl.load(partial + offs, mask=offs < last, other=0.0)
        b += RB
    s = tl.sum(acc, axis=0)
    tl.store(per64 + pid, s)
    tl.store(per32 + pid, tl.sqrt(s).to(tl.float32))


@triton.jit(do_not_specialize=["n_rows"])
def _total_kernel(per64, n_rows, total, RB: tl.constexpr):
    """l2norm phase 3: the total, the tensors' sums added in a fixed order."""
    acc = tl.zeros([RB], dtype=tl.float64)
    n = n_rows.to(tl.int64)
    b = n - n
    while b < n:
        offs = b + tl.arange(0, RB)
        acc = acc + tl.load(per64 + offs, mask=offs < n, other=0.0)
        b += RB
    tl.store(total, tl.sqrt(tl.sum(acc, axis=0)).to(tl.float32))


# ---------------------------------------------------------------------------------------------
# how each kernel is launched: the one table the host side (host._launch) and the ahead-of-time
# matrix (aot.aot_variants) both read, so the PTX and resource checks compile each kernel with
# the warps and the fixed constexprs it runs with

class Launch(NamedTuple):
    num_warps: int
    constexprs: Dict[str, int]  # the constexprs every launch passes (the rest vary per launch)


LAUNCHES: Dict[str, Launch] = {
    "_adam_kernel": Launch(NUM_WARPS, {"BLOCK": BLOCK}),
    "_nonfinite_kernel": Launch(NUM_WARPS, {"BLOCK": BLOCK}),
    "_scale_kernel": Launch(NUM_WARPS, {"BLOCK": BLOCK}),
    "_sumsq_kernel": Launch(NUM_WARPS, {"NB": NORM_BLOCK, "BLOCK": BLOCK}),
    "_rowsum_kernel": Launch(NUM_WARPS, {"RB": NORM_RBLOCK}),
    "_total_kernel": Launch(NUM_WARPS, {"RB": NORM_RBLOCK}),
    # one thread computes a step's scalars: one warp
    "_step_scalars_kernel": Launch(1, {"NBITS": STEP_BITS}),
}
# the non-finite scan's NL (the pointer table's rows before numel: the grads and the state
# lists, 1 + params, exp_avgs, exp_avg_sqs, then an EMA and masters or remainders where the
# bucket has them)
NL_VALUES = (4, 5, 6)
