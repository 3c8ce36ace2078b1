"""Write small dataset files in verl's and RLinf's record formats, to train on with your own reward.

    .venv/bin/python examples/math/reward/make_data.py [OUT_DIR] [--count N]     # OUT_DIR: outputs/byo-data

writes, from arithmetic problems (`What is 7 + 3?`, which the tiny model learns in a few dozen steps):

- OUT_DIR/train.parquet, verl's layout: `data_source`, `prompt` (chat messages), `ability`,
  `reward_model.ground_truth`, `extra_info` (split, index);
- OUT_DIR/train.jsonl, RLinf's math layout: `prompt` and a `solutions` list (a response is correct when it matches
  any of them).

Train on either with only `data.dataset` set (the record schema is detected), e.g. with the verl-style reward
function beside this script: `examples/math/config/tiny-grpo-verl-data.yaml` (see docs/reward.md).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlinf_pipe.data.arithmetic import ArithmeticSpec, Problem, generate_problem
from rlinf_pipe.data.templates import DEFAULT_SYSTEM_PROMPT


def problems(count: int, seed: int = 0) -> list[Problem]:
    """`count` two-operand +/- problems with operands 1..10 (the tiny model's warm start)."""
    spec = ArithmeticSpec(min_value=1, max_value=10)
    return [generate_problem(spec, random.Random(f"byo-data:{seed}:{i}")) for i in range(count)]


def verl_records(items: list[Problem]) -> list[dict]:
    """verl's layout. The system message is the one the tiny model was warm-started with (a record's own messages
    are rendered as given: `data.system_prompt` is not added to them)."""
    return [{
        "data_source": "arithmetic",
        "prompt": [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                   {"role": "user", "content": f"What is {p.expression}?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
        "extra_info": {"split": "train", "index": i},
    } for i, p in enumerate(items)]


def rlinf_records(items: list[Problem]) -> list[dict]:
    """RLinf's math layout, with two equal ways of writing each answer."""
    return [{"prompt": f"What is {p.expression}?", "solutions": [str(p.answer), f"{p.answer}.0"]} for p in items]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default="outputs/byo-data", help="folder to write the files in")
    parser.add_argument("--count", type=int, default=256, help="problems per file")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = problems(args.count)
    pq.write_table(pa.Table.from_pylist(verl_records(items)), out / "train.parquet")
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rlinf_records(items)))
    print(f"wrote {out / 'train.parquet'} (verl) and {out / 'train.jsonl'} (RLinf math), {len(items)} problems each")


if __name__ == "__main__":
    main()
