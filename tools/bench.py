#!/usr/bin/env python3
"""Benchmark FusedEmaAdamW against the best ways PyTorch, MindSpeed and DeepSpeed do AdamW + EMA.

What is measured, in one process, for each workload and each thread count (torch.set_num_threads):
  * every peer's step time, interleaved round by round (each step follows the other peers'
    steps) and, where enabled, in bursts of back-to-back steps (data and threads warm);
  * the ceiling: the best bandwidth of in-place streaming ops (torch's fused AdamW step,
    _foreach_lerp_, _foreach_add_) on the same workload tensors, counting the bytes each op
    really moves, measured in the same run at the same thread count;
  * each peer's effective GB/s = bytes the fused AdamW + EMA update must move (36 B/element,
    fp32 or bf16 + fp32 masters) / median step time, and that as a % of the ceiling;
  * peak extra memory of one step and a check that every peer ends where ours does.
Then an in-cache compute figure: ns per element per core on one L2-resident tensor, 1 thread.

Workloads: W1 GPT-2-small fp32 (148 tensors, 124M elements), W2 3000 small fp32 tensors,
W3 GPT-2-small bf16 params + fp32 masters, S 6 x 50,000 fp32, S3 the same in bf16 + masters.
Peers: ours (FusedEmaAdamW), torch AdamW fused / foreach + _foreach_lerp_ EMA, the per-tensor
npu_apply_fused_ema_adamw loop (MindSpeed), DeepSpeedCPUAdam + lerp when DeepSpeed imports;
for bf16 workloads the composed mixed-precision recipe around each of them.
Every time is taken with torch.utils.benchmark (a Timer per peer; Measurements merged over the
rounds; the medians printed as Compare tables); the derived figures are printed beside them.
Targets are data (tools/benchlib/targets.py), printed beside the numbers, never asserted.
The parts live in tools/benchlib/: workloads, peers, measure, memory, machine, report.

Usage
  python tools/bench.py                                  # everything, about 5 min on 2 cores
  python tools/bench.py --workloads S,W2 --rounds 5      # a quick look
  python tools/bench.py --workloads W1 --threads-list 2 --json bench.json --plot bench.png
  python tools/bench.py --quick                          # every workload, short (a few minutes)
  python tools/bench.py --quick --workloads S,W2 --w2-tensors 100 --json /tmp/b.json   # smoke
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.dirname(os.path.abspath(__file__))
for _path in (ROOT, TOOLS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # silence the profiler's start/stop lines
import torch  # noqa: E402

from benchlib import config, machine, measure, memory, peers, report  # noqa: E402
from benchlib.workloads import NAMES, make_workload  # noqa: E402


def parse_threads(text: str) -> List[int]:
    counts: List[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        n = int(part)
        if n < 1:
            raise ValueError(f"thread count must be >= 1, got {n}")
        if n not in counts:
            counts.append(n)
    if not counts:
        raise ValueError("no thread count given")
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 1)[1])
    parser.add_argument("--workloads", default="W1,W2,W3,S,S3",
                        help=f"comma list of {','.join(NAMES)} (default: all)")
    parser.add_argument("--peers", default=None,
                        help="comma list of peers (default: all that apply and can run; 'ours' "
                             f"is always added): {', '.join(peers.DESCRIPTIONS)}")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per workload, thread count and timing mode (default: " +
                             ", ".join(f"{w} {r}" for w, r in config.DEFAULT_ROUNDS.items()) +
                             "; each capped by --budget)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of timed rounds per workload, thread count and mode before "
                             "stopping early (default: " +
                             ", ".join(f"{w} {b:g}" for w, b in config.DEFAULT_BUDGET_S.items()) +
                             f"; at least {config.MIN_ROUNDS} rounds always run)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up steps per peer at each thread count")
    parser.add_argument("--w2-tensors", type=int,
                        default=int(os.environ.get("BENCH_W2_TENSORS", "3000")),
                        help="number of W2 tensors (default 3000, env BENCH_W2_TENSORS)")
    parser.add_argument("--threads", type=int, default=None,
                        help="one thread count, same as --threads-list N")
    parser.add_argument("--threads-list", default=None,
                        help="comma list of thread counts to run every workload at (default: "
                             "1 and torch.get_num_threads(), deduplicated)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory steps")
    parser.add_argument("--burst", type=int, default=None, metavar="N",
                        help="back-to-back steps per peer per round in the burst mode, timed as "
                             "one block by Timer.timeit(N) after its 2 warm-up steps; N >= 1 runs "
                             "it for every workload, 0 turns it off (default: " +
                             ", ".join(f"{w} {b}" for w, b in config.DEFAULT_BURST.items()) +
                             ", the others off)")
    parser.add_argument("--no-incache", action="store_true",
                        help="skip the in-cache compute figure")
    parser.add_argument("--incache-numel", type=int, default=None,
                        help="elements of the in-cache tensor (default: the largest power of two "
                             "whose working set fits in 3/4 of L2)")
    parser.add_argument("--incache-steps", type=int, default=None,
                        help="steps per in-cache measurement, in Timer.timeit blocks of 100 "
                             f"(default {config.INCACHE_STEPS})")
    parser.add_argument("--quick", action="store_true",
                        help="short run: %(rounds)d rounds, %(warmup)d warm-up step, ceiling "
                             "blocks of min_run_time %(ceiling_s)g s, bursts of %(burst)d, "
                             "%(incache_steps)d in-cache steps" % config.QUICK)
    parser.add_argument("--json", metavar="PATH", default=None, help="write all numbers as JSON")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="write a PNG of step times and %% of the ceiling (needs matplotlib)")
    return parser


def run_lengths(args: argparse.Namespace, workload: str) -> Dict[str, float]:
    """Rounds, warm-up steps, budget, burst and ceiling min_run_time for one workload."""
    quick = config.QUICK if args.quick else None

    def pick(given, key: str, defaults: Dict[str, float]):
        if given is not None:
            return given
        return quick[key] if quick else defaults[workload]

    if args.burst is not None:
        burst = args.burst
    elif workload in config.DEFAULT_BURST:
        burst = pick(None, "burst", config.DEFAULT_BURST)
    else:
        burst = 0
    return {
        "rounds": max(1, pick(args.rounds, "rounds", config.DEFAULT_ROUNDS)),
        "warmup": max(0, pick(args.warmup, "warmup", config.DEFAULT_WARMUP)),
        "budget_s": args.budget if args.budget is not None else config.DEFAULT_BUDGET_S[workload],
        "burst": max(0, burst),
        "ceiling_s": max(0.0, pick(None, "ceiling_s", config.CEILING_MIN_RUN_S)),
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    workloads = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in NAMES:
            parser.error(f"unknown workload {w!r}; choose from {', '.join(NAMES)}")
    wanted = None
    if args.peers:
        wanted = {p.strip() for p in args.peers.split(",") if p.strip()} | {"ours"}
        unknown = wanted - set(peers.DESCRIPTIONS)
        if unknown:
            parser.error(f"unknown peers {sorted(unknown)}; choose from {sorted(peers.DESCRIPTIONS)}")
    if args.threads is not None and args.threads_list is not None:
        parser.error("give --threads or --threads-list, not both")
    try:
        if args.threads is not None:
            threads_list = parse_threads(str(args.threads))
        elif args.threads_list is not None:
            threads_list = parse_threads(args.threads_list)
        else:
            threads_list = parse_threads(f"1,{torch.get_num_threads()}")
    except ValueError as exc:
        parser.error(str(exc))
    default_threads = torch.get_num_threads()

    info = machine.machine_info()
    report.print_header(info, threads_list)
    print(f"memory method: {memory.METHOD}")
    machine.warn_if_busy("start", info["loadavg_start"])
    t_run = time.perf_counter()
    foreign = machine.ForeignLoad()

    plans = {w: [p for p in peers.peers_for(w) if wanted is None or p in wanted] for w in workloads}
    requested = {p for names in plans.values() for p in names}
    skipped = {}
    if peers.DEEPSPEED_PEERS & requested:
        print("deepspeed: importing with DS_ACCELERATOR=cpu and loading its CPU Adam op "
              "(the first use compiles it, about a minute) ...", flush=True)
        adam, note = peers.deepspeed_adam()
        info["deepspeed"] = note if adam is not None else None
        if adam is not None:
            print(f"deepspeed: {note}, DeepSpeedCPUAdam loaded")
        else:
            skipped = {name: note for name in sorted(peers.DEEPSPEED_PEERS & requested)}
            for name in skipped:
                print(f"peer {name}: skipped, DeepSpeed unavailable ({note})")
    with_deepspeed = bool(peers.DEEPSPEED_PEERS & requested) and not skipped

    results = {}
    compare = []
    for w in workloads:
        names = [p for p in plans[w] if p not in skipped]
        if "ours" not in names:
            names.insert(0, "ours")
        wl = make_workload(w, args.w2_tensors)
        results[w] = measure.run_workload(wl, names, threads_list, **run_lengths(args, w),
                                          measure_memory=not args.no_memory)
        compare += results[w].pop("compare")
        del wl
        gc.collect()
        memory.malloc_trim()
    torch.set_num_threads(default_threads)

    incache = None
    if not args.no_incache:
        numel = args.incache_numel or measure.default_incache_numel(info["cpu_caches_bytes"])
        steps = args.incache_steps or (config.QUICK["incache_steps"] if args.quick
                                       else config.INCACHE_STEPS)
        print(f"\n[in-cache] {numel:,} elements, {steps} steps per peer, 1 thread ...", flush=True)
        incache = measure.in_cache(numel, steps, with_deepspeed, info["cpu_caches_bytes"])
    total = time.perf_counter() - t_run
    info["loadavg_end"] = machine.loadavg()
    info["other_processes_cores"] = foreign.cores()

    print(f"\n######## results | backend: {info['backend']} | torch {info['torch_version']} | "
          f"threads {', '.join(map(str, threads_list))} | {info['cpu_capability']} ########")
    print("peer/ours > 1 means ours is faster. GB/s = byte-model bytes / median, for every peer;")
    print(f"%ceil against the ceiling: {measure.CEILING_METHOD}")
    report.print_compare(compare)
    for w, res in results.items():
        report.print_workload(w, res)
    if incache:
        report.print_in_cache(incache)
    scored = report.all_targets(results, incache)
    report.print_summary(scored)
    print(f"\ntotal run time {total:.1f} s")
    other = info["other_processes_cores"]
    if other is not None:
        print(f"other processes kept {other:.2f} cores busy on average during the run"
              + (" (NOISY: timings are not trustworthy)" if other > report.NOISY_CORES else ""))

    if args.json:
        settings = {"lr": config.LR, "betas": list(config.BETAS), "eps": config.EPS,
                    "weight_decay": config.WEIGHT_DECAY, "ema_decay": config.EMA_DECAY,
                    "threads_list": threads_list, "quick": args.quick, "burst": args.burst,
                    "rounds": args.rounds, "budget_s": args.budget, "warmup": args.warmup,
                    "w2_tensors": args.w2_tensors, "workloads": workloads,
                    "argv": sys.argv[1:] if argv is None else list(argv)}
        report.write_json(args.json, report.payload(info, settings, results, incache, skipped, total))
    if args.plot:
        report.write_plot(args.plot, results, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
