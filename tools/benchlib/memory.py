"""Peak extra memory of one optimizer step, measured outside the timed rounds.

  rss    VmHWM - VmRSS from /proc/self/status, with the high-water mark reset just before the
         step by writing "5" to /proc/self/clear_refs (after malloc_trim(0), so freed heap pages
         do not hide new allocations). Coarse: counts any allocation, torch's or not.
  torch  peak of the running sum of the CPU allocator's alloc/free events that
         torch.profiler(profile_memory=True) records during the step: the exact bytes torch
         allocated above what was live when the step began.
"""
from __future__ import annotations

import ctypes
import gc
import sys
from typing import Callable, Optional

METHOD = ("rss: VmHWM - VmRSS (/proc/self/status) around one step, peak reset by writing '5' to "
          "/proc/self/clear_refs after malloc_trim(0); torch: peak of the running sum of CPU "
          "allocator alloc/free events recorded by torch.profiler(profile_memory=True) during one step")

_LIBC = None


def malloc_trim() -> None:
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_peak_extra_mb(step: Callable[[], None]) -> Optional[float]:
    """VmHWM after one step minus VmRSS before it, in MB (None where /proc is unavailable)."""
    gc.collect()
    malloc_trim()
    rss0 = _status_kb("VmRSS")
    if rss0 is None or not _reset_peak_rss():
        step()
        return None
    step()
    hwm = _status_kb("VmHWM")
    if hwm is None:
        return None
    return max(0, hwm - rss0) * 1024 / 1e6


def torch_peak_extra_mb(step: Callable[[], None]) -> Optional[float]:
    """Peak bytes torch's CPU allocator held above the step's start, from profiler memory events."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                  if e.name() == "[memory]"]
    except Exception as exc:  # a private profiler API: report "unknown", never fail the run
        print(f"  (torch allocator peak unavailable: {type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    events.sort(key=lambda e: e[0])  # stable: same-timestamp events keep their recorded order
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak / 1e6
