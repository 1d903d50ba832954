"""The bench's picture (``tools/bench.py --plot PATH``): step time and % of the ceiling.

One column per thread count; top row: median step time per workload and peer (grouped bars, log
scale), the ceiling's time (the workload's bytes at the measured streaming bandwidth) as a black
line over each group and ``peer / ours`` above each peer's bar; bottom row: effective GB/s as a
% of that ceiling. Bars are the interleaved medians; where a workload also ran in bursts
(back-to-back steps) their medians are black markers. bf16 workloads' peers (``mp_*``, the
composed mixed-precision recipe) share the colour of their fp32 counterparts.

It reads only the numbers ``report.payload()`` stores under ``workloads``, imports neither torch
nor the package, so a saved JSON can be replotted:

    python tools/benchlib/plot.py bench.json bench.png

matplotlib is optional: without it nothing is written and the caller is told why.
"""
from __future__ import annotations

import json
import sys
from typing import Dict, List, Optional

# Colour and legend order by peer family; "mp_X" (bf16 + masters) is drawn as family X.
FAMILIES = {
    "ours": ("FusedEmaAdamW (ours)", "tab:green"),
    "fused_ema": ("torch AdamW(fused=True) + _foreach_lerp_ EMA", "tab:red"),
    "foreach_ema": ("torch AdamW(foreach=True) + _foreach_lerp_ EMA", "tab:orange"),
    "npu_loop": ("per-tensor npu_apply_fused_ema_adamw loop (MindSpeed)", "tab:purple"),
    "deepspeed_ema": ("DeepSpeedCPUAdam + _foreach_lerp_ EMA", "tab:brown"),
}


PCT_CAP = 150.0  # the % axis stops here; higher bars are clipped and labelled


def family(peer: str) -> str:
    return peer[3:] if peer.startswith("mp_") else peer


def _families_in(workloads: Dict[str, dict]) -> List[str]:
    seen = {family(p) for w in workloads.values() for e in w["by_threads"].values()
            for p in e["interleaved"]["peers"]}
    known = [f for f in FAMILIES if f in seen]
    return known + sorted(seen - set(known))


def _threads_in(workloads: Dict[str, dict]) -> List[str]:
    counts = {n for w in workloads.values() for n in w["by_threads"]}
    return sorted(counts, key=int)


def _label(name: str, wl: dict) -> str:
    numel = wl["numel"]
    size = f"{numel / 1e6:.1f}M" if numel >= 1e5 else f"{numel / 1e3:.0f}k"
    dtype = "bf16+fp32" if wl.get("param_dtype") == "bfloat16" else wl.get("param_dtype", "")
    return f"{name}\n{wl['n_tensors']} tensors\n{size} {dtype}".rstrip()


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio < 1 else f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"


def write_plot(path: str, workloads: Dict[str, dict], machine: Optional[dict] = None,
               dpi: int = 100) -> Optional[str]:
    """Write the PNG; returns None when written, else why not (matplotlib missing, no data)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib), no plot written"
    if not workloads:
        return "no workload results, no plot written"
    names = list(workloads)
    fams = _families_in(workloads)
    threads = _threads_in(workloads)
    slot = 0.8 / len(fams)
    width = max(7.0, 1.6 * len(names) * len(threads) + 2)
    fig, axes = plt.subplots(2, len(threads), figsize=(width, 8.5), squeeze=False, sharex="col")
    any_burst = False
    top_pct = 110.0
    pct_points = []  # (axis, x, pct): values above the axis's cap get their number written
    for col, n in enumerate(threads):
        ax_t, ax_p = axes[0][col], axes[1][col]
        for i, name in enumerate(names):
            entry = workloads[name]["by_threads"].get(n)
            if entry is None:
                continue
            inter, burst = entry["interleaved"]["peers"], (entry.get("burst") or {}).get("peers")
            ceiling_gbps = entry["ceiling"]["gbps"]
            if ceiling_gbps:
                floor_ms = workloads[name]["bytes_per_step"] / ceiling_gbps / 1e6
                ax_t.hlines(floor_ms, i - 0.42, i + 0.42, color="black", lw=1.2)
            for peer, fig_ in inter.items():
                fam = family(peer)
                x = i - 0.4 + slot * (fams.index(fam) + 0.5)
                color = FAMILIES.get(fam, (fam, "0.5"))[1]
                ms = fig_["median_s"] * 1e3
                ax_t.bar(x, ms, slot * 0.92, color=color, edgecolor="black", lw=0.3)
                ratio = fig_.get("ratio_vs_ours")
                if fam != "ours" and ratio:
                    ax_t.annotate(_times(ratio), (x, ms), xytext=(0, 2), textcoords="offset points",
                                  ha="center", va="bottom", fontsize=6, rotation=90)
                pct = fig_.get("pct_of_ceiling")
                if pct is not None:
                    top_pct = max(top_pct, 1.05 * pct)
                    pct_points.append((ax_p, x, pct))
                    ax_p.bar(x, pct, slot * 0.92, color=color, edgecolor="black", lw=0.3)
                if burst and peer in burst:
                    any_burst = True
                    ax_t.plot(x, burst[peer]["median_s"] * 1e3, "kD", ms=3)
                    if burst[peer].get("pct_of_ceiling") is not None:
                        top_pct = max(top_pct, 1.05 * burst[peer]["pct_of_ceiling"])
                        ax_p.plot(x, burst[peer]["pct_of_ceiling"], "kD", ms=3)
        ax_t.set_yscale("log")
        ax_t.set_title(f"{n} thread{'s' if n != '1' else ''}: median step time")
        ax_t.set_ylabel("ms per step (log scale)")
        ax_t.grid(axis="y", alpha=0.3, which="both")
        ax_t.margins(y=0.15)
        ax_p.axhline(100, color="black", lw=0.8, ls="--")
        ax_p.set_title(f"{n} thread{'s' if n != '1' else ''}: effective GB/s as % of the ceiling")
        ax_p.set_ylabel("% of the measured ceiling (36 B/element)")
        ax_p.grid(axis="y", alpha=0.3)
        ax_p.set_xticks(range(len(names)), [_label(w, workloads[w]) for w in names], fontsize=8)
    top_pct = min(top_pct, PCT_CAP)
    for ax_p in axes[1]:
        ax_p.set_ylim(0, top_pct)
    for ax_p, x, pct in pct_points:
        if pct > top_pct:  # a ceiling measured low (e.g. a busy machine) makes % meaningless
            ax_p.annotate(f"{pct:.0f}%\u2191", (x, top_pct), xytext=(0, -2),
                          textcoords="offset points", ha="center", va="top", fontsize=6,
                          rotation=90, color="white", fontweight="bold")
    handles = [Patch(facecolor=FAMILIES.get(f, (f, "0.5"))[1], edgecolor="black", lw=0.3,
                     label=FAMILIES.get(f, (f,))[0]) for f in fams]
    handles.append(Line2D([], [], color="black", lw=1.2,
                          label="ceiling: the workload's bytes at the streaming bandwidth"))
    if any_burst:
        handles.append(Line2D([], [], color="black", marker="D", ms=3, ls="",
                              label="burst (back-to-back steps) median"))
    fig.legend(handles=handles, loc="lower center", ncol=min(3, len(handles)), fontsize=8,
               frameon=False)
    title = "tools/bench.py: AdamW + EMA step, interleaved medians (bars); bf16 workloads: " \
            "peers run the composed recipe on fp32 masters"
    if machine:
        title += "\n" + " | ".join((str(machine.get("cpu_model", "?")),
                                    f"torch {machine.get('torch_version', '?')}",
                                    f"backend {machine.get('backend', '?')}",
                                    str(machine.get("cpu_capability", "?"))))
    fig.suptitle(title, fontsize=9)
    rows = -(-len(handles) // 3)
    fig.tight_layout(rect=(0, 0.03 + 0.025 * rows, 1, 1))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return None


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python tools/benchlib/plot.py BENCH_JSON OUT_PNG", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        doc = json.load(f)
    why_not = write_plot(argv[1], doc.get("workloads") or {}, doc.get("machine"))
    print(f"plot: {why_not}" if why_not else f"wrote {argv[1]}")
    return 1 if why_not else 0


if __name__ == "__main__":
    sys.exit(main())
