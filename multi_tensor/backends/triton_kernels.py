"""The Triton kernels of the ``triton`` backend (what is compiled; the host side that feeds them
is :mod:`multi_tensor.backends.triton_host`, the ahead-of-time variant list
:mod:`multi_tensor.backends.triton_aot`).

Imported only through :mod:`multi_tensor.backends.triton_gpu` when the first CUDA bucket is
prepared or op called (this module imports triton). Everything here also runs on CPU tensors under
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

import os

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
