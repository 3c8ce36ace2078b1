#!/usr/bin/env bash
# Math GRPO, disaggregated pipeline (rollout | inference | actor on their own GPUs).
#   bash examples/math/run_main_math_pipeline_grpo_megatron.sh [CONFIG_NAME] [key=value ...]
# CONFIG_NAME defaults to tiny-grpo-megatron-pipeline (runs on a laptop CPU); extra arguments are config overrides,
# e.g. runner.max_steps=5 runner.output_dir=/tmp/out runner.experiment_name=try runner.seed=2.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
name="tiny-grpo-megatron-pipeline"
if [ $# -gt 0 ] && [[ "$1" != *=* ]]; then name="$1"; shift; fi
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python=python3
exec "$python" "$repo/examples/math/main_math.py" --config-path "$repo/examples/math/config" --config-name "$name" "$@"
