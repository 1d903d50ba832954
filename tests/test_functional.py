"""The functional API: fused_optim.npu_apply_fused_ema_adamw (the seed operator's contract) and
fused_optim.fused_ema_adamw (explicit lists), against the float64 seed formula."""
from __future__ import annotations

import pytest
import torch

from fused_optim import fused_ema_adamw, npu_apply_fused_ema_adamw
from seed_reference import (assert_bitwise_equal, assert_close64, assert_unchanged,
                            assert_within_ulps, seed_update, snapshot)

FP32_TOL = dict(rtol=1e-6, atol=1e-6)


def _views(gen, shape, kind):
    """A random float32 tensor of ``shape``, contiguous or a non-contiguous view of a larger one."""
    if kind == "transposed" and len(shape) >= 2:
        base = torch.randn(shape[::-1], generator=gen)
        return base.permute(*reversed(range(base.dim()))), base
    if kind == "sliced" and len(shape) >= 1:
        base = torch.randn(shape[:-1] + (2 * shape[-1],), generator=gen)
        return base[..., ::2], base
    t = torch.randn(shape, generator=gen)
    return t, t


# ---------------------------------------------------------------------------------------------
# npu_apply_fused_ema_adamw

def test_seed_worked_example(backend):
    """The seed's call, verbatim but on the CPU; expected values from the float64 formula."""
    grad = torch.full((10, 10), 0.5).to(torch.float32)
    var = torch.full((10, 10), 0.5).to(torch.float32)
    m = torch.full((10, 10), 0.9).to(torch.float32)
    v = torch.full((10, 10), 0.9).to(torch.float32)
    s = torch.full((10, 10), 0.5).to(torch.float32)
    step = torch.full((1,), 1).to(torch.int64)
    lr, ema_decay, beta1, beta2, eps, mode, bias_correction, weight_decay = \
        1e-8, 0.9999, 0.9999, 0.9999, 1e-8, 1, True, 0.001
    expected = seed_update(grad, var, m, v, s, 1, lr, ema_decay, beta1, beta2, eps, mode,
                           bias_correction, weight_decay)
    inputs = (var, m, v, s)
    out = npu_apply_fused_ema_adamw(grad, var, m, v, s, step, lr, ema_decay, beta1, beta2, eps,
                                    mode, bias_correction, weight_decay)
    assert len(out) == 4
    for name, o, i, e in zip(("var", "m", "v", "s"), out, inputs, expected):
        assert o is i, f"{name} must be updated in place and returned"
        assert o.dtype == torch.float32 and o.shape == (10, 10)
        assert_within_ulps(o, e, 1.0, msg=f"worked example {name}")
    assert not torch.equal(var, torch.full((10, 10), 0.5))
    assert torch.equal(step, torch.ones(1, dtype=torch.int64)), "step is an input, not updated"


def test_defaults_are_the_operators(backend):
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(4, 6, generator=gen) for _ in range(5)]
    tensors[3] = tensors[3].abs()
    expected = seed_update(*tensors, 2, 1e-3, 0.9999, 0.9, 0.999, 1e-8, 1, True, 0.0)
    npu_apply_fused_ema_adamw(*tensors, torch.tensor([2], dtype=torch.int64))
    for o, e in zip(tensors[1:], expected):
        assert_close64(o, e, **FP32_TOL)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("mode", [0, 1])
def test_random_shapes_and_layouts(backend, mode, bias_correction, weight_decay):
    gen = torch.Generator().manual_seed(100 + 4 * mode + 2 * bias_correction + int(weight_decay > 0))
    hp = dict(lr=1e-2, ema_decay=0.9, beta1=0.9, beta2=0.99, eps=1e-3)
    shapes = [(), (0,), (3, 0), (1,), (19,), (6, 5), (2, 3, 4)]
    kinds = ("contiguous", "transposed", "sliced")
    for i, shape in enumerate(shapes):
        made = [_views(gen, shape, kinds[(i + k) % 3]) for k in range(5)]
        grad, var, m, v, s = (t for t, _ in made)
        v.abs_()
        for step in (1, 2, 5):
            grad.copy_(torch.randn(shape, generator=gen))
            expected = seed_update(grad, var, m, v, s, step, hp["lr"], hp["ema_decay"], hp["beta1"],
                                   hp["beta2"], hp["eps"], mode, bias_correction, weight_decay)
            grad_before = grad.clone()
            out = npu_apply_fused_ema_adamw(grad, var, m, v, s,
                                            torch.tensor([step], dtype=torch.int64), mode=mode,
                                            bias_correction=bias_correction,
                                            weight_decay=weight_decay, **hp)
            assert_bitwise_equal(grad, grad_before, "grad")
            for name, o, t, e in zip("var m v s".split(), out, (var, m, v, s), expected):
                assert o is t
                assert_close64(t, e, msg=f"shape {shape} step {step} {name}", **FP32_TOL)
        # the results landed in the original (base) tensors
        for (t, b) in made[1:]:
            if t.numel():
                assert t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_step_as_python_int_and_fp64_tensors(backend):
    gen = torch.Generator().manual_seed(5)
    t64 = [torch.randn(7, 3, generator=gen, dtype=torch.float64) for _ in range(5)]
    t64[3].abs_()
    expected = seed_update(*t64, 4, 1e-2, 0.9, 0.8, 0.9, 1e-6, 0, True, 0.1)
    npu_apply_fused_ema_adamw(*t64, 4, 1e-2, 0.9, 0.8, 0.9, 1e-6, 0, True, 0.1)
    for o, e in zip(t64[1:], expected):
        assert o.dtype == torch.float64
        assert_close64(o, e, rtol=1e-12, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# fused_ema_adamw over explicit lists

def _rows(gen):
    """Mixed rows: (param dtype, grad dtype, with master, start step)."""
    specs = [(torch.float32, (5, 4), False, 0), (torch.float32, (0,), False, 0),
             (torch.bfloat16, (9,), True, 3), (torch.float16, (3, 3), True, 0),
             (torch.float16, (6,), False, 1), (torch.float64, (2, 5), False, 7),
             (torch.float32, (11,), False, 3)]
    rows = []
    for dtype, shape, with_master, step in specs:
        w = torch.randn(shape, generator=gen)
        state_dtype = torch.float32 if with_master else dtype
        rows.append(dict(
            param=w.to(dtype), grad=torch.randn(shape, generator=gen).to(dtype),
            m=(0.1 * torch.randn(shape, generator=gen)).to(state_dtype),
            v=(0.1 * torch.randn(shape, generator=gen)).square().to(state_dtype),
            s=(w + 0.01 * torch.randn(shape, generator=gen)).to(state_dtype),
            master=w.clone() if with_master else None,
            step=torch.tensor(float(step))))
    return rows


def _call(rows, **kw):
    fused_ema_adamw([r["param"] for r in rows], [r["grad"] for r in rows], [r["m"] for r in rows],
                    [r["v"] for r in rows], [r["s"] for r in rows], [r["step"] for r in rows],
                    [r["master"] for r in rows], **kw)


HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-3, weight_decay=0.02, ema_decay=0.8)


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("maximize", [False, True])
def test_list_api_mixed_rows_per_row_steps(backend, adam_w_mode, maximize):
    gen = torch.Generator().manual_seed(17)
    rows = _rows(gen)
    for it in range(3):
        for r in rows:
            r["grad"].copy_(torch.randn(r["grad"].shape, generator=gen))
        expected = []
        for r in rows:
            w = r["master"] if r["master"] is not None else r["param"]
            expected.append(seed_update(r["grad"], w, r["m"], r["v"], r["s"], int(r["step"]) + 1,
                                        HP["lr"], HP["ema_decay"], HP["beta1"], HP["beta2"],
                                        HP["eps"], 1 if adam_w_mode else 0, True,
                                        HP["weight_decay"], maximize=maximize))
        steps_before = [int(r["step"]) for r in rows]
        _call(rows, adam_w_mode=adam_w_mode, maximize=maximize, **HP)
        for i, (r, (var_, m_, v_, s_)) in enumerate(zip(rows, expected)):
            assert int(r["step"]) == steps_before[i] + 1
            if r["master"] is not None:
                assert_close64(r["master"], var_, msg=f"row {i} master", **FP32_TOL)
                assert_bitwise_equal(r["param"], r["master"].to(r["param"].dtype), f"row {i} param")
                tol = FP32_TOL
            elif r["param"].dtype == torch.float64:
                tol = dict(rtol=1e-12, atol=1e-13)
            elif r["param"].dtype == torch.float16:
                # state in fp16: the fp32 result rounded once to fp16 (plus fp16 inputs' rounding)
                tol = dict(rtol=2 ** -10, atol=2 ** -14)
            else:
                tol = FP32_TOL
            if r["master"] is None:
                assert_close64(r["param"], var_, msg=f"row {i} param", **tol)
            assert_close64(r["m"], m_, msg=f"row {i} m", **tol)
            assert_close64(r["v"], v_, msg=f"row {i} v", **tol)
            assert_close64(r["s"], s_, msg=f"row {i} s", **tol)


def test_list_api_found_inf_changes_nothing(backend):
    gen = torch.Generator().manual_seed(19)
    rows = _rows(gen)
    tensors = [t for r in rows for k, t in r.items() if t is not None]
    saved = snapshot(tensors)
    _call(rows, found_inf=torch.tensor(1.0), **HP)
    assert_unchanged(tensors, saved, "found_inf")


def test_list_api_grad_scale(backend):
    gen = torch.Generator().manual_seed(23)
    a = _rows(gen)
    b = [{k: (t.clone() if t is not None else None) for k, t in r.items()} for r in a]
    for r in b:
        r["grad"].mul_(256.0)
    _call(a, **HP)
    _call(b, grad_scale=torch.tensor(256.0), **HP)
    for ra, rb in zip(a, b):
        for k in ("param", "m", "v", "s", "master", "step"):
            if ra[k] is not None:
                assert_bitwise_equal(rb[k], ra[k], k)


def test_list_api_chunk_size_independent(backend):
    results = []
    for chunk_size in (1, 7, 2048 * 32):
        rows = _rows(torch.Generator().manual_seed(29))
        _call(rows, chunk_size=chunk_size, **HP)
        _call(rows, chunk_size=chunk_size, **HP)
        results.append(rows)
    for other in results[1:]:
        for ra, rb in zip(results[0], other):
            for k in ("param", "m", "v", "s", "master"):
                if ra[k] is not None:
                    assert_bitwise_equal(rb[k], ra[k], k)


def test_list_api_length_mismatch_changes_nothing(backend):
    rows = _rows(torch.Generator().manual_seed(31))
    tensors = [t for r in rows for k, t in r.items() if t is not None]
    saved = snapshot(tensors)
    with pytest.raises(ValueError, match="exp_avgs"):
        fused_ema_adamw([r["param"] for r in rows], [r["grad"] for r in rows],
                        [r["m"] for r in rows][:-1], [r["v"] for r in rows], [r["s"] for r in rows],
                        [r["step"] for r in rows], [r["master"] for r in rows], **HP)
    assert_unchanged(tensors, saved)
