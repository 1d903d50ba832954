"""Smoke test of tools/bench.py: it runs end to end and writes the JSON it promises.

Runs a tiny W2 (100 tensors, 3 rounds) in a subprocess. Checks structure and that times are
positive; it never asserts a speed.
"""
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "tools", "bench.py")


def test_bench_quick_w2_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, BENCH_W2_TENSORS="100")
    proc = subprocess.run(
        [sys.executable, BENCH, "--quick", "--workloads", "W2", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "backend" in proc.stdout

    data = json.loads(out.read_text())
    for key in ("machine", "settings", "bandwidth", "memory_method", "byte_models", "workloads",
                "total_s"):
        assert key in data, key
    machine = data["machine"]
    for key in ("torch_version", "torch_threads", "cpu_capability", "backend"):
        assert key in machine, key
    assert machine["torch_threads"] >= 1
    assert isinstance(machine["backend"], str) and machine["backend"]
    assert data["bandwidth"]["ceiling_gbps"] > 0

    assert list(data["workloads"]) == ["W2"]
    w2 = data["workloads"]["W2"]
    assert w2["n_tensors"] == 100
    assert w2["numel"] > 0 and w2["bytes_per_step"] == 36 * w2["numel"]
    assert w2["rounds"] >= 1
    assert set(w2["peers"]) == {"ours", "fused_ema", "foreach_ema", "npu_loop"}
    for name, peer in w2["peers"].items():
        assert peer["median_s"] > 0, name
        assert len(peer["times_s"]) == w2["rounds"]
        assert all(t > 0 for t in peer["times_s"]), name
        assert peer["ratio_vs_ours"] > 0 and math.isfinite(peer["ratio_vs_ours"]), name
        assert peer["effective_gbps"] > 0, name
        assert peer["pct_of_ceiling"] > 0, name
        assert set(peer["peak_extra_mb"]) == {"rss_mb", "torch_mb"}
        assert peer["check"]["all_finite"], name
    assert w2["peers"]["ours"]["ratio_vs_ours"] == 1.0
    assert isinstance(w2["targets"], list) and w2["targets"]
    for target in w2["targets"]:
        assert {"what", "target", "actual", "met"} <= set(target)


def test_bench_gpt2_shapes_count():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import bench
    finally:
        sys.path.pop(0)
    shapes = bench.gpt2_small_shapes()
    assert len(shapes) == 148
    assert sum(math.prod(s) for s in shapes) == 124_439_808
    small = bench.small_tensor_shapes(3000)
    assert len(small) == 3000 and small == bench.small_tensor_shapes(3000)
    assert all(64 <= math.prod(s) <= 1024 for s in small)
