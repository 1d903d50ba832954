#!/usr/bin/env bash
# Installs what the demo (default) or the tests (--test) need, then this package with its C++ kernels.
#
#   bash tools/bootstrap.sh          # torch (if missing) + the package + scikit-learn, tqdm, matplotlib
#   bash tools/bootstrap.sh --test   # ... + pytest, ruff and import-linter (the lint), triton (pinned,
#                                    #     for the Triton backend's tests), lightning, transformers,
#                                    #     accelerate (the recipe tests)
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

build_deps=(setuptools wheel ninja numpy)
# The demo's data (load_digits ships inside the scikit-learn wheel), its progress bar and its plot;
# the tests run the demo too. None depends on torch, so pip never pulls another torch for them.
build_deps+=(scikit-learn tqdm matplotlib)
if [[ "${1:-}" == "--test" ]]; then
    # expecttest: torch.testing._internal (torch's optimizer error inputs, tests/test_torch_conformance.py)
    # hypothesis: the fuzz test draws its numerics cases with it (tests/test_fuzz.py)
    build_deps+=(pytest expecttest hypothesis)
    # the linter .ci/run runs before the tests (configured in pyproject.toml); pinned, so a new
    # ruff release cannot fail CI with rules the code has not seen
    build_deps+=("ruff==${RUFF_VERSION:-0.17.6}")
    # lint-imports: the package's import rules (pyproject.toml's [tool.importlinter]), pinned
    # likewise; its grimp also serves tests/test_import_rules.py
    build_deps+=("import-linter==${IMPORT_LINTER_VERSION:-2.16}")
    # the frameworks tests/test_frameworks.py runs docs/recipes.md's recipes in; pinned to versions
    # tested with torch 2.13, whose torch requirement (>= 2.1) the installed torch meets
    build_deps+=(lightning==2.6.6 transformers==5.24.0 accelerate==1.15.0)
    # triton: the CUDA backend's kernels, tested on CPU (interpreter + PTX). An installed triton
    # (e.g. the one a CUDA torch pins) is kept as it is.
    "$PYTHON" -c "import triton" 2>/dev/null || build_deps+=("triton==${TRITON_VERSION:-3.6.0}")
fi
"$PYTHON" -m pip install -q "${build_deps[@]}"

# --no-build-isolation: build against the torch installed above (an isolated build would fetch
# another torch). --use-pep517: an editable build through setuptools' PEP 660 hook, in this
# environment (newer setuptools turn the legacy `setup.py develop` into an isolated build,
# which cannot see torch and so would skip the C++ kernels). About 75 s on 2 cores.
"$PYTHON" -m pip install -q --no-build-isolation --use-pep517 -e .
"$PYTHON" -m multi_tensor.env | sed 's/^/bootstrap: /'
if [[ "${FUSED_OPTIM_NO_EXT:-0}" == "0" ]]; then
    # The kernels must have built: a silent fallback would hide a broken build.
    "$PYTHON" -c "import multi_tensor.backends.cpu as n, sys; sys.exit(0 if n.loaded_module else 'bootstrap: the native CPU extension did not build/load: %s' % n.load_error)"
fi
