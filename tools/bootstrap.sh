#!/usr/bin/env bash
# Installs what the demo (default) or the tests (--test) need, then this package with its C++ kernels.
#
#   bash tools/bootstrap.sh          # torch (if missing) + the package
#   bash tools/bootstrap.sh --test   # ... + pytest
#
# An installed torch is kept as it is. Where none is present a CPU build of torch is installed:
# first as the local wheel `torch==2.13.0+cpu` from pip's configured sources (wheelhouses),
# otherwise from PyTorch's CPU wheel index, so a CPU machine never downloads a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

if "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "bootstrap: using the installed torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
else
    echo "bootstrap: no torch found; installing a CPU build of torch $TORCH_VERSION"
    "$PYTHON" -m pip install -q "torch==${TORCH_VERSION}+cpu" 2>/dev/null \
        || "$PYTHON" -m pip install -q "torch==${TORCH_VERSION}" --index-url "$TORCH_CPU_INDEX"
fi

build_deps=(setuptools wheel ninja)
if [[ "${1:-}" == "--test" ]]; then
    build_deps+=(pytest)
fi
"$PYTHON" -m pip install -q "${build_deps[@]}"

# --no-build-isolation: build against the torch installed above (an isolated build would fetch
# another torch); the C++ kernels compile here (a few minutes on 2 cores, MAX_JOBS caps ninja).
"$PYTHON" -m pip install -q --no-build-isolation -e .
"$PYTHON" -m multi_tensor.env 2>/dev/null | sed 's/^/bootstrap: /' || true
