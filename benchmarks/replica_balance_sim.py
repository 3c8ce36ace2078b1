"""How evenly actor replicas share a mini-batch's tokens: by slot (round-robin) against by tokens
(`algorithm.replica_routing: tokens`, `rlinf_pipe.data.routing.TokenBalance`), on simulated GRPO mini-batches.

    python benchmarks/replica_balance_sim.py [--groups 32] [--replicas 8] [--group-size 16] [--trials 2000]
        [--seed 0] [--arrival shortest-first|random] [--json]

No model runs: the figure that matters is the busiest replica's tokens over the mean (`max / mean`), since every
replica waits for the busiest at the optimizer step, and a replica's training time grows with its tokens. Each
trial draws one mini-batch of `groups` groups (the qwen2.5-1.5b 4-node example: 32 groups of 16 samples over 8
replicas). Response lengths vary mostly by prompt, as a reasoning model's do: each prompt draws a typical length
(easy 300-1500 tokens, medium 1500-5000, hard 4000-8192, equally likely), each sample that length with a 50%
spread, capped at 8192, plus a 300-token prompt. By slot, groups go round-robin in slot order (which says nothing of
their lengths); by tokens, they arrive in the order they finish generating, about shortest first (each group's
length times a random factor in 0.8-1.2; `--arrival random`: in random order), and `TokenBalance` places each.
Reported: the median and 90th percentile of max / mean for each routing over the trials. With --json the last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from rlinf_pipe.data.routing import TokenBalance, TrainRouting
from rlinf_pipe.utils.metrics import max_over_mean


def group_tokens(rng: random.Random, group_size: int) -> int:
    typical = rng.choice([rng.uniform(300, 1500), rng.uniform(1500, 5000), rng.uniform(4000, 8192)])
    return int(sum(min(8192.0, max(50.0, rng.gauss(typical, typical * 0.5))) + 300 for _ in range(group_size)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arrival", choices=["shortest-first", "random"], default="shortest-first")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    routing = TrainRouting(args.groups, 1, args.replicas)
    by_slot: list[float] = []
    by_tokens: list[float] = []
    for _ in range(args.trials):
        tokens = [group_tokens(rng, args.group_size) for _ in range(args.groups)]
        loads = [0] * args.replicas
        for slot, t in enumerate(tokens):
            loads[routing.replica_of(slot)] += t
        by_slot.append(max_over_mean(loads))
        balance = TokenBalance(routing)
        order = list(range(args.groups))
        if args.arrival == "random":
            rng.shuffle(order)
        else:
            order.sort(key=lambda s: tokens[s] * rng.uniform(0.8, 1.2))
        for slot in order:
            balance.assign(slot, tokens[slot])
        by_tokens.append(max_over_mean(balance.tokens[0]))

    def summary(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {"median": round(statistics.median(values), 3), "p90": round(ordered[int(0.9 * len(values))], 3)}

    result = {"by_slot": summary(by_slot), "by_tokens": summary(by_tokens),
              "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    print(f"busiest replica's tokens / mean, {args.groups} groups of {args.group_size} over {args.replicas} replicas, "
          f"{args.trials} mini-batches: by slot {result['by_slot']['median']} (p90 {result['by_slot']['p90']}), "
          f"by tokens {result['by_tokens']['median']} (p90 {result['by_tokens']['p90']})")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
