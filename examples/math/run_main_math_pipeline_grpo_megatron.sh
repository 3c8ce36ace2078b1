#!/usr/bin/env bash
# Math GRPO, disaggregated pipeline (rollout | inference | actor on their own GPUs).
#   bash examples/math/run_main_math_pipeline_grpo_megatron.sh [CONFIG] [key=value ...]
# CONFIG is a shipped config's name (examples/math/config/NAME.yaml; default tiny-grpo-megatron-pipeline, which runs
# on a laptop CPU) or the path of your own YAML file (relative to where you run the script, or absolute; a word with
# a `/` or a .yaml / .yml ending is a path). Extra arguments are config overrides, e.g. runner.max_steps=5
# runner.output_dir=/tmp/out runner.experiment_name=try runner.seed=2. The mode comes from the config's placement:
# this script only changes the default config. `--help` prints this text and the shipped configs.
set -euo pipefail
RLINF_PIPE_DEFAULT_CONFIG=tiny-grpo-megatron-pipeline RLINF_PIPE_SCRIPT="$0" \
  exec bash "$(dirname "$0")/run_main_math_grpo_megatron.sh" "$@"
