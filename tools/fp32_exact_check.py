"""Check multi_tensor.backends.npu.fp32_exact.sqrt against numpy on every positive fp32, in chunks.

    python tools/fp32_exact_check.py [--ulps N] [--chunk-log2 24] [--start HEX] [--stop HEX]

Every finite positive float32 (bit patterns 0x00000001 .. 0x7F7FFFFF, subnormals included) is
square-rooted by ``fp32_exact.sqrt_flat`` with the "device" approximation (``torch.sqrt``)
moved at random by up to ``--ulps`` ulp, and compared bitwise with numpy's float32 sqrt (the
IEEE instruction). Prints each binade range's mismatches and the time taken. One thread (it is a
check, not a benchmark: run it at low priority, e.g. ``nice -n 19``). Not part of CI.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from multi_tensor.backends.npu import fp32_exact  # noqa: E402

LAST_FINITE = 0x7F7FFFFF


def perturbed_sqrt(ulps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def approx(x):
        r = torch.sqrt(x)
        if ulps == 0:
            return r
        k = torch.randint(-ulps, ulps + 1, r.shape, generator=gen, dtype=torch.int32)
        moved = (r.view(torch.int32) + k).view(torch.float32)
        ok = torch.isfinite(r) & (r > 0) & torch.isfinite(moved) & (moved > 0)
        return torch.where(ok, moved, r)
    return approx


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ulps", type=int, default=1, help="perturbation of the approximation")
    ap.add_argument("--chunk-log2", type=int, default=24)
    ap.add_argument("--start", type=lambda s: int(s, 16), default=1)
    ap.add_argument("--stop", type=lambda s: int(s, 16), default=LAST_FINITE + 1,
                    help="first bit pattern not checked (hex)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    approx = perturbed_sqrt(args.ulps, 0)
    chunk = 1 << args.chunk_log2
    t0 = time.perf_counter()
    bad_total = checked = 0
    report_every = 1 << 27
    next_report = args.start + report_every
    start = args.start
    while start < args.stop:
        stop = min(start + chunk, args.stop)
        x = torch.arange(start, stop, dtype=torch.int32).view(torch.float32)
        got = fp32_exact.sqrt_flat(x, approx)
        want = torch.from_numpy(np.sqrt(x.numpy()))
        bad = got.view(torch.int32) != want.view(torch.int32)
        n_bad = int(bad.sum())
        if n_bad:
            i = int(bad.nonzero()[0])
            print(f"MISMATCH in [{start:#010x}, {stop:#010x}): {n_bad}, e.g. sqrt({x[i].item()!r}) = "
                  f"{got[i].item()!r}, want {want[i].item()!r}", flush=True)
        bad_total += n_bad
        checked += stop - start
        start = stop
        if start >= next_report or start >= args.stop:
            print(f"up to {start:#010x}: {checked} checked, {bad_total} wrong, "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            next_report += report_every
    print(f"done: {checked} positive fp32 values, {bad_total} wrong, ulps={args.ulps}, "
          f"{time.perf_counter() - t0:.1f} s on one thread")
    return 1 if bad_total else 0


if __name__ == "__main__":
    sys.exit(main())
