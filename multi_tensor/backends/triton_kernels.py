"""The Triton kernels of the ``triton`` backend, and the host side that feeds them.

Imported only by :mod:`multi_tensor.backends.triton_gpu` when the first CUDA bucket is prepared
or op called (this module imports triton). Everything here also runs on CPU tensors under
``TRITON_INTERPRET=1`` (how the tests check the kernels without a GPU).

Multi-tensor launch
-------------------
A bucket (or an op call) is cut into chunks of ``chunk_size`` elements per tensor; empty tensors
have no chunk. Per chunk, an int64 *pointer table* holds one address per list, the tensor's numel
and the chunk's start offset. The table is column-major (``table[row, chunk]``), so the grads'
addresses are one contiguous row that can be rewritten alone. An address is stored as an element
offset from the list's *base pointer* (a tensor of that list passed as a kernel argument): Triton
then knows the base's 16-byte alignment, and when every address is 16-byte aligned the kernel is
specialised (``ALIGNED``) to say so, which gives 128-bit loads and stores. Offsets are 64-bit,
the grid is the number of chunks: one launch per bucket, for any number of tensors.

Exactness
---------
Every kernel mirrors :mod:`multi_tensor.rules` (and ``csrc/include/adam_rule.h``) line for line:
fp32 math with ``tl.div_rn``/``tl.sqrt_rn`` (fp64 buckets: ``/`` and ``tl.sqrt``, which are IEEE
in fp64), every kernel is launched with ``enable_fp_fusion=False`` (no multiply-add contraction),
negation flips the sign bit, fp32 -> bf16 rounds to nearest even with integer operations (NaN ->
0x7FC0; the interpreter's own cast truncates), fp32 -> fp16 converts with ``rtne``. Scalars are
rounded once from double, on the host (``torch`` casts) or on the device (``cvt.rn``).

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

import operator
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from .. import rules

# dtype codes (constexpr kernel arguments)
F32, F16, BF16, F64 = 0, 1, 2, 3
DTYPE_CODE = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16, torch.float64: F64}
ELEMENT_SIZE = {F32: 4, F16: 2, BF16: 2, F64: 8}

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
    """Load elements ``base[delta + offs]`` of dtype code DT, converted exactly to MATH."""
    ptr = base + delta + offs
    if mask is None:  # whole blocks
        raw = tl.load(ptr)
    else:
        raw = tl.load(ptr, mask=mask, other=0)
    if DT == 2:  # bf16, through its bits (base is an int16 view)
        x = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = raw.to(tl.float32 if DT != 3 else tl.float64)
    return x.to(MATH)


@triton.jit
def _st(base, delta, offs, x, mask, DT: tl.constexpr):
    """Store ``x`` (fp32 or fp64) to dtype code DT, rounded once to nearest even."""
    ptr = base + delta + offs
    if DT == 3:
        tl.store(ptr, x.to(tl.float64), mask=mask)
    elif DT == 0:
        tl.store(ptr, x.to(tl.float32), mask=mask)
    elif DT == 1:
        tl.store(ptr, x.to(tl.float32).to(tl.float16, fp_downcast_rounding="rtne"), mask=mask)
    else:
        xf = x.to(tl.float32)
        bits = xf.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(xf != xf, 0x7FC0, r)
        tl.store(ptr, r.to(tl.int16), mask=mask)


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
def _adam_block(offs, mask, g_base, g_d, p_base, p_d, m_base, m_d, v_base, v_d, s_base, s_d,
                w_base, w_d, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2, eps, step_size, ema_w,
                l2, decoupled, use_denom, maximize, inv_scale,
                G_DT: tl.constexpr, P_DT: tl.constexpr, S_DT: tl.constexpr, E_DT: tl.constexpr,
                EMA: tl.constexpr, MASTER: tl.constexpr, HAS_SCALE: tl.constexpr,
                MATH: tl.constexpr, IS64: tl.constexpr):
    # multi_tensor/rules.py, line for line (csrc/include/adam_rule.h adam_update). E_DT: the
    # EMA's storage (S_DT, or bf16 beside fp32/fp16 state): loaded exactly, rounded once on store.
    g = _ld(g_base, g_d, offs, mask, G_DT, MATH)
    if MASTER:
        w = _ld(w_base, w_d, offs, mask, 0, MATH)
    else:
        w = _ld(p_base, p_d, offs, mask, P_DT, MATH)
    m = _ld(m_base, m_d, offs, mask, S_DT, MATH)
    v = _ld(v_base, v_d, offs, mask, S_DT, MATH)
    if HAS_SCALE:
        g = g * inv_scale
    g = tl.where(maximize, _neg(g, IS64), g)
    g = tl.where(l2, g + l2_wd * w, g)
    m = beta1 * m + omb1 * g
    v = beta2 * v + (omb2 * g) * g
    u = tl.where(use_denom, _div(m, _sqrt(v, IS64) * isb2 + eps, IS64), m)
    wn = tl.where(decoupled, w - lr_wd * w, w)
    wn = wn - step_size * u
    _st(m_base, m_d, offs, m, mask, S_DT)
    _st(v_base, v_d, offs, v, mask, S_DT)
    if EMA:
        s = _ld(s_base, s_d, offs, mask, E_DT, MATH)
        s = s + ema_w * (wn - s)
        _st(s_base, s_d, offs, s, mask, E_DT)
    if MASTER:
        _st(w_base, w_d, offs, wn, mask, 0)
    _st(p_base, p_d, offs, wn, mask, P_DT)


@triton.jit(do_not_specialize=["n_chunks", "chunk"])
def _adam_kernel(table, n_chunks, chunk, g_base, p_base, m_base, v_base, s_base, w_base, scal,
                 noop, gscale, G_DT: tl.constexpr, P_DT: tl.constexpr, S_DT: tl.constexpr,
                 E_DT: tl.constexpr, EMA: tl.constexpr, MASTER: tl.constexpr, HAS_SCALE: tl.constexpr,
                 ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    IS64: tl.constexpr = P_DT == 3
    MATH: tl.constexpr = tl.float64 if P_DT == 3 else tl.float32
    NL: tl.constexpr = 4 + EMA + MASTER
    VG: tl.constexpr = 8 if G_DT == 1 or G_DT == 2 else (2 if G_DT == 3 else 4)
    VP: tl.constexpr = 8 if P_DT == 1 or P_DT == 2 else (2 if P_DT == 3 else 4)
    VS: tl.constexpr = 8 if S_DT == 1 or S_DT == 2 else (2 if S_DT == 3 else 4)
    VE: tl.constexpr = 8 if E_DT == 1 or E_DT == 2 else (2 if E_DT == 3 else 4)
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
    if MASTER:
        w_d = tl.load(table + (NL - 1) * n + pid)
    numel = tl.load(table + NL * n + pid)
    start = tl.load(table + (NL + 1) * n + pid)
    if ALIGNED:  # (tl.multiple_of must be applied here: a jit helper's hint is lost)
        g_d = tl.multiple_of(g_d, VG)
        p_d = tl.multiple_of(p_d, VP)
        m_d = tl.multiple_of(m_d, VS)
        v_d = tl.multiple_of(v_d, VS)
        s_d = tl.multiple_of(s_d, VE)
        w_d = tl.multiple_of(w_d, 4)
        start = tl.multiple_of(start, 16)
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
    # while loops: the interpreter cannot run range() over loaded bounds (1-element arrays)
    full = start + ((end - start) // BLOCK) * BLOCK
    base = start
    while base < full:  # whole blocks, unmasked (128-bit accesses when ALIGNED)
        if ALIGNED:
            offs = tl.multiple_of(base, 16) + tl.arange(0, BLOCK)
        else:
            offs = base + tl.arange(0, BLOCK)
        _adam_block(offs, None, g_base, g_d, p_base, p_d, m_base, m_d, v_base, v_d, s_base, s_d,
                    w_base, w_d, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2, eps, step_size,
                    ema_w, l2, decoupled, use_denom, maximize, inv_scale,
                    G_DT, P_DT, S_DT, E_DT, EMA, MASTER, HAS_SCALE, MATH, IS64)
        base += BLOCK
    if base < end:  # the tail: one masked block
        offs = base + tl.arange(0, BLOCK)
        _adam_block(offs, offs < end, g_base, g_d, p_base, p_d, m_base, m_d, v_base, v_d, s_base,
                    s_d, w_base, w_d, beta1, omb1, beta2, omb2, l2_wd, lr_wd, isb2, eps,
                    step_size, ema_w, l2, decoupled, use_denom, maximize, inv_scale,
                    G_DT, P_DT, S_DT, E_DT, EMA, MASTER, HAS_SCALE, MATH, IS64)


@triton.jit(do_not_specialize=["n_chunks", "chunk"])
def _nonfinite_kernel(table, n_chunks, chunk, g_base, noop, NL: tl.constexpr,
                      G_DT: tl.constexpr, BLOCK: tl.constexpr):
    """check_finite: sets ``noop`` to 1 if any grad holds an inf or NaN (before the update)."""
    pid = tl.program_id(0).to(tl.int64)
    n = n_chunks.to(tl.int64)
    g_d = tl.load(table + pid)
    numel = tl.load(table + NL * n + pid)
    start = tl.load(table + (NL + 1) * n + pid)
    end = tl.minimum(start + chunk.to(tl.int64), numel)
    end = tl.where(tl.load(noop) != 0, start, end)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    base = start
    while base < end:
        offs = base + tl.arange(0, BLOCK)
        g = _ld(g_base, g_d, offs, offs < end, G_DT, tl.float32 if G_DT != 3 else tl.float64)
        f = g - g  # NaN exactly where g is inf or NaN
        bad = bad | (f != f).to(tl.int32)
        base += BLOCK
    if tl.max(bad, axis=0) != 0:
        tl.store(noop, 1)


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

@triton.jit(do_not_specialize=["n_chunks", "chunk"])
def _scale_kernel(table, n_chunks, chunk, src_base, dst_base, factor, noop,
                  S_DT: tl.constexpr, D_DT: tl.constexpr, ALIGNED: tl.constexpr,
                  BLOCK: tl.constexpr):
    """dst = round(opmath(src) * opmath(scale)); opmath is fp64 if either side is fp64."""
    IS64: tl.constexpr = S_DT == 3 or D_DT == 3
    MATH: tl.constexpr = tl.float64 if IS64 else tl.float32
    VS: tl.constexpr = 8 if S_DT == 1 or S_DT == 2 else (2 if S_DT == 3 else 4)
    VD: tl.constexpr = 8 if D_DT == 1 or D_DT == 2 else (2 if D_DT == 3 else 4)
    pid = tl.program_id(0).to(tl.int64)
    n = n_chunks.to(tl.int64)
    s_d = tl.load(table + pid)
    d_d = tl.load(table + n + pid)
    numel = tl.load(table + 2 * n + pid)
    start = tl.load(table + 3 * n + pid)
    if ALIGNED:
        s_d = tl.multiple_of(s_d, VS)
        d_d = tl.multiple_of(d_d, VD)
        start = tl.multiple_of(start, 16)
    end = tl.minimum(start + chunk.to(tl.int64), numel)
    f = tl.load(factor).to(MATH)  # the double rounded once (cvt.rn), as torch's scalar
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    base = start
    while base < end:
        offs = base + tl.arange(0, BLOCK)
        mask = offs < end
        x = _ld(src_base, s_d, offs, mask, S_DT, MATH)
        d = x - x
        bad = bad | (d != d).to(tl.int32)
        y = x * f
        if D_DT != 3:
            y = y.to(tl.float32)  # fp64 products reach fp16/bf16 through fp32, as torch's copy_
        _st(dst_base, d_d, offs, y, mask, D_DT)
        base += BLOCK
    if tl.max(bad, axis=0) != 0:
        tl.store(noop, 1)


@triton.jit(do_not_specialize=["n_blocks"])
def _sumsq_kernel(table, n_blocks, base, partial, noop, DT: tl.constexpr, NB: tl.constexpr,
                  BLOCK: tl.constexpr):
    """l2norm phase 1: the fp64 sum of squares of one fixed block of NB elements."""
    pid = tl.program_id(0).to(tl.int64)
    n = n_blocks.to(tl.int64)
    d = tl.load(table + pid)
    numel = tl.load(table + n + pid)
    start = tl.load(table + 2 * n + pid)
    out = tl.load(table + 3 * n + pid)
    end = tl.minimum(start + NB, numel)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    b = start
    while b < end:
        offs = b + tl.arange(0, BLOCK)
        x = _ld(base, d, offs, offs < end, DT, tl.float64)
        acc = acc + x * x
        f = x - x
        bad = bad | (f != f).to(tl.int32)
        b += BLOCK
    tl.store(partial + out, tl.sum(acc, axis=0))
    if tl.max(bad, axis=0) != 0:
        tl.store(noop, 1)


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
# host helpers

def _launch(kernel, grid, device: torch.device, *args, **kwargs):
    kwargs.setdefault("num_warps", NUM_WARPS)
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return kernel[grid](*args, **kwargs, **COMPILE_OPTIONS)
    return kernel[grid](*args, **kwargs, **COMPILE_OPTIONS)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def to_device(host: torch.Tensor, out: Optional[torch.Tensor], device: torch.device,
              what: str = "table") -> torch.Tensor:
    """Copy a host tensor to ``device`` without a host sync (pinned memory, non-blocking).

    Writes into ``out`` when given (same shape and dtype), else returns a new device tensor.
    """
    if _capturing(device):
        raise RuntimeError(
            f"multi_tensor triton: the {what} of a bucket had to be rewritten during CUDA graph "
            "capture (grads, hyperparameters or tensors changed); run the step once outside the "
            "capture first (warm-up), and keep them fixed while capturing")
    if device.type == "cuda":
        host = host.pin_memory()
        if out is None:
            return host.to(device, non_blocking=True)
        out.copy_(host, non_blocking=True)
        return out
    if out is None:
        return host.clone()
    out.copy_(host)
    return out


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill ``numel`` consecutive slots from data_ptr."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _layout_of(shape, strides) -> tuple:
    """The element -> memory map of a dense tensor (strides of the dims of size > 1)."""
    return tuple(st for sz, st in zip(shape, strides) if sz != 1)


def _layout(t: torch.Tensor) -> tuple:
    return _layout_of(t.shape, t.stride())


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for size in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def _base_view(t: torch.Tensor) -> torch.Tensor:
    """What the kernel receives as a list's base pointer (bf16 as its int16 bits)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _chunks(numels: Sequence[int], chunk: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row of each chunk, start offset of each chunk, chunks per row); empty rows have none."""
    numel = np.asarray(numels, dtype=np.int64)
    counts = (numel + chunk - 1) // chunk
    rows = np.repeat(np.arange(len(numel), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    starts = (np.arange(len(rows), dtype=np.int64) - np.repeat(first, counts)) * chunk
    return rows, starts, counts


def _deltas(ptrs: np.ndarray, base_ptr: int, esize: int) -> np.ndarray:
    return (ptrs - np.int64(base_ptr)) // esize


def _flag(noop_flag: Optional[torch.Tensor], device: torch.device, spare: List) -> torch.Tensor:
    """The flag a kernel reads (and may set): the noop flag itself, or a zeroed spare."""
    if noop_flag is not None and noop_flag.numel() > 0:
        flag = noop_flag.as_strided((1,), (1,))  # its first element, always a view
        if flag.dtype == torch.bool:
            flag = flag.view(torch.uint8)
        return flag
    if not spare:
        spare.append(torch.zeros(1, dtype=torch.int32, device=device))
    else:
        spare[0].zero_()
    return spare[0]


# ---------------------------------------------------------------------------------------------
# the prepared Adam-family bucket

class _Staged:
    """A tensor the kernel cannot address in place, and the dense copy it runs on."""

    __slots__ = ("orig", "copy", "written")

    def __init__(self, orig: torch.Tensor, strides: tuple, written: bool):
        self.orig = orig
        self.copy = torch.empty_strided(orig.shape, strides, dtype=orig.dtype, device=orig.device)
        self.written = written


class AdamBucket:
    """One Adam-family op bound to a bucket's state lists (``prepare``'s result).

    ``bind(grads)`` checks the grads cheaply (same objects and addresses as last time: one pass
    over ``data_ptr``; else count, dtype, shape, device, layout) and rewrites the grads' row of
    the pointer table only when an address changed. ``run`` launches one kernel.

    Layouts: a row whose tensors are dense (contiguous, channels_last, ...) with the param's
    strides runs in place. A tensor that is not dense, or whose strides differ from its param's,
    runs on a persistent dense copy: copied in before the launch and, for written lists, back
    after it (two extra copies per such tensor; rare: the optimizers create their state with
    the params' layout).
    """

    def __init__(self, op: str, lists, chunk_size: int):
        self.op = op
        self.ema = lists.has_ema
        self.master = lists.has_master
        # the pointer table's rows: the grads, then the state lists in AdamLists' field order
        # (params, exp_avgs, exp_avg_sqs, emas, masters: the order _adam_kernel reads them in)
        self.list_names = [name for name, _ in lists.present() if name != "grads"]
        self.state_lists = [list(getattr(lists, name)) for name in self.list_names]
        self.chunk = int(chunk_size)
        params = self.state_lists[0]
        self.n = len(params)
        self.device = params[0].device if params else torch.device("cpu")
        self.p_dt = DTYPE_CODE[params[0].dtype] if params else F32
        self.s_dt = F32 if self.master else self.p_dt
        # the EMA's storage: the state dtype, or bf16 (schema.REDUCED_EMA_DTYPE)
        emas = lists.emas or []
        self.e_dt = DTYPE_CODE[emas[0].dtype] if emas else self.s_dt
        self.math = torch.float64 if self.p_dt == F64 else torch.float32
        self._grad_dtypes = ((torch.float64,) if self.p_dt == F64
                             else (torch.float16, torch.bfloat16, torch.float32))
        self._sizes = [p.size() for p in params]
        self._spare: List[torch.Tensor] = []
        self._grads = None
        self._g_objs = None
        self._g_ptrs = None
        self._g_dtype = None
        self._g_base = None
        self._g_col = None
        self._g_staged: List[_Staged] = []
        self._g_stage_rows = {}
        self._hyper = None
        # row layouts and the state lists' addresses
        self._strides = []  # each row's layout: its param's if dense, else contiguous
        self._row_contiguous = []
        self._layouts = []
        self._staged: List[_Staged] = []
        numels = []
        for p in params:
            strides = tuple(p.stride()) if _dense(p) else _contiguous_strides(p.shape)
            self._strides.append(strides)
            self._layouts.append(_layout_of(p.shape, strides))
            self._row_contiguous.append(self._layouts[-1] == _layout_of(
                p.shape, _contiguous_strides(p.shape)))
            numels.append(p.numel())
        self._numels = np.asarray(numels, dtype=np.int64)
        self._live = self._numels > 0
        self._rows, starts, _ = _chunks(numels, self.chunk)
        self.n_chunks = len(self._rows)
        nl = 1 + len(self.state_lists)
        host = np.zeros((nl + 2, self.n_chunks), dtype=np.int64)
        self._bases = []
        aligned = self.chunk % 16 == 0
        for li, tensors in enumerate(self.state_lists):
            eff = []
            for i, t in enumerate(tensors):
                if t.numel() and not self._fits(t, i):
                    st = _Staged(t, self._strides[i], written=True)
                    self._staged.append(st)
                    t = st.copy
                eff.append(t)
            base, col, ok = self._column(eff)
            self._bases.append(base)
            host[li + 1] = col
            aligned = aligned and ok
        self._state_aligned = aligned
        host[nl] = self._numels[self._rows]
        host[nl + 1] = starts
        self._nl = nl
        self._table = (to_device(torch.from_numpy(host), None, self.device)
                       if self.n_chunks else None)
        self._g_aligned = True
        self._scal = torch.zeros(rules.N_SCALARS, dtype=self.math, device=self.device)
        self._hyp = torch.zeros(rules.N_HYPER, dtype=torch.float64, device=self.device)

    def _column(self, tensors) -> Tuple[Optional[torch.Tensor], np.ndarray, bool]:
        """A list's base pointer, its row of the table (per chunk) and whether all is aligned."""
        live = [t for t, on in zip(tensors, self._live) if on]
        if not live:
            return None, np.zeros(self.n_chunks, dtype=np.int64), True
        base = live[0]
        ptrs = np.asarray([t.data_ptr() if on else base.data_ptr()
                           for t, on in zip(tensors, self._live)], dtype=np.int64)
        col = _deltas(ptrs, base.data_ptr(), base.element_size())[self._rows]
        return _base_view(base), col, bool(np.all(ptrs % 16 == 0))

    # --- grads ---------------------------------------------------------------------------------
    def _fits(self, t: torch.Tensor, row: int) -> bool:
        return t.numel() <= 1 or (_dense(t) and _layout(t) == self._layouts[row])

    def bind(self, grads) -> bool:
        self._grads = None
        if len(grads) != self.n:
            return False
        if not self.n:
            self._grads = []
            return True
        objs = self._g_objs
        if objs is not None and all(map(operator.is_, grads, objs)):
            try:
                ptrs = list(map(torch.Tensor.data_ptr, grads))
            except TypeError:
                return False
            if ptrs == self._g_ptrs:
                self._grads = list(grads)
                return True
        return self._bind_slow(list(grads))

    def _bind_slow(self, grads) -> bool:
        g0 = grads[0]
        if g0 is None or not isinstance(g0, torch.Tensor):
            return False
        dtype = g0.dtype
        if dtype not in self._grad_dtypes:
            return False
        device = self.device
        for g in grads:  # (not ``None in grads``: that compares tensors with ==)
            if g is None or g.dtype != dtype or g.layout != torch.strided or g.device != device:
                return False
        if list(map(torch.Tensor.size, grads)) != self._sizes:
            return False
        # a param reshaped in place (``p.data = p.data.view(...)``) no longer fits its state
        if list(map(torch.Tensor.size, self.state_lists[0])) != self._sizes:
            return False
        stage_rows = {}
        eff = list(grads)
        contiguous = list(map(torch.Tensor.is_contiguous, grads))
        for i, g in enumerate(grads):
            if contiguous[i] and self._row_contiguous[i]:
                continue  # the common case
            if g.numel() and not self._fits(g, i):
                st = self._g_stage_rows.get(i)
                if st is None or st.copy.dtype != dtype:
                    st = _Staged(g, self._strides[i], written=False)
                st.orig = g
                stage_rows[i] = st
                eff[i] = st.copy
        self._g_stage_rows = stage_rows
        self._g_staged = list(stage_rows.values())
        base, col, aligned = self._column(eff)
        if self.n_chunks and (self._g_col is None or not np.array_equal(col, self._g_col)):
            # new addresses (not just new tensor objects): rewrite the grads' row only
            to_device(torch.from_numpy(np.ascontiguousarray(col)), self._table[0], device,
                      "grads' row of the pointer table")
            self._g_col = col
        self._g_aligned = aligned
        self._g_base = base
        self._g_dtype = dtype
        self._g_objs = list(grads)
        self._g_ptrs = list(map(torch.Tensor.data_ptr, grads))
        self._grads = list(grads)
        return True

    # --- run -----------------------------------------------------------------------------------
    def run(self, noop_flag, scalars: rules.StepScalars, grad_scale=None,
            check_finite: bool = False) -> None:
        """One update with the host's scalars (copied to the device buffer, no sync)."""
        grads, self._grads = self._grads, None
        if grads is None:
            raise RuntimeError("multi_tensor triton: run() without a successful bind()")
        if not self.n_chunks:
            return
        to_device(rules.pack(scalars, self.math), self._scal, self.device, "scalars")
        self._hyper = None  # a later device step rewrites its step-independent scalars
        self._launch(_flag(noop_flag, self.device, self._spare), grad_scale, check_finite)

    def run_device_step(self, step: torch.Tensor, hyper: rules.AdamHyper, noop_flag=None,
                        grad_scale=None, lr: Optional[torch.Tensor] = None) -> None:
        """One update whose step and scalars live on the device (sync-free, graph-capturable).

        ``step``: a float32 scalar tensor on the bucket's device holding the number of updates
        done; it is advanced by one unless ``noop_flag`` (e.g. GradScaler's ``found_inf``) is
        nonzero, in which case nothing changes. ``hyper``: the step-independent
        hyperparameters (the host rewrites the device copy only when they change). ``lr``: an
        optional device tensor read at run time instead of ``hyper.lr`` (capturable lr).
        """
        grads, self._grads = self._grads, None
        if grads is None:
            raise RuntimeError("multi_tensor triton: run_device_step() without a successful bind()")
        key = (hyper, lr is not None)
        if key != self._hyper:
            self._write_hyper(hyper)
            self._hyper = key
        flag = _flag(noop_flag, self.device, self._spare)
        _launch(_step_scalars_kernel, (1,), self.device, self._hyp, step, flag,
                lr if lr is not None else self._hyp, self._scal, LR_TENSOR=lr is not None,
                NBITS=STEP_BITS, num_warps=1)
        if self.n_chunks:
            self._launch(flag, grad_scale, False)

    def _write_hyper(self, h: rules.AdamHyper) -> None:
        # the step-independent fields (the kernel rewrites the step-dependent ones every step)
        to_device(rules.pack(rules.step_scalars(h, 1), self.math), self._scal, self.device,
                  "scalars")
        to_device(rules.pack(rules.device_hyper(h)), self._hyp, self.device, "hyperparameters")

    def _launch(self, flag: torch.Tensor, grad_scale, check_finite: bool) -> None:
        for st in self._staged:
            st.copy.copy_(st.orig)
        for st in self._g_staged:
            st.copy.copy_(st.orig)
        g_dt = DTYPE_CODE[self._g_dtype]
        if check_finite:
            _launch(_nonfinite_kernel, (self.n_chunks,), self.device, self._table, self.n_chunks,
                    self.chunk, self._g_base, flag, NL=self._nl, G_DT=g_dt, BLOCK=BLOCK)
        gscale = self._scal
        if grad_scale is not None:
            gscale = grad_scale.reshape(-1)[:1].to(device=self.device, dtype=self.math)
        b = dict(zip(self.list_names, self._bases))
        p_base = b["params"]
        _launch(_adam_kernel, (self.n_chunks,), self.device, self._table, self.n_chunks,
                self.chunk, self._g_base, p_base, b["exp_avgs"], b["exp_avg_sqs"],
                b.get("emas", p_base), b.get("masters", p_base), self._scal, flag,
                gscale, G_DT=g_dt, P_DT=self.p_dt, S_DT=self.s_dt, E_DT=self.e_dt,
                EMA=self.ema, MASTER=self.master, HAS_SCALE=grad_scale is not None,
                ALIGNED=self._state_aligned and self._g_aligned, BLOCK=BLOCK)
        for st in self._staged:
            st.orig.copy_(st.copy)


# ---------------------------------------------------------------------------------------------
# scale

def scale(chunk_size, noop_flag, tensor_lists, scale_factor) -> bool:
    """multi_tensor_scale; returns False (nothing done) for dtypes the kernel does not handle."""
    srcs, dsts = tensor_lists
    if not srcs:
        return True
    if any(t.dtype not in DTYPE_CODE for t in srcs) or any(t.dtype not in DTYPE_CODE for t in dsts):
        return False
    device = srcs[0].device
    flag = _flag(noop_flag, device, [])
    factor = to_device(torch.tensor([float(scale_factor)], dtype=torch.float64), None, device,
                       "scale factor")
    chunk = int(chunk_size)
    groups = {}
    copy_back = []
    for s, d in zip(srcs, dsts):
        if not s.numel():
            continue
        if not (_dense(s) and _dense(d) and (s.numel() <= 1 or _layout(s) == _layout(d))):
            s = s.contiguous()
            if not (d.is_contiguous()):
                tmp = torch.empty_like(s, dtype=d.dtype)
                copy_back.append((d, tmp))
                d = tmp
        groups.setdefault((s.dtype, d.dtype), []).append((s, d))
    for (sdt, ddt), pairs in groups.items():
        rows, starts, _ = _chunks([s.numel() for s, _ in pairs], chunk)
        sp = np.asarray([s.data_ptr() for s, _ in pairs], dtype=np.int64)
        dp = np.asarray([d.data_ptr() for _, d in pairs], dtype=np.int64)
        s0, d0 = pairs[0]
        host = np.stack([_deltas(sp, s0.data_ptr(), s0.element_size())[rows],
                         _deltas(dp, d0.data_ptr(), d0.element_size())[rows],
                         np.asarray([s.numel() for s, _ in pairs], dtype=np.int64)[rows], starts])
        aligned = (chunk % 16 == 0 and bool(np.all(sp % 16 == 0)) and bool(np.all(dp % 16 == 0)))
        table = to_device(torch.from_numpy(np.ascontiguousarray(host)), None, device)
        _launch(_scale_kernel, (len(rows),), device, table, len(rows), chunk, _base_view(s0),
                _base_view(d0), factor, flag, S_DT=DTYPE_CODE[sdt], D_DT=DTYPE_CODE[ddt],
                ALIGNED=aligned, BLOCK=BLOCK)
    for d, tmp in copy_back:
        d.copy_(tmp)
    return True


# ---------------------------------------------------------------------------------------------
# l2norm

def l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """multi_tensor_l2norm: (total, per-tensor norms) as fp32 device tensors, or None for
    dtypes the kernel does not handle. Fixed NORM_BLOCK blocks (independent of chunk_size),
    each summed in fp64, then each tensor's blocks in index order, then the tensors in order."""
    del chunk_size
    tensors = tensor_lists[0]
    device = tensors[0].device if tensors else noop_flag.device
    if any(t.dtype not in DTYPE_CODE for t in tensors):
        return None
    n = len(tensors)
    flag = _flag(noop_flag, device, [])
    counts = [(t.numel() + NORM_BLOCK - 1) // NORM_BLOCK for t in tensors]
    first = np.cumsum([0] + counts[:-1]).astype(np.int64) if n else np.zeros(0, np.int64)
    n_blocks = int(sum(counts))
    partial = torch.zeros(max(n_blocks, 1), dtype=torch.float64, device=device)
    groups = {}
    for i, t in enumerate(tensors):
        if t.numel():
            groups.setdefault(t.dtype, []).append((i, t if _dense(t) else t.contiguous()))
    for dtype, items in groups.items():
        numels = [t.numel() for _, t in items]
        rows, starts, _ = _chunks(numels, NORM_BLOCK)
        ptrs = np.asarray([t.data_ptr() for _, t in items], dtype=np.int64)
        t0 = items[0][1]
        out = first[np.asarray([i for i, _ in items], dtype=np.int64)][rows] + starts // NORM_BLOCK
        host = np.stack([_deltas(ptrs, t0.data_ptr(), t0.element_size())[rows],
                         np.asarray(numels, dtype=np.int64)[rows], starts, out])
        table = to_device(torch.from_numpy(np.ascontiguousarray(host)), None, device)
        _launch(_sumsq_kernel, (len(rows),), device, table, len(rows), _base_view(t0), partial,
                flag, DT=DTYPE_CODE[dtype], NB=NORM_BLOCK, BLOCK=BLOCK)
    total = torch.zeros((), dtype=torch.float32, device=device)
    per32 = torch.zeros(n, dtype=torch.float32, device=device)
    if n:
        rows_host = np.stack([first, np.asarray(counts, dtype=np.int64)])
        rows_t = to_device(torch.from_numpy(np.ascontiguousarray(rows_host)), None, device)
        per64 = torch.empty(n, dtype=torch.float64, device=device)
        _launch(_rowsum_kernel, (n,), device, partial, rows_t, n, per64, per32, RB=NORM_RBLOCK)
        _launch(_total_kernel, (1,), device, per64, n, total, RB=NORM_RBLOCK)
    if not per_tensor:
        per32 = torch.zeros(0, dtype=torch.float32, device=device)
    return total, per32


# ---------------------------------------------------------------------------------------------
# ahead-of-time compilation (the PTX check; no GPU needed)

_PTR = {F32: "*fp32", F16: "*fp16", BF16: "*i16", F64: "*fp64"}


def aot_variants():
    """(name, kernel, signature, constexprs): every kernel of this module, specialised as the
    backend launches it, for the ahead-of-time PTX check. Adam family: each (param, grad,
    masters) dtype path once, EMA / grad scale / ALIGNED both ways (all four combinations for
    the fp32 and fp64 paths), and a bf16 EMA beside fp32 and fp16 state (aligned or not);
    scale: every (src, dst) dtype pair; l2norm: each input dtype and
    both combine phases; the device step kernel with fp32 and fp64 scalars, lr float or tensor."""
    out = []
    combos = [  # (param, grad, master, ema storage: None = the state dtype)
        (F32, F32, False, None), (F32, BF16, False, None), (F32, F16, False, None),
        (F16, F16, False, None), (BF16, BF16, False, None), (BF16, BF16, True, None),
        (BF16, F32, True, None), (F16, F32, True, None), (F16, F16, True, None),
        (F64, F64, False, None),
        # a bf16 EMA beside fp32 state (with and without masters) and beside fp16 state
        (F32, F32, False, BF16), (BF16, BF16, True, BF16), (F16, F16, False, BF16),
    ]
    # every dtype path once; EMA, grad scale and the ALIGNED specialisation each both ways
    switches = [(True, True, True), (False, False, False), (True, False, True),
                (False, True, False)]
    for k, (p, g, master, e) in enumerate(combos):
        s = F32 if master else p
        full = not master and p == g and p in (F32, F64) and e is None  # fp32, fp64: all four
        if e is not None:  # a bf16 EMA: with the EMA, both alignments
            variants = [(True, True, True), (True, False, False)]
        else:
            variants = switches if full else [switches[k % 4]]
        e = s if e is None else e
        for ema, has_scale, aligned in variants:
            name = (f"adam_p{p}_g{g}_{'master' if master else 'plain'}_"
                    f"{f'ema{e}' if ema else 'noema'}_{'scale' if has_scale else 'noscale'}_"
                    f"{'aligned' if aligned else 'unaligned'}")
            math_ptr = "*fp64" if p == F64 else "*fp32"
            sig = {"table": "*i64", "n_chunks": "i32", "chunk": "i32", "g_base": _PTR[g],
                   "p_base": _PTR[p], "m_base": _PTR[s], "v_base": _PTR[s],
                   "s_base": _PTR[e] if ema else _PTR[p],
                   "w_base": "*fp32" if master else _PTR[p], "scal": math_ptr,
                   "noop": "*i32", "gscale": math_ptr}
            cx = dict(G_DT=g, P_DT=p, S_DT=s, E_DT=e if ema else s, EMA=ema, MASTER=master,
                      HAS_SCALE=has_scale, ALIGNED=aligned, BLOCK=BLOCK)
            out.append((name, _adam_kernel, sig, cx))
    for g in (F32, F16, BF16, F64):
        sig = {"table": "*i64", "n_chunks": "i32", "chunk": "i32", "g_base": _PTR[g],
               "noop": "*i32"}
        out.append((f"nonfinite_g{g}", _nonfinite_kernel, sig, dict(NL=5, G_DT=g, BLOCK=BLOCK)))
    for sdt in (F32, F16, BF16, F64):
        for ddt in (F32, F16, BF16, F64):
            sig = {"table": "*i64", "n_chunks": "i32", "chunk": "i32", "src_base": _PTR[sdt],
                   "dst_base": _PTR[ddt], "factor": "*fp64", "noop": "*i32"}
            out.append((f"scale_s{sdt}_d{ddt}", _scale_kernel, sig,
                        dict(S_DT=sdt, D_DT=ddt, ALIGNED=True, BLOCK=BLOCK)))
    for dt in (F32, F16, BF16, F64):
        sig = {"table": "*i64", "n_blocks": "i32", "base": _PTR[dt], "partial": "*fp64",
               "noop": "*i32"}
        out.append((f"sumsq_{dt}", _sumsq_kernel, sig, dict(DT=dt, NB=NORM_BLOCK, BLOCK=BLOCK)))
    out.append(("rowsum", _rowsum_kernel, {"partial": "*fp64", "rows": "*i64", "n_rows": "i32",
                                           "per64": "*fp64", "per32": "*fp32"},
                dict(RB=NORM_RBLOCK)))
    out.append(("total", _total_kernel, {"per64": "*fp64", "n_rows": "i32", "total": "*fp32"},
                dict(RB=NORM_RBLOCK)))
    for out_ty in ("*fp32", "*fp64"):
        for lr_t in (False, True):
            sig = {"hyp": "*fp64", "step": "*fp32", "noop": "*fp32",
                   "lr_ptr": "*fp32" if lr_t else "*fp64", "scal": out_ty}
            out.append((f"step_scalars_{out_ty[1:]}_{'lrtensor' if lr_t else 'lrfloat'}",
                        _step_scalars_kernel, sig, dict(LR_TENSOR=lr_t, NBITS=STEP_BITS)))
    return out


def compile_ptx(kernel, signature, constexprs, arch: int, num_warps: int = NUM_WARPS) -> str:
    """The PTX of one kernel variant for CUDA sm_<arch>, compiled on this machine (no GPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    # as at run time for torch allocations: every pointer argument is 16-byte aligned
    names = list(kernel.arg_names)
    attrs = {(names.index(name),): [["tt.divisibility", 16]]
             for name, ty in signature.items() if ty.startswith("*")}
    src = ASTSource(fn=kernel, signature=sig, constexprs=dict(constexprs), attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(COMPILE_OPTIONS, num_warps=num_warps))
    return compiled.asm["ptx"]
