#!/usr/bin/env bash
# Validation during training, then the final checkpoint evaluated offline with the run's own config
# (docs/evaluation.md). Runs the tiny CPU pipeline for 4 steps.
#   bash examples/evaluation/validate_then_eval.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-outputs/evaluation-example}
PY=${PYTHON:-.venv/bin/python}
"$PY" -m rlinf_pipe.cli train runner.max_steps=4 runner.val_interval=2 runner.val_before_train=true \
    runner.output_dir="$OUT" runner.experiment_name=validated
RUN=$(ls -d "$OUT"/validated/*/ | tail -1)
RUN=${RUN%/}
echo "validation rows of $RUN/metrics.jsonl:"
grep '"val/pass@1"' "$RUN/metrics.jsonl" | "$PY" -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print("  step %d: pass@1 %.3f  pass@%d %.3f" % (r["step"], r["val/pass@1"], r["val/k"], r["val/pass@k"]))'
CKPT=$(ls -d "$RUN"/checkpoints/step_* | tail -1)
"$PY" -m rlinf_pipe.cli eval "$RUN/config.yaml" --model "$CKPT" --heldout --out "$RUN/eval-final"
echo "(the same problems, seeds and weights as the validation after the last step: the same pass@1)"
