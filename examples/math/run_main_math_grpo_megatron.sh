#!/usr/bin/env bash
# Math GRPO, collocated mode (actor,rollout share the GPUs).
#   bash examples/math/run_main_math_grpo_megatron.sh [CONFIG] [key=value ...]
# CONFIG is a shipped config's name (examples/math/config/NAME.yaml; default tiny-grpo-megatron, which runs on a
# laptop CPU) or the path of your own YAML file (relative to where you run the script, or absolute; a word with a
# `/` or a .yaml / .yml ending is a path). Extra arguments are config overrides, e.g. runner.max_steps=5
# runner.output_dir=/tmp/out runner.experiment_name=try runner.seed=2. The mode comes from the config's placement.
# `--help` prints this text and the shipped configs.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
name="${RLINF_PIPE_DEFAULT_CONFIG:-tiny-grpo-megatron}"
script="${RLINF_PIPE_SCRIPT:-$0}"
if [ $# -gt 0 ] && { [ "$1" = "--help" ] || [ "$1" = "-h" ]; }; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$script"
  echo "Shipped configs: $(cd "$repo/examples/math/config" && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')"
  exit 0
fi
if [ $# -gt 0 ] && [[ "$1" != *=* ]]; then name="$1"; shift; fi
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python=python3
if [[ "$name" == */* || "$name" == *.yaml || "$name" == *.yml ]]; then
  exec "$python" "$repo/examples/math/main_math.py" "$name" "$@"  # (a file: read from the caller's folder)
fi
exec "$python" "$repo/examples/math/main_math.py" --config-path "$repo/examples/math/config" --config-name "$name" "$@"
