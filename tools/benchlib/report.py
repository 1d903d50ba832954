"""Printing the results as tables, and the JSON document that holds every number.

JSON layout (``--json PATH``)
  machine            versions, CPU, caches, backend, load averages
  settings           hyperparameters, thread counts, rounds, argv
  byte_models, ceiling_method, memory_method, peer_descriptions
  target_definitions the targets as data (workload, metric, op, value, peer, mode)
  skipped_peers      {peer: why} for peers that could not run (DeepSpeed missing, ...)
  workloads.<W>      shapes summary, byte model, per-peer memory and sanity check, seconds per
                     phase (setup, warmup, ceiling, timing, memory, check), and
    by_threads.<n>   for each thread count n: other_processes_cores (cores other processes
                     kept busy meanwhile), ceiling {gbps, best_op, ops{op: gbps, ...}},
                     interleaved / burst {rounds, peers{peer: median_s, p10_s, p90_s,
                     ratio_vs_ours, effective_gbps, pct_of_ceiling, times_s, ...}}, targets
  in_cache           ns/element/core per peer on an L2-resident tensor, 1 thread, targets
  targets            every scored target in one list (workload, threads, actual, met)
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional

from torch.utils import benchmark

from . import config, memory, targets
from .measure import CEILING_METHOD
from .peers import DESCRIPTIONS


NOISY_CORES = 0.2


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_header(info: Dict[str, object], threads_list: List[int]) -> None:
    caches = ", ".join(f"{k} {v >> 10} KiB" for k, v in info["cpu_caches_bytes"].items())
    print(f"torch {info['torch_version']} | CPU capability {info['cpu_capability']} | "
          f"{info['cpu_model']} ({info['cpu_count']} CPUs; {caches or 'caches unknown'})")
    print(f"fused_ema_adamw backend on cpu: {info['backend']} | thread counts: "
          f"{', '.join(map(str, threads_list))}")


def _target_note(scored: List[Dict[str, object]], peer: str, mode: str) -> str:
    for t in scored:
        if t["metric"] == "ratio" and t["peer"] == peer and t["mode"] == mode:
            return f">={t['value']:g}"
    return ""


def print_compare(found: List[benchmark.Measurement]) -> None:
    """The step times as ``torch.utils.benchmark.Compare`` tables: one per workload, a row per
    peer and thread count, a column per timing mode (medians; the in-place ops of the ceiling
    as ``ceiling:*`` rows)."""
    if not found:
        return
    benchmark.Compare(found).print()


def print_workload(name: str, res: Dict[str, object]) -> None:
    print(f"\n== {name}: {res['description']} | {res['n_tensors']} tensors, {res['numel']:,} "
          f"elements | {res['bytes_per_step'] / 1e9:.3f} GB/step")
    print(f"   byte model: {res['byte_model']}")
    for n, entry in res["by_threads"].items():
        ceil = entry["ceiling"]
        ops = ", ".join(f"{op} {o['gbps']:.1f}" for op, o in ceil["ops"].items())
        print(f"\n   -- {n} thread(s): ceiling {ceil['gbps']:.1f} GB/s = max({ops}) GB/s, "
              f"medians in the interleaved rounds (best single repetition "
              f"{ceil['best_rep_gbps']:.1f} GB/s)")
        foreign = entry["other_processes_cores"]
        if foreign is not None and foreign > NOISY_CORES:
            print(f"   NOISY: other processes kept {foreign:.2f} cores busy during these rounds")
        inter, burst = entry["interleaved"], entry["burst"]
        head = (f"   {'peer':<17} {'p10..p90 ms':>19} {'peer/ours':>9} "
                f"{'target':>7} {'GB/s':>7} {'%ceil':>6}")
        if burst:
            head += f" | {'burst':>5} {'peer/ours':>9} {'target':>7} {'%ceil':>6}"
        print(f"   interleaved: {inter['rounds']} rounds" + (
            f" | burst: {burst['rounds']} rounds of Timer.timeit({burst['steps_per_block']}), "
            f"2 warm-up steps + {burst['steps_per_block']} back-to-back" if burst else "")
            + "; medians in the Compare table")
        print(head)
        print("   " + "-" * (len(head) - 3))
        for peer, r in inter["peers"].items():
            row = (f"   {peer:<17} "
                   f"{r['p10_s'] * 1e3:>9.3f}..{r['p90_s'] * 1e3:<8.3f} "
                   f"{_fmt(r['ratio_vs_ours'], '.2f'):>8}x "
                   f"{_target_note(entry['targets'], peer, 'interleaved'):>7} "
                   f"{r['effective_gbps']:>7.1f} {_fmt(r['pct_of_ceiling'], '.1f'):>6}")
            if burst:
                b = burst["peers"][peer]
                row += (f" | {'':>5} {_fmt(b['ratio_vs_ours'], '.2f'):>8}x "
                        f"{_target_note(entry['targets'], peer, 'burst'):>7} "
                        f"{_fmt(b['pct_of_ceiling'], '.1f'):>6}")
            print(row)
        for t in entry["targets"]:
            print(f"   target ({n} thread(s)): {t['what']} {t['target']} -> "
                  f"{_fmt(t['actual'], '.2f', 'n/a')} ({_met(t['met'])})")
    print(f"\n   {'peer':<17} {'rss MB':>8} {'torch MB':>9} {'max|dp|':>9} {'max|dema|':>9}   "
          f"(peak extra memory of one step; max abs difference from ours after the same steps)")
    for peer, r in res["peers"].items():
        mem = r["peak_extra_mb"] or {}
        chk = r["check"] or {}
        finite = "" if chk.get("all_finite", True) else "  NON-FINITE params"
        print(f"   {peer:<17} {_fmt(mem.get('rss_mb'), '.1f'):>8} {_fmt(mem.get('torch_mb'), '.1f'):>9} "
              f"{_fmt(chk.get('max_abs_diff_param_vs_ours'), '.1e'):>9} "
              f"{_fmt(chk.get('max_abs_diff_ema_vs_ours'), '.1e'):>9}{finite}")


def _met(met: Optional[bool]) -> str:
    return "n/a" if met is None else ("met" if met else "NOT met")


def print_in_cache(res: Dict[str, object]) -> None:
    l2 = f"{res['l2_bytes'] >> 10} KiB L2" if res["l2_bytes"] else "L2 size unknown"
    foreign = res["other_processes_cores"]
    print(f"\n== in-cache compute: one fp32 tensor of {res['numel']:,} elements "
          f"({res['working_set_bytes'] / 1024:.0f} KiB working set, {l2}), {res['threads']} thread, "
          f"{res['steps']} steps; marginal = from the {res['small_numel']:,}-element run")
    if foreign is not None and foreign > NOISY_CORES:
        print(f"   NOISY: other processes kept {foreign:.2f} cores busy meanwhile")
    print(f"   {'peer':<15} {'step us':>9} {'ns/elem/core':>13} {'marginal ns':>12} "
          f"{'fixed us':>9}  what")
    for name, r in res["peers"].items():
        print(f"   {name:<15} {r['step_s'] * 1e6:>9.2f} {r['ns_per_elem_core']:>13.3f} "
              f"{_fmt(r['marginal_ns_per_elem_core'], '.3f'):>12} "
              f"{_fmt(r['fixed_overhead_us'], '.2f'):>9}  {r['description']}")
    ours = res["peers"].get("ours", {})
    if ours.get("tiny_step_us") is not None:
        print(f"   fixed cost: a 16-element FusedEmaAdamW step {ours['tiny_step_us']:.2f} us, torch's "
              f"Optimizer.step wrapper alone {ours['wrapper_step_us']:.2f} us "
              f"(+{ours['fixed_over_wrapper_us']:.2f} us)")
    for t in res["targets"]:
        print(f"   target: {t['what']} {t['target']} -> {_fmt(t['actual'], '.3f', 'n/a')} "
              f"({_met(t['met'])})")


def all_targets(workloads: Dict[str, Dict[str, object]], incache: Optional[Dict[str, object]]):
    scored = []
    for entry_w in workloads.values():
        for entry in entry_w["by_threads"].values():
            scored += entry["targets"]
    if incache:
        scored += incache["targets"]
    return scored


def print_summary(scored: List[Dict[str, object]]) -> None:
    if not scored:
        return
    print("\n== targets (printed, never asserted)")
    for t in scored:
        print(f"   {t['workload']:<8} {t['threads']} thr  {t['what']:<42} {t['target']:>8}  "
              f"actual {_fmt(t['actual'], '.3f', 'n/a'):>8}  {_met(t['met'])}")


def payload(info, settings, workloads, incache, skipped, total_s) -> Dict[str, object]:
    return {
        "machine": info,
        "settings": settings,
        "byte_models": config.BYTE_MODELS,
        "ceiling_method": CEILING_METHOD,
        "memory_method": memory.METHOD,
        "peer_descriptions": DESCRIPTIONS,
        "target_definitions": [t.definition() for t in targets.TARGETS],
        "skipped_peers": skipped,
        "workloads": workloads,
        "in_cache": incache,
        "targets": all_targets(workloads, incache),
        "total_s": total_s,
    }


def write_json(path: str, doc: Dict[str, object]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")


def write_plot(path: str, workloads: Dict[str, Dict[str, object]], info: Dict[str, object]) -> None:
    """``--plot PATH``: step time and % of the ceiling per workload and peer (benchlib.plot)."""
    from .plot import write_plot as plot
    why_not = plot(path, workloads, info)
    print(f"plot: {why_not}" if why_not else f"wrote {path}")
