"""Distributed training on 2 CPU ranks (gloo): DDP, FSDP2, DCP checkpoints, EMA export.

Each test spawns 2 processes once (a scenario group) with a free port on 127.0.0.1, a bounded
wait, process groups destroyed and temporary directories removed. Under FSDP2 every rank also
runs a plain single-process copy of the model with the same optimizer, fed the FSDP2 run's
gathered (full) grads: the update is elementwise, so params, state and EMA gathered from the
shards must equal the plain run's bit for bit. The native CPU kernel must be what runs the
local shards.

The DCP state-initialisation rules (torch's ``_init_optim_state`` must not step) are also
checked in one process, without spawning.
"""
from __future__ import annotations

import copy
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.nn as nn

from fused_optim import FusedEmaAdamW

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")

WORLD = 2
TIMEOUT_S = 120


# --- process harness ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, port: int, scenario: str, arg) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        SCENARIOS[scenario](rank, arg)
    finally:
        dist.destroy_process_group()


def _spawn(scenario: str, arg=None) -> None:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_entry, args=(_free_port(), scenario, arg), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"scenario {scenario!r} did not finish in {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()


# --- models and helpers (used inside the workers) ----------------------------------------------
class Net(nn.Module):
    """Params whose shards over 2 ranks are even, uneven (2/1 rows) and empty (1 row: rank 1
    holds 0 elements)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 3)           # weight 3x6, bias 3: uneven shards
        self.row = nn.Parameter(torch.randn(1, 3))   # rank 1 holds nothing
        self.b = nn.Linear(3, 4)           # even shards

    def forward(self, x):
        return self.b(torch.tanh(self.a(x) + self.row))


def _data(step: int, rank: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=gen).to(dtype), torch.randn(5, 4, generator=gen).to(dtype)


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _equal(a, b, what):
    if a.dtype == torch.int16 and b.dtype == torch.int16:  # gloo and NCCL gather no int16
        a, b = a.to(torch.int32), b.to(torch.int32)
    a, b = _full(a).detach(), _full(b).detach()
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                       b.view(-1).view(torch.uint8) if b.numel() else b), (
        f"{what}: not bitwise equal (max diff {(a.double() - b.double()).abs().max().item()})")


def _assert_native(opt):
    from multi_tensor.backends import cpu as native_cpu
    if native_cpu.loaded_module is None:
        # only a build without the extension, on purpose, may skip the check
        assert os.environ.get("FUSED_OPTIM_NO_EXT") == "1", native_cpu.load_error
        return
    buckets = [b for plan in opt._plans.values() for b in plan.buckets]
    assert buckets, "no bucket was planned"
    for b in buckets:
        assert isinstance(b.prepared, native_cpu.loaded_module.AdamBucket), type(b.prepared)


BF16_PARAMS = ("bf16_masters", "bf16_remainder")


def _sharded(seed, precision):
    """(FSDP2 model, plain model with the same initial weights) for a precision."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    plain = Net()
    model = Net()
    model.load_state_dict(plain.state_dict())
    if precision in BF16_PARAMS:
        plain, model = plain.to(torch.bfloat16), model.to(torch.bfloat16)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "mixed"
          else MixedPrecisionPolicy())
    for sub in (model.a, model.b):
        fully_shard(sub, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model, plain


OPT = dict(lr=1e-2, weight_decay=0.05, ema_decay=0.9, ema_schedule="warmup")


def _train_step(model, opt, step, rank, dtype):
    x, y = _data(step, rank, dtype)
    loss = ((model(x).float() - y.float()) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


# --- scenarios ---------------------------------------------------------------------------------
def _scenario_ddp(rank, _):
    """DDP: different data per rank, all-reduced grads: every rank's params, state and EMA
    are bitwise identical after every step; a compiled step equals the eager one."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Net())
    opt = FusedEmaAdamW(model.parameters(), max_grad_norm=0.5, **OPT)
    for step in range(4):
        _train_step(model, opt, step, rank, torch.float32)
    _assert_native(opt)
    tensors = [t.detach() for p in model.parameters()
               for t in (p, *(opt.state[p][k] for k in ("exp_avg", "exp_avg_sq", "ema")))]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    _equal(gathered[0], gathered[1], "rank 0 vs rank 1")

    # a compiled step (torch.compile, fullgraph: one custom op per bucket) under DDP gives the
    # eager step's bits
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(DDP(Net()))
    (eager_model, compiled_model) = models
    eager_opt = FusedEmaAdamW(eager_model.parameters(), **OPT)
    compiled_opt = FusedEmaAdamW(compiled_model.parameters(), **OPT)
    compiled_step = torch.compile(compiled_opt.step, backend="eager", fullgraph=True)
    for step in range(3):
        x, y = _data(step, rank)
        for model_, step_fn in ((eager_model, eager_opt.step), (compiled_model, compiled_step)):
            ((model_(x) - y) ** 2).mean().backward()
            step_fn()
        eager_opt.zero_grad()
        compiled_opt.zero_grad()
    for (name, p), q in zip(eager_model.named_parameters(), compiled_model.parameters()):
        _equal(p, q, f"compiled step: {name}")
        for key in ("exp_avg", "exp_avg_sq", "ema", "step"):
            _equal(eager_opt.state[p][key], compiled_opt.state[q][key], f"compiled step: {name} {key}")


# per-scenario optimizer options beside OPT: an EMA kept in bf16 and updated every other step;
# the fp32 masters of bf16 params held as int16 remainders
EXTRA_OPTIONS = {"fp32_bf16_ema_every_2": dict(ema_update_every=2, ema_dtype=torch.bfloat16),
                 "bf16_remainder": dict(master_weights="remainder")}


def _scenario_fsdp(rank, precision):
    """FSDP2 vs a plain run fed the gathered grads, bitwise; native kernel on the shards."""
    from torch.distributed.tensor import DTensor

    model, plain = _sharded(0, precision)
    dtype = torch.bfloat16 if precision in BF16_PARAMS else torch.float32
    options = dict(OPT, **EXTRA_OPTIONS.get(precision, {}))
    opt = FusedEmaAdamW(model.parameters(), **options)
    ref = FusedEmaAdamW(plain.parameters(), **options)
    named = dict(model.named_parameters())
    for step in range(4):
        x, y = _data(step, rank, dtype)
        ((model(x).float() - y.float()) ** 2).mean().backward()
        for name, p in plain.named_parameters():
            p.grad = _full(named[name].grad).to(p.dtype)
        opt.step()
        ref.step()
        opt.zero_grad()
        _assert_native(opt)
        for name, p in plain.named_parameters():
            q = named[name]
            assert isinstance(q, DTensor)
            _equal(q, p, f"{precision} step {step} param {name}")
            for key, value in ref.state[p].items():
                mine = opt.state[q][key]
                if key != "step":
                    assert isinstance(mine, DTensor) and mine.placements == q.placements, key
                if key == "param_remainder":  # gloo and NCCL gather no int16: compared widened
                    assert mine.dtype == value.dtype == torch.int16
                    mine, value = mine.to(torch.int32), value.to(torch.int32)
                _equal(mine, value, f"{precision} step {step} {name} {key}")
    if rank == 1:  # the empty shard really is empty
        assert named["row"].to_local().numel() == 0

    # EMA export: a full state dict on every rank, into a plain module, and swapped in place
    full = opt.ema_state_dict(model, full_state_dict=True)
    expected = ref.ema_state_dict(plain)
    assert list(full) == list(expected)
    for key in expected:
        assert not isinstance(full[key], DTensor)
        _equal(full[key], expected[key], f"ema_state_dict {key}")
    target = Net().to(dtype)
    opt.copy_ema_to(target)
    for (name, t), (_, e) in zip(target.named_parameters(), plain.named_parameters()):
        _equal(t, ref.state[e]["ema"].to(dtype), f"copy_ema_to {name}")
    before = {name: _full(p).clone() for name, p in model.named_parameters()}
    x, _ = _data(99, 0, dtype)
    with pytest.raises(ValueError, match="module=model"):
        with opt.swap_ema_weights():
            pass
    with torch.no_grad():
        model(x)  # a forward without backward leaves the root's params gathered
        with opt.swap_ema_weights(module=model):
            for name, p in plain.named_parameters():
                _equal(named[name], ref.state[p]["ema"].to(dtype), f"swapped {name}")
            out_ema = model(x)
        out_train = model(x)
    def forward(m):  # mixed precision: FSDP2 computes in bf16 from the fp32 shards
        return copy.deepcopy(m).to(torch.bfloat16)(x.bfloat16()) if precision == "mixed" else m(x)

    with ref.swap_ema_weights():
        expected_ema = forward(plain)
    _equal(out_ema, expected_ema, "forward inside swap_ema_weights")
    _equal(out_train, forward(plain), "forward after swap_ema_weights")
    model.reshard()  # the no-grad forward above left the root's params gathered
    for name, p in model.named_parameters():
        _equal(p, before[name], f"restored {name}")


def _scenario_fsdp_all(rank, _):
    for precision in ("fp32", "mixed", "bf16_masters", "fp32_bf16_ema_every_2", "bf16_remainder"):
        _scenario_fsdp(rank, precision)
    _scenario_clip(rank, None)


def _scenario_clip(rank, _):
    """max_grad_norm under FSDP2 is the global norm (all shards), as clip_grad_norm_ takes it."""
    model, plain = _sharded(1, "fp32")
    opt = FusedEmaAdamW(model.parameters(), max_grad_norm=0.05, **OPT)
    ref = FusedEmaAdamW(plain.parameters(), max_grad_norm=0.05, **OPT)
    named = dict(model.named_parameters())
    for step in range(3):
        x, y = _data(step, rank)
        ((model(x) - y) ** 2).mean().backward()
        for name, p in plain.named_parameters():
            p.grad = _full(named[name].grad).clone()
        # torch's norm of the DTensor grads (max_norm=inf multiplies them by exactly 1)
        expected = _full(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        opt.step()
        ref.step()
        opt.zero_grad()
        torch.testing.assert_close(opt.last_grad_norm.float(), expected.float(), rtol=1e-6, atol=0)
        assert opt.last_grad_norm.item() > 0.05  # the clip is active
        for name, p in plain.named_parameters():
            torch.testing.assert_close(_full(named[name]), p.detach(), rtol=1e-6, atol=1e-7)
    _assert_native(opt)


def _scenario_dcp_remainder(rank, directory):
    _scenario_dcp(rank, directory, "bf16_remainder")


def _scenario_dcp(rank, directory, precision="bf16_masters"):
    """dcp.save at step 3 -> fresh model and optimizer -> dcp.load -> 3 more steps equals an
    uninterrupted 6-step run bit for bit (params, masters, moments, EMA, steps, EMA schedule);
    DCP's state initialisation on the fresh optimizer neither steps nor moves anything.
    ``precision``: fp32 masters, or the masters held as int16 remainders."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    dtype = torch.bfloat16

    def run(model, opt, steps):
        for step in steps:
            _train_step(model, opt, step, rank, dtype)

    options = dict(OPT, **EXTRA_OPTIONS.get(precision, {}))
    model, _ = _sharded(0, precision)
    opt = FusedEmaAdamW(model.parameters(), **options)
    run(model, opt, range(6))
    uninterrupted = opt

    model_a, _ = _sharded(0, precision)
    opt_a = FusedEmaAdamW(model_a.parameters(), **options)
    run(model_a, opt_a, range(3))
    dcp.save({"model": get_model_state_dict(model_a),
              "optim": get_optimizer_state_dict(model_a, opt_a)}, checkpoint_id=directory)

    model_b, _ = _sharded(7, precision)  # other initial weights: all must come from the file
    opt_b = FusedEmaAdamW(model_b.parameters(), **options)
    initial = {n: _full(p).clone() for n, p in model_b.named_parameters()}
    state = {"model": get_model_state_dict(model_b),
             "optim": get_optimizer_state_dict(model_b, opt_b)}   # runs DCP's init step()
    for name, p in model_b.named_parameters():   # DCP's init: no step, nothing moved
        s = opt_b.state[p]
        assert s["step"].item() == 0, (name, s["step"])
        _equal(p, initial[name], f"param after DCP init {name}")
        _equal(s["ema"], initial[name].float(), f"EMA after DCP init {name}")
        if precision == "bf16_remainder":
            assert not _full(s["param_remainder"].to(torch.int32)).any()
        else:
            _equal(s["master_param"], initial[name].float(), f"master after DCP init {name}")
        assert not _full(s["exp_avg"]).any() and not _full(s["exp_avg_sq"]).any()
        assert p.grad is None
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model_b, state["model"])
    set_optimizer_state_dict(model_b, opt_b, state["optim"])
    run(model_b, opt_b, range(3, 6))
    _assert_native(opt_b)
    for (name, p), q in zip(model.named_parameters(), model_b.parameters()):
        _equal(q, p, f"resumed param {name}")
        assert set(opt_b.state[q]) == set(uninterrupted.state[p])
        for key, value in uninterrupted.state[p].items():
            _equal(opt_b.state[q][key], value, f"resumed {name} {key}")
    assert opt_b.state[q]["step"].item() == 6


SCENARIOS = {"ddp": _scenario_ddp, "fsdp_all": _scenario_fsdp_all,
             "dcp": _scenario_dcp, "dcp_remainder": _scenario_dcp_remainder}


# --- tests -------------------------------------------------------------------------------------
def test_ddp_ranks_bitwise_identical():
    _spawn("ddp")


def test_fsdp2_three_precisions_match_single_process_bitwise_ema_export_and_global_clip():
    """fp32, MixedPrecisionPolicy(param_dtype=bf16), bf16 params with fp32 masters; EMA
    export (full state dict, copy into a plain module, swap on the sharded model); and
    max_grad_norm's global norm. One spawn for all of them."""
    _spawn("fsdp_all")


def test_dcp_save_load_resume_is_bit_exact_and_init_does_not_step():
    with tempfile.TemporaryDirectory() as directory:
        _spawn("dcp", os.path.join(directory, "ckpt"))


def test_dcp_resume_with_master_remainders_is_bit_exact():
    with tempfile.TemporaryDirectory() as directory:
        _spawn("dcp_remainder", os.path.join(directory, "ckpt"))


# --- DCP's state initialisation, in one process -------------------------------------------------
def _plain_model_and_opt(**kwargs):
    torch.manual_seed(0)
    model = Net()
    return model, FusedEmaAdamW(model.parameters(), **{**OPT, **kwargs})


def test_dcp_init_optim_state_creates_state_without_stepping():
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    model, opt = _plain_model_and_opt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _init_optim_state(opt)
    for name, p in model.named_parameters():
        assert opt.state[p]["step"].item() == 0
        assert torch.equal(p, before[name]) and torch.equal(opt.state[p]["ema"], before[name])
        assert p.grad is None
    assert opt.param_groups[0]["lr"] == OPT["lr"]
    # the next real step is the first: the same bits as an optimizer that never saw the init
    model2, opt2 = _plain_model_and_opt()
    for m, o in ((model, opt), (model2, opt2)):
        _train_step(m, o, 0, 0, torch.float32)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq", "ema"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key]), key


def test_first_step_with_lr_zero_and_real_grads_counts():
    """A linear warm-up from lr=0 (Hugging Face's schedulers) steps with real grads: it counts."""
    model, opt = _plain_model_and_opt(lr=0.0)
    _train_step(model, opt, 0, 0, torch.float32)
    for p in model.parameters():
        assert opt.state[p]["step"].item() == 1
        assert opt.state[p]["exp_avg"].any()


def test_init_state_is_public_and_idempotent():
    model, opt = _plain_model_and_opt()
    opt.init_state()
    assert all(opt.state[p]["step"].item() == 0 for p in model.parameters())
    _train_step(model, opt, 0, 0, torch.float32)
    opt.init_state()  # existing state is kept
    assert all(opt.state[p]["step"].item() == 1 for p in model.parameters())


def test_fsdp_example_runs_and_checks_itself():
    """tools/fsdp_example.py under torchrun (2 ranks): trains, resumes bit-exactly from DCP,
    exports the EMA; it exits non-zero if any rank's check fails."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
         os.path.join(root, "tools", "fsdp_example.py"), "--steps", "12"],
        cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CHECK resume bit-exact: True; EMA export loads: True -> OK" in proc.stdout
