#!/usr/bin/env bash
# The Triton backend's GPU check, for a machine with an NVIDIA GPU (at most ~5 minutes):
# the CUDA tests, bitwise parity with the reference on the GPU, CUDA-graph capture and replay, a
# GradScaler step under torch.cuda.set_sync_debug_mode("error"), and the GPU benchmark (W1, a
# 1.5B-element bucket, W3, W2 against torch's fused AdamW + lerp EMA, and the copy bandwidth).
#
#   bash tools/gpu_check.sh [OUT_DIR]      # default: $OUT, else ./gpu_check_out
#
# Runs from the source tree (no install, no build needed): PYTHONPATH is the repo, and
# MULTI_TENSOR_DISABLE_NATIVE=1 is set when the C++ CPU extension is not built (it is never
# compiled here: FUSED_OPTIM_NO_JIT=1). Needs torch with CUDA, triton (3.6: the version the CPU
# tests pin), pytest and numpy; no network. Writes gpu_check.json, gpu_check.md,
# pytest.log and pytest.xml to OUT_DIR, and bench_rows.jsonl (one line per bench row as it
# finishes).
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
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Never compile the C++ CPU extension here (the first-use build would eat the time budget; the
# GPU check does not need it): use a prebuilt one if it imports, else disable it.
export FUSED_OPTIM_NO_JIT=1
if ! MULTI_TENSOR_DISABLE_NATIVE=0 "$PYTHON" -W ignore -c \
    "import sys, multi_tensor.backends.cpu as n; sys.exit(0 if n.loaded_module else 1)" \
    >/dev/null 2>&1; then
    export MULTI_TENSOR_DISABLE_NATIVE=1
    echo "gpu_check: the C++ CPU extension is not built: MULTI_TENSOR_DISABLE_NATIVE=1"
fi
"$PYTHON" -c "import torch, triton; print('gpu_check: torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
timeout -k 10 300 "$PYTHON" tools/gpu_check.py --out "$OUT_DIR" --budget "${GPU_CHECK_BUDGET:-270}"
rc=$?
echo "gpu_check: exit $rc; results in $OUT_DIR/gpu_check.md and gpu_check.json"
exit $rc
