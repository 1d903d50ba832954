"""tools/gpu_check.sh and its Python parts, on a machine without a GPU.

The shell script parses (``bash -n``); tools/gpu_check.py and tools/gpucheck import; its rows
that can run on a CPU run there at toy sizes (``--dry-run``: the native extension row, the
GPT-2 train step, the cold first step in a fresh process, FSDP2 + DCP resuming bit for bit on
one gloo rank) and write their rows to disk; the GPU rows say they were skipped. ncu's CSV is
read from a sample of its output. Nothing here measures a speed.
"""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

from gpucheck import ncu, train  # noqa: E402

NCU_COLUMNS = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context",
               "Stream", "Block Size", "Grid Size", "Device", "CC", "Section Name",
               "Metric Name", "Metric Unit", "Metric Value"]
NCU_ROWS = [  # (ID, kernel, metric, unit, value) as ncu --csv prints them
    ("0", "adam_kernel", "dram__bytes.sum.per_second", "byte/second", "3,912,345,678,901.5"),
    ("0", "adam_kernel", "dram__bytes_read.sum", "byte", "2,488,796,160"),
    ("0", "adam_kernel", "dram__bytes_write.sum", "Mbyte", "1,991.04"),
    ("0", "adam_kernel", "gpu__time_duration.sum", "nsecond", "1,145,000"),
    ("1", "noop_flag_zero", "gpu__time_duration.sum", "usecond", "2.5"),
]


def ncu_output() -> str:
    """A sample of ncu's output: its own lines around the CSV table."""
    quoted = lambda cells: ",".join(f'"{c}"' for c in cells)  # noqa: E731
    lines = ["==PROF== Connected to process 4242", quoted(NCU_COLUMNS)]
    for kid, kernel, metric, unit, value in NCU_ROWS:
        lines.append(quoted([kid, "4242", "python", "h", kernel, "1", "7", "(256, 1, 1)",
                             "(8192, 1, 1)", "0", "9.0", "Command line profiler metrics",
                             metric, unit, value]))
    return "\n".join(lines + ["==PROF== Disconnected from process 4242", ""])


def test_gpu_check_sh_parses():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    proc = subprocess.run([bash, "-n", os.path.join(TOOLS, "gpu_check.sh")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = open(os.path.join(TOOLS, "gpu_check.sh")).read()
    # the check measures what users run: nothing in it turns the native extension off
    assert "MULTI_TENSOR_DISABLE_NATIVE=1" not in text and "FUSED_OPTIM_NO_JIT" not in text


def test_ncu_summary_reads_the_csv():
    kernels = ncu.summarize(ncu_output())
    assert [k["kernel"] for k in kernels] == ["adam_kernel", "noop_flag_zero"]
    adam, noop = kernels
    assert adam["us"] == pytest.approx(1145.0)
    assert adam["dram_GBps"] == pytest.approx(3912.3456789015)
    assert adam["read_MB"] == pytest.approx(2488.79616)
    assert adam["written_MB"] == pytest.approx(1991.04)
    assert noop["us"] == pytest.approx(2.5) and noop["dram_GBps"] is None
    cmd = ncu.command("W1", python="python")
    assert cmd[1:3] == ["--clock-control", "none"] and cmd[-1] == "W1"
    with pytest.raises(ValueError, match="no CSV"):
        ncu.summarize("==ERROR== ERR_NVGPUCTRPERM")


def test_gpt2_small_has_the_w1_tensors():
    from benchlib import workloads

    with torch.device("meta"):
        model = train.GPT2(train.CONFIGS["gpt2-small"])
    # the same tensors up to layout (nn.Linear stores (out, in), GPT-2's Conv1D (in, out))
    sizes = sorted(p.numel() for p in model.parameters())
    assert sizes == sorted(math.prod(s) for s in workloads.gpt2_small_shapes())
    assert len(sizes) == 148 and sum(sizes) == 124_439_808


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run is for machines without CUDA")
def test_gpu_check_dry_run_on_cpu(tmp_path):
    run = [sys.executable, os.path.join(TOOLS, "gpu_check.py"), "--out", str(tmp_path),
           "--skip-tests", "--skip-bench"]
    proc = subprocess.run(run + ["--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    for name in ("parity_W1", "parity_W3", "graph", "sync", "ncu"):
        assert sections[name] == {"status": "skipped", "error": "no CUDA device"}, name
    native = sections["native"]["result"]
    assert native["row"].startswith("native extension: ")
    assert native["loaded"] or "ABSENT" in native["row"]
    tr = sections["train"]
    assert tr["status"] == "passed", tr
    for form in ("fp32", "bf16+masters"):
        for who in ("ours", "torch"):
            assert tr["result"][f"{who}_{form}_step_ms"] > 0
            assert tr["result"][f"{who}_{form}_finite"]
    cold = sections["cold"]
    assert cold["status"] == "passed", cold
    assert cold["result"]["fp32_first_step_s"] > 0 and cold["result"]["device"] == "cpu"
    fsdp = sections["fsdp"]
    assert fsdp["status"] == "passed", fsdp
    assert fsdp["result"]["bit_exact_resume"] and "world 1 (gloo" in fsdp["result"]["stdout"]
    # each row reached the disk as it finished, in order
    rows = [json.loads(line) for line in (tmp_path / "bench_rows.jsonl").read_text().splitlines()]
    assert [r["section"] for r in rows] == ["native", "train", "cold", "fsdp"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "train step (tiny" in md and "resume bit-exact yes" in md and "cold start" in md

    # without --dry-run a machine without CUDA is told so, and nothing runs but the native row
    proc = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sections["native"]["status"] == "passed"
    assert sections["train"] == {"status": "skipped", "error": "no CUDA device"}
