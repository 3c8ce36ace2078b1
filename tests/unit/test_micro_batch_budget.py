"""`actor.micro_batch_tokens: auto` (`rlinf_pipe.planning.micro_batch_budget`): resolved before a run to the largest
budget the memory estimate fits, shown by `plan`, refused with the reason where it cannot be sized."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rlinf_pipe.cli import main
from rlinf_pipe.config import load_config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.models.arch import model_arch
from rlinf_pipe.planning.memory import estimate_memory
from rlinf_pipe.config.validate import token_budget
from rlinf_pipe.planning.micro_batch_budget import MICRO_BATCH_STEP, resolve_micro_batch_tokens
from rlinf_pipe.planning.run_plan import plan_run

SEED = "qwen2.5-1.5b-grpo-megatron-pipeline"


def seed(*overrides: str):
    return load_config("examples/math/config", SEED, list(overrides))


def test_auto_becomes_the_largest_budget_that_fits_and_a_number_stays():
    resolved = resolve_micro_batch_tokens(seed("actor.micro_batch_tokens=auto", "cluster.gpu_memory_gb=80"))
    tokens = resolved.actor.micro_batch_tokens
    assert isinstance(tokens, int) and tokens % MICRO_BATCH_STEP == 0
    arch, _ = model_arch(resolved.actor.model_path)

    def fits(n: int) -> bool:
        trial = seed(f"actor.micro_batch_tokens={n}", "cluster.gpu_memory_gb=80")
        return estimate_memory(trial, plan_run(trial), arch, 80 * 10**9)["actor"].fits

    assert fits(tokens) and not fits(tokens + MICRO_BATCH_STEP)
    kept = seed("actor.micro_batch_tokens=4096")
    assert resolve_micro_batch_tokens(kept) is kept
    with pytest.raises(ConfigError, match="was not resolved"):
        token_budget(seed("actor.micro_batch_tokens=auto").actor)  # (nothing reads it unresolved)


def test_auto_that_cannot_be_sized_says_why():
    with pytest.raises(ConfigError, match=r"not even one sample of \d+ tokens .* cluster.gpu_memory_gb"):
        resolve_micro_batch_tokens(seed("actor.micro_batch_tokens=auto", "cluster.gpu_memory_gb=2"))
    with pytest.raises(ConfigError, match="needs the model's config.json"):
        resolve_micro_batch_tokens(seed("actor.micro_batch_tokens=auto", "actor.model_path=/nowhere/model"))


def test_plan_shows_what_auto_became(capsys):
    assert main(["plan", "--config-name", SEED, "--no-files", "actor.micro_batch_tokens=auto",
                 "cluster.gpu_memory_gb=80", "--json"]) == 0
    tokens = json.loads(capsys.readouterr().out)["resolved"]["actor.micro_batch_tokens"]
    assert tokens == resolve_micro_batch_tokens(seed("actor.micro_batch_tokens=auto",
                                                     "cluster.gpu_memory_gb=80")).actor.micro_batch_tokens
    assert main(["plan", "--config-name", SEED, "--no-files", "actor.micro_batch_tokens=auto",
                 "cluster.gpu_memory_gb=80"]) == 0
    assert f"actor.micro_batch_tokens: auto -> {tokens} (the largest the memory estimate fits)" in capsys.readouterr().out


def test_a_search_of_an_auto_config_gives_each_candidate_the_largest_budget_it_fits():
    from rlinf_pipe.planning.costs import default_costs
    from rlinf_pipe.planning.search import candidate_config, search

    cfg = seed("actor.micro_batch_tokens=auto")
    result = search(cfg, default_costs(cfg, "H100"), 80 * 10**9, top=2)
    assert result.ranked
    for ranked in result.ranked:
        budget = dict(ranked.candidate.sizes)["actor.micro_batch_tokens"]
        fixed = candidate_config(cfg, ranked.candidate)
        assert budget == resolve_micro_batch_tokens(
            replace(fixed, actor=replace(fixed.actor, micro_batch_tokens="auto"),
                    cluster=replace(fixed.cluster, gpu_memory_gb=80))).actor.micro_batch_tokens
