"""Step time of FusedEmaAdamW, eager vs ``torch.compile(opt.step, fullgraph=True)``, on CPU.

    python tools/compile_overhead.py [--tensors 10,300] [--numel 1000] [--threads 2]

Both optimizers hold the same number of fp32 tensors with fixed grads; each figure is the best of
3 repetitions of 200 steps, after 5 warm-up steps (the compiled one compiles there).
"""
from __future__ import annotations

import argparse
import time

import torch

from fused_optim import FusedEmaAdamW


def _params(count: int, numel: int):
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(numel)
    return params


def _ms_per_step(step, steps: int = 200, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - start) / steps)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", default="10,300", help="comma list of tensor counts")
    parser.add_argument("--numel", type=int, default=1000, help="elements per tensor")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, fp32 tensors of {args.numel} elements")
    for count in (int(c) for c in args.tensors.split(",")):
        eager = FusedEmaAdamW(_params(count, args.numel), lr=1e-3)
        compiled_opt = FusedEmaAdamW(_params(count, args.numel), lr=1e-3)
        compiled = torch.compile(compiled_opt.step, fullgraph=True)
        for _ in range(5):
            eager.step()
            compiled()
        e, c = _ms_per_step(eager.step), _ms_per_step(compiled)
        print(f"{count:5d} tensors: eager {e:.3f} ms, compiled {c:.3f} ms per step")


if __name__ == "__main__":
    main()
