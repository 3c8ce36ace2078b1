"""Long responses on CPU: a Megatron training step on long packed sequences at CP 1 (one process) against CP 2 (two
gloo processes, each a load-balanced half of every sequence), and at TP 2 with and without sequence parallelism.

    python benchmarks/long_response_bench.py [--seq-len 2048] [--repeats 3] [--json]

Each case trains the tiny Qwen3 model (built locally on first use) on the same sequence of `seq-len` tokens (the
first ninth prompt, the rest response: `one_sequence_batch`), one micro-batch, `repeats` steps after one warm-up step. Reported per
case: the median step time and its spread, tokens per second (the sequence's tokens over the step time, all ranks
together), and each rank's peak resident memory grown by training (`ru_maxrss` after the steps less before the
warm-up step: the step's activations and buffers and the optimizer's state, in this process). On 2 cores the CP and TP cases' two processes share
the cores of the one-process case, so their time says what the communication costs here, not what two devices gain;
the memory per rank is the figure that carries over.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CASES = {"cp1": ({}, {}), "cp2": ({"cp": 2}, {}), "tp2": ({"tp": 2}, {}),
         "tp2-sp": ({"tp": 2}, {"sequence_parallel": True})}


def _steps(rank: int, model_path: str, seq_len: int, repeats: int, sequence_parallel: bool = False) -> dict:
    from support.actor_run import LOSS, one_sequence_batch, vocab_size

    from rlinf_pipe.engines.policy.policy import MegatronPolicy

    policy = MegatronPolicy(model_path, lr=1e-4, sequence_parallel=sequence_parallel)
    batch = one_sequence_batch(vocab_size(model_path), seq_len)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # (the model built, nothing trained yet)
    policy.train_micro_batch(batch, LOSS)  # (warm-up: the optimizer's state is made in its first step)
    policy.optimizer_step()
    times = []
    for _ in range(repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        policy.train_micro_batch(batch, LOSS)
        policy.optimizer_step()
        times.append(time.perf_counter() - start)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    return {"times": times, "peak_growth_bytes": grown, "peak_bytes": before * 1024 + grown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from support.actor_run import spawn

    from rlinf_pipe.models.tiny import ensure_tiny_model

    model = str(ensure_tiny_model(None, arch="qwen3", max_position_embeddings=max(512, args.seq_len)))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (parallel, extra) in CASES.items():
            world = parallel.get("tp", 1) * parallel.get("cp", 1)
            ranks = spawn(world, _steps, f"{tmp}/{name}", parallel=parallel, model_path=model,
                          seq_len=args.seq_len, repeats=args.repeats, **extra)
            times = ranks[0]["times"]
            median = statistics.median(times)
            results[name] = {"ranks": world, "step_s": median, "spread_s": [min(times), max(times)],
                             "tokens_per_s": args.seq_len / median,
                             "peak_growth_gib_per_rank": max(r["peak_growth_bytes"] for r in ranks) / 2**30}
            if not args.json:
                r = results[name]
                print(f"{name:7} ranks {world}  step {median:.2f} s ({min(times):.2f}-{max(times):.2f})  "
                      f"{r['tokens_per_s']:.0f} tokens/s  peak growth {r['peak_growth_gib_per_rank']:.2f} GiB/rank")
    summary = {"seq_len": args.seq_len, "repeats": args.repeats, "cases": results}
    print(json.dumps(summary) if args.json else "")


if __name__ == "__main__":
    main()
