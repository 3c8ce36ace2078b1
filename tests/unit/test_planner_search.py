"""plan --search: the shapes enumerated, pruning that never loses the best, candidates that pass `plan`."""

from __future__ import annotations

import json
import re

from rlinf_pipe.config import load_config
from rlinf_pipe.planning.costs import default_costs
from rlinf_pipe.planning.run_plan import plan_run
from rlinf_pipe.errors import RlinfPipeError
from rlinf_pipe.planning.search import _model, candidate_config, enumerate_candidates, search
from rlinf_pipe.planning.simulate import simulate
from rlinf_pipe.planning.search_space import neighbours, shapes, split_unit

SEED = "examples/math/config/qwen2.5-1.5b-grpo-megatron-pipeline.yaml"


def test_the_shapes_of_four_gpus():
    found = {(s.mode, s.ranges) for s in shapes(4, 1, logprob_stage=True)}
    # collocated 1; for each of 3 first ranges: rollout + actor, and the two hybrids (9); 3-way splits: 2 + 1 (3)
    assert len(found) == 13
    assert ("disaggregated", (("rollout", 2), ("inference", 1), ("actor", 1))) in found
    assert ("hybrid", (("rollout,inference", 3), ("actor", 1))) in found
    assert len(shapes(4, 1, logprob_stage=False)) == 4  # no inference: collocated and three 2-way splits
    assert [s.placement() for s in shapes(4, 2, False)] == [{"actor,rollout": "0-3"},
                                                            {"rollout": "0-1", "actor": "2-3"}]


def test_the_unit_coarsens_with_the_cluster_and_neighbours_refine():
    assert (split_unit(32), split_unit(128), split_unit(1024)) == (1, 4, 32)
    shape = shapes(16, 4, False)[2]  # rollout 8, actor 8
    assert {s.counts()["rollout"] for s in neighbours(shape, 16, 4, 2)} == {4, 6, 8, 10, 12}


def test_pruning_never_loses_the_best_a_full_search_finds():
    cfg = load_config(overrides=["cluster.num_gpus_per_node=6", "algorithm.n_minibatches=2",
                                 "data.rollout_batch_size=12"])
    costs = default_costs(cfg, "cpu")
    # every candidate simulated, by hand: the best prediction of each placement
    best: dict = {}
    # (the same space the search has: the tiny model's sizes, TP 4 refused by its 2 key/value heads)
    candidates = enumerate_candidates(cfg, costs, shapes(6, 1, True), True, _model(cfg)[1], 0.0)
    for cand in candidates:
        trial = candidate_config(cfg, cand)
        try:
            plan = plan_run(trial)
        except RlinfPipeError:
            continue
        step = simulate(trial, plan, costs).step_s
        best[cand.shape] = min(best.get(cand.shape, step), step)
    pruned = search(cfg, costs, 80 * 10**9, top=3)
    assert pruned.pruned > 0 and pruned.simulated < len(candidates)
    assert [r.prediction.step_s for r in pruned.ranked] == sorted(best.values())[:3]


def test_every_candidate_for_the_seed_cluster_passes_plan():
    from rlinf_pipe.runner.preflight import preflight

    cfg = load_config(".", SEED)
    result = search(cfg, default_costs(cfg, "H100"), 80 * 10**9, top=5)
    assert len(result.ranked) == 5
    steps = [r.prediction.step_s for r in result.ranked]
    assert steps == sorted(steps)
    for r in result.ranked:
        loaded = load_config(".", SEED, r.candidate.overrides())  # the overrides turn the config into it
        assert loaded.cluster.component_placement == {**r.candidate.placement()}
        preflight(loaded, files=False)
        plan_run(loaded)


def test_search_json_from_the_command_line(capsys):
    from rlinf_pipe.cli import main

    assert main(["plan", "--search", "--json", "--top", "2", "--gpus", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["candidates"]) == 2 and out["source"].startswith("default:")
    first = out["candidates"][0]
    assert {"component_placement", "overrides", "predicted_step_s", "bubble", "tokens_per_s", "source"} <= set(first)
    assert first["predicted_step_s"] <= out["candidates"][1]["predicted_step_s"]


def test_candidates_within_ten_percent_of_the_best_are_called_a_tie():
    import dataclasses

    from rlinf_pipe.planning.search_report import render_search, search_json

    cfg = load_config(".", SEED)
    costs = default_costs(cfg, "H100")
    result = search(cfg, costs, 80 * 10**9, top=3)
    result.ranked = [dataclasses.replace(r, prediction=dataclasses.replace(r.prediction, step_s=s))
                     for r, s in zip(result.ranked, (10.0, 10.8, 11.5))]
    text = render_search(result, costs)
    table = text.split("\n\n")[1].splitlines()
    assert "step s  vs #1" in table[0] and [row.split()[0] for row in table[1:4]] == ["1", "2", "3"]
    assert re.search(r"10\.80 +\+8% ", table[2]) and re.search(r"11\.50 +\+15% ", table[3]) and "+" not in table[1]
    assert table[4].startswith("#2 is within 10% of #1: a tie within the prediction's accuracy")  # (under the table)
    out = search_json(result, costs)["candidates"]
    assert [c["tie_with_best"] for c in out] == [False, True, False]
    assert [round(c["behind_best"], 3) for c in out] == [0.0, 0.08, 0.15]
    result.ranked = result.ranked[::2]  # (10 and 11.5 s: no tie)
    assert "within 10%" not in render_search(result, costs)


def test_search_flags_without_search_are_refused(capsys):
    from rlinf_pipe.cli import main

    assert main(["plan", "--gpus", "4"]) == 2
    assert "--search" in capsys.readouterr().err


def test_the_largest_micro_batch_that_fits_is_found_by_bisection():
    from rlinf_pipe.models.arch import model_arch
    from rlinf_pipe.planning.memory import estimate_memory
    from rlinf_pipe.planning.micro_batch_budget import MICRO_BATCH_STEP, largest_micro_batch_tokens

    cfg = load_config(".", SEED)
    arch, _ = model_arch(cfg.actor.model_path)
    capacity = 80 * 10**9
    tokens = largest_micro_batch_tokens(cfg, arch, capacity)
    assert tokens is not None and tokens % MICRO_BATCH_STEP == 0

    def fits(n: int) -> bool:
        trial = load_config(".", SEED, [f"actor.micro_batch_tokens={n}"])
        return estimate_memory(trial, plan_run(trial), arch, capacity)["actor"].fits

    assert fits(tokens) and not fits(tokens + MICRO_BATCH_STEP)
    assert largest_micro_batch_tokens(cfg, arch, 10**9) is None  # 1 GB holds no sample's training


def test_with_staleness_the_rules_refuse_the_engines_taking_turns_with_the_actor():
    cfg = load_config(overrides=["cluster.num_gpus_per_node=4", "runner.max_staleness=1"])
    result = search(cfg, default_costs(cfg, "cpu"), 80 * 10**9, top=10)
    assert result.ranked and result.refused_rules > 0
    assert all("actor,rollout" not in r.candidate.placement() for r in result.ranked)


def test_the_search_sizes_memory_by_the_folders_dtype(tmp_path):
    """A float32 model folder is searched with 4 bytes a weight value, as `plan` estimates it: its candidates get
    smaller micro-batches than the same model in bfloat16."""
    known = json.loads(open("rlinf_pipe/models/known/DeepSeek-R1-Distill-Qwen-1.5B/config.json").read())
    chosen = {}
    for dtype in ("bfloat16", "float32"):
        folder = tmp_path / dtype
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**known, "torch_dtype": dtype}))
        cfg = load_config(".", SEED, [f"actor.model_path={folder}", "actor.params_dtype=float32"])
        result = search(cfg, default_costs(cfg, "H100"), 80 * 10**9, top=1)
        chosen[dtype] = dict(result.ranked[0].candidate.sizes)["actor.micro_batch_tokens"]
    assert chosen["float32"] < chosen["bfloat16"]
