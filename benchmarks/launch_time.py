"""Time from launch to the first training step: `rlinf-pipe train` on the default config against what a plain
single-process GRPO loop needs before its first step.

    python benchmarks/launch_time.py [--repeats 3] [--json]

Ours: `python -m rlinf_pipe.cli train runner.max_steps=1` (the embedded default: the tiny pipeline on 2 virtual
GPUs, a local Ray started by the job), its model already cached. Launch-to-first-step is the start of step 0 on
the run's timeline minus the time the process was started; the script also reports the whole command's wall time.
Baseline: a fresh Python process that imports torch and transformers, loads the same model folder and its
tokenizer, builds an AdamW optimizer and renders the prompts of one step (16, with the chat template): everything
a single-process loop (HF `generate` + the same loss) has to do before it can generate. The two alternate; medians
over `--repeats`. With --json the last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE = """
import time, sys
start = float(sys.argv[1])
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {i} + {i + 1}?"}],
                                         tokenize=True, add_generation_prompt=True) for i in range(16)]
print(time.time() - start)
"""


def ours(out: Path) -> tuple[float, float]:
    """(launch to the first step's start, whole command) seconds of one `rlinf-pipe train` run of one step."""
    from rlinf_pipe.utils.timeline import STEP_SPAN, read_chrome_trace

    started = time.time()
    subprocess.run([sys.executable, "-m", "rlinf_pipe.cli", "train", "runner.max_steps=1", "runner.progress=false",
                    f"runner.output_dir={out}", "runner.tensorboard=false"], check=True, capture_output=True)
    wall = time.time() - started
    timeline = next(out.glob("*/*/timeline.json"))
    first = min(s.start for s in read_chrome_trace(timeline) if s.name == STEP_SPAN)
    return first - started, wall


def baseline(model: str) -> float:
    out = subprocess.run([sys.executable, "-c", BASELINE, repr(time.time()), model], check=True, capture_output=True,
                         text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from rlinf_pipe.config import load_config
    from rlinf_pipe.runner.driver_inputs import run_model_path

    model = run_model_path("tiny", load_config())  # built and cached before anything is timed
    began = time.time()
    firsts, walls, bases = [], [], []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            if repeat % 2:
                bases.append(baseline(model))
            first, wall = ours(Path(tmp))
            firsts.append(first)
            walls.append(wall)
            if not repeat % 2:
                bases.append(baseline(model))
        print(f"repeat {repeat}: first step after {firsts[-1]:.1f} s (command {walls[-1]:.1f} s); "
              f"single process ready after {bases[-1]:.1f} s", flush=True)
    result = {
        "first_step_s": statistics.median(firsts), "first_step_s_range": [min(firsts), max(firsts)],
        "command_s": statistics.median(walls), "baseline_ready_s": statistics.median(bases),
        "baseline_ready_s_range": [min(bases), max(bases)],
        "first_step_over_baseline": statistics.median(f / b for f, b in zip(firsts, bases, strict=True)),
        "repeats": args.repeats, "runtime_s": round(time.time() - began, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
    }
    print(f"first step {result['first_step_s']:.1f} s after launch (single process ready after "
          f"{result['baseline_ready_s']:.1f} s: {result['first_step_over_baseline']:.1f}x)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
