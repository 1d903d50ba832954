"""The ``triton`` backend's kernels specialised as it launches them, compiled ahead of time.

:func:`aot_variants` lists every kernel variant the host side (:mod:`.host`) can launch, each
with the warps and fixed constexprs of its kernel's row of :data:`.kernels.LAUNCHES` (the table
the host's launches read); :func:`compile_ptx` compiles one for an NVIDIA architecture on any
machine (no GPU needed), for the PTX and ``ptxas`` checks of ``tests/test_triton_ptx.py`` and
``tests/test_triton_resources.py``.
"""
from __future__ import annotations

import functools

import triton

from .kernels import (ALIGN_ALL, ALIGN_CHUNK, ALIGN_NONE, BF16, COMPILE_OPTIONS, F16, F32,
                      F64, LAUNCHES, NL_VALUES, _adam_kernel, _nonfinite_kernel,
                      _rowsum_kernel, _scale_kernel, _step_scalars_kernel, _sumsq_kernel,
                      _total_kernel)


_PTR = {F32: "*fp32", F16: "*fp16", BF16: "*i16", F64: "*fp64"}
# the ALIGN modes (the Adam kernel, the non-finite scan, scale, the sum of squares), as the
# variant names spell them
ALIGN_NAMES = {ALIGN_ALL: "aligned", ALIGN_CHUNK: "chunk", ALIGN_NONE: "unaligned"}


def aot_variants():
    """(name, kernel, signature, constexprs): every kernel of kernels.py, specialised as the
    backend can launch it, for the ahead-of-time PTX and resource checks. Adam family: every
    dtype path (params x grads x masters (none, fp32, remainders beside bf16 params) x EMA
    storage: none, the state dtype or bf16), in
    each ALIGN mode (every chunk aligned, aligned per chunk, none), with and without a grad
    scale (alternating); the non-finite check for every grad dtype, ALIGN mode and number of
    lists (``NL_VALUES``); scale and l2norm's sum of squares: every dtype (pair) in each ALIGN
    mode; the l2norm combine phases; the device step kernel with fp32 and fp64 scalars, lr
    float or tensor. Each variant's constexprs include its kernel's fixed ones (``LAUNCHES``)."""
    out = []
    # (param, grad, master form: None, "master" (fp32 masters) or "rem" (master remainders,
    # bf16 params only), ema storage: None = no EMA)
    combos = []
    for p in (F32, F16, BF16):
        for g in (F32, F16, BF16):
            for master in (None, "master") + (("rem",) if p == BF16 else ()):
                s = F32 if master else p
                for e in (None, s) + ((BF16,) if s != BF16 else ()):
                    combos.append((p, g, master, e))
    combos += [(F64, F64, None, None), (F64, F64, None, F64)]
    for k, (p, g, master, e) in enumerate(combos):
        s = F32 if master else p
        ema = e is not None
        for align in (ALIGN_ALL, ALIGN_CHUNK, ALIGN_NONE):
            has_scale = (k + align) % 2 == 0
            name = (f"adam_p{p}_g{g}_{master or 'plain'}_"
                    f"{f'ema{e}' if ema else 'noema'}_{'scale' if has_scale else 'noscale'}_"
                    f"{ALIGN_NAMES[align]}")
            math_ptr = "*fp64" if p == F64 else "*fp32"
            sig = {"table": "*i64", "n_chunks": "i32", "chunk": "i32", "g_base": _PTR[g],
                   "p_base": _PTR[p], "m_base": _PTR[s], "v_base": _PTR[s],
                   "s_base": _PTR[e] if ema else _PTR[p],
                   "w_base": {"master": "*fp32", "rem": "*i16"}.get(master, _PTR[p]),
                   "scal": math_ptr,
                   "noop": "*i32", "gscale": math_ptr}
            cx = dict(G_DT=g, P_DT=p, S_DT=s, E_DT=e if ema else s, EMA=ema,
                      MASTER=master == "master", REM=master == "rem", HAS_SCALE=has_scale,
                      ALIGN=align)
            out.append((name, _adam_kernel, sig, cx))
    for align in (ALIGN_ALL, ALIGN_CHUNK, ALIGN_NONE):
        for g in (F32, F16, BF16, F64):
            sig = {"table": "*i64", "n_chunks": "i32", "chunk": "i32", "g_base": _PTR[g],
                   "noop": "*i32"}
            for nl in NL_VALUES:
                out.append((f"nonfinite_g{g}_nl{nl}_{ALIGN_NAMES[align]}", _nonfinite_kernel,
                            sig, dict(NL=nl, G_DT=g, ALIGN=align)))
    for align in (ALIGN_ALL, ALIGN_CHUNK, ALIGN_NONE):
        tag = ALIGN_NAMES[align]
        for sdt in (F32, F16, BF16, F64):
            for ddt in (F32, F16, BF16, F64):
                sig = {"table": "*i64", "n_chunks": "i32", "chunk": "i32", "src_base": _PTR[sdt],
                       "dst_base": _PTR[ddt], "factor": "*fp64", "noop": "*i32"}
                out.append((f"scale_s{sdt}_d{ddt}_{tag}", _scale_kernel, sig,
                            dict(S_DT=sdt, D_DT=ddt, ALIGN=align)))
        for dt in (F32, F16, BF16, F64):
            sig = {"table": "*i64", "n_blocks": "i32", "base": _PTR[dt], "partial": "*fp64",
                   "noop": "*i32"}
            out.append((f"sumsq_{dt}_{tag}", _sumsq_kernel, sig, dict(DT=dt, ALIGN=align)))
    out.append(("rowsum", _rowsum_kernel, {"partial": "*fp64", "rows": "*i64", "n_rows": "i32",
                                           "per64": "*fp64", "per32": "*fp32"}, {}))
    out.append(("total", _total_kernel, {"per64": "*fp64", "n_rows": "i32", "total": "*fp32"},
                {}))
    for out_ty in ("*fp32", "*fp64"):
        for lr_t in (False, True):
            # the step counter is float64 (fused_optim.planning._Bucket.device_step)
            sig = {"hyp": "*fp64", "step": "*fp64", "noop": "*fp32",
                   "lr_ptr": "*fp32" if lr_t else "*fp64", "scal": out_ty}
            out.append((f"step_scalars_{out_ty[1:]}_{'lrtensor' if lr_t else 'lrfloat'}",
                        _step_scalars_kernel, sig, dict(LR_TENSOR=lr_t)))
    # (the per-launch constexprs completed with the kernel's fixed ones)
    return [(name, kernel, sig, {**LAUNCHES[kernel.__name__].constexprs, **cx})
            for name, kernel, sig, cx in out]


def num_warps_of(kernel) -> int:
    """The warps ``kernel`` is launched with (its row of ``LAUNCHES``)."""
    return LAUNCHES[kernel.__name__].num_warps


@functools.lru_cache(maxsize=None)
def _variant_index():
    return {v[0]: v for v in aot_variants()}


@functools.lru_cache(maxsize=None)
def compiled_ptx(name: str, arch: int) -> str:
    """The PTX of the variant called ``name`` for sm_<arch>, compiled once per process (the PTX
    and resource tests share it)."""
    _, kernel, sig, cx = _variant_index()[name]
    return compile_ptx(kernel, sig, cx, arch)


def compile_ptx(kernel, signature, constexprs, arch: int, num_warps: int = None) -> str:
    """The PTX of one kernel variant for CUDA sm_<arch>, compiled on this machine (no GPU),
    with the warps it is launched with unless ``num_warps`` is given."""
    if num_warps is None:
        num_warps = num_warps_of(kernel)
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
