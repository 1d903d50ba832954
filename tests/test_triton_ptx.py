"""The Triton backend's kernels compiled ahead of time for sm_80 and sm_90, on this CPU machine.

The interpreter cannot tell an approximate kernel from an exact one (it runs everything through
numpy), so exactness on a GPU is checked here, in the PTX the GPU would run
(``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``, with the backend's own
``enable_fp_fusion=False``):

* fp32 math: ``div.rn.f32`` and ``sqrt.rn.f32`` present (fp64 math: ``div.rn.f64``,
  ``sqrt.rn.f64``);
* nowhere: ``div.full``, ``div.approx``, ``sqrt.approx``, ``rcp.approx``, ``rsqrt.approx``, a
  floating-point fused or contracted multiply-add (``fma.rn.f32/f64``, ``mad`` on f32/f64), or a
  flush-to-zero ``.ftz`` modifier. (Integer ``mad.lo``/``mad.wide`` do appear: they are the
  address arithmetic of the loads and stores, not floating-point contraction.)
* the aligned Adam variants (every chunk aligned, or the choice made per chunk) really give
  128-bit accesses (``ld.global.v4``/``v2.b64``); the variant with no aligned chunk gives none.

Every kernel of the backend is compiled (Adam family in every dtype path and list form, the
check_finite scan, scale, the three l2norm phases, the device step-scalars kernel). Skips when
triton is not installed.
"""
from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (tools/bootstrap.sh --test)")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled",
                allow_module_level=True)

from multi_tensor.backends.triton import aot as K  # noqa: E402

VARIANTS = K.aot_variants()
FORBIDDEN = {
    "approximate division": re.compile(r"\bdiv\.full\b"),
    "an approximate instruction": re.compile(r"\b[a-z0-9]+\.approx\b[.\w]*"),
    "fused multiply-add": re.compile(r"\bfma\.rn[.\w]*"),
    "floating-point mad": re.compile(r"\bmad(?:\.rn)?(?:\.ftz)?(?:\.sat)?\.f(?:16|32|64)\b"),
    "flush to zero": re.compile(r"\S*\.ftz\b\S*"),
}

def ptx_of(name: str, arch: int) -> str:
    return K.compiled_ptx(name, arch)  # compiled once per process (shared with the resource test)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("name", [v[0] for v in VARIANTS])
def test_ptx_is_ieee_exact(name, arch):
    ptx = ptx_of(name, arch)
    assert f".target sm_{arch}" in ptx
    for what, pattern in FORBIDDEN.items():
        found = sorted(set(pattern.findall(ptx)))
        assert not found, f"{name} sm_{arch}: {what} in the PTX: {found}"
    _, _, sig, cx = next(v for v in VARIANTS if v[0] == name)
    if name.startswith("adam"):
        wide = cx["P_DT"] == K.F64
        suffix = "f64" if wide else "f32"
        assert f"div.rn.{suffix}" in ptx, f"{name}: no div.rn.{suffix}"
        assert f"sqrt.rn.{suffix}" in ptx, f"{name}: no sqrt.rn.{suffix}"
        if not wide:
            assert "mul.rn.f32" in ptx and "add.rn.f32" in ptx
    if name.startswith("step_scalars"):
        for op in ("div.rn.f64", "sqrt.rn.f64", "mul.rn.f64"):
            assert op in ptx, f"{name}: no {op}"
        if sig["scal"] == "*fp32":
            assert "cvt.rn.f32.f64" in ptx, "the fp64 scalars are not rounded to nearest"
    if name.startswith("adam"):
        vec = "ld.global.v2.b64" if cx["P_DT"] == K.F64 else "ld.global.v4.b32"
        if cx["ALIGN"] == K.ALIGN_NONE:
            assert vec not in ptx, f"{name}: a variant with no aligned chunk vectorises"
        else:
            assert vec in ptx, f"{name}: the aligned variant does not vectorise ({vec})"
    if re.search(r"_p1_|_d1_", name):  # fp16 params or an fp16 scale destination
        assert re.search(r"cvt\.rn\.f16(?:x2)?\.f32", ptx), f"{name}: fp16 not rounded to nearest"


def test_every_kernel_is_covered():
    kernels = {v[1] for v in VARIANTS}
    jitted = {getattr(K, n) for n in dir(K)
              if n.endswith("_kernel") and isinstance(getattr(K, n), triton.runtime.JITFunction)}
    assert jitted and jitted <= kernels, f"kernels without a PTX check: {jitted - kernels}"
