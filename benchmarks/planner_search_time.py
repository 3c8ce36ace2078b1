"""How long `rlinf-pipe plan --search` takes on a large cluster: 128 nodes x 8 GPUs (1,024), RLinf's worked example
scaled up (batch 512 x 16, 4 mini-batches, 8,192-token responses, a 1.5B model), the default H100 costs. The issue's
target: at most 10 s. Prints one JSON line per cluster size; the last is the 1,024-GPU one.

    .venv/bin/python benchmarks/planner_search_time.py [--nodes 16 128]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlinf_pipe.config import load_config
from rlinf_pipe.planning.costs import default_costs
from rlinf_pipe.planning.search import search

CONFIG = Path(__file__).resolve().parents[1] / "examples/math/config/rlinf-example-128.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 128])
    args = parser.parse_args()
    for nodes in args.nodes:
        started = time.perf_counter()
        cfg = load_config(CONFIG.parent, CONFIG.stem, [f"cluster.num_nodes={nodes}"])
        result = search(cfg, default_costs(cfg, "H100"), 80 * 10**9, top=5)
        total = time.perf_counter() - started
        best = result.ranked[0]
        print(json.dumps({"gpus": nodes * 8, "seconds": round(total, 2), "search_seconds": round(result.seconds, 2),
                          "enumerated": result.enumerated, "simulated": result.simulated,
                          "refused_rules": result.refused_rules, "refused_memory": result.refused_memory,
                          "pruned": result.pruned, "budget_hit": result.budget_hit,
                          "best": best.candidate.placement(), "best_step_s": round(best.prediction.step_s, 2)}))


if __name__ == "__main__":
    main()
