"""The StepScalars layout is defined once (multi_tensor/rules.py) and every backend reads it so.

Structural: the committed csrc/include/step_scalars.h is what rules.py generates, its offsets
are rules.py's, the loaded native build reports rules.py's fields, rules.pack puts field i in
slot i, and the Triton kernels' offsets come from rules.py (no literal index into a buffer).

Behavioural: each field read at its own offset. One set of scalars whose values all differ
(a value read from another field's slot changes the result), and for each field a variant where
only that field changes (a field a kernel ignores or reads from elsewhere shows); every backend
CI runs must give the reference's bits for each. :func:`check_backend` runs it for one backend;
the Triton kernels run it under the interpreter (case ``scalar-offsets`` of
tests/test_triton_interpreter.py).
"""
from __future__ import annotations

import os
import re
import types
from typing import Callable, Dict, List

import pytest
import torch

from multi_tensor import rules, schema
from multi_tensor.backends import reference
from multi_tensor.backends import cpu as native_cpu
from multi_tensor.testing import npu_standin
from multi_tensor.ops import named_lists

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(ROOT, "csrc", "include", "step_scalars.h")
F32, F64 = torch.float32, torch.float64
OPS = ("fused_ema_adamw", "adam")  # with and without an EMA (the op fixes ``ema``)

# All values distinct and none the sum or complement of another: ``omb1`` is not 1 - beta1, so
# a kernel that derived it would show. Both decays on (the kernels take the flags independently).
BASE = dict(beta1=0.81, omb1=0.17, beta2=0.93, omb2=0.045, l2_wd=0.021, lr_wd=0.0037, isb2=1.7,
            eps=0.013, step_size=0.0123, ema_w=0.29, l2=True, decoupled=True, use_denom=True,
            maximize=False)


def _scaled(name: str) -> Callable[[dict], dict]:
    return lambda kw: {**kw, name: kw[name] * 1.375}


def _toggled(name: str) -> Callable[[dict], dict]:
    return lambda kw: {**kw, name: not kw[name]}


# How each field is varied alone. A new StepScalars field needs an entry here (a test says so).
VARIANTS: Dict[str, Callable[[dict], dict]] = {
    **{name: _scaled(name) for name in ("beta1", "omb1", "beta2", "omb2", "l2_wd", "lr_wd",
                                        "isb2", "eps", "step_size", "ema_w")},
    **{name: _toggled(name) for name in ("l2", "decoupled", "use_denom", "maximize")},
    "ema": None,  # fixed by the op's lists: covered by running an op with and one without
}


def scalar_sets(op: str) -> List[tuple]:
    """(what, scalars, must differ from the base) for ``op``: the base, then each variant."""
    ema = schema.OPS[op].has_ema
    base = dict(BASE, ema=ema)
    out = [("base", rules.StepScalars(**base), False)]
    for name in rules.SCALAR_FIELDS:
        vary = VARIANTS[name]
        if vary is None:
            continue
        visible = ema or name != "ema_w"
        out.append((f"only {name}", rules.StepScalars(**vary(base)), visible))
    return out


def make_lists(op: str, dtype: torch.dtype, seed: int = 0) -> List[List[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = ((37,), (5, 3))

    def rnd(shape, scale=1.0):
        return (torch.randn(shape, generator=gen, dtype=F64) * scale).to(dtype)

    lists = [[rnd(s) for s in shapes], [rnd(s) for s in shapes], [rnd(s, 0.1) for s in shapes],
             [rnd(s, 0.01).abs() for s in shapes]]
    if schema.OPS[op].has_ema:
        lists.append([rnd(s) for s in shapes])
    return lists


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({F32: torch.int32, F64: torch.int64}[t.dtype])


def _differs(a, b) -> bool:
    return any(not torch.equal(_bits(x), _bits(y)) for la, lb in zip(a, b) for x, y in zip(la, lb))


def _reference(op, lists, c) -> None:
    reference.adam_family(2048, torch.zeros(1, dtype=torch.int32), named_lists(op, lists), c)


def check_backend(run: Callable, what: str, dtypes=(torch.float32, torch.float64)) -> None:
    """``run(op, lists, scalars)`` updates ``lists`` in place; each scalar set must give the
    reference's bits (fp32 and fp64 math), and each variant must change the reference's result."""
    for op in OPS:
        for dtype in dtypes:
            lists = make_lists(op, dtype)
            base_want = None
            for name, c, visible in scalar_sets(op):
                got = [[t.clone() for t in ts] for ts in lists]
                want = [[t.clone() for t in ts] for ts in lists]
                run(op, got, c)
                _reference(op, want, c)
                if base_want is None:
                    base_want = want
                    assert _differs(want[1:], lists[1:]), "the update changed nothing"
                elif visible:
                    assert _differs(want[1:], base_want[1:]), f"{op}: {name} has no effect"
                for li, (gs, ws) in enumerate(zip(got[1:], want[1:])):
                    for i, (g, w) in enumerate(zip(gs, ws)):
                        assert torch.equal(_bits(g), _bits(w)), (
                            f"{what} {op} {dtype} {name}: list {li + 1} tensor {i} differs from "
                            f"the reference (a StepScalars field read at the wrong offset?)")


# ---------------------------------------------------------------------------------------------
# structure

def test_every_field_has_a_variant():
    assert set(VARIANTS) == set(rules.SCALAR_FIELDS), (
        "tests/test_scalar_layout.py VARIANTS must say how to vary each StepScalars field; "
        f"missing {set(rules.SCALAR_FIELDS) - set(VARIANTS)}, unknown "
        f"{set(VARIANTS) - set(rules.SCALAR_FIELDS)}")


def test_committed_header_is_generated_from_rules():
    with open(HEADER) as f:
        committed = f.read()
    assert committed == rules.header_text(), (
        "csrc/include/step_scalars.h is stale: run python tools/step_scalars_header.py and "
        "rebuild the extension (python setup.py build_ext --inplace)")


def test_header_offsets_and_struct_are_rules_order():
    with open(HEADER) as f:
        text = f.read()
    offsets = {m.group(1): int(m.group(2))
               for m in re.finditer(r"constexpr int kStepScalar(\w+) = (\d+);", text)}
    want = {"".join(p.capitalize() for p in name.split("_")): i
            for name, i in rules.SCALAR_OFFSET.items()}
    assert offsets == want
    assert f"constexpr int kNumStepScalars = {rules.N_SCALARS};" in text
    names = re.search(r"kStepScalarNames\[kNumStepScalars\] = \{(.*?)\};", text, re.S).group(1)
    assert re.findall(r'"(\w+)"', names) == list(rules.SCALAR_FIELDS)
    struct = re.search(r"struct StepScalars \{(.*?)\};", text, re.S).group(1)
    members = re.findall(r"(bool|T) (\w+);", struct)
    assert members == [("bool" if n in rules.SCALAR_FLAGS else "T", n) for n in rules.SCALAR_FIELDS]
    reads = re.findall(r"c\.(\w+) = .*\(kStepScalar(\w+)\)", text)
    assert [(n, "".join(p.capitalize() for p in n.split("_"))) for n in rules.SCALAR_FIELDS] == reads


def test_offsets_are_the_field_order_and_flags_are_the_bools():
    assert rules.SCALAR_FIELDS == rules.StepScalars._fields
    assert [rules.SCALAR_OFFSET[n] for n in rules.SCALAR_FIELDS] == list(range(rules.N_SCALARS))
    assert set(rules.SCALAR_FLAGS) == {"l2", "decoupled", "use_denom", "maximize", "ema"}
    assert [rules.HYPER_OFFSET[n] for n in rules.HYPER_FIELDS] == list(range(rules.N_HYPER))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_pack_puts_each_field_in_its_slot(dtype):
    c = rules.StepScalars(**BASE, ema=True)
    packed = rules.pack(c, dtype)
    assert packed.dtype == dtype and packed.shape == (rules.N_SCALARS,)
    for name, i in rules.SCALAR_OFFSET.items():
        want = torch.tensor(float(getattr(c, name)), dtype=F64).to(dtype)  # rounded once
        assert torch.equal(packed[i], want), name


def test_device_hyper_packs_by_name():
    h = rules.AdamHyper(lr=0.3, beta1=0.5, beta2=0.98, eps=1e-6, weight_decay=0.1,
                        rule=rules.RADAM, bias_correction=False)
    d = rules.device_hyper(h)
    assert d == rules.DeviceHyper(lr=0.3, beta1=0.5, beta2=0.98, weight_decay=0.1, lr_wd_on=True,
                                  bias_correction=True, radam=True)
    packed = rules.pack(d)
    for name, i in rules.HYPER_OFFSET.items():
        assert float(packed[i]) == float(getattr(d, name)), name
    adam_l2 = rules.device_hyper(rules.AdamHyper(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8,
                                                 weight_decay=0.1, decoupled=False))
    assert not adam_l2.lr_wd_on and adam_l2.bias_correction and not adam_l2.radam


def test_triton_offsets_come_from_rules():
    pytest.importorskip("triton")
    from multi_tensor.backends.triton import kernels as k
    consts = {name: getattr(k, name) for name in dir(k) if re.fullmatch(r"[SH]_[A-Z0-9_]+", name)}
    assert consts, "the Triton kernels name no offsets"
    for name, value in consts.items():
        field = name[2:].lower()
        offsets = rules.SCALAR_OFFSET if name[0] == "S" else rules.HYPER_OFFSET
        assert field in offsets, f"triton_kernels.{name} names no field of rules.py's layout"
        assert int(getattr(value, "value", value)) == offsets[field], name
    with open(k.__file__) as f:
        src = f.read()
    literal = re.findall(r"\b(?:scal|hyp) \+ \d", src)
    assert not literal, f"a literal offset into a packed buffer: {literal}"


def test_native_build_reports_the_rules_layout():
    if native_cpu.loaded_module is None:
        pytest.skip(f"the native extension did not load: {native_cpu.load_error}")
    assert tuple(native_cpu.loaded_module.step_scalar_fields) == rules.SCALAR_FIELDS
    assert native_cpu._layout_error(native_cpu.loaded_module) is None


def test_a_stale_native_build_is_refused_with_the_reason():
    stale = types.SimpleNamespace(step_scalar_fields=rules.SCALAR_FIELDS[:-1])
    assert "stale build" in native_cpu._layout_error(stale)
    assert "stale build" in native_cpu._layout_error(types.SimpleNamespace())


def test_native_refuses_scalars_of_another_layout():
    if native_cpu.BACKEND is None:
        pytest.skip(f"the native extension did not load: {native_cpu.load_error}")
    lists = make_lists("adam", F32)
    before = [[t.clone() for t in ts] for ts in lists]
    c = rules.StepScalars(**BASE, ema=False)
    run = native_cpu.BACKEND.ops["adam"]
    noop = torch.zeros(1, dtype=torch.int32)
    for bad in (tuple(c)[:-1], tuple(c) + (0.0,), types.SimpleNamespace(**c._asdict())):
        with pytest.raises(RuntimeError, match="StepScalars"):
            run(2048, noop, named_lists("adam", lists), bad)
    assert not _differs(lists, before), "a refused call changed a tensor"


# ---------------------------------------------------------------------------------------------
# every backend CI runs reads each field at its offset

def test_reference_is_its_own_reference():
    check_backend(_reference, "reference")


def test_native_reads_each_field_at_its_offset():
    if native_cpu.BACKEND is None:
        pytest.skip(f"the native extension did not load: {native_cpu.load_error}")
    ops = native_cpu.BACKEND.ops
    check_backend(lambda op, lists, c: ops[op](2048, torch.zeros(1, dtype=torch.int32),
                                               named_lists(op, lists), c),
                  "native_cpu")


def test_native_prepared_bucket_reads_each_field_at_its_offset():
    if native_cpu.BACKEND is None:
        pytest.skip(f"the native extension did not load: {native_cpu.load_error}")

    def run(op, lists, c):
        bucket = native_cpu.BACKEND.prepare_bucket(op, named_lists(op, lists).state(), 2048)
        assert bucket.bind(lists[0])
        bucket.run(torch.zeros(1, dtype=torch.int32), c)

    check_backend(run, "native_cpu prepared")


def test_npu_standin_reads_each_field_at_its_offset():
    with npu_standin.standin_backend(mode="exact") as backend:
        def run(op, lists, c):
            bucket = backend.prepare_bucket(op, named_lists(op, lists).state(), 2048)
            assert bucket.bind(lists[0])
            bucket.run(torch.zeros(1, dtype=torch.int32), c)

        check_backend(run, "npu stand-in", (F32,))  # no fp64 on the NPU: refused at prepare
