"""The numerics contract (SPEC sections 2 and 4, multi_tensor/rules.py), on every registered backend.

* IEEE: sqrt and division correctly rounded, no FMA contraction. Inputs are picked where
  torch's own CPU ``sqrt`` (MKL) is an ulp off, so a backend that borrowed it would fail; every
  backend must equal the numpy IEEE oracle bit for bit.
* The EMA is unbiased: the EMA of a constant over 20,000+ steps at decay 0.9999 and 0.99999
  stays within 1e-5 relative of float64 (the literal ``d * s + (1 - d) * p`` form in fp32 does
  not, which the test also shows, so it can fail).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import multi_tensor
from multi_tensor import multi_tensor_fused_ema_adamw, rules
from multi_tensor.backends import forced_backend
from ieee_oracle import adam_update, as_numpy, bf16_round

BACKENDS = [b.name for b in multi_tensor.registered_backends() if b.handles("cpu")]


def sqrt_disagreeing_inputs(n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """``n`` values whose ``torch.sqrt`` differs from the IEEE sqrt (MKL's error cases), padded
    with random values when this torch build's sqrt happens to be exact."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(400_000, generator=gen, dtype=torch.float64).mul_(3.0).add_(1e-3).to(dtype)
    bad = torch.sqrt(x).numpy() != np.sqrt(x.numpy())
    picked = x[torch.from_numpy(bad)][:n]
    if picked.numel() < n:
        picked = torch.cat([picked, x[: n - picked.numel()]])
    return picked


def test_the_inputs_do_hit_torch_sqrt_errors():
    """On this torch build (MKL), the chosen inputs really are ones torch.sqrt rounds wrongly."""
    x = sqrt_disagreeing_inputs(256)
    wrong = int((torch.sqrt(x).numpy() != np.sqrt(x.numpy())).sum())
    if wrong == 0:
        pytest.skip("torch.sqrt is correctly rounded on this build: nothing to pick")
    assert wrong == 256


CASES = {
    "adamw": dict(op="fused_ema_adamw", hyper=dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                                   weight_decay=0.01, ema_decay=0.999)),
    "adam_l2_maximize": dict(op="adam", hyper=dict(lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6,
                                                   weight_decay=0.1, decoupled=False,
                                                   maximize=True)),
    "radam_ema": dict(op="radam_ema", hyper=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                                 weight_decay=0.01, ema_decay=0.99,
                                                 rule=rules.RADAM), step=10),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", ["fp32", "fp64", "bf16_master"])
def test_matches_ieee_oracle_bitwise(backend, case, dtype):
    spec = CASES[case]
    op = multi_tensor.schema.OPS[spec["op"]]
    step = spec.get("step", 3)
    hyper = rules.AdamHyper(**spec["hyper"])
    c = rules.step_scalars(hyper, step)
    n = 1000
    math_t = torch.float64 if dtype == "fp64" else torch.float32
    np_t = np.float64 if dtype == "fp64" else np.float32
    gen = torch.Generator().manual_seed(1)
    # v' = beta2 * v + (omb2 * g) * g with g = 0 is exactly fp(beta2 * v): pick v so that v'
    # lands on inputs where torch.sqrt errs, then add a real grad to half of the elements.
    target = sqrt_disagreeing_inputs(n, math_t)
    v = (target.to(torch.float64) / c.beta2).to(math_t)
    g = torch.randn(n, generator=gen, dtype=torch.float64) * 1e-3
    g[: n // 2] = 0.0
    w = torch.randn(n, generator=gen, dtype=torch.float64)
    m = torch.randn(n, generator=gen, dtype=torch.float64) * 0.1
    s = w + torch.randn(n, generator=gen, dtype=torch.float64) * 0.01
    master = dtype == "bf16_master"
    param = w.to(torch.bfloat16) if master else w.to(math_t)
    lists = [[g.to(torch.bfloat16 if master else math_t)], [param], [m.to(math_t)],
             [v.clone()]]
    if op.has_ema:
        lists.append([s.to(math_t)])
    if master:
        lists.append([w.to(torch.float32)])
    weights = lists[-1][0] if master else lists[1][0]
    expected = adam_update(c, as_numpy(lists[0][0], np_t), as_numpy(weights, np_t),
                           as_numpy(lists[2][0], np_t), as_numpy(lists[3][0], np_t),
                           as_numpy(lists[4][0], np_t) if op.has_ema else None, dtype=np_t)
    with forced_backend(backend):
        named = multi_tensor.ops.named_lists(op, lists)
        multi_tensor.plan.backend_for_lists(op, named.present()).ops[op.name](
            2048, torch.zeros(1, dtype=torch.int32), named, c, None, False)
    got = {"w": weights, "m": lists[2][0], "v": lists[3][0]}
    if op.has_ema:
        got["s"] = lists[4][0]
    for name, arr in zip(("w", "m", "v", "s"), expected):
        if name not in got:
            continue
        actual = got[name].numpy()
        assert actual.dtype == arr.dtype
        diff = int((actual.view(np.int64 if np_t == np.float64 else np.int32)
                    != arr.view(np.int64 if np_t == np.float64 else np.int32)).sum())
        assert diff == 0, f"{backend} {case} {dtype}: {name} differs from the IEEE oracle in {diff} of {n}"
    if master:
        rounded = bf16_round(expected[0])
        np.testing.assert_array_equal(lists[1][0].float().numpy().view(np.int32),
                                      rounded.view(np.int32))


# --- the unbiased EMA ---------------------------------------------------------------------------

def literal_ema_fp32(c: float, d: float, steps: int) -> float:
    """The literal fp32 form ``d * s + (1 - d) * p`` (what the contract does NOT use)."""
    s, p = np.float32(0.0), np.float32(c)
    a, b = np.float32(d), np.float32(1.0 - d)
    for _ in range(steps):
        s = a * s + b * p
    return float(s)


CONSTS = torch.tensor([1.0, -3.0, 0.123456789, 1e-3, 7.5, 100.0], dtype=torch.float32)


def ema_of_constants(backend: str, decay: float, steps: int) -> float:
    """The largest relative error against float64 of the EMA of :data:`CONSTS` after ``steps``
    steps with lr = 0 (the param stays the constant, only the EMA moves) on ``backend``."""
    n = CONSTS.numel()
    p = CONSTS.clone()
    lists = [[torch.zeros(n)], [p], [torch.zeros(n)], [torch.zeros(n)], [torch.zeros(n)]]
    noop = torch.zeros(1, dtype=torch.int32)
    with forced_backend(backend):
        for t in range(1, steps + 1):
            multi_tensor_fused_ema_adamw(65536, noop, lists, 0.0, decay, 0.9, 0.999, 1e-8, t, 1,
                                         True, 0.0)
    assert torch.equal(p, CONSTS)
    exact = CONSTS.double() * (1.0 - decay ** steps)
    return ((lists[4][0].double() - exact).abs() / exact.abs()).max().item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("decay,steps", [(0.9999, 20_000), (0.99999, 25_000)])
def test_ema_of_a_constant_is_unbiased(backend, decay, steps):
    rel = ema_of_constants(backend, decay, steps)
    assert rel <= 1e-5, f"EMA of a constant is {rel:.2e} relative off float64 after {steps} steps"
    literal = abs(literal_ema_fp32(1.0, decay, steps) - (1.0 - decay ** steps)) / (1.0 - decay ** steps)
    assert literal > 1e-5, "the biased literal form would pass too: the test could not fail"


@pytest.mark.parametrize("mode,decay,steps", [(None, 0.9999, 20_000), (None, 0.99999, 25_000),
                                              ("cann_literal", 0.9999, 20_000)])
def test_ema_of_a_constant_on_the_npu_default_path(mode, decay, steps):
    """The NPU backend's default path on the stand-in with CANN's kernel emulated
    (``npu_standin.cann_device_op``): the operator with ``ema_decay=1`` and one lerp stays within
    the bound; the operator's own EMA (``cann_literal``) does not, which is why it is not the
    default."""
    from multi_tensor.backends import npu
    from multi_tensor.testing import npu_standin

    calls = []

    def op(*args, **kwargs):
        calls.append(None)
        return npu_standin.cann_device_op(*args, **kwargs)

    with npu_standin.standin_backend(op, name="npu_standin_ema", mode=mode):
        assert npu.get_op_mode() == (mode or npu.DEFAULT_MODE) == (mode or "cann")
        rel = ema_of_constants("npu_standin_ema", decay, steps)
    assert len(calls) == steps  # the operator served every step
    if mode is None:
        assert rel <= 1e-5, f"the NPU default's EMA is {rel:.2e} relative off float64"
    else:
        assert rel > 1e-5, f"the literal EMA is {rel:.2e} off: within the bound after all"


# (beta, steps): the per-step table of factors (rules._power_by_table, what step_scalars uses)
# against rules.power's loop, bit for bit: every step of a long run, single set bits, all bits
# set, the table's end and past it (the loop then), and betas that underflow, are 0, -0 or NaN
_STEPS = list(range(0, 5000)) + [2 ** k for k in range(70)] + [2 ** k - 1 for k in range(1, 70)]
POWER_CASES = [(beta, _STEPS) for beta in
               (0.9, 0.999, 0.95, 1.0 - 1e-7, 0.5, 1e-300, 0.0, -0.0, 1.0, float("nan"))]


@pytest.mark.parametrize("beta,steps", POWER_CASES)
def test_step_scalars_power_table_matches_power_bitwise(beta, steps):
    squares = rules._squares(beta)
    got = np.array([rules._power_by_table(squares, n) for n in steps])
    want = np.array([rules.power(beta, n) for n in steps])
    assert got.view(np.int64).tolist() == want.view(np.int64).tolist()
