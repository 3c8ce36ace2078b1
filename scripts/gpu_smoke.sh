#!/usr/bin/env bash
# The GPU smoke suite (tests/gpu, docs/benchmarks.md#gpu-smoke-suite) on a bare GPU machine, in minutes.
#   bash scripts/gpu_smoke.sh [-- PYTEST_ARGS]               # with network: installs what is missing, runs the suite
#   bash scripts/gpu_smoke.sh --wheels DIR [-- PYTEST_ARGS]  # offline: installs from wheels fetched beforehand
#   bash scripts/gpu_smoke.sh --fetch DIR [PYTHON_VERSION]    # on a machine with network: fetch those wheels (3.12)
# It never installs torch: the machine's CUDA build is used (a virtual environment over the system packages, in
# $RLINF_PIPE_GPU_VENV, default /tmp/rlinf-pipe-gpu). Tests that need Ray or sglang skip where they are missing;
# `pip install -e '.[sglang]'` first to run the SGLang ones. RLINF_PIPE_GPU_DRY_RUN=1 runs the suite's logic on CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
NEEDED=("msgspec>=0.19" "omegaconf>=2.3" "megatron-core>=0.16.1,<0.17")

if [ "${1:-}" = "--fetch" ]; then
    dir="${2:?usage: --fetch DIR [PYTHON_VERSION]}"; version="${3:-3.12}"
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "$version" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$dir" "${NEEDED[@]}"
    echo "wheels for Python $version in $dir: copy them with the tree, then: bash scripts/gpu_smoke.sh --wheels $dir"
    exit 0
fi
source=()
if [ "${1:-}" = "--wheels" ]; then
    source=(--no-index --find-links "${2:?usage: --wheels DIR}"); shift 2
fi
[ "${1:-}" = "--" ] && shift

venv="${RLINF_PIPE_GPU_VENV:-/tmp/rlinf-pipe-gpu}"
[ -x "$venv/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$venv"
py="$venv/bin/python"
missing=()
"$py" -c "import msgspec" 2>/dev/null || missing+=("${NEEDED[0]}")
"$py" -c "import omegaconf" 2>/dev/null || missing+=("${NEEDED[1]}")
"$py" -c "import megatron.core" 2>/dev/null || missing+=("${NEEDED[2]}")
"$py" -c "import pytest, pytest_timeout" 2>/dev/null || missing+=("pytest>=8" "pytest-timeout>=2.3")
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    "$py" -m pip install --quiet "${source[@]}" "${missing[@]}"
fi

if [ -z "${RLINF_PIPE_GPU_DRY_RUN:-}" ]; then
    "$py" - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("error: torch sees no CUDA GPU here (torch " + torch.__version__ + "); the GPU suite needs one")
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {len(names)} GPU(s): {', '.join(names)}")
PY
fi
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m pytest tests/gpu -m gpu -v -rs -s -p no:cacheprovider --timeout 900 "$@"
