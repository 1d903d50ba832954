"""Tensors without real storage (DTensor, meta, fake) never reach native code (SPEC section 5).

They go to a backend that declares it runs them (the reference: plain torch ops dispatch through
them); where the resolved backends do not (a forced native backend), the front end raises a
TypeError naming the tensor, before anything is modified.
"""
from __future__ import annotations

import os
import socket

import pytest
import torch

import multi_tensor
from fused_optim import FusedEmaAdamW
from multi_tensor import multi_tensor_fused_ema_adamw
from multi_tensor.backends import forced_backend
from multi_tensor.validation import has_storage
from seed_reference import assert_bitwise_equal

NATIVE = "native_cpu" in [b.name for b in multi_tensor.registered_backends()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _dtensor(mesh, t):
    from torch.distributed.tensor import Shard, distribute_tensor
    return distribute_tensor(t, mesh, [Shard(0)])


def test_has_storage_tells_plain_from_storageless(mesh):
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert has_storage(torch.zeros(3)) and has_storage(torch.nn.Parameter(torch.zeros(3)))
    assert not has_storage(torch.zeros(3, device="meta"))
    assert not has_storage(_dtensor(mesh, torch.zeros(4)))
    with FakeTensorMode():
        fake = torch.zeros(3)
    assert not has_storage(fake)


def test_dtensor_lists_run_on_the_reference_and_match_plain_tensors(mesh):
    gen = torch.Generator().manual_seed(0)
    plain = [[torch.randn(8, 3, generator=gen)] for _ in range(5)]
    plain[3][0].abs_()
    dist = [[_dtensor(mesh, t[0].clone())] for t in plain]
    args = (1e-2, 0.99, 0.9, 0.999, 1e-8, 1, 1, True, 0.01)
    noop = torch.zeros(1, dtype=torch.int32)
    multi_tensor_fused_ema_adamw(2048, noop, plain, *args)
    multi_tensor_fused_ema_adamw(2048, noop, dist, *args)
    for a, b in zip(plain, dist):
        assert_bitwise_equal(b[0].to_local(), a[0], "DTensor result")


@pytest.mark.skipif(not NATIVE, reason="native CPU backend not built")
def test_forced_native_rejects_dtensor_with_type_error_and_changes_nothing(mesh):
    lists = [[_dtensor(mesh, torch.randn(4, 2))] for _ in range(5)]
    lists[3][0] = lists[3][0].abs()
    before = [t[0].to_local().clone() for t in lists]
    with forced_backend("native_cpu"), pytest.raises(TypeError, match=r"grads\[0\].*no real storage"):
        multi_tensor_fused_ema_adamw(2048, torch.zeros(1, dtype=torch.int32), lists, 1e-2, 0.99,
                                     0.9, 0.999, 1e-8, 1, 1, True, 0.0)
    for t, b in zip(lists, before):
        assert torch.equal(t[0].to_local(), b)


@pytest.mark.skipif(not NATIVE, reason="native CPU backend not built")
def test_optimizer_runs_dtensor_params_on_their_local_shards_natively(mesh):
    """A sharded param (what FSDP2 hands the optimizer) steps on the native kernel through its
    local shard, exactly like a plain one; its state stays a DTensor sharded alike. A plain grad
    for a sharded param is rejected naming it, before anything changes."""
    from multi_tensor.backends import cpu as native_cpu
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    values = torch.randn(6, 4)
    grad = torch.randn(6, 4)
    plain = torch.nn.Parameter(values.clone())
    sharded = torch.nn.Parameter(_dtensor(mesh, values.clone()))
    opt_plain = FusedEmaAdamW([plain], lr=1e-2, ema_decay=0.9)
    opt_sharded = FusedEmaAdamW([sharded], lr=1e-2, ema_decay=0.9)
    with forced_backend("native_cpu"):
        for _ in range(3):
            plain.grad = grad.clone()
            sharded.grad = _dtensor(mesh, grad.clone())
            opt_plain.step()
            opt_sharded.step()
    assert_bitwise_equal(sharded.to_local(), plain.detach(), "sharded param")
    for key in ("ema", "exp_avg", "exp_avg_sq"):
        state = opt_sharded.state[sharded][key]
        assert isinstance(state, DTensor) and state.placements == sharded.placements
        assert_bitwise_equal(state.to_local(), opt_plain.state[plain][key], key)
    bucket = opt_sharded._plans[id(opt_sharded.param_groups[0])].buckets[0]
    assert isinstance(bucket.prepared, native_cpu.loaded_module.AdamBucket)

    other = torch.nn.Parameter(_dtensor(mesh, values.clone()))
    other.grad = grad.clone()
    opt = FusedEmaAdamW([other], lr=1e-2)
    with pytest.raises(TypeError, match=r"grads tensor of param 0 is a plain tensor"):
        opt.step()
    assert torch.equal(other.to_local(), values)


def test_meta_tensors_are_never_handed_to_native():
    lists = [[torch.empty(5, device="meta")] for _ in range(5)]
    # meta tensors resolve to the reference (native serves only "cpu"), which computes on meta
    multi_tensor_fused_ema_adamw(2048, torch.zeros(1, dtype=torch.int32), lists, 1e-2, 0.99, 0.9,
                                 0.999, 1e-8, 1, 1, True, 0.0)
    assert lists[1][0].is_meta


@pytest.mark.skipif(not NATIVE, reason="native CPU backend not built")
def test_bucket_key_separates_placements_and_plain_tensors(mesh):
    """Same device and dtype, but Shard(0), Replicate() and plain params: three buckets, each
    run natively, each matching a plain run bitwise."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(1)
    values = [torch.randn(4, 3) for _ in range(3)]
    grads = [torch.randn(4, 3) for _ in range(3)]
    placements = [[Shard(0)], [Replicate()], None]
    params = [torch.nn.Parameter(v.clone() if pl is None else distribute_tensor(v.clone(), mesh, pl))
              for v, pl in zip(values, placements)]
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    opt, ref = FusedEmaAdamW(params, lr=1e-2), FusedEmaAdamW(plain, lr=1e-2)
    for _ in range(2):
        for p, q, g, pl in zip(params, plain, grads, placements):
            p.grad = g.clone() if pl is None else distribute_tensor(g.clone(), mesh, pl)
            q.grad = g.clone()
        opt.step()
        ref.step()
    buckets = opt._plans[id(opt.param_groups[0])].buckets
    assert [b.rows for b in buckets] == [[0], [1], [2]]
    for p, q in zip(params, plain):
        local = p.to_local() if p is not params[2] else p
        assert_bitwise_equal(local.detach(), q.detach(), "param")
