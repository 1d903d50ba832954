#!/usr/bin/env bash
# The Triton backend's GPU check, for a machine with an NVIDIA GPU (at most 6 minutes), measuring
# what a user's install runs: the native C++ extension built on first use (or a row saying it is
# absent, and why), the CUDA tests, bitwise parity with the reference on the GPU, CUDA-graph
# capture and replay, GradScaler steps under torch.cuda.set_sync_debug_mode("error"), the GPU
# benchmark (W1, a 1.5B-element bucket, W3, W2 eager and in CUDA graphs on both sides, against
# torch's recipes, and the copy bandwidth), the GPT-2-small train step, the cold first step,
# FSDP2 + DCP on one rank with NCCL, and a per-kernel ncu summary (where ncu is on PATH).
#
#   bash tools/gpu_check.sh [OUT_DIR [gpu_check.py options]]   # OUT_DIR: $OUT, else ./gpu_check_out
#
# Runs from the source tree (no install needed: PYTHONPATH is the repo; the extension is built
# into the user's cache on first use, about 30 s on 16 cores). Needs torch with CUDA, triton (3.6:
# the version the CPU tests pin), pytest and numpy; no network. Writes gpu_check.json,
# gpu_check.md, pytest.log and pytest.xml to OUT_DIR, and bench_rows.jsonl (one line per row as
# it finishes).
set -uo pipefail
cd "$(dirname "$0")/.."
# the interpreter: $PYTHON, else python3, else python on PATH (gpu_check.py then runs its
# children with its own sys.executable)
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
if [ -z "$PYTHON" ]; then
    echo "gpu_check: no python3 or python on PATH; set PYTHON=/path/to/python" >&2
    exit 2
fi
OUT_DIR=${1:-${OUT:-$PWD/gpu_check_out}}
[ $# -gt 0 ] && shift  # what follows OUT_DIR goes to gpu_check.py (e.g. --skip-tests)
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "import torch, triton; print('gpu_check: torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
# 6 minutes in all: the Python part's own budget, and a hard stop a little after it (the rows
# done by then are on disk already)
timeout -k 10 "${GPU_CHECK_TIMEOUT:-350}" "$PYTHON" tools/gpu_check.py --out "$OUT_DIR" \
    --budget "${GPU_CHECK_BUDGET:-330}" "$@"
rc=$?
echo "gpu_check: exit $rc; results in $OUT_DIR/gpu_check.md and gpu_check.json"
exit $rc
