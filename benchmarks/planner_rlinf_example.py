"""RLinf's worked example through our planner: 128 GPUs, actor 101 s, rollout 224 s, inference 10 s per step measured
collocated (`--costs 101,224,10`), batch 512 x 16 in 4 mini-batches (examples/math/config/rlinf-example-128.yaml).
Prints our best candidates and our prediction of RLinf's answer (rollout 80 / inference 16 / actor 32) from the
same costs, and RLinf's own estimate by its rule (each stage's collocated seconds scaled by 128 / its GPUs, the
largest stage taken as the step). One JSON line.

    .venv/bin/python benchmarks/planner_rlinf_example.py
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rlinf_pipe.config import load_config
from rlinf_pipe.planning.rlinf_costs import rlinf_costs
from rlinf_pipe.planning.run_plan import plan_run
from rlinf_pipe.planning.search import search
from rlinf_pipe.planning.simulate import simulate

CONFIG = Path(__file__).resolve().parents[1] / "examples/math/config/rlinf-example-128.yaml"
ACTOR_S, ROLLOUT_S, INFERENCE_S, GPUS = 101.0, 224.0, 10.0, 128
RLINF = {"rollout": "0-79", "inference": "80-95", "actor": "96-127"}


def main() -> None:
    cfg = load_config(CONFIG.parent, CONFIG.stem)
    costs = rlinf_costs(ACTOR_S, ROLLOUT_S, INFERENCE_S, GPUS, cfg)
    result = search(cfg, costs, 80 * 10**9, top=5)
    theirs = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, component_placement=dict(RLINF)))
    predicted = simulate(theirs, plan_run(theirs), costs)
    ahead = dataclasses.replace(theirs, runner=dataclasses.replace(theirs.runner, max_staleness=1))
    predicted_ahead = simulate(ahead, plan_run(ahead), costs)
    rule = max(ROLLOUT_S * GPUS / 80, INFERENCE_S * GPUS / 16, ACTOR_S * GPUS / 32)
    print(json.dumps({
        "ours": [{"placement": r.candidate.placement(), "parallel": dict(r.candidate.sizes),
                  "predicted_step_s": round(r.prediction.step_s, 1), "bubble": round(r.prediction.bubble, 3)}
                 for r in result.ranked],
        "rlinf_answer": RLINF, "rlinf_answer_predicted_by_us_s": round(predicted.step_s, 1),
        "rlinf_answer_bubble_by_us": round(predicted.bubble, 3),
        "rlinf_answer_staleness_1_predicted_by_us_s": round(predicted_ahead.step_s, 1),
        "rlinf_rule_estimate_s": round(rule, 1),
        "collocated_measured_s": ACTOR_S + ROLLOUT_S + INFERENCE_S, "search_seconds": round(result.seconds, 1),
        "budget_hit": result.budget_hit, "source": costs.source}))


if __name__ == "__main__":
    main()
