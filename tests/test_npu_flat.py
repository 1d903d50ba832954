"""Zero-copy flat buckets of the NPU backend, on CPU tensors (multi_tensor.testing.npu_standin).

An optimizer's NPU bucket moves its params into one flat buffer per dtype and makes their grads
views of one flat grad buffer that backward accumulates into and ``zero_grad`` keeps
(multi_tensor.backends.npu.flat: ``repoint_params``, ``FlatGrads``). What is checked here:

* torch's semantics hold with real backward passes: a param that received no grad since
  ``zero_grad(set_to_none=True)`` is skipped exactly as a ``None`` grad (bitwise against the
  reference backend, whose ``zero_grad`` sets None); ``set_to_none=False`` steps every param;
  a grad the user assigns is used (and the next ``zero_grad`` gives the view back);
* the steady state (third step), counted by a dispatch-mode op counter (every non-view aten op
  one launch; ``_foreach_*`` one per 48 tensors of one dtype, else one per tensor; the device
  operator one launch): the same launches for 20 and 200 params, no host read, and for the
  CANN modes exactly the operator (+ the EMA's lerp) plus one grad cast and one master->param
  cast with fp16/bf16 masters;
* the switch ``MULTI_TENSOR_NPU_FLAT_GRADS=0`` and what is not re-pointed.
"""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import helpers

from fused_optim import FusedAdam, FusedEmaAdamW
from multi_tensor import forced_backend, multi_tensor_fused_ema_adamw
from multi_tensor.backends import npu
from multi_tensor.backends.npu import flat
from multi_tensor.backends.npu import ops as npu_ops
from multi_tensor.testing import npu_standin

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
SHAPES = ((3, 5), (130,), (1,), (7, 3, 2), (257,), (0,))
STANDIN = "npu_standin"
SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
            torch.ops.aten.equal.default}
METADATA_OPS = {"aten::detach", "aten::lift_fresh", "aten::set_.source_Storage_storage_offset"}


class OpCounter(TorchDispatchMode):
    """Launches, host reads and fp64 ops of the aten ops run inside it (views are free).

    ``opaque(fn)``: ``fn`` counted as one launch (the device operator), its own ops not seen.
    """

    def __init__(self):
        super().__init__()
        self.launches, self.names, self.syncs, self.fp64 = 0, [], 0, 0
        self._inside = 0

    def opaque(self, fn):
        def call(*args, **kwargs):
            self._inside += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside -= 1
                self.launches += 1
                self.names.append("operator")
        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.name()
        if self._inside or name.startswith("profiler::"):
            return out
        if func in SYNC_OPS:
            self.syncs += 1
            return out
        if func.is_view or name in METADATA_OPS:
            return out
        tensors = [t for a in list(args) + list((kwargs or {}).values())
                   for t in (a if isinstance(a, (list, tuple)) else [a])
                   if isinstance(t, torch.Tensor)]
        self.fp64 += any(t.dtype == torch.float64 for t in tensors)
        n = 1
        if "_foreach_" in name:
            first = args[0]
            n = math.ceil(len(first) / 48) if len({t.dtype for t in first}) == 1 else len(first)
        self.launches += n
        self.names.append(name)
        return out


class CountingOp:
    """A stand-in device operator that an :class:`OpCounter` (when set) counts as one launch."""

    def __init__(self, op):
        self.op, self.counter = op, None

    def __call__(self, *args):
        if self.counter is None:
            return self.op(*args)
        return self.counter.opaque(self.op)(*args)


def coefficients(params, step, dtype):
    gen = torch.Generator().manual_seed(500 + step)
    return [torch.randn(p.shape, generator=gen).to(dtype) for p in params]


def backward(params, step, idle=lambda k, i: False):
    """A real backward pass: ``sum_i (p_i * c_i).sum()`` over the params not idle at ``step``;
    each grad is ``c_i`` exactly (accumulated by autograd into ``p.grad``)."""
    terms = [(p * c).sum() for i, (p, c) in enumerate(zip(params, coefficients(
        params, step, params[0].dtype))) if not idle(step, i)]
    if terms:
        torch.stack([t.float() for t in terms]).sum().backward()


def fit(backend, *, dtype=F32, steps=8, shapes=SHAPES, idle=lambda k, i: False,
        set_to_none=True, opt_cls=FusedEmaAdamW, seed=0, opt=None, params=None, start=0, **kw):
    params = params if params is not None else helpers.make_params(shapes, dtype, seed)
    opt = opt if opt is not None else opt_cls(params, **kw)
    for k in range(start, start + steps):
        opt.zero_grad(set_to_none=set_to_none)
        backward(params, k, idle)
        with forced_backend(backend):
            opt.step()
    return params, opt


def assert_same(pa, oa, pb, ob):
    for i, (p, q) in enumerate(zip(pa, pb)):
        assert p.dtype == q.dtype and torch.equal(p.detach(), q.detach()), f"param {i}"
        sa, sb = oa.state[p], ob.state[q]
        assert sa.keys() == sb.keys(), (i, sa.keys(), sb.keys())
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), f"{key}[{i}]"


def buckets(opt):
    return [b.prepared for plan in opt._plans.values() for b in plan.buckets]


def idle_some(k, i):
    return (i == 1 and k % 3 == 1) or (i == 3 and k in (2, 3))


CASES = {
    "fp32_adamw": dict(dtype=F32, weight_decay=0.1),
    "bf16_masters": dict(dtype=BF16, master_weights=True, weight_decay=0.05),
    "fp16_masters_adam_l2": dict(dtype=F16, master_weights=True, adam_w_mode=False,
                                 weight_decay=0.01),
    "fp16_no_masters": dict(dtype=F16, master_weights=False),
    "fp32_ema_every_3": dict(dtype=F32, ema_decay=0.9, ema_update_every=3),
    "fused_adam": dict(dtype=F32, opt_cls=FusedAdam, weight_decay=0.1),
}


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_idle_params_give_the_reference_bits(standin, case, set_to_none):
    """Params that receive no grad in some steps: the reference optimizer's bits, whose
    ``zero_grad`` is torch's (None grads skipped; with ``set_to_none=False`` zero grads step)."""
    kw = dict(CASES[case], lr=1e-2, steps=9, idle=idle_some, set_to_none=set_to_none)
    pa, oa = fit(STANDIN, **kw)
    pb, ob = fit("reference", **kw)
    assert_same(pa, oa, pb, ob)
    assert any(b.grad_keeper is not None for b in buckets(oa))


@pytest.mark.parametrize("mode", ["cann", "cann_literal"])
@pytest.mark.parametrize("case", ["fp32_adamw", "bf16_masters", "fp32_ema_every_3"])
def test_cann_flat_grads_give_the_gathered_grads_bits(monkeypatch, case, mode):
    """The CANN path on flat grads and on grads gathered per step (the switch off): same bits."""
    kw = dict(CASES[case], lr=1e-2, steps=7, idle=idle_some)
    with npu_standin.standin_backend(mode=mode):
        pa, oa = fit(STANDIN, **kw)
        monkeypatch.setenv(npu.FLAT_GRADS_ENV, "0")
        pb, ob = fit(STANDIN, **kw)
    assert_same(pa, oa, pb, ob)
    assert all(b.grad_keeper is None for b in buckets(ob))
    assert all(b.last_path == mode for b in buckets(oa) + buckets(ob))


@pytest.mark.parametrize("dtype,master", [(F32, False), (BF16, True)])
def test_params_and_grads_are_views_that_backward_accumulates_into(standin, dtype, master):
    params, opt = fit(STANDIN, dtype=dtype, master_weights=master, steps=2)
    (bucket,) = buckets(opt)
    keeper = bucket.grad_keeper
    region = bucket.param_region
    assert keeper is not None and region is not None
    for i, p in enumerate(params):
        assert p.grad is keeper.views[i]
        assert p.untyped_storage().data_ptr() == region.untyped_storage().data_ptr()
        assert p.is_leaf and p.requires_grad and isinstance(p, torch.nn.Parameter)
    gathers, aliased = bucket.stats["grad_gathers"], bucket.stats["grad_alias"]
    opt.zero_grad()
    assert all(p.grad is None for p in params)  # as torch leaves them
    assert not keeper.buffer.any()
    backward(params, 5)  # the grad hooks give the zero views back before accumulation
    assert all(p.grad is v for p, v in zip(params, keeper.views))
    want = coefficients(params, 5, dtype)
    assert all(torch.equal(p.grad, c) for p, c in zip(params, want))
    with forced_backend(STANDIN):
        opt.step()
    (same,) = buckets(opt)
    assert same is bucket and bucket.stats["grad_gathers"] == gathers + (dtype != F32)
    assert bucket.stats["grad_alias"] == aliased + (dtype == F32)
    if master:
        assert all(torch.equal(p.detach(), opt.state[p]["master_param"].to(dtype))
                   for p in params)


def test_a_grad_the_user_assigns_is_used_then_the_view_comes_back(standin):
    kw = dict(dtype=F32, steps=3, weight_decay=0.1)
    pa, oa = fit(STANDIN, **kw)
    pb, ob = fit("reference", **kw)
    (bucket,) = buckets(oa)
    keeper = bucket.grad_keeper
    gathers = bucket.stats["grad_gathers"]
    for opt, params, backend in ((oa, pa, STANDIN), (ob, pb, "reference")):
        opt.zero_grad()
        backward(params, 3)
        params[2].grad = torch.full_like(params[2], 0.25)  # replaced, not a view
        with forced_backend(backend):
            opt.step()
    assert bucket.stats["grad_gathers"] == gathers + 1
    assert_same(pa, oa, pb, ob)
    oa.zero_grad(set_to_none=False)
    assert pa[2].grad is keeper.views[2]
    pa, oa = fit(STANDIN, opt=oa, params=pa, start=4, steps=2)
    pb, ob = fit("reference", opt=ob, params=pb, start=4, steps=2)
    assert_same(pa, oa, pb, ob)


def test_module_zero_grad_sets_none_and_the_step_still_counts_right(standin):
    """``model.zero_grad()`` (None grads, fresh grads from backward): gathered, same bits."""
    pa, oa = fit(STANDIN, steps=2)
    pb, ob = fit("reference", steps=2)
    for opt, params, backend in ((oa, pa, STANDIN), (ob, pb, "reference")):
        for p in params:
            p.grad = None
        backward(params, 2, idle_some)
        with forced_backend(backend):
            opt.step()
    assert_same(pa, oa, pb, ob)


def test_the_switch_turns_flat_grads_off(standin, monkeypatch):
    monkeypatch.setenv(npu.FLAT_GRADS_ENV, "0")
    params, opt = fit(STANDIN, steps=2)
    (bucket,) = buckets(opt)
    assert bucket.grad_keeper is None and bucket.param_region is not None
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    monkeypatch.setenv(npu.FLAT_GRADS_ENV, "yes")
    opt._plans.clear()
    backward(params, 3)
    with pytest.raises(ValueError, match="MULTI_TENSOR_NPU_FLAT_GRADS"):
        with forced_backend(STANDIN):
            opt.step()


def test_params_that_share_their_storage_are_not_moved(standin):
    params = helpers.make_params(SHAPES, F32, 0)
    held = [p.detach() for p in params]  # e.g. a state_dict() kept by the caller
    ptrs = [p.data_ptr() for p in params]
    pa, oa = fit(STANDIN, params=params, steps=3)
    pb, ob = fit("reference", steps=3)
    assert_same(pa, oa, pb, ob)
    assert [p.data_ptr() for p in pa] == ptrs
    assert all(torch.equal(h, p.detach()) for h, p in zip(held, pa))
    (bucket,) = buckets(oa)
    assert bucket.param_region is None and bucket.grad_keeper is not None


def test_a_reallocated_param_replans_and_keeps_the_bits(standin):
    pa, oa = fit(STANDIN, steps=3, weight_decay=0.1)
    pb, ob = fit("reference", steps=3, weight_decay=0.1)
    (first,) = buckets(oa)
    pa[1].data = pa[1].data.clone()  # e.g. load_state_dict(assign=True)
    pa, oa = fit(STANDIN, opt=oa, params=pa, start=3, steps=3, weight_decay=0.1)
    pb, ob = fit("reference", opt=ob, params=pb, start=3, steps=3, weight_decay=0.1)
    assert_same(pa, oa, pb, ob)
    (bucket,) = buckets(oa)
    assert bucket is not first
    assert pa[1].untyped_storage().data_ptr() == bucket.param_region.untyped_storage().data_ptr()


def test_state_dict_round_trip_with_flat_grads(standin):
    kw = dict(dtype=BF16, master_weights=True, weight_decay=0.1)
    pa, oa = fit(STANDIN, steps=4, **kw)
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)
    buf.seek(0)
    oc = FusedEmaAdamW(pa, **{k: v for k, v in kw.items() if k != "dtype"})
    oc.load_state_dict(torch.load(buf))
    pb, ob = fit("reference", steps=4, **kw)
    pa, oc = fit(STANDIN, opt=oc, params=pa, start=4, steps=3, idle=idle_some)
    pb, ob = fit("reference", opt=ob, params=pb, start=4, steps=3, idle=idle_some)
    assert_same(pa, oc, pb, ob)


# --- the steady state, counted ------------------------------------------------------------------

def steady_state(n_params, dtype, mode, master):
    """Counters of the third step and of the zero_grad after it, for ``n_params`` params."""
    op = CountingOp(npu_standin.literal_device_op if mode == "cann_literal"
                    else npu_standin.reference_device_op)
    gen = torch.Generator().manual_seed(n_params)
    with npu_standin.standin_backend(op, mode=mode):
        params = [torch.nn.Parameter(torch.randn(1000 + (i * 397) % 4000, generator=gen)
                                     .to(dtype)) for i in range(n_params)]
        opt = FusedEmaAdamW(params, lr=1e-3, master_weights=master, weight_decay=0.1)
        for k in range(3):
            opt.zero_grad()
            backward(params, k)
            counter = OpCounter()
            op.counter = counter
            with forced_backend(STANDIN), counter:
                opt.step()
        zeroing = OpCounter()
        with zeroing:
            opt.zero_grad()
    assert all(b.last_path == mode for b in buckets(opt))
    return counter, zeroing


# launches of a steady-state step in the CANN modes: the operator, the EMA's lerp (cann), and
# with fp16/bf16 params and fp32 masters one grad cast and one master->param cast
CANN_LAUNCHES = {("cann", False): ["operator", "aten::lerp_.Scalar"],
                 ("cann_literal", False): ["operator"],
                 ("cann", True): ["aten::copy_", "operator", "aten::lerp_.Scalar", "aten::copy_"],
                 ("cann_literal", True): ["aten::copy_", "operator", "aten::copy_"]}


@pytest.mark.parametrize("mode", ["cann", "cann_literal", "exact"])
@pytest.mark.parametrize("dtype,master", [(F32, False), (BF16, True), (F16, True)])
def test_steady_state_launches_do_not_grow_with_the_params(dtype, master, mode):
    small, zero_small = steady_state(20, dtype, mode, master)
    large, zero_large = steady_state(200, dtype, mode, master)
    assert small.launches == large.launches and small.names == large.names
    assert zero_small.launches == zero_large.launches == 1  # zero_grad: one launch per bucket
    if mode != "exact":
        assert large.names == CANN_LAUNCHES[mode, master]
        assert large.syncs == 0 and large.fp64 == 0


def test_apex_call_with_check_finite_reads_the_host_once():
    """The one-shot op keeps apex's noop_flag: on the CANN path with check_finite, the flag is
    read together with the finite check, one host read in all."""
    params = helpers.make_params(((6,), (9,)), F32, 0)
    state = [[torch.zeros(p.shape) for p in params] for _ in range(3)]
    grads = helpers.random_grads(params, 1)
    args = (1e-2, 0.99, 0.9, 0.999, 1e-8, 1, 1, True, 0.1)
    op = CountingOp(npu_standin.reference_device_op)
    with npu_standin.standin_backend(op, mode="cann"):
        for flag, skipped in ((0, False), (1, True)):
            before = [p.detach().clone() for p in params]
            noop = torch.full((1,), flag, dtype=torch.int32)
            counter = op.counter = OpCounter()
            with counter:
                multi_tensor_fused_ema_adamw(2048, noop, [grads, params] + state, *args,
                                             check_finite=True)
            assert counter.syncs == 1
            assert int(noop) == flag
            assert all(torch.equal(p, b) for p, b in zip(params, before)) == skipped
    assert all(flat.is_ours(p) is False for p in params)  # a one-shot call moves nothing


def test_grads_written_by_hand_after_zero_grad_are_seen(standin):
    """Code that accumulates grads itself (``p.grad = g`` where None, else ``p.grad.add_(g)``)
    after ``zero_grad()``: the grads are None there, as in torch, so nothing written is lost."""
    pa, oa = fit(STANDIN, steps=2)
    pb, ob = fit("reference", steps=2)
    for opt, params, backend in ((oa, pa, STANDIN), (ob, pb, "reference")):
        for k in range(2):
            opt.zero_grad()
            for i, p in enumerate(params):
                g = torch.full_like(p, 0.125 * (i + 1 + k))
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
            with forced_backend(backend):
                opt.step()
    assert_same(pa, oa, pb, ob)


def _ieee_sqrt(tensors):
    """An IEEE device's fp32 sqrt (numpy's, the hardware instruction)."""
    return [torch.from_numpy(np.sqrt(t.numpy())) for t in tensors]


def _one_ulp_off_sqrt(tensors):
    """A device whose fp32 sqrt is one ulp high on every finite positive result."""
    out = []
    for t in _ieee_sqrt(tensors):
        moved = (t.view(torch.int32) + 1).view(F32)
        out.append(torch.where(torch.isfinite(t) & (t > 0), moved, t))
    return out


@pytest.mark.parametrize("case", ["fp32_adamw", "bf16_masters", "fused_adam"])
def test_the_devices_own_sqrt_and_div_when_they_are_ieee(monkeypatch, standin, case):
    """MULTI_TENSOR_NPU_IEEE_SQRT_DIV=1: the torch path on the device's own fp32 sqrt and
    division, bitwise the reference where those are correctly rounded (numpy's sqrt here), and
    not where the sqrt is not: the switch is for devices npu_check has shown IEEE."""
    kw = dict(CASES[case], lr=1e-2, steps=5)
    pb, ob = fit("reference", **kw)
    calls = []
    monkeypatch.setattr(npu_ops, "device_sqrt", lambda t: calls.append(1) or _ieee_sqrt(t))
    trusted = npu.device_sqrt_div()
    npu.set_device_sqrt_div(True)
    try:
        pa, oa = fit(STANDIN, **kw)
        assert_same(pa, oa, pb, ob)
        assert len(calls) == 5, "the device's own sqrt was not the one used"
        monkeypatch.setattr(npu_ops, "device_sqrt", _one_ulp_off_sqrt)
        pc, oc = fit(STANDIN, **kw)
    finally:
        npu.set_device_sqrt_div(trusted)
    with pytest.raises(AssertionError):  # (bf16 params may round alike: the masters differ)
        assert_same(pc, oc, pb, ob)


def test_the_device_sqrt_div_switch_reads_its_environment(monkeypatch):
    monkeypatch.setenv(npu.IEEE_ENV, "2")
    with pytest.raises(ValueError, match=npu.IEEE_ENV):
        npu.modes._env_flag(npu.IEEE_ENV)
    monkeypatch.setenv(npu.IEEE_ENV, "1")
    assert npu.modes._env_flag(npu.IEEE_ENV)
    monkeypatch.delenv(npu.IEEE_ENV)
    assert not npu.modes._env_flag(npu.IEEE_ENV)
