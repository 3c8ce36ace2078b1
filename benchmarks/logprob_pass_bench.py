"""A forward-only log-prob pass (`MegatronPolicy.compute_logprobs`) whose micro-batches keep their own shape, against
the same pass with every micro-batch padded to one shape, as a pipeline-parallel schedule needs them.

    python benchmarks/logprob_pass_bench.py [--model tiny|warm|smollm2] [--rows 64] [--budget 576]
        [--max-prompt 64] [--max-response 512] [--group-size 8] [--repeats 10] [--json]

One process, a gloo world of one rank (TP = PP = 1), fp32 CPU, packed sequences with shared prompts (the defaults).
The batch imitates long-tailed GRPO rollouts at a scale a CPU handles: groups of `group-size` rows sharing a prompt
of up to `max-prompt` tokens, responses drawn long-tailed up to `max-response` (half the rows under a sixth of it),
in log-prob micro-batches of at most `budget` real tokens (the qwen2.5-1.5b examples: 9216-token budget, 1024 +
8192-token rows; these defaults are those divided by 16). Both passes run the same micro-batches; the baseline's
streams carry filler up to the longest (`same_shape=True` in `model_inputs.logprob_micro_batches`, what a
single-stage pass did before). Reported: each pass's median time over `--repeats` (alternating), the ratio
(own / equal shapes: < 1 is faster), the filler fraction of the equal-shape pass (filler tokens / tokens run), and
the largest difference between the two passes' log-probs. With --json the last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megatron_step_bench import init_megatron, model_folder  # noqa: E402

from rlinf_pipe.data.train_batch import TrainBatch  # noqa: E402


def long_tailed_batch(rows: int, group_size: int, max_prompt: int, max_response: int, vocab: int) -> TrainBatch:
    """Right-padded groups of rows sharing a prompt, responses long-tailed (an exponential draw, capped)."""
    g = torch.Generator().manual_seed(0)
    groups = -(-rows // group_size)
    prompts = torch.randint(max(2, max_prompt // 4), max_prompt + 1, (groups,), generator=g).repeat_interleave(
        group_size)[:rows]
    responses = (torch.empty(rows).exponential_(generator=g) * max_response / 4).long().clamp(1, max_response)
    width = int((prompts + responses).max())
    columns = torch.arange(width)[None, :]
    valid = columns < (prompts + responses)[:, None]
    response_mask = valid & (columns >= prompts[:, None])
    first = torch.arange(rows) // group_size * group_size
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    ids = torch.where(columns < prompts[:, None], ids[first], ids).masked_fill(~valid, 0)
    zeros = torch.zeros(rows, width)
    return TrainBatch(input_ids=ids, attention_mask=valid, response_mask=response_mask, old_logprobs=zeros,
                      advantages=zeros, rewards=torch.zeros(rows), version=0, num_sequences=rows,
                      num_tokens=int(response_mask.sum()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny", "warm", "smollm2"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--budget", type=int, default=576, help="log-prob micro-batch budget (real tokens)")
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--max-response", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    init_megatron()
    from rlinf_pipe.engines.policy.model_inputs import logprob_micro_batches, packing
    from rlinf_pipe.engines.policy.policy import MegatronPolicy

    policy = MegatronPolicy(model_folder(args.model, "qwen2"), train=False, params_dtype="float32",
                            logprob_max_tokens=args.budget)
    batch = long_tailed_batch(args.rows, args.group_size, args.max_prompt, args.max_response, policy.vocab_size)
    packed, shared = packing(batch, True, True)
    _, equal = logprob_micro_batches(batch, args.budget, packed, policy.device, shared, same_shape=True)
    _, own = logprob_micro_batches(batch, args.budget, packed, policy.device, shared, same_shape=False)
    run_tokens = sum(m.shape[0] * m.shape[1] for m in equal)
    real_tokens = sum(m.shape[0] * m.shape[1] for m in own)

    def timed(pp_size: int) -> tuple[float, torch.Tensor]:
        policy.pp_size = pp_size  # (only the shape rule reads it: one stage's schedule runs either way)
        t0 = time.perf_counter()
        lp = policy.compute_logprobs(batch)
        return time.perf_counter() - t0, lp

    times: dict[str, list[float]] = {"own": [], "equal": []}
    timed(1), timed(2)  # warm-up
    for i in range(args.repeats):
        for name in (("own", "equal") if i % 2 == 0 else ("equal", "own")):
            seconds, lp = timed(1 if name == "own" else 2)
            times[name].append(seconds)
            if name == "own":
                lp_own = lp
            else:
                lp_equal = lp
    policy.pp_size = 1
    med = {k: statistics.median(v) for k, v in times.items()}
    summary = {
        "own_shape_s": round(med["own"], 5), "equal_shape_s": round(med["equal"], 5),
        "own_s_range": [round(min(times["own"]), 5), round(max(times["own"]), 5)],
        "equal_s_range": [round(min(times["equal"]), 5), round(max(times["equal"]), 5)],
        "ratio_own_over_equal": round(med["own"] / med["equal"], 3),
        "micro_batches": len(own), "filler_fraction": round(1 - real_tokens / run_tokens, 4),
        "max_abs_diff": float((lp_own - lp_equal).abs().max()),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}, "
                   f"torch {torch.__version__}, {torch.get_num_threads()} torch threads",
    }
    print(f"{len(own)} micro-batches of at most {args.budget} real tokens; equal shapes add "
          f"{summary['filler_fraction']:.1%} filler")
    print(f"own shapes {med['own'] * 1e3:.1f} ms, equal shapes {med['equal'] * 1e3:.1f} ms: ratio "
          f"{summary['ratio_own_over_equal']:.3f}; log-probs differ by at most {summary['max_abs_diff']:.2e}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
