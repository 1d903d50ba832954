"""A per-kernel Nsight Compute summary of our step: achieved DRAM GB/s for W1 and W3.

``python tools/gpucheck/ncu.py W1`` is the profiled program: it builds the workload, takes two
warm-up steps, then one step inside the NVTX range ``ncu_step``; ``command()`` wraps it in
``ncu --clock-control none`` (the clocks as a user runs them, not ncu's locked base clock),
profiling only the kernels in that range, with a few metrics (fast: no full section replay).
``summarize()`` reads ncu's CSV: per kernel, its duration, bytes read and written, and achieved
DRAM throughput. Without ``ncu`` on PATH the row says so.
"""
from __future__ import annotations

import csv
import io
import os
import shutil
import sys
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")

METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
           "dram__bytes.sum.per_second")
# ncu's units, with --print-units base mostly the base ones, scaled to bytes, seconds, bytes/s
UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
         "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0,
         "byte/second": 1.0, "Kbyte/second": 1e3, "Mbyte/second": 1e6, "Gbyte/second": 1e9,
         "Tbyte/second": 1e12, "byte/s": 1.0, "Gbyte/s": 1e9, "Tbyte/s": 1e12}


def ncu_path() -> Optional[str]:
    return shutil.which("ncu")


def command(workload: str, python: str = sys.executable) -> List[str]:
    return [ncu_path() or "ncu", "--clock-control", "none", "--nvtx", "--nvtx-include",
            "ncu_step/", "--metrics", ",".join(METRICS), "--csv", "--print-units", "base",
            python, os.path.abspath(__file__), workload]


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def summarize(csv_text: str) -> List[Dict[str, object]]:
    """Per kernel (in launch order): seconds, bytes read/written, DRAM GB/s (from ncu's CSV)."""
    start = csv_text.find('"ID"')
    if start < 0:
        raise ValueError("no CSV table in ncu's output:\n" + csv_text[-2000:])
    kernels: Dict[str, Dict[str, object]] = {}
    for rec in csv.DictReader(io.StringIO(csv_text[start:])):
        if rec.get("Metric Name") not in METRICS:
            continue
        key = rec["ID"]
        k = kernels.setdefault(key, {"kernel": rec["Kernel Name"], "grid": rec.get("Grid Size"),
                                     "block": rec.get("Block Size")})
        unit = (rec.get("Metric Unit") or "").strip()
        k[rec["Metric Name"]] = _number(rec["Metric Value"]) * UNITS.get(unit, 1.0)
    out = []
    for k in kernels.values():
        seconds = k.pop("gpu__time_duration.sum", None)
        read, write = k.pop("dram__bytes_read.sum", None), k.pop("dram__bytes_write.sum", None)
        rate = k.pop("dram__bytes.sum.per_second", None)
        out.append(dict(k, us=None if seconds is None else seconds * 1e6,
                        read_MB=None if read is None else read / 1e6,
                        written_MB=None if write is None else write / 1e6,
                        dram_GBps=None if rate is None else rate / 1e9))
    return out


def profiled_program(workload: str) -> None:
    """The program ncu runs: two steps, then one inside the ``ncu_step`` NVTX range."""
    for path in (ROOT, TOOLS):
        if path not in sys.path:
            sys.path.insert(0, path)
    import torch

    import fused_optim
    from benchlib import workloads

    dtype = {"W1": torch.float32, "W3": torch.bfloat16}[workload]
    params = [torch.nn.Parameter(torch.randn(s, device="cuda").mul_(0.02).to(dtype))
              for s in workloads.gpt2_small_shapes()]
    for p in params:
        p.grad = torch.randn_like(p).mul_(1e-3)
    opt = fused_optim.FusedEmaAdamW(params, master_weights=True, lr=1e-4)
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("ncu_step")
    opt.step()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    profiled_program(sys.argv[1])
