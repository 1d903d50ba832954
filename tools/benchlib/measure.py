"""Timing: peers' step times, the in-place streaming ceiling, and the in-cache compute figure.

Every figure comes from ``torch.utils.benchmark``: each peer is a ``Timer`` (label = workload,
sub_label = peer, description = mode and threads, ``num_threads`` = the thread count) and each
result a ``Measurement`` (median, IQR, the per-step times), merged over rounds with
``Measurement.merge`` and printed by ``Compare``. The timer function is torch's, which
synchronizes an accelerator before reading the clock.

Peer timing. All peers of a workload live in one process and are timed round by round; the
order rotates each round, so machine noise (frequency, other tenants, page cache) hits all
peers alike. Two modes:
  interleaved  each round steps every peer once; every step starts with caches holding the
               previous peer's data. One step per timing (``timeit.Timer(step).timeit(1)``, the
               loop torch's Timer wraps, garbage collection off meanwhile): the Timer's own
               ``timeit`` and ``blocked_autorange`` warm up with steps of the same peer first,
               which is what this mode must not do; the round-robin has no ecosystem equivalent.
  burst        each round runs ``Timer.timeit(N)`` per peer: its two warm-up steps, then N
               back-to-back steps timed as one block (a time is the block's mean per step);
               data and threads are warm, as in a training loop where the optimizer step
               follows the backward pass of the same model. Every peer takes the same number of
               steps (``blocked_autorange`` would choose a block size per peer), so the check
               that every peer ends where ours does stays meaningful.
Reported per peer: median, p10, p90 (linear interpolation, as the Measurement's quartiles),
peer median / ours median (> 1: ours is faster), effective GB/s = the byte model's bytes (what
the fused update must move, the same for every peer) / median, and that as a % of the ceiling.

Ceiling. The bandwidth of in-place streaming ops on the workload's own tensor list (fp32
copies of its params; the fp32 masters' shapes for bf16 workloads) and its grads, counting the
bytes each op really moves:
  adamw_fused   torch.optim.AdamW(fused=True).step()   28 B/element: grad 4r, param/m/v 4r4w
  foreach_lerp  torch._foreach_lerp_(a, b, w)          12 B/element: a 4r4w, b 4r
  foreach_add   torch._foreach_add_(a, b)              12 B/element: a 4r4w, b 4r
The ops run INSIDE the interleaved rounds, as three more "peers", so the ceiling is measured
with the same statistic and under the same conditions as the peers: each op's median over the
rounds; the ceiling is the highest of the three median bandwidths. (This machine's memory speed
changes between rounds, by up to 1.8x: a best-of ceiling against the peers' medians would
compare a fast moment with a typical one.) The fastest block of a ``blocked_autorange`` of each
op, before and after the rounds, is reported beside it. These ops own their tensors, so they
never disturb a peer's state. On large workloads the ceiling is DRAM bandwidth; on small ones
(S, W2) the data sits in cache and W2's 3000 tensors make the ops pay per-tensor overhead, so
there a fused step can reach more than 100% of it.

In-cache compute. One fp32 tensor small enough that param, grad, m, v and EMA stay in L2, one
thread, blocks of 100 steps (``Timer.timeit(100)``); the step time is the fastest block's mean
(interference only adds time). ns per element per core = step time * threads / elements. This is the
arithmetic cost when memory is not the limit. The same steps on a tensor a quarter the size
give the marginal cost per element, i.e. without the fixed per-step overhead (Python, the
dispatcher, launching), which is printed beside it.
"""
from __future__ import annotations

import gc
import time
import timeit
from typing import Callable, Dict, List, Optional

import torch
from torch.utils import benchmark

import fused_optim

from . import config, machine, memory, targets
from .config import BETAS, EMA_DECAY, EPS, LR, WEIGHT_DECAY
from .peers import DESCRIPTIONS, Peer, deepspeed_adam, make_peer, max_abs_diff
from .workloads import Workload

CEILING_METHOD = ("highest median bandwidth of in-place streaming ops on the workload's fp32 "
                  "tensors, timed inside the interleaved rounds, bytes each really moves: torch "
                  "AdamW(fused=True) step 28 B/elem, _foreach_lerp_(a, b, w) 12 B/elem, "
                  "_foreach_add_(a, b) 12 B/elem; same run, same thread count")


def make_timer(step: Callable[[], None], label: str, sub_label: str, description: str,
               threads: int) -> benchmark.Timer:
    return benchmark.Timer(stmt="step()", globals={"step": step}, label=label,
                           sub_label=sub_label, description=description, num_threads=threads)


def summarize(m: benchmark.Measurement) -> Dict[str, object]:
    """A Measurement's figures for the JSON document: per-step times and their statistics."""
    ts = torch.tensor(m.times, dtype=torch.float64)
    return {"median_s": m.median, "min_s": ts.min().item(), "mean_s": m.mean,
            "p10_s": ts.quantile(0.10).item(), "p90_s": ts.quantile(0.90).item(),
            "iqr_s": m.iqr, "times_s": list(m.times)}


def time_rounds(steps: Dict[str, Callable[[], None]], rounds: int, budget_s: float, *,
                label: str, threads: int, burst: int = 0) -> Dict[str, object]:
    """Round-robin timing, Measurements merged per peer; ``burst`` 0: one timed step per peer
    per round (interleaved); N: ``Timer.timeit(N)`` per peer per round (burst)."""
    mode = "burst" if burst else "interleaved"
    description = mode
    order = list(steps)
    timers = {name: make_timer(step, label, name, description, threads)
              for name, step in steps.items()}
    specs = {name: benchmark.TaskSpec(stmt="step()", setup="pass", label=label, sub_label=name,
                                      description=description, num_threads=threads)
             for name in steps}
    clocks = {name: timeit.Timer(step, timer=benchmark.timer) for name, step in steps.items()}
    found: List[benchmark.Measurement] = []
    gc.collect()
    t_start = time.perf_counter()
    done = 0
    for r in range(rounds):
        k = r % len(order)
        for name in order[k:] + order[:k]:
            if burst:
                found.append(timers[name].timeit(burst))
            else:
                found.append(benchmark.Measurement(1, [clocks[name].timeit(1)], specs[name]))
        done = r + 1
        if done >= config.MIN_ROUNDS and time.perf_counter() - t_start > budget_s:
            break
    merged = {m.task_spec.sub_label: m for m in benchmark.Measurement.merge(found)}
    timed_steps = {name: 0 for name in steps}
    for m in found:
        timed_steps[m.task_spec.sub_label] += m.number_per_run * len(m.raw_times)
    return {"rounds": done, "mode": mode, "steps_per_block": burst or 1,
            "timed_steps": timed_steps, "wall_s": time.perf_counter() - t_start,
            "measurements": {name: merged[name] for name in order}}


class CeilingOps:
    """In-place streaming ops over fp32 tensors shaped like the workload's; see the module doc."""

    BYTES_PER_ELEMENT = {"adamw_fused": 28, "foreach_lerp": 12, "foreach_add": 12}

    def __init__(self, wl: Workload):
        self.numel = wl.numel
        self.params = wl.new_fp32_params()
        self.grads = wl.fp32_grads()
        for p, g in zip(self.params, self.grads):
            p.grad = g
        self.opt = torch.optim.AdamW(self.params, lr=LR, betas=BETAS, eps=EPS,
                                     weight_decay=WEIGHT_DECAY, fused=True)
        weight = 1.0 - EMA_DECAY
        self.ops: Dict[str, Callable[[], None]] = {
            "adamw_fused": self.opt.step,
            "foreach_lerp": lambda: torch._foreach_lerp_(self.params, self.grads, weight),
            "foreach_add": lambda: torch._foreach_add_(self.params, self.grads),
        }
        self.best_s = {name: float("inf") for name in self.ops}
        self.reps = 0
        with torch.no_grad():
            for op in self.ops.values():
                op()

    def measure(self, min_run_time_s: float, threads: int) -> None:
        """The fastest block of a ``Timer.blocked_autorange`` of every op."""
        for name, op in self.round_steps().items():
            m = make_timer(op, "ceiling", name, f"{threads} thr", threads).blocked_autorange(
                min_run_time=min_run_time_s)
            self.best_s[name[len(self.PREFIX):]] = min(self.best_s[name[len(self.PREFIX):]],
                                                       min(m.times))
            self.reps += m.number_per_run * len(m.raw_times)

    PREFIX = "ceiling:"

    def round_steps(self) -> Dict[str, Callable[[], None]]:
        """The ops as steps for the interleaved rounds (names prefixed with ``ceiling:``)."""
        def no_grad(op):
            def step():
                with torch.no_grad():
                    op()
            return step
        return {self.PREFIX + name: no_grad(op) for name, op in self.ops.items()}

    def result(self, rounds: Dict[str, benchmark.Measurement]) -> Dict[str, object]:
        """The ceiling from the ops' median times in the rounds (``rounds`` holds the
        ``ceiling:*`` Measurements, removed from it here); fastest blocks beside them."""
        ops = {}
        for name, best in self.best_s.items():
            nbytes = self.BYTES_PER_ELEMENT[name] * self.numel
            median = rounds.pop(self.PREFIX + name).median
            ops[name] = {"bytes_per_element": self.BYTES_PER_ELEMENT[name], "bytes_per_step": nbytes,
                         "median_s": median, "gbps": nbytes / median / 1e9,
                         "best_s": best, "best_gbps": nbytes / best / 1e9, "reps": self.reps}
        best_op = max(ops, key=lambda n: ops[n]["gbps"])
        return {"gbps": ops[best_op]["gbps"], "best_op": best_op,
                "best_rep_gbps": max(op["best_gbps"] for op in ops.values()), "ops": ops}

    def reset(self) -> None:
        self.best_s = {name: float("inf") for name in self.ops}
        self.reps = 0


def _peer_figures(wl: Workload, timing: Dict[str, object], ceiling_gbps: float,
                  compare: List[benchmark.Measurement]) -> Dict[str, object]:
    found = timing.pop("measurements")
    compare += found.values()
    ours = found["ours"].median if "ours" in found else None
    peers = {}
    for name, m in found.items():
        fig = summarize(m)
        fig["timed_steps"] = timing["timed_steps"][name]
        gbps = wl.bytes_per_step / fig["median_s"] / 1e9
        fig["ratio_vs_ours"] = fig["median_s"] / ours if ours else None
        fig["effective_gbps"] = gbps
        fig["pct_of_ceiling"] = 100.0 * gbps / ceiling_gbps if ceiling_gbps else None
        peers[name] = fig
    timing["peers"] = peers
    del timing["timed_steps"]
    return timing


class _PhaseClock:
    """Seconds spent per phase of a workload (setup, warmup, ceiling, timing, memory, check)."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._t
        self._t = now


def _checks(peers: Dict[str, Peer]) -> Dict[str, Dict[str, object]]:
    """Every peer took the same steps: its params and EMA should match ours to rounding."""
    if "ours" not in peers:
        return {}
    ours = peers["ours"]
    return {name: {
        "max_abs_diff_param_vs_ours": max_abs_diff(peer.model_params(), ours.model_params()),
        "max_abs_diff_ema_vs_ours": max_abs_diff(peer.emas(), ours.emas()),
        "all_finite": all(bool(torch.isfinite(p).all()) for p in peer.model_params()),
    } for name, peer in peers.items()}


def run_workload(wl: Workload, peer_names: List[str], threads_list: List[int], *, rounds: int,
                 warmup: int, budget_s: float, burst: int, ceiling_s: float,
                 measure_memory: bool) -> Dict[str, object]:
    """Time every peer of ``wl`` at each thread count; see the module doc for what is measured."""
    print(f"\n[{wl.name}] {wl.description}: {len(wl.shapes)} tensors, {wl.numel:,} elements; "
          f"setting up {len(peer_names)} peers and the ceiling ops ...", flush=True)
    clock = _PhaseClock()
    peers: Dict[str, Peer] = {name: make_peer(name, wl) for name in peer_names}
    ceiling = CeilingOps(wl)
    steps = {name: peer.step for name, peer in peers.items()}
    clock.lap("setup")
    by_threads: Dict[str, object] = {}
    compare: List[benchmark.Measurement] = []
    for n in threads_list:
        torch.set_num_threads(n)
        foreign = machine.ForeignLoad()
        for step in steps.values():
            for _ in range(warmup):
                step()
        clock.lap("warmup")
        ceiling.reset()
        ceiling.measure(ceiling_s, n)
        clock.lap("ceiling")
        inter = time_rounds(dict(steps, **ceiling.round_steps()), rounds, budget_s,
                            label=wl.name, threads=n)
        back = (time_rounds(steps, rounds, budget_s, label=wl.name, threads=n, burst=burst)
                if burst else None)
        clock.lap("timing")
        ceiling.measure(ceiling_s, n)
        clock.lap("ceiling")
        ceil = ceiling.result(inter["measurements"])
        entry = {"threads": n, "warmup_steps": warmup, "other_processes_cores": foreign.cores(),
                 "ceiling": ceil,
                 "interleaved": _peer_figures(wl, inter, ceil["gbps"], compare),
                 "burst": _peer_figures(wl, back, ceil["gbps"], compare) if back else None}
        entry["targets"] = [dict(t, threads=n) for t in targets.score_workload(wl.name, entry)]
        by_threads[str(n)] = entry
        line = (f"[{wl.name}] {n} thread(s): ceiling {ceil['gbps']:.1f} GB/s ({ceil['best_op']}); "
                f"{inter['rounds']} interleaved rounds in {inter['wall_s']:.1f} s")
        if back:
            line += (f", {back['rounds']} burst rounds of Timer.timeit({burst}) "
                     f"in {back['wall_s']:.1f} s")
        if entry["other_processes_cores"] is not None:
            line += f"; other processes kept {entry['other_processes_cores']:.2f} cores busy"
        print(line, flush=True)
    del ceiling

    mem: Dict[str, Dict[str, Optional[float]]] = {}
    if measure_memory:
        for name, peer in peers.items():
            mem[name] = {"rss_mb": memory.rss_peak_extra_mb(peer.step),
                         "torch_mb": memory.torch_peak_extra_mb(peer.step)}
        clock.lap("memory")
    checks = _checks(peers)
    per_peer = {name: {"description": DESCRIPTIONS[name], "peak_extra_mb": mem.get(name),
                       "check": checks.get(name)} for name in peers}
    peers.clear()
    steps.clear()
    gc.collect()
    memory.malloc_trim()
    clock.lap("check")
    wall_s = sum(clock.seconds.values())
    print(f"[{wl.name}] done in {wall_s:.1f} s (" +
          ", ".join(f"{k} {v:.1f}" for k, v in clock.seconds.items()) + ")", flush=True)
    return {
        "description": wl.description,
        "n_tensors": len(wl.shapes),
        "numel": wl.numel,
        "param_dtype": str(wl.param_dtype).replace("torch.", ""),
        "byte_model": config.BYTE_MODELS[wl.byte_model_key],
        "bytes_per_element": config.BYTES_PER_ELEMENT,
        "bytes_per_step": wl.bytes_per_step,
        "burst_steps": burst or None,
        "peers": per_peer,
        "by_threads": by_threads,
        "wall_s": wall_s,
        "phase_s": clock.seconds,
        "compare": compare,  # Measurements for the Compare table; bench.py takes them out
    }


def default_incache_numel(caches: Dict[str, int]) -> int:
    """The largest power of two whose in-cache working set fills at most 3/4 of L2."""
    l2 = caches.get("L2")
    if not l2:
        return config.INCACHE_FALLBACK_NUMEL
    n = 1024
    while 2 * n * config.INCACHE_BYTES_PER_ELEMENT <= 0.75 * l2:
        n *= 2
    return n


def _incache_steppers(numel: int, with_deepspeed: bool) -> Dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(99)

    def param():
        p = torch.empty(numel).normal_(0.0, 0.02, generator=gen)
        p.grad = torch.empty(numel).normal_(0.0, 1e-3, generator=gen)
        return p

    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    steppers: Dict[str, Callable[[], None]] = {}
    p = param()
    steppers["ours"] = fused_optim.FusedEmaAdamW([p], ema_decay=EMA_DECAY, **kw).step
    steppers["ours_kernel"] = _kernel_stepper(param())
    # torch.optim.Optimizer.step's wrapper alone (hooks, profiler record, no_grad): the fixed
    # cost every torch optimizer pays, measured the same way as ours
    steppers["torch_wrapper"] = _NoopOptimizer([param()]).step
    p = param()
    steppers["fused_adamw"] = torch.optim.AdamW([p], fused=True, **kw).step
    p = param()
    fused = torch.optim.AdamW([p], fused=True, **kw)
    params, emas = [p], [torch.zeros(numel)]

    def fused_ema() -> None:
        fused.step()
        torch._foreach_lerp_(emas, params, 1.0 - EMA_DECAY)
    steppers["fused_ema"] = fused_ema
    if with_deepspeed:
        adam, _ = deepspeed_adam()
        if adam is not None:
            p = param()
            steppers["deepspeed_adam"] = adam([p], adamw_mode=True, **kw).step
    return steppers


def _kernel_stepper(p: torch.Tensor) -> Callable[[], None]:
    """The fused_ema_adamw kernel alone: the backend's prepared bucket, bind + run per step, as
    the optimizer's step calls it, without the optimizer's Python (plans, hyperparameters,
    torch's step hooks), so the per-element compute shows apart from the per-step overhead."""
    from multi_tensor import rules, schema
    from multi_tensor.backends import registry

    lists = schema.AdamLists(grads=None, params=[p.detach()], exp_avgs=[torch.zeros_like(p)],
                             exp_avg_sqs=[torch.zeros_like(p)], emas=[p.detach().clone()])
    bucket = registry.backend_for("fused_ema_adamw", p.device).prepare_bucket(
        "fused_ema_adamw", lists, fused_optim.base.multi_tensor_applier.chunk_size)
    b1, b2 = BETAS
    scalars = rules.step_scalars(rules.AdamHyper(
        lr=LR, beta1=b1, beta2=b2, eps=EPS, weight_decay=WEIGHT_DECAY, decoupled=True,
        bias_correction=True, maximize=False, ema_decay=EMA_DECAY, rule=rules.ADAM), 10)
    noop, grads = torch.zeros(1, dtype=torch.int32), [p.grad]

    def step() -> None:
        bucket.bind(grads)
        bucket.run(noop, scalars, None, False)
    return step


class _NoopOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose step does nothing: what remains is torch's wrapper."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        return None


INCACHE_DESCRIPTIONS = {
    "torch_wrapper": "torch.optim.Optimizer.step's wrapper alone (a step that does nothing)",
    "ours": "FusedEmaAdamW step (AdamW + EMA)",
    "ours_kernel": "its kernel alone: prepared bucket bind + run (no optimizer Python)",
    "fused_adamw": "torch AdamW(fused=True) step (no EMA)",
    "fused_ema": "torch AdamW(fused=True) step + _foreach_lerp_ EMA",
    "deepspeed_adam": "DeepSpeedCPUAdam step (no EMA)",
}


@torch.no_grad()
def _per_step_s(step: Callable[[], None], name: str, steps: int, chunk: int = 100) -> float:
    """Per-step time of the fastest of ``steps // chunk`` blocks of ``chunk`` back-to-back steps
    (``Timer.timeit(chunk)``, two warm-up steps each): interference only adds time. Fixed-size
    blocks, where ``blocked_autorange`` would pick one block of thousands for a 10 us step and
    leave no fastest block to take on a busy machine."""
    chunk = max(1, min(chunk, steps))
    timer = make_timer(step, "in-cache", name, "1 thr", 1)
    return min(min(timer.timeit(chunk).times) for _ in range(max(1, steps // chunk)))


def in_cache(numel: int, steps: int, with_deepspeed: bool, caches: Dict[str, int]) -> Dict[str, object]:
    """ns/element/core of one step on a tensor that stays in L2, 1 thread; see the module doc."""
    threads = 1
    foreign = machine.ForeignLoad()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    small = max(1, numel // 4)
    try:
        large_steppers = _incache_steppers(numel, with_deepspeed)
        small_steppers = _incache_steppers(small, with_deepspeed)
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            peers = {}
            for name, step in large_steppers.items():
                t_large = _per_step_s(step, name, steps)
                t_small = _per_step_s(small_steppers[name], name, steps)
                marginal = max(0.0, (t_large - t_small) / (numel - small)) if numel > small else None
                fixed = None if marginal is None else t_large - marginal * numel
                peers[name] = {
                    "description": INCACHE_DESCRIPTIONS[name],
                    "step_s": t_large,
                    "ns_per_elem_core": t_large * threads / numel * 1e9,
                    "small_step_s": t_small,
                    "marginal_ns_per_elem_core": None if marginal is None else marginal * threads * 1e9,
                    "fixed_overhead_us": None if fixed is None else fixed * 1e6,
                }
        finally:
            if gc_was_enabled:
                gc.enable()
    finally:
        torch.set_num_threads(previous)
    # the fixed cost of our step beyond the wrapper every torch optimizer pays: a one-tensor
    # optimizer on a 16-element tensor (no per-element cost to speak of) against the wrapper
    # alone, both timed the same way, best of five
    tiny = torch.empty(16).normal_(0.0, 0.02)
    tiny.grad = torch.full_like(tiny, 1e-3)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ours_tiny = fused_optim.FusedEmaAdamW([tiny], lr=LR, betas=BETAS, eps=EPS,
                                              weight_decay=WEIGHT_DECAY, ema_decay=EMA_DECAY).step
        wrapper = _NoopOptimizer([torch.empty(16)]).step
        t_ours = min(_per_step_s(ours_tiny, "ours_tiny", steps) for _ in range(5))
        t_wrapper = min(_per_step_s(wrapper, "torch_wrapper", steps) for _ in range(5))
    finally:
        torch.set_num_threads(previous)
    if "ours" in peers:
        peers["ours"]["tiny_step_us"] = t_ours * 1e6
        peers["ours"]["wrapper_step_us"] = t_wrapper * 1e6
        peers["ours"]["fixed_over_wrapper_us"] = (t_ours - t_wrapper) * 1e6
    result = {"numel": numel, "small_numel": small, "threads": threads, "steps": steps,
              "working_set_bytes": numel * config.INCACHE_BYTES_PER_ELEMENT,
              "l2_bytes": caches.get("L2"), "other_processes_cores": foreign.cores(),
              "peers": peers}
    result["targets"] = []
    for t in targets.targets_for("in_cache"):
        fig = peers.get(t.peer)
        result["targets"].append(dict(t.score(fig.get(t.metric) if fig else None), threads=threads))
    return result
