"""What the numbers were measured on: software versions, CPU, caches, threads, backend, load."""
from __future__ import annotations

import os
import platform
import subprocess
import time
from typing import Dict, List, Optional, Tuple

import torch

import multi_tensor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _size_bytes(text: str) -> Optional[int]:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        if text and text[-1] in scale:
            return int(text[:-1]) * scale[text[-1]]
        return int(text)
    except ValueError:
        return None


def cpu_caches() -> Dict[str, int]:
    """Cache sizes of cpu0 in bytes, e.g. {"L1d": 32768, "L2": 1048576, "L3": 33554432}."""
    caches: Dict[str, int] = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return caches
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            with open(os.path.join(base, entry, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(base, entry, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(base, entry, "size")) as f:
                size = _size_bytes(f.read())
        except OSError:
            continue
        if kind == "Instruction" or size is None:
            continue
        caches[f"L{level}" + ("d" if kind == "Data" else "")] = size
    return caches


def _mem_total_gb() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def _git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except Exception:
        return None


def loadavg() -> Optional[List[float]]:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine_info() -> Dict[str, object]:
    backend = multi_tensor.backend_for("fused_ema_adamw", "cpu")
    return {
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_caches_bytes": cpu_caches(),
        "mem_total_gb": _mem_total_gb(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "backend": backend.name,
        "backend_description": getattr(backend, "description", ""),
        "registered_backends": [b.name for b in multi_tensor.registered_backends()],
        "MULTI_TENSOR_BACKEND": os.environ.get("MULTI_TENSOR_BACKEND"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "git_commit": _git_commit(),
        "loadavg_start": loadavg(),
    }


def warn_if_busy(when: str, load: Optional[List[float]]) -> None:
    """Warn when other processes compete for the cores (OpenMP barriers suffer most)."""
    cpus = os.cpu_count()
    if load and cpus and load[0] > 0.5 * cpus:
        print(f"WARNING: 1-min load average {load[0]:.2f} at {when} on {cpus} CPUs: other "
              f"processes compete for the cores; timings will be noisy")


class ForeignLoad:
    """How many cores other processes kept busy between construction and ``cores()``.

    Busy jiffies of the whole machine (/proc/stat, less idle, iowait and guest time) minus this
    process's own user + system time (/proc/self/stat), over the wall time. Near 0 on a quiet
    machine; OpenMP-parallel peers lose most when it is not.
    """

    def __init__(self):
        self._start = self._sample()

    @staticmethod
    def _sample() -> Optional[Tuple[int, int, float]]:
        try:
            with open("/proc/stat") as f:
                vals = [int(v) for v in f.readline().split()[1:]]
            busy = sum(vals) - vals[3] - vals[4] - sum(vals[8:10])
            with open("/proc/self/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return busy, int(fields[11]) + int(fields[12]), time.perf_counter()
        except (OSError, ValueError, IndexError):
            return None

    def cores(self) -> Optional[float]:
        end = self._sample()
        if self._start is None or end is None or end[2] <= self._start[2]:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        other = (end[0] - self._start[0]) - (end[1] - self._start[1])
        return max(0.0, other / ticks / (end[2] - self._start[2]))
