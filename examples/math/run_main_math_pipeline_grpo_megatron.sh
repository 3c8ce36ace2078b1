#!/usr/bin/env bash
# Math GRPO, disaggregated pipeline (rollout | inference | actor on their own GPUs).
#   bash examples/math/run_main_math_pipeline_grpo_megatron.sh [CONFIG_NAME] [key=value ...]
# CONFIG_NAME defaults to tiny-grpo-megatron-pipeline (runs on a laptop CPU); extra arguments are config overrides,
# e.g. runner.max_steps=5 runner.output_dir=/tmp/out runner.experiment_name=try runner.seed=2.
# The mode comes from the config's placement: this script only changes the default config name.
set -euo pipefail
if [ $# -eq 0 ] || [[ "$1" == *=* ]]; then set -- tiny-grpo-megatron-pipeline "$@"; fi
exec bash "$(dirname "$0")/run_main_math_grpo_megatron.sh" "$@"
