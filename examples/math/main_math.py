"""Math GRPO with rlinf_pipe: the placement in the config decides pipeline or collocated mode.

    python examples/math/main_math.py --config-path examples/math/config --config-name tiny-grpo-megatron-pipeline \
        runner.max_steps=5 runner.output_dir=outputs

Outputs go to `<runner.output_dir>/<runner.experiment_name>/<timestamp>/` (metrics.jsonl, timeline.json,
timeline.png, reward.png, tensorboard/, checkpoints/). See docs/quickstart.md.
"""

from __future__ import annotations

import sys

from rlinf_pipe.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
