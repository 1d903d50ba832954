"""A small transformer trained with FSDP2 + FusedEmaAdamW, checkpointed with DCP, resumed, and
its EMA model exported.

    torchrun --nproc_per_node 2 tools/fsdp_example.py          # 2 CPU ranks (gloo)
    torchrun --nproc_per_node 1 tools/fsdp_example.py --device cuda   # GPUs (NCCL), rank = GPU

What it does, on every rank:

1. builds a 2-block causal transformer (a next-token task on random repeating sequences),
   ``fully_shard`` on each block and on the root, bf16 compute (``MixedPrecisionPolicy``);
2. trains ``--steps`` steps with ``FusedEmaAdamW`` (AdamW + EMA of the weights in one pass over
   the local shards), saving a ``torch.distributed.checkpoint`` at the middle step;
3. builds a fresh model and optimizer, loads the checkpoint (``get/set_optimizer_state_dict``)
   and trains the second half again: the losses and the final params, moments and EMA must equal
   the uninterrupted run's bit for bit;
4. exports the EMA model as one full state dict (``ema_state_dict(model, full_state_dict=True)``,
   gathered on every rank, saved by rank 0 with ``torch.save``), loads it into a plain
   (unsharded) model and compares its loss with the raw model's on held-out data.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fused_optim import FusedEmaAdamW  # noqa: E402

VOCAB, SEQ, DIM, HEADS = 32, 24, 64, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, DIM))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)).clone()  # FSDP2 warns when a root returns a view


DEVICE = torch.device("cpu")  # the rank's device: cuda:LOCAL_RANK with --device cuda


def batch(step: int, rank: int, size: int = 16):
    """Sequences repeating a random pattern of length 6: the next token is predictable."""
    gen = torch.Generator().manual_seed(10_000 * rank + step)
    pattern = torch.randint(0, VOCAB, (size, 6), generator=gen)
    seq = pattern.repeat(1, SEQ // 6 + 2)[:, : SEQ + 1].to(DEVICE)
    return seq[:, :-1], seq[:, 1:]


def loss_of(model, idx, target):
    return F.cross_entropy(model(idx).float().reshape(-1, VOCAB), target.reshape(-1))


def build(seed: int):
    torch.manual_seed(seed)
    model = TinyGPT().to(DEVICE)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = FusedEmaAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, ema_decay=0.99,
                        ema_schedule="warmup", max_grad_norm=1.0)
    return model, opt


def train(model, opt, steps, rank):
    losses = []
    for step in steps:
        idx, target = batch(step, rank)
        loss = loss_of(model, idx, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)  # the mean over ranks, for printing
        losses.append(avg.item() / dist.get_world_size())
    return losses


def snapshot(model, opt):
    """Full (gathered) params and optimizer state, for the bitwise check."""
    out = []
    for p in model.parameters():
        out.append(p.full_tensor())
        for key in ("step", "exp_avg", "exp_avg_sq", "ema"):
            value = opt.state[p][key]
            out.append(value.full_tensor() if hasattr(value, "full_tensor") else value)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo; cuda: NCCL, each rank on cuda:LOCAL_RANK")
    parser.add_argument("--out", default=None, help="where the EMA model is saved "
                        "(default: a temporary directory, removed at the end)")
    args = parser.parse_args()
    global DEVICE
    torch.set_num_threads(1)
    if args.device == "cuda":
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    workdir = tempfile.mkdtemp(prefix="fsdp_example_") if rank == 0 else None
    shared = [workdir]
    dist.broadcast_object_list(shared, src=0)
    workdir = shared[0]
    ckpt = os.path.join(workdir, "ckpt")
    half = args.steps // 2
    try:
        model, opt = build(seed=0)
        first = train(model, opt, range(half), rank)
        dcp.save({"model": get_model_state_dict(model),
                  "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
        second = train(model, opt, range(half, args.steps), rank)

        resumed_model, resumed_opt = build(seed=1)     # other weights: all comes from the file
        state = {"model": get_model_state_dict(resumed_model),
                 "optim": get_optimizer_state_dict(resumed_model, resumed_opt)}
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(resumed_model, state["model"])
        set_optimizer_state_dict(resumed_model, resumed_opt, state["optim"])
        again = train(resumed_model, resumed_opt, range(half, args.steps), rank)
        same = all(torch.equal(a, b) for a, b in zip(snapshot(model, opt),
                                                     snapshot(resumed_model, resumed_opt)))

        ema = opt.ema_state_dict(model, full_state_dict=True)   # collective: every rank
        out_dir = args.out or workdir
        path = os.path.join(out_dir, "tinygpt_ema.pt")
        if rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            torch.save(ema, path)
        dist.barrier()
        plain = TinyGPT().to(DEVICE)
        plain.load_state_dict(torch.load(path, weights_only=True, map_location=DEVICE))
        idx, target = batch(10**6, 0, size=64)
        with torch.no_grad():
            ema_loss = loss_of(plain, idx, target).item()
            raw = TinyGPT().to(DEVICE)
            raw.load_state_dict({k: v.full_tensor() for k, v in get_model_state_dict(
                model).items()})  # a collective too
            raw_loss = loss_of(raw, idx, target).item()

        from multi_tensor.backends import cpu as native_cpu
        prepared = {type(b.prepared).__module__ + "." + type(b.prepared).__name__
                    for plan in opt._plans.values() for b in plan.buckets}
        if rank == 0:
            print(f"world {world} ({dist.get_backend()}, {DEVICE.type}), "
                  f"{sum(p.numel() for p in plain.parameters())} params, "
                  f"buckets run by {sorted(prepared)} "
                  f"(native extension loaded: {native_cpu.loaded_module is not None})")
            for i in range(0, args.steps, 6):
                losses = first + second
                line = f"step {i + 1:3d}  loss {losses[i]:.4f}"
                if i >= half:
                    line += f"  resumed {again[i - half]:.4f}"
                print(line)
            print(f"final: loss {second[-1]:.4f}, grad norm {opt.last_grad_norm.item():.4f}, "
                  f"held-out loss raw {raw_loss:.4f}, EMA {ema_loss:.4f}")
            print(f"EMA model saved to {path} ({os.path.getsize(path)} bytes), loaded into a "
                  f"plain TinyGPT")
        # every rank checks its own shards and run: a failure on any rank fails torchrun
        ok = same and second == again and math.isfinite(ema_loss) and ema_loss < math.log(VOCAB)
        if rank == 0 or not ok:
            print(f"[rank {rank}] CHECK resume bit-exact: {same and second == again}; EMA "
                  f"export loads: {math.isfinite(ema_loss)} -> {'OK' if ok else 'FAILED'}")
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        dist.destroy_process_group()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
