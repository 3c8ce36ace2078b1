"""How fast a dataset's prompts are rendered and tokenized at launch: `PromptRenderer.encode_many` (what loading a
dataset file does) against `encode` one prompt at a time (what it did until 2026-11-29), the same ids.

    python benchmarks/prompt_encoding.py [--prompts 20000] [--repeats 3] [--model PATH] [--template chat] [--json]

The prompts are GSM8K-sized word problems, each a little different; the tokenizer is the warm-started tiny model's
(a Qwen2 fast tokenizer with its chat template) or `--model`'s. Each repeat times both ways, alternating; reported:
the medians with their ranges, microseconds a prompt and the ratio. With --json the last printed line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rlinf_pipe.data.templates import CHAT, PromptRenderer


def word_problems(n: int) -> list[str]:
    return [f"Natalia sold clips to {i} of her friends in April, and then she sold half as many clips in May. How "
            f"many clips did Natalia sell altogether in April and May, if {i % 7} were returned?" for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="a model folder whose tokenizer to use (default: the tiny one)")
    parser.add_argument("--template", default=CHAT)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    if args.model is None:
        from rlinf_pipe.config.schema import DataConfig
        from rlinf_pipe.models.warmstart import ensure_warm_tiny_model

        args.model = str(ensure_warm_tiny_model(None, DataConfig()))
    renderer = PromptRenderer(AutoTokenizer.from_pretrained(args.model), args.template)
    prompts = word_problems(args.prompts)
    times: dict[str, list[float]] = {"together": [], "one_at_a_time": []}
    for _ in range(args.repeats):
        start = time.perf_counter()
        together = renderer.encode_many(prompts)
        times["together"].append(time.perf_counter() - start)
        start = time.perf_counter()
        one_at_a_time = [renderer.encode(p) for p in prompts]
        times["one_at_a_time"].append(time.perf_counter() - start)
        if together != one_at_a_time:
            raise SystemExit("encode_many gave other ids than encode")
    result: dict[str, object] = {"prompts": args.prompts, "model": args.model}
    for key, values in times.items():
        result[f"{key}_s"] = statistics.median(values)
        result[f"{key}_range_s"] = [min(values), max(values)]
        result[f"{key}_us_per_prompt"] = statistics.median(values) / args.prompts * 1e6
    result["ratio"] = statistics.median(times["one_at_a_time"]) / statistics.median(times["together"])
    print(f"{args.prompts} prompts: together {result['together_s']:.2f} s ({result['together_us_per_prompt']:.0f} us "
          f"a prompt), one at a time {result['one_at_a_time_s']:.2f} s "
          f"({result['one_at_a_time_us_per_prompt']:.0f} us): {result['ratio']:.2f}x")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
