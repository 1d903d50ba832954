"""Smoke tests of tools/bench.py: it runs end to end and writes the JSON it promises.

A tiny S + W2 run at thread counts 1 and 2 in a subprocess; the checks are on structure and on
the arithmetic that ties the figures together (effective GB/s, % of ceiling, ratios, the
Measurement statistics), never on a speed. A second tiny run hides DeepSpeed behind a module
that fails to import and checks the peer is skipped with a reason rather than failing the
run. With matplotlib, ``--plot`` writes a PNG (and tools/benchlib/plot.py replots the saved
JSON); without it, the plot says why not.
"""
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
BENCH = os.path.join(TOOLS, "bench.py")
FP32_PEERS = {"ours", "fused_ema", "foreach_ema", "npu_loop"}
CEILING_BYTES = {"adamw_fused": 28, "foreach_lerp": 12, "foreach_add": 12}


def run_bench(tmp_path, *args, env=None):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, BENCH, "--quick", "--w2-tensors", "100", "--incache-numel", "4096",
         "--incache-steps", "20", "--json", str(out), *args],
        cwd=ROOT, env=dict(os.environ, **(env or {})), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


def check_timing(mode, wl, ceiling_gbps, steps_per_block):
    """One Measurement per peer, merged over the rounds: a time per round (one step, or the
    mean of a block of back-to-back steps), every peer the same number of timed steps."""
    assert mode["rounds"] >= 1 and mode["steps_per_block"] == steps_per_block
    assert set(mode["peers"]) == FP32_PEERS
    for name, peer in mode["peers"].items():
        assert len(peer["times_s"]) == mode["rounds"], name
        assert peer["timed_steps"] == mode["rounds"] * steps_per_block, name
        assert all(t > 0 for t in peer["times_s"]), name
        assert peer["min_s"] == min(peer["times_s"])
        assert peer["median_s"] == pytest.approx(statistics.median(peer["times_s"]))
        assert peer["p10_s"] <= peer["median_s"] <= peer["p90_s"], name
        assert peer["effective_gbps"] == pytest.approx(wl["bytes_per_step"] / peer["median_s"] / 1e9)
        assert peer["pct_of_ceiling"] == pytest.approx(100 * peer["effective_gbps"] / ceiling_gbps)
        assert peer["ratio_vs_ours"] == pytest.approx(
            peer["median_s"] / mode["peers"]["ours"]["median_s"])
    assert mode["peers"]["ours"]["ratio_vs_ours"] == 1.0


def test_bench_quick_writes_json(tmp_path):
    stdout, data = run_bench(tmp_path, "--workloads", "S,W2", "--threads-list", "1,2",
                             "--peers", ",".join(sorted(FP32_PEERS)))
    assert "backend" in stdout and "ceiling" in stdout
    # the step times as torch.utils.benchmark.Compare tables, a row per peer and thread count
    assert re.search(r"^\s+\|\s+interleaved\s+\|\s+burst\s*$", stdout, re.M), stdout
    assert re.search(r"^1 threads: -+$", stdout, re.M) and "Times are in" in stdout
    for key in ("machine", "settings", "byte_models", "ceiling_method", "memory_method",
                "target_definitions", "skipped_peers", "workloads", "in_cache", "targets", "total_s"):
        assert key in data, key
    machine = data["machine"]
    for key in ("torch_version", "torch_threads", "cpu_capability", "backend", "cpu_caches_bytes"):
        assert key in machine, key
    assert isinstance(machine["backend"], str) and machine["backend"]
    assert data["settings"]["threads_list"] == [1, 2]
    defined = {t["workload"] for t in data["target_definitions"]}
    assert defined == {"W1", "W2", "W3", "S", "S3", "in_cache"}

    assert list(data["workloads"]) == ["S", "W2"]
    assert data["workloads"]["S"]["numel"] == 300_000 and data["workloads"]["S"]["n_tensors"] == 6
    for name, wl in data["workloads"].items():
        assert wl["bytes_per_step"] == 36 * wl["numel"]
        assert set(wl["peers"]) == FP32_PEERS
        for peer_name, peer in wl["peers"].items():
            assert set(peer["peak_extra_mb"]) == {"rss_mb", "torch_mb"}
            assert peer["check"]["all_finite"], peer_name
            # every peer took the same steps (burst blocks are the same size for all)
            assert peer["check"]["max_abs_diff_param_vs_ours"] < 1e-5, peer_name
        assert list(wl["by_threads"]) == ["1", "2"]
        for n, entry in wl["by_threads"].items():
            assert entry["threads"] == int(n)
            assert entry["other_processes_cores"] is None or entry["other_processes_cores"] >= 0
            ceiling = entry["ceiling"]
            assert set(ceiling["ops"]) == set(CEILING_BYTES)
            for op, fig in ceiling["ops"].items():
                assert fig["bytes_per_element"] == CEILING_BYTES[op]
                assert fig["bytes_per_step"] == CEILING_BYTES[op] * wl["numel"]
                assert fig["gbps"] == pytest.approx(fig["bytes_per_step"] / fig["median_s"] / 1e9)
                assert fig["best_gbps"] == pytest.approx(fig["bytes_per_step"] / fig["best_s"] / 1e9)
            assert ceiling["gbps"] == max(f["gbps"] for f in ceiling["ops"].values()) > 0
            assert ceiling["ops"][ceiling["best_op"]]["gbps"] == ceiling["gbps"]
            check_timing(entry["interleaved"], wl, ceiling["gbps"], 1)
            assert wl["burst_steps"] == 3   # --quick
            check_timing(entry["burst"], wl, ceiling["gbps"], wl["burst_steps"])
            assert entry["targets"]
            for target in entry["targets"]:
                assert target["workload"] == name and target["threads"] == int(n)
                assert {"what", "metric", "op", "value", "peer", "mode", "actual", "met"} <= set(target)
                assert isinstance(target["met"], bool) and math.isfinite(target["actual"])
    w2_modes = {t["mode"] for t in data["workloads"]["W2"]["by_threads"]["2"]["targets"]}
    assert w2_modes == {"burst"}

    incache = data["in_cache"]
    assert incache["numel"] == 4096 and incache["threads"] == 1
    assert {"ours", "ours_kernel", "torch_wrapper", "fused_adamw"} <= set(incache["peers"])
    for name, peer in incache["peers"].items():
        assert peer["ns_per_elem_core"] == pytest.approx(peer["step_s"] / 4096 * 1e9), name
    assert [(t["peer"], t["metric"]) for t in incache["targets"]] == [
        ("ours", "ns_per_elem_core"), ("ours", "marginal_ns_per_elem_core"),
        ("ours_kernel", "marginal_ns_per_elem_core"), ("ours", "fixed_over_wrapper_us")]
    assert len(data["targets"]) == 2 * 2 + 4   # two workloads x two thread counts + in-cache


def test_bench_skips_deepspeed_when_it_does_not_import(tmp_path):
    fake = tmp_path / "fake" / "deepspeed"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('deepspeed hidden by the smoke test')\n")
    stdout, data = run_bench(tmp_path, "--workloads", "S", "--threads-list", "1", "--no-memory",
                             "--no-incache", "--peers", "fused_ema,deepspeed_ema",
                             env={"PYTHONPATH": str(tmp_path / "fake")})
    assert "peer deepspeed_ema: skipped" in stdout
    assert "hidden by the smoke test" in data["skipped_peers"]["deepspeed_ema"]
    assert set(data["workloads"]["S"]["peers"]) == {"ours", "fused_ema"}
    assert data["in_cache"] is None


def test_bench_shapes_and_targets_are_data():
    sys.path.insert(0, TOOLS)
    try:
        from benchlib import targets, workloads
    finally:
        sys.path.remove(TOOLS)
    shapes = workloads.gpt2_small_shapes()
    assert len(shapes) == 148
    assert sum(math.prod(s) for s in shapes) == 124_439_808
    small = workloads.small_tensor_shapes(3000)
    assert len(small) == 3000 and small == workloads.small_tensor_shapes(3000)
    assert all(64 <= math.prod(s) <= 1024 for s in small)
    assert [math.prod(s) for s in workloads.small_model_shapes()] == [50_000] * 6
    for t in targets.TARGETS:
        assert isinstance(t.value, float) and t.op in (">=", "<=")
    w1 = {(t.metric, t.peer): t.value for t in targets.targets_for("W1")}
    assert w1 == {("pct_ceiling", "ours"): 85.0, ("ratio", "fused_ema"): 1.05}
    scored = targets.Target("X", "ratio", ">=", 2.0, peer="p").score(1.5)
    assert scored["met"] is False and scored["target"] == ">= 2"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (--plot is optional)")
def test_bench_plot_writes_png(tmp_path):
    png, replot = tmp_path / "bench.png", tmp_path / "replot.png"
    stdout, data = run_bench(tmp_path, "--workloads", "S,S3", "--threads-list", "1",
                             "--no-memory", "--no-incache", "--peers", "fused_ema,mp_fused_ema",
                             "--plot", str(png))
    assert f"wrote {png}" in stdout and list(data["workloads"]) == ["S", "S3"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the same picture from the saved JSON, without running the bench again
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, "benchlib", "plot.py"),
                           str(tmp_path / "bench.json"), str(replot)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert replot.stat().st_size > 10_000


def test_bench_plot_without_matplotlib_says_why(tmp_path):
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib hidden by the smoke test')\n")
    doc = tmp_path / "bench.json"
    doc.write_text(json.dumps({"workloads": {"S": {}}}))
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, "benchlib", "plot.py"), str(doc),
                           str(tmp_path / "never.png")], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path / "fake")), timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "matplotlib is not installed" in proc.stdout
    assert not (tmp_path / "never.png").exists()
