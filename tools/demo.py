"""Demo: train a small bf16 model with FusedEmaAdamW (fp32 master weights) and evaluate its EMA.

The data is generated here: a fixed random "teacher" MLP labels Gaussian inputs, plus noise. A
bf16 student MLP learns it with FusedEmaAdamW. The script prints the training loss as it goes,
the evaluation loss of the raw weights against the EMA weights, and the optimizer step time
against PyTorch's way of doing the same work: ``torch.optim.AdamW(fused=True)`` on fp32 masters,
then a separate ``torch._foreach_lerp_`` EMA pass and a copy back to the bf16 params.

    python tools/demo.py [--steps 300] [--width 512] [--depth 2] [--seed 0]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from fused_optim import FusedEmaAdamW
from multi_tensor import backend_for


def make_data(n: int, dim: int, generator: torch.Generator):
    teacher = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
        x = torch.randn(n, dim, generator=generator)
        y = teacher(x) + 0.1 * torch.randn(n, 1, generator=generator)
    return x, y


def make_student(dim: int, width: int, depth: int) -> torch.nn.Module:
    layers = [torch.nn.Linear(dim, width), torch.nn.GELU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def progress(step: int, total: int, loss: float, width: int = 30) -> None:
    done = int(width * step / total)
    sys.stderr.write(f"\r  [{'#' * done}{'.' * (width - done)}] {step:4d}/{total} loss {loss:.4f}")
    if step == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


class TorchAdamWWithEma:
    """PyTorch's composition of the same update: fused AdamW on fp32 masters + EMA + copy back."""

    def __init__(self, params, lr, weight_decay, ema_decay):
        self.params = list(params)
        self.masters = [p.detach().float().clone() for p in self.params]
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        self.emas = [m.clone() for m in self.masters]
        self.decay = ema_decay
        self.opt = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay, fused=True)

    @torch.no_grad()
    def step(self):
        torch._foreach_copy_([m.grad for m in self.masters], [p.grad for p in self.params])
        self.opt.step()
        torch._foreach_lerp_(self.emas, self.masters, 1.0 - self.decay)
        torch._foreach_copy_(self.params, self.masters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=2, help="hidden layers")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--ema-decay", type=float, default=0.99)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    dim = 32
    x, y = make_data(8192 + 4096, dim, gen)
    x_train, y_train, x_eval, y_eval = x[:8192], y[:8192], x[8192:], y[8192:]

    model = make_student(dim, args.width, args.depth).to(torch.bfloat16)
    peer_model = make_student(dim, args.width, args.depth).to(torch.bfloat16)
    peer_model.load_state_dict(model.state_dict())
    n_params = sum(p.numel() for p in model.parameters())
    opt = FusedEmaAdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                        ema_decay=args.ema_decay, master_weights=True)
    peer = TorchAdamWWithEma(peer_model.parameters(), args.lr, 0.01, args.ema_decay)

    print(f"FusedEmaAdamW demo: bf16 MLP, {n_params / 1e6:.2f}M params in "
          f"{len(list(model.parameters()))} tensors, fp32 master weights, ema_decay={args.ema_decay}")
    print(f"backend: {backend_for('fused_ema_adamw', 'cpu').name}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")

    def loss_of(m, xs, ys):
        return torch.nn.functional.mse_loss(m(xs.to(torch.bfloat16)).float(), ys)

    ours_ms, peer_ms, losses = [], [], []
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, x_train.shape[0], (args.batch,), generator=gen)
        xb, yb = x_train[idx], y_train[idx]
        for m, times, stepper in ((model, ours_ms, opt.step), (peer_model, peer_ms, peer.step)):
            for p in m.parameters():
                p.grad = None
            loss = loss_of(m, xb, yb)
            loss.backward()
            start = time.perf_counter()
            stepper()
            times.append((time.perf_counter() - start) * 1e3)
            if m is model:
                losses.append(loss.item())
        if step % 10 == 0 or step == args.steps:
            progress(step, args.steps, statistics.fmean(losses[-10:]))

    with torch.no_grad():
        raw = loss_of(model, x_eval, y_eval).item()
        with opt.swap_ema_weights():
            ema = loss_of(model, x_eval, y_eval).item()
        peer_raw = loss_of(peer_model, x_eval, y_eval).item()
    print(f"training loss: first 10 steps {statistics.fmean(losses[:10]):.4f} -> "
          f"last 10 steps {statistics.fmean(losses[-10:]):.4f}")
    print(f"eval loss: raw weights {raw:.4f} | EMA weights {ema:.4f} "
          f"(torch AdamW peer, raw weights {peer_raw:.4f})")
    ours, theirs = statistics.median(ours_ms[5:]), statistics.median(peer_ms[5:])
    print(f"optimizer step (median): FusedEmaAdamW {ours:.3f} ms | torch AdamW(fused) + EMA pass "
          f"+ copy to bf16 {theirs:.3f} ms | {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
