"""The GPT-2-small train step (forward + backward + optimizer step) as a user runs it: ours
against torch's recipe, fp32 params and bf16 params + fp32 masters, bf16 autocast.

    ours, fp32             FusedEmaAdamW(params)
    torch, fp32            torch.optim.AdamW(fused=True) + torch._foreach_lerp_ EMA
    ours, bf16 + masters   FusedEmaAdamW(bf16 params, master_weights=True)
    torch, bf16 + masters  the composed recipe: bf16 grads -> fp32 master grads, AdamW(fused=True)
                           on the masters, lerp EMA from the masters, masters -> bf16 params

The model is GPT-2 small written out (124,439,808 params in 148 tensors, the head tied to the
token embedding: the shapes of tools/benchlib's W1), so no model library is needed. Each step is
timed whole, and its optimizer step alone, with ``gpucheck.timing``. ``--config tiny`` runs the
same code on the CPU in seconds (the CPU test's dry run).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

from .timing import timed

HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, ema_decay=0.9999)


@dataclass(frozen=True)
class Config:
    vocab: int = 50257
    ctx: int = 1024
    dim: int = 768
    layers: int = 12
    heads: int = 12
    batch: int = 8
    seq: int = 1024


CONFIGS = {"gpt2-small": Config(),
           "tiny": Config(vocab=97, ctx=32, dim=32, layers=2, heads=4, batch=2, seq=16)}


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.heads = c.heads
        self.ln_1, self.ln_2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.c_attn, self.c_proj = nn.Linear(c.dim, 3 * c.dim), nn.Linear(c.dim, c.dim)
        self.c_fc, self.mlp_proj = nn.Linear(c.dim, 4 * c.dim), nn.Linear(4 * c.dim, c.dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.c_proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab, c.dim), nn.Embedding(c.ctx, c.dim)
        self.h = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.dim)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # the head tied to the embedding


class ComposedRecipe:
    """torch's mixed-precision recipe around AdamW(fused=True) and a lerp EMA (bf16 params)."""

    def __init__(self, params: List[torch.nn.Parameter]):
        self.params = params
        self.masters = [p.detach().float() for p in params]
        self.master_grads = [torch.zeros_like(m) for m in self.masters]
        for m, g in zip(self.masters, self.master_grads):
            m.grad = g
        self.emas = [m.clone() for m in self.masters]
        self.opt = torch.optim.AdamW(self.masters, **_torch_hyper(), fused=True)

    @torch.no_grad()
    def step(self) -> None:
        torch._foreach_copy_(self.master_grads, [p.grad for p in self.params])
        self.opt.step()
        torch._foreach_lerp_(self.emas, self.masters, 1.0 - HYPER["ema_decay"])
        torch._foreach_copy_(self.params, self.masters)


def _torch_hyper() -> Dict[str, object]:
    return {k: v for k, v in HYPER.items() if k != "ema_decay"}


def _fp32_torch(params: List[torch.nn.Parameter]) -> Callable[[], None]:
    opt = torch.optim.AdamW(params, **_torch_hyper(), fused=True)
    emas = [p.detach().clone() for p in params]
    detached = [p.detach() for p in params]

    def step() -> None:
        opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(emas, detached, 1.0 - HYPER["ema_decay"])
    return step


def build(config: Config, device: torch.device, master: bool, who: str):
    """(model, optimizer step) for one of the four rows."""
    import fused_optim

    torch.manual_seed(0)
    model = GPT2(config).to(device)
    if master:
        model = model.to(torch.bfloat16)
    params = list(model.parameters())
    if who == "ours":
        step = fused_optim.FusedEmaAdamW(params, master_weights=master, **HYPER).step
    elif master:
        step = ComposedRecipe(params).step
    else:
        step = _fp32_torch(params)
    return model, step


def train_step_row(config_name: str = "gpt2-small", device: str = "cuda", iters: int = 10,
                   warmup: int = 3) -> Dict[str, object]:
    """Step times (ms) of the four rows, whole train step and optimizer step alone."""
    config = CONFIGS[config_name]
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    idx = torch.randint(0, config.vocab, (config.batch, config.seq + 1), generator=gen).to(dev)
    x, y = idx[:, :-1], idx[:, 1:]
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16)
    row: Dict[str, object] = {"model": config_name, "batch": f"{config.batch}x{config.seq}",
                              "autocast": "bf16", "device": str(dev)}
    for master in (False, True):
        form = "bf16+masters" if master else "fp32"
        for who in ("ours", "torch"):
            model, opt_step = build(config, dev, master, who)
            row["params"] = sum(p.numel() for p in model.parameters())
            row["tensors"] = len(list(model.parameters()))

            def train_step(model=model, opt_step=opt_step) -> None:
                with autocast:
                    loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
                loss.backward()
                opt_step()
                model.zero_grad(set_to_none=False)

            t = timed(train_step, iters, warmup, dev)
            o = timed(opt_step, iters, 1, dev)  # grads of the last train step, kept
            row[f"{who}_{form}_step_ms"] = 1e3 * t["s"]
            row[f"{who}_{form}_optimizer_ms"] = 1e3 * o["s"]
            finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
            row[f"{who}_{form}_finite"] = finite
            del model, opt_step, train_step
        row[f"ratio_{form}"] = row[f"torch_{form}_step_ms"] / row[f"ours_{form}_step_ms"]
        row[f"ratio_{form}_optimizer"] = (row[f"torch_{form}_optimizer_ms"]
                                          / row[f"ours_{form}_optimizer_ms"])
    row["passed"] = all(v for k, v in row.items() if k.endswith("_finite"))
    assert math.isfinite(row["ratio_fp32"])
    return row
