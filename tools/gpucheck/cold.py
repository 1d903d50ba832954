"""The cold first step: what a user waits for before the first FusedEmaAdamW step returns.

Run as its own process (``python tools/gpucheck/cold.py --device cuda``) with an empty Triton
cache (``TRITON_CACHE_DIR`` pointed at a fresh directory by the caller), so the kernels compile
as on a new install: the first fp32 step on the W1 shapes, its second step, then the first and
second bf16 + fp32 masters step. Prints one JSON line. ``--small`` uses a few small tensors
(the CPU test's dry run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")
for _path in (ROOT, TOOLS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402


def first_steps(device: str, small: bool):
    import fused_optim
    from benchlib import workloads

    dev = torch.device(device)
    shapes = [(1000,), (32, 32)] if small else workloads.gpt2_small_shapes()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {"device": str(dev), "tensors": len(shapes)}
    for form, dtype, master in (("fp32", torch.float32, False),
                                ("bf16+masters", torch.bfloat16, True)):
        params = [torch.nn.Parameter(torch.randn(s, device=dev).mul_(0.02).to(dtype))
                  for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p).mul_(1e-3)
        opt = fused_optim.FusedEmaAdamW(params, master_weights=master, lr=1e-4)
        for which in ("first", "second"):
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            out[f"{form}_{which}_step_s"] = time.perf_counter() - t0
        del params, opt
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import fused_optim  # noqa: F401  (the import is part of a cold start)
    row = {"import_s": time.perf_counter() - t0,
           "triton_cache": os.environ.get("TRITON_CACHE_DIR")}
    row.update(first_steps(args.device, args.small))
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
