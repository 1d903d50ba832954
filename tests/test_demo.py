"""tools/demo.py runs end to end on real data (scikit-learn's bundled digits) and reports.

One short run in a subprocess (300 steps, 1 thread so that other processes on a small machine
cannot stall OpenMP barriers): it finishes, prints raw and EMA test accuracies well above chance
and both step times, and writes its PNG when matplotlib is installed. Skipped without
scikit-learn or tqdm (``bash tools/bootstrap.sh --test`` installs both).
"""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "tools", "demo.py")
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sklearn") is None or importlib.util.find_spec("tqdm") is None,
    reason="scikit-learn or tqdm is not installed (the demo's data set and progress bar)")


def run_demo(*args, timeout=120):
    proc = subprocess.run([sys.executable, DEMO, "--steps", "300", "--threads", "1", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, proc.stderr


def accuracy(stdout, which):
    match = re.search(rf"^\s+{which} weights\s+([0-9.]+)% \((\d+)/(\d+)\)", stdout, re.M)
    assert match, f"no final {which} accuracy line in:\n{stdout}"
    return float(match.group(1))


def test_demo_trains_and_reports(tmp_path):
    png = tmp_path / "digits.png"
    stdout, stderr = run_demo("--plot", str(png))
    assert "load_digits" in stdout and "bf16" in stdout
    assert "300 steps of batch 32" in stdout  # --steps was honoured
    assert re.search(r"training: 100%.*300/300", stderr)  # tqdm's bar reached the end
    raw, ema = accuracy(stdout, "raw"), accuracy(stdout, "EMA")
    assert raw > 50.0 and ema > 50.0, (raw, ema)  # chance is 10%; both are ~90%+ after 300 steps
    times = re.findall(r"^\s+(FusedEmaAdamW\.step\(\)|torch recipe)\s+([0-9.]+) ms", stdout, re.M)
    assert [name for name, _ in times] == ["FusedEmaAdamW.step()", "torch recipe"], stdout
    assert all(float(ms) > 0 for _, ms in times)
    assert re.search(r"torch / ours = [0-9.]+", stdout)
    if HAS_MATPLOTLIB:
        assert "plot: wrote" in stdout
        assert png.stat().st_size > 10_000
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in stdout and not png.exists()


def test_demo_no_plot_writes_nothing(tmp_path):
    png = tmp_path / "never.png"
    stdout, _ = run_demo("--steps", "40", "--no-plot", "--plot", str(png))
    assert "plot:" not in stdout and not png.exists()
    assert accuracy(stdout, "raw") > 0
