"""One timer for every row of the GPU check: CUDA events on a GPU, the wall clock beside them.

On CUDA the figure is the larger of the events' time and the wall time over ``iters`` back-to-back
calls (a host-bound step shows in the wall time, a device-bound one in the events); on the CPU
the wall time alone, so the rows' code runs unchanged in the CPU test.
"""
from __future__ import annotations

import time
from typing import Callable, Dict

import torch


def timed(fn: Callable[[], None], iters: int, warmup: int = 2,
          device: torch.device = torch.device("cuda")) -> Dict[str, float]:
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        end.record()
        end.synchronize()
    wall = (time.perf_counter() - t0) / iters
    if not cuda:
        return {"wall_s": wall, "gpu_s": None, "s": wall}
    gpu = start.elapsed_time(end) / 1e3 / iters
    return {"wall_s": wall, "gpu_s": gpu, "s": max(wall, gpu)}
