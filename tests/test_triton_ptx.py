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
check_finite scan, scale, the three l2norm phases, the device step-scalars kernel): the kernels
are found in the kernel module itself (every ``@triton.jit`` function no other one calls), and
the launches the host side makes (recorded on CPU tensors) are checked to be compiled variants,
with the warps and constexprs of :data:`~multi_tensor.backends.triton.kernels.LAUNCHES`. Skips
when triton is not installed.
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
from multi_tensor.backends.triton import kernels as KM  # noqa: E402

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


def _launched_kernels():
    """The ``@triton.jit`` functions of the kernel module that no other one calls: the kernels
    the host launches (the rest are device functions they inline)."""
    jitted = {name: fn for name, fn in vars(KM).items()
              if isinstance(fn, triton.runtime.JITFunction)}
    called = {name for name in jitted for other, fn in jitted.items()
              if other != name and re.search(rf"\b{name}\s*\(", fn.src)}
    return {name: jitted[name] for name in set(jitted) - called}


def test_every_kernel_is_covered():
    """Every kernel found in the kernel module (not an import list) is in the compiled matrix
    and has its row of the launch table."""
    roots = _launched_kernels()
    compiled = {v[1].__name__ for v in VARIANTS}
    assert roots and set(roots) <= compiled, \
        f"kernels without a PTX check: {sorted(set(roots) - compiled)}"
    assert set(roots) == set(KM.LAUNCHES), \
        f"kernels and launch table differ: {sorted(set(roots) ^ set(KM.LAUNCHES))}"


def _record_launches(monkeypatch):
    """Every launch the host side makes (kernel, constexprs, warps), the launches stubbed."""
    from multi_tensor.backends.triton import host
    seen = []

    def run(kernel, grid, device, args, constexprs, num_warps):
        seen.append((kernel, dict(constexprs), num_warps))
    monkeypatch.setattr(host, "_run", run)
    return host, seen


# (param dtype, grad dtype, masters (False, True or "rem": master remainders), EMA dtype or
# None) of the buckets whose launches are checked
_BUCKETS = [("float32", "float32", False, "float32"), ("float32", "float32", False, None),
            ("bfloat16", "bfloat16", True, "float32"), ("bfloat16", "float32", True, "bfloat16"),
            ("bfloat16", "float32", "rem", "float32"), ("bfloat16", "bfloat16", "rem", None),
            ("float16", "float16", False, "bfloat16"), ("float64", "float64", False, "float64")]


def test_launches_are_compiled_variants(monkeypatch):
    """What the host side launches, run on CPU tensors with the launches recorded: each
    launch's kernel, constexprs and warps are those of a compiled variant (the Adam variants'
    HAS_SCALE is sampled, alternating, and left out of the comparison)."""
    import torch

    from multi_tensor import rules, schema
    host, seen = _record_launches(monkeypatch)
    for p_dt, g_dt, master, e_dt in _BUCKETS:
        p_dt, g_dt = getattr(torch, p_dt), getattr(torch, g_dt)
        s_dt = torch.float32 if master else p_dt
        sizes = [1000, 37, 4096 + 5]
        params = [torch.randn(n).to(p_dt) for n in sizes]
        lists = schema.AdamLists(
            grads=None, params=params, exp_avgs=[torch.zeros(n, dtype=s_dt) for n in sizes],
            exp_avg_sqs=[torch.zeros(n, dtype=s_dt) for n in sizes],
            emas=None if e_dt is None else [torch.zeros(n, dtype=getattr(torch, e_dt))
                                            for n in sizes],
            masters=[p.float() for p in params] if master is True else None,
            remainders=([torch.zeros(n, dtype=torch.int16) for n in sizes] if master == "rem"
                        else None))
        op = "fused_ema_adamw" if e_dt is not None else "adam"
        bucket = host.AdamBucket(op, lists, 2048)
        grads = [torch.randn(n).to(g_dt) for n in sizes]
        hyper = rules.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                                decoupled=True, bias_correction=True, maximize=False,
                                ema_decay=None if e_dt is None else 0.999, rule=rules.ADAM)
        assert bucket.bind(grads)
        bucket.run(torch.zeros(1, dtype=torch.int32), rules.step_scalars(hyper, 1),
                   torch.ones(1), True)
        assert bucket.bind(grads)
        bucket.grad_norm(torch.zeros(1, dtype=torch.int32))
        math = torch.float64 if p_dt == torch.float64 else torch.float32
        bucket.run_device_step(torch.zeros((), dtype=torch.float64), hyper)
        assert bucket.bind(grads)
        bucket.run_device_step(torch.zeros((), dtype=torch.float64), hyper,
                               lr=torch.tensor(1e-3, dtype=math))
        host.scale(2048, torch.zeros(1, dtype=torch.int32), [grads, params], 0.5)
    kinds = {kernel.__name__ for kernel, _, _ in seen}
    assert kinds == set(KM.LAUNCHES), f"not launched here: {sorted(set(KM.LAUNCHES) - kinds)}"
    compiled = {(v[1].__name__, tuple(sorted((k, x) for k, x in v[3].items()
                                             if k != "HAS_SCALE"))) for v in VARIANTS}
    for kernel, cx, warps in seen:
        key = (kernel.__name__, tuple(sorted((k, x) for k, x in cx.items() if k != "HAS_SCALE")))
        assert key in compiled, f"launched but never compiled: {key}"
        assert warps == K.num_warps_of(kernel), (kernel.__name__, warps)
