#!/usr/bin/env bash
# Creates .venv (if missing) and installs rlinf_pipe into it in editable mode.
#   bash scripts/setup.sh          runtime dependencies
#   bash scripts/setup.sh test     plus the test tools
# On a machine without an NVIDIA GPU, torch is pinned through constraints-cpu.txt so no CUDA build is pulled.
# Re-running is cheap: the install is skipped while pyproject.toml, the constraints and the extras are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null || python_bin=python3

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$python_bin" --version)"
  "$python_bin" -m venv .venv
fi

constraints=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  constraints=(-c constraints-cpu.txt)
fi

stamp=.venv/.rlinf_pipe_installed
want="$(cat pyproject.toml constraints-cpu.txt | sha256sum | cut -d' ' -f1) extras=${extras} cpu=${#constraints[@]}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

target="."
[ -n "$extras" ] && target=".[${extras}]"
echo "[setup] installing rlinf_pipe${extras:+[$extras]} into .venv (first time takes about a minute)"
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "${constraints[@]}" -e "$target"
echo "$want" > "$stamp"
