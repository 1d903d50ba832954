"""What the Triton backend's kernels cost an sm_90a GPU, checked on this CPU machine.

Every kernel variant the backend can launch (``triton_aot.aot_variants``: every op, list form,
dtype combination, each ALIGN mode: aligned per launch, per chunk or not), with the warps and
constexprs it is launched with (``kernels.LAUNCHES``), is compiled for sm_90a and assembled by
``ptxas -v``, the one Triton itself picks for that target. Asserted:

* no shared memory (``ld/st.shared``) and no barrier (``bar.sync``) in the PTX of the
  elementwise kernels (Adam family, scale, the non-finite check). A layout conversion between
  lists of different vector widths goes through shared memory and a barrier per iteration;
  Triton's shared memory is dynamic, so ``ptxas -v`` does not report it and the PTX is read
  instead. (The l2norm phases reduce across warps, which needs shared memory: exempt.)
* 0 bytes of spill stores and loads;
* at most 96 registers per thread (at most 80 when every list is fp32), so that enough warps fit
  on an SM to keep the loads in flight. The step-scalars kernel runs one thread once per step:
  its register count does not matter and is not limited;
* in the aligned variants (``ALIGN_ALL``), every unmasked global load and store of every list
  is 128-bit (``ld/st.global.v4.b32``; fp64:
  ``.v2.b64``; 16-bit lists are moved as packed 32-bit words), counted per list: each access is
  traced back to the kernel parameter its address derives from. The masked tail of a tensor
  (predicated accesses) is element by element;
* in the variants that decide per chunk (``ALIGN_CHUNK``: a tensor at a misaligned address,
  such as a grad view into a flat buffer, in a bucket, scale group or l2norm group of aligned
  ones; the sum of squares decides per fixed block), the two branches are
  counted apart per list: the aligned chunks' whole blocks in exactly the 128-bit accesses of
  the aligned variant, the element-by-element loop in accesses of one element (one per element
  of its block per thread), nothing of another width; ``ALIGN_NONE``: no 128-bit access.

What this proves: the code the GPU would run has no shared-memory round trip, no spills, an
occupancy the register count allows, and full-width memory transactions. What it cannot prove:
the bandwidth actually reached (scheduling, caches, DRAM), which only a run on the GPU measures
(``tools/gpu_check``). Skips when triton or its ptxas is missing.
"""
from __future__ import annotations

import functools
import itertools
import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (tools/bootstrap.sh --test)")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled",
                allow_module_level=True)

from multi_tensor.backends.triton import aot as K  # noqa: E402
from multi_tensor.backends.triton.kernels import ELEMENT_SIZE, I16  # noqa: E402

ARCH = 90


def _ptxas(arch: int):
    """The ptxas Triton itself assembles sm_<arch> code with (``get_ptxas(arch)``: it picks
    another assembler for some targets and honours ``TRITON_PTXAS_PATH``), or None."""
    try:
        from triton.backends.nvidia import compiler
        return compiler.get_ptxas(arch).path
    except (ImportError, AttributeError, RuntimeError):
        return None


PTXAS = _ptxas(ARCH)
if not PTXAS or not os.path.exists(PTXAS):
    pytest.skip(f"Triton's ptxas for sm_{ARCH} is missing ({PTXAS})", allow_module_level=True)

VARIANTS = {v[0]: v for v in K.aot_variants()}
ELEMENTWISE = ("adam_", "scale_", "nonfinite_")
MAX_REGS, MAX_REGS_FP32 = 96, 80

# the list arguments of each kernel: "r" read, "w" written, "rw" both
LISTS = {
    "_adam_kernel": {"g_base": "r", "p_base": "rw", "m_base": "rw", "v_base": "rw",
                     "s_base": "rw", "w_base": "rw"},
    "_scale_kernel": {"src_base": "r", "dst_base": "w"},
    "_nonfinite_kernel": {"g_base": "r"},
    "_sumsq_kernel": {"base": "r"},
}
_REG = re.compile(r"%[a-z]+\d+")
_PARAM = re.compile(r"\[\s*(\w+)_param_(\d+)\s*\]")


@functools.lru_cache(maxsize=None)
def compiled(name: str):
    """(ptx, registers, spill bytes) of one variant for sm_90a: compiled once per session."""
    ptx = K.compiled_ptx(name, ARCH)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        # as Triton assembles it for the backend (enable_fp_fusion=False: --fmad=false)
        r = subprocess.run([PTXAS, "-lineinfo", "--fmad=false", "-v", "--gpu-name=sm_90a", src,
                            "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{name}: ptxas failed:\n{out}"
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", out)]
    spills = [int(a) + int(b) for a, b in
              re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)]
    assert regs and spills, f"{name}: no resource line from ptxas -v:\n{out}"
    return ptx, max(regs), sum(spills)


def _instructions(ptx: str):
    """(predicated, mnemonic, operands) of each PTX instruction."""
    for line in ptx.splitlines():
        line = line.split("//")[0].strip()
        if not line.endswith(";") or line.startswith("."):
            continue
        line = line[:-1].strip()
        pred = line.startswith("@")
        if pred:
            line = line.split(None, 1)[1]
        parts = line.split(None, 1)
        if len(parts) == 2:
            yield pred, parts[0], parts[1]


def _split_operands(ops: str):
    out, depth, cur = [], 0, ""
    for ch in ops:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return out


def global_accesses(ptx: str):
    """[(kind 'ld'/'st', mnemonic, predicated, params)]: each global access and the kernel
    parameters its address is computed from (register taint, iterated to a fixed point so that
    loop-carried registers are followed)."""
    insts = list(_instructions(ptx))
    taint = {}
    changed = True
    while changed:
        changed = False
        for _, mn, ops in insts:
            if mn.startswith(("st.", "bra", "ret", "bar", "@")):
                continue
            opl = _split_operands(ops)
            dests = _REG.findall(opl[0])
            if mn.startswith("ld.param"):
                m = _PARAM.search(ops)
                src = frozenset([int(m.group(2))]) if m else frozenset()
            else:
                src = frozenset()
                for o in opl[1:]:
                    for r in _REG.findall(o):
                        src |= taint.get(r, frozenset())
            for r in dests:
                if not src <= taint.get(r, frozenset()):
                    taint[r] = taint.get(r, frozenset()) | src
                    changed = True
    out = []
    for pred, mn, ops in insts:
        if not mn.startswith(("ld.global", "st.global")):
            continue
        addr = re.search(r"\[([^\]]*)\]", ops).group(1)
        params = frozenset()
        for r in _REG.findall(addr):
            params |= taint.get(r, frozenset())
        out.append((mn[:2], mn, pred, params))
    return out


def _all_fp32(cx) -> bool:
    dts = [cx[k] for k in ("G_DT", "P_DT", "S_DT", "E_DT", "D_DT", "DT") if k in cx]
    return bool(dts) and all(d == K.F32 for d in dts)


def _lists_of(name):
    _, kernel, sig, cx = VARIANTS[name]
    lists = dict(LISTS.get(kernel.__name__, {}))
    if kernel.__name__ == "_adam_kernel":
        if not cx["EMA"]:
            del lists["s_base"]
        if not cx["MASTER"] and not cx["REM"]:
            del lists["w_base"]
        elif cx["MASTER"]:  # the update reads the masters; the params are only written
            lists["p_base"] = "w"
    return kernel, lists, cx


@pytest.mark.parametrize("name", list(VARIANTS))
def test_resources(name):
    ptx, regs, spill = compiled(name)
    cx = VARIANTS[name][3]
    assert spill == 0, f"{name}: {spill} bytes of register spills"
    if not name.startswith("step_scalars"):
        limit = MAX_REGS_FP32 if _all_fp32(cx) else MAX_REGS
        assert regs <= limit, f"{name}: {regs} registers (at most {limit})"
    if name.startswith(ELEMENTWISE):
        shared = re.findall(r"\b(?:ld|st)\.shared[.\w]*", ptx)
        bars = re.findall(r"\b(?:bar|barrier)\.(?:sync|arrive|red)\b", ptx)
        assert not shared, f"{name}: {len(shared)} shared-memory accesses (a layout conversion)"
        assert not bars, f"{name}: {len(bars)} barriers"


def _per_thread(kernel, cx) -> int:
    """Elements per thread of one whole block (the Adam family runs half blocks in fp64)."""
    block = cx["BLOCK"]
    if kernel.__name__ == "_adam_kernel" and cx["P_DT"] == K.F64:
        block //= 2
    return block // (32 * K.num_warps_of(kernel))


def _dtype_of(kernel, arg, cx) -> int:
    return {"_adam_kernel": dict(g_base=cx.get("G_DT"), p_base=cx.get("P_DT"),
                                 m_base=cx.get("S_DT"), v_base=cx.get("S_DT"),
                                 s_base=cx.get("E_DT"),
                                 w_base=I16 if cx.get("REM") else K.F32),
            "_scale_kernel": dict(src_base=cx.get("S_DT"), dst_base=cx.get("D_DT")),
            "_nonfinite_kernel": dict(g_base=cx.get("G_DT")),
            "_sumsq_kernel": dict(base=cx.get("DT"))}[kernel.__name__][arg]


def _align(cx) -> int:
    """The variant's ALIGN mode."""
    return cx["ALIGN"]


def _scalar_per_thread(kernel, cx) -> int:
    """Elements per thread of one element-by-element block: the Adam kernel's are half blocks
    (a quarter in fp64 beside the 128-bit loop), the non-finite scan's and scale's whole blocks
    (half beside the 128-bit loop), the sum of squares' whole blocks (its lanes fix the sum)."""
    block, chunk = cx["BLOCK"], _align(cx) == K.ALIGN_CHUNK
    if kernel.__name__ == "_adam_kernel":
        block //= 4 if chunk and cx["P_DT"] == K.F64 else 2
    elif chunk and kernel.__name__ != "_sumsq_kernel":
        block //= 2
    return block // (32 * K.num_warps_of(kernel))


_WIDE = re.compile(r"\.v4\.b32$|\.v2\.b64$")


def _body_accesses(name):
    """{(list, 'ld'/'st'): [mnemonic of each unmasked access]} of a variant's global accesses
    (the list each access derives from), after checking that no access derives from two."""
    ptx, _, _ = compiled(name)
    kernel, lists, cx = _lists_of(name)
    index = {a: i for i, a in enumerate(kernel.arg_names)}
    acc = global_accesses(ptx)
    out = {}
    for arg, how in lists.items():
        mine = [a for a in acc if index[arg] in a[3]]
        assert not [a for a in mine if len(a[3] & {index[x] for x in lists}) > 1], \
            f"{name}: an access derives from two lists"
        for kind in ("ld", "st"):
            body = [a[1] for a in mine if a[0] == kind and not a[2]]
            if ("r" if kind == "ld" else "w") not in how:
                assert not body, f"{name}: {arg} is not {'read' if kind == 'ld' else 'written'}"
                continue
            out[arg, kind] = body
    return kernel, cx, out


ALIGNED = [n for n in VARIANTS if VARIANTS[n][1].__name__ in LISTS
           and _align(VARIANTS[n][3]) == K.ALIGN_ALL]
BRANCHED = [n for n in VARIANTS if VARIANTS[n][1].__name__ in LISTS
            and _align(VARIANTS[n][3]) != K.ALIGN_ALL]


@pytest.mark.parametrize("name", ALIGNED)
def test_aligned_accesses_are_128_bit(name):
    kernel, cx, body = _body_accesses(name)
    for (arg, kind), mns in body.items():
        narrow = sorted({mn for mn in mns if not _WIDE.search(mn)})
        assert mns, f"{name}: no unmasked {kind}.global of {arg}"
        assert not narrow, f"{name}: {arg}: unmasked {kind}.global narrower than 128 bits: " \
                           f"{narrow} ({len(mns)} accesses)"
        # each element of a whole block moved once: (elements per thread) x size / 16 bytes
        want = _per_thread(kernel, cx) * ELEMENT_SIZE[_dtype_of(kernel, arg, cx)] // 16
        assert len(mns) == want, \
            f"{name}: {arg}: {len(mns)} unmasked 128-bit {kind}.global, expected {want}"


@pytest.mark.parametrize("name", BRANCHED)
def test_chunk_branches_are_told_apart(name):
    """ALIGN_CHUNK (the choice made per chunk): per list, the aligned chunks' whole blocks
    moved in 128-bit accesses (each element once) and the element-by-element loop in accesses
    of one element (each element of its block once), nothing of another width. ALIGN_NONE: only
    the element-by-element loop, no 128-bit access."""
    kernel, cx, body = _body_accesses(name)
    chunk = _align(cx) == K.ALIGN_CHUNK
    for (arg, kind), mns in body.items():
        size = ELEMENT_SIZE[_dtype_of(kernel, arg, cx)]
        one = re.compile(rf"\.b{8 * size}$")
        wide = [mn for mn in mns if _WIDE.search(mn)]
        single = [mn for mn in mns if one.search(mn) and not _WIDE.search(mn)]
        other = sorted(set(mns) - set(wide) - set(single))
        assert not other, f"{name}: {arg}: unmasked {kind}.global of other widths: {other}"
        want_wide = _per_thread(kernel, cx) * size // 16 if chunk else 0
        assert len(wide) == want_wide, \
            f"{name}: {arg}: {len(wide)} unmasked 128-bit {kind}.global, expected {want_wide}"
        want_single = _scalar_per_thread(kernel, cx)
        assert len(single) == want_single, \
            f"{name}: {arg}: {len(single)} unmasked one-element {kind}.global, expected " \
            f"{want_single}"


def test_every_op_list_form_and_dtype_is_covered():
    """The variant list covers what the backend can launch: every Adam-family dtype path
    (params x grads x masters (none, fp32, remainders beside bf16 params) x EMA storage) in
    every ALIGN mode, with and without a grad
    scale; the non-finite scan, scale (every (src, dst) pair) and the sum of squares for every
    dtype in every ALIGN mode."""
    modes = (K.ALIGN_ALL, K.ALIGN_CHUNK, K.ALIGN_NONE)
    dts = (K.F32, K.F16, K.BF16)
    want = set()
    for p in dts:
        for g in dts:
            for master in ("plain", "master") + (("rem",) if p == K.BF16 else ()):
                s = K.F32 if master != "plain" else p
                for e in (None, s, K.BF16):
                    for align in modes:
                        want.add((p, g, master, e, align))
    want |= {(K.F64, K.F64, "plain", e, a) for e in (None, K.F64) for a in modes}
    got, scales = set(), set()
    for name, kernel, sig, cx in VARIANTS.values():
        if kernel.__name__ == "_adam_kernel":
            master = "master" if cx["MASTER"] else "rem" if cx["REM"] else "plain"
            got.add((cx["P_DT"], cx["G_DT"], master, cx["E_DT"] if cx["EMA"] else None,
                     cx["ALIGN"]))
            scales.add((cx["P_DT"], cx["G_DT"], master, cx["HAS_SCALE"]))
    assert want <= got, f"Adam variants not covered: {sorted(want - got)}"
    assert {s[3] for s in scales} == {False, True}
    every = (K.F32, K.F16, K.BF16, K.F64)
    for kname, keys in (("_scale_kernel", ("S_DT", "D_DT")), ("_nonfinite_kernel", ("G_DT",)),
                        ("_sumsq_kernel", ("DT",))):
        have = {tuple(cx[k] for k in keys) + (cx["ALIGN"],)
                for _, kernel, _, cx in VARIANTS.values() if kernel.__name__ == kname}
        need = {tuple(c) + (a,) for a in modes
                for c in itertools.product(every, repeat=len(keys))}
        assert need <= have, f"{kname}: not covered: {sorted(need - have)}"
