"""The issue's numeric targets, as data, and how a measured result is scored against them.

Targets are printed beside the numbers and recorded in the JSON; nothing is asserted. Each
target names the figure it reads:

  ratio               peer median step time / ours median step time, in one timing mode
                      (``interleaved``: every step follows the other peers' steps;
                      ``burst``: back-to-back steps of one peer, caches and threads warm)
  pct_ceiling         ours' effective GB/s as a % of the in-place streaming ceiling
  ns_per_elem_core    in-cache compute: step time * threads / elements, in ns (workload "in_cache")
  marginal_ns_per_elem_core
                      in-cache compute per added element: the difference between two tensor
                      sizes, so the fixed per-step cost (Python, hooks) drops out

A workload's targets are scored separately for each thread count.
"""
from __future__ import annotations

import operator
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

_OPS = {">=": operator.ge, "<=": operator.le}


@dataclass(frozen=True)
class Target:
    workload: str
    metric: str
    op: str
    value: float
    peer: str = "ours"
    mode: str = "interleaved"

    def describe(self) -> str:
        if self.metric == "ratio":
            return f"{self.peer} time / ours time ({self.mode})"
        if self.metric == "pct_ceiling":
            return f"{self.peer} % of in-place ceiling ({self.mode})"
        if self.metric == "ns_per_elem_core":
            return f"{self.peer} in-cache ns/element/core"
        if self.metric == "marginal_ns_per_elem_core":
            return f"{self.peer} in-cache marginal ns/element/core"
        if self.metric == "fixed_over_wrapper_us":
            return f"{self.peer} fixed cost per step beyond torch's Optimizer.step wrapper, us"
        return f"{self.peer} {self.metric} ({self.mode})"

    def definition(self) -> Dict[str, object]:
        return dict(asdict(self), what=self.describe(), target=f"{self.op} {self.value:g}")

    def score(self, actual: Optional[float]) -> Dict[str, object]:
        met = None if actual is None else bool(_OPS[self.op](actual, self.value))
        return dict(self.definition(), actual=actual, met=met)


TARGETS: List[Target] = [
    Target("W1", "pct_ceiling", ">=", 85.0),
    Target("W1", "ratio", ">=", 1.05, peer="fused_ema"),
    Target("W2", "ratio", ">=", 10.0, peer="fused_ema", mode="burst"),
    Target("W3", "ratio", ">=", 1.5, peer="mp_fused_ema"),
    Target("S", "ratio", ">=", 1.1, peer="fused_ema"),
    Target("S3", "ratio", ">=", 1.1, peer="mp_fused_ema"),
    Target("in_cache", "ns_per_elem_core", "<=", 0.5),
    Target("in_cache", "marginal_ns_per_elem_core", "<=", 0.5),
    Target("in_cache", "marginal_ns_per_elem_core", "<=", 0.5, peer="ours_kernel"),
    Target("in_cache", "fixed_over_wrapper_us", "<=", 10.0),
]


def targets_for(workload: str) -> List[Target]:
    return [t for t in TARGETS if t.workload == workload]


def score_workload(workload: str,
                   by_mode: Dict[str, Optional[Dict[str, object]]]) -> List[Dict[str, object]]:
    """Score one workload at one thread count; ``by_mode[mode]["peers"][peer]`` holds the figures."""
    scored = []
    for t in targets_for(workload):
        timing = by_mode.get(t.mode)
        peer = (timing or {}).get("peers", {}).get(t.peer)
        actual = None
        if peer is not None:
            actual = peer.get("ratio_vs_ours") if t.metric == "ratio" else peer.get("pct_of_ceiling")
        scored.append(t.score(actual))
    return scored
