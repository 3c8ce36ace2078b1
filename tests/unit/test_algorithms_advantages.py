"""Advantage estimators: hand-computed values, degenerate groups, registry, and finiteness for any input."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlinf_pipe.algorithms import (
    advantage_scope,
    compute_advantages,
    get_advantage,
    group_stats,
    register_advantage,
    registered_advantages,
)
from rlinf_pipe.algorithms import advantages as adv_mod

BUILTIN = ["dr_grpo", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"]

# Two groups: [1, 0, 1, 1] (mean 0.75) and [0, 0, 0] (uniform).
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1])


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test disappear after it."""
    monkeypatch.setattr(adv_mod, "_REGISTRY", dict(adv_mod._REGISTRY))
    monkeypatch.setattr(adv_mod, "_SCOPES", dict(adv_mod._SCOPES))


def close(actual: torch.Tensor, expected: list[float], tol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def test_builtin_names() -> None:
    assert registered_advantages() == BUILTIN


def test_each_builtin_is_the_estimators_function_of_its_name_loaded_on_first_use() -> None:
    from rlinf_pipe.algorithms import estimators

    assert sorted(adv_mod.BUILTIN_ESTIMATORS) == BUILTIN
    for name in BUILTIN:
        assert get_advantage(name) is getattr(estimators, name) and adv_mod._REGISTRY[name] is get_advantage(name)


def test_grpo_hand_values() -> None:
    # group 0: deviations [.25, -.75, .25, .25], sum of squares .75, unbiased var .75 / 3 = .25, std .5
    close(compute_advantages("grpo", REWARDS, GROUPS, eps=0.0), [0.5, -1.5, 0.5, 0.5, 0, 0, 0])
    # default eps = 1e-6 in the denominator: .25 / (.5 + 1e-6)
    d = 0.5 + 1e-6
    close(compute_advantages("grpo", REWARDS, GROUPS), [0.25 / d, -0.75 / d, 0.25 / d, 0.25 / d, 0, 0, 0])


def test_dr_grpo_is_grpo_without_std() -> None:
    expected = [0.25, -0.75, 0.25, 0.25, 0, 0, 0]
    close(compute_advantages("grpo", REWARDS, GROUPS, norm_by_std=False), expected)
    close(compute_advantages("dr_grpo", REWARDS, GROUPS), expected)


def test_rloo_hand_values() -> None:
    # 1 - mean(0, 1, 1) = 1/3; 0 - mean(1, 1, 1) = -1
    close(compute_advantages("rloo", REWARDS, GROUPS), [1 / 3, -1, 1 / 3, 1 / 3, 0, 0, 0])


def test_reinforce_plus_plus_hand_values() -> None:
    # batch mean 3/7, deviations 4/7 and -3/7, unbiased var (3*16/49 + 4*9/49) / 6 = 2/7 -> 4/sqrt(14), -3/sqrt(14)
    hi, lo = 4 / math.sqrt(14), -3 / math.sqrt(14)
    close(compute_advantages("reinforce_plus_plus", REWARDS, GROUPS, eps=0.0), [hi, lo, hi, hi, lo, lo, lo])


def test_reinforce_plus_plus_baseline_hand_values() -> None:
    # group-centred [.25, -.75, .25, .25, 0, 0, 0], batch unbiased var .75 / 6 = .125, std 1/(2 sqrt 2)
    a = 1 / math.sqrt(2)
    close(compute_advantages("reinforce_plus_plus_baseline", REWARDS, GROUPS, eps=0.0), [a, -3 * a, a, a, 0, 0, 0])


def test_std_is_unbiased() -> None:
    # [0, 2]: biased std 1, unbiased std sqrt(2) -> advantages +-1/sqrt(2)
    close(compute_advantages("grpo", torch.tensor([0.0, 2.0]), torch.tensor([5, 5]), eps=0.0), [-(0.5**0.5), 0.5**0.5])
    s = group_stats(torch.tensor([0.0, 2.0, 7.0]), torch.tensor([1, 1, 2]))
    close(s.std, [math.sqrt(2), 0.0])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_degenerate_groups_give_zero(name: str) -> None:
    # a uniform group of awkward floats (their mean is not exactly 0.1 in float32) and a group of one
    rewards = torch.tensor([0.1] * 7 + [3.0])
    groups = torch.tensor([4] * 7 + [9])
    out = compute_advantages(name, rewards, groups)
    assert torch.equal(out, torch.zeros(8)), out


@pytest.mark.parametrize("name", BUILTIN)
def test_degenerate_batches_give_zero(name: str) -> None:
    uniform, single = torch.tensor([0.1] * 7), torch.tensor([5.0])
    assert torch.equal(compute_advantages(name, uniform, torch.arange(7) % 2), torch.zeros(7))
    assert torch.equal(compute_advantages(name, single, torch.tensor([3])), torch.zeros(1))


def test_reinforce_plus_plus_baseline_is_the_batch() -> None:
    # the uniform group [0.1] * 7 is not zeroed: its baseline is the batch mean (0.1 * 7 + 3) / 8
    out = compute_advantages("reinforce_plus_plus", torch.tensor([0.1] * 7 + [3.0]), torch.tensor([4] * 7 + [9]))
    assert (out[:7] < 0).all() and out[7] > 0


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_ignore_id_values_and_order(name: str) -> None:
    perm = torch.tensor([6, 2, 0, 5, 1, 3, 4])
    base = compute_advantages(name, REWARDS, GROUPS)
    shuffled = compute_advantages(name, REWARDS[perm], GROUPS[perm] * 1000 - 7)
    torch.testing.assert_close(shuffled, base[perm])


def test_dtype_and_empty_batch() -> None:
    assert compute_advantages("grpo", REWARDS.double(), GROUPS).dtype == torch.float64
    assert compute_advantages("rloo", torch.tensor([1, 0]), torch.tensor([0, 0])).dtype == torch.float32
    for name in BUILTIN:
        assert compute_advantages(name, torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="same length"):
        compute_advantages("grpo", REWARDS, GROUPS[:3])
    with pytest.raises(ValueError, match="integer"):
        compute_advantages("grpo", REWARDS, GROUPS.float())
    with pytest.raises(ValueError, match="finite"):
        compute_advantages("grpo", torch.tensor([float("nan"), 1.0]), torch.tensor([0, 0]))
    with pytest.raises(TypeError):
        compute_advantages("rloo", REWARDS, GROUPS, norm_by_std=False)


def test_unknown_name_lists_registered_and_closest() -> None:
    with pytest.raises(ValueError) as info:
        get_advantage("rlooo")
    msg = str(info.value)
    assert "'rlooo'" in msg and "closest: 'rloo'" in msg
    for name in BUILTIN:
        assert name in msg


def test_register_custom_estimator(isolated_registry: None) -> None:
    @register_advantage("best_of_group")
    def best_of_group(rewards: torch.Tensor, group_ids: torch.Tensor, *, bonus: float = 1.0) -> torch.Tensor:
        s = group_stats(rewards, group_ids)
        best = torch.zeros(s.num_groups).scatter_reduce(0, s.index, rewards, "amax", include_self=False)
        return (rewards == best[s.index]).to(rewards.dtype) * bonus

    assert "best_of_group" in registered_advantages()
    assert get_advantage("best_of_group") is best_of_group
    close(compute_advantages("best_of_group", REWARDS, GROUPS, bonus=2.0), [2, 0, 2, 2, 2, 2, 2])
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("best_of_group")(best_of_group)
    register_advantage("best_of_group", override=True)(best_of_group)
    assert advantage_scope("best_of_group") == "group"
    register_advantage("whole_batch", scope="batch")(best_of_group)
    assert advantage_scope("whole_batch") == "batch"
    with pytest.raises(ValueError, match="scope"):
        register_advantage("x", scope="step")  # type: ignore[arg-type]


def test_scopes_of_builtins() -> None:
    assert [advantage_scope(n) for n in BUILTIN] == ["group", "group", "batch", "batch", "group"]
    with pytest.raises(ValueError, match="unknown"):
        advantage_scope("nope")


def test_docs_snippet_runs(isolated_registry: None) -> None:
    """The registration example of docs/algorithms.md runs as written."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()
    snippet = re.search(r"<!-- register-example -->\s*```python\n(.*?)```", text, re.S)
    assert snippet, "docs/algorithms.md lost its register-example snippet"
    exec(compile(snippet.group(1), "docs/algorithms.md", "exec"), {})
    assert "centered_clip" in registered_advantages()


rewards_and_groups = st.integers(min_value=1, max_value=24).flatmap(
    lambda n: st.tuples(
        st.lists(
            st.one_of(st.floats(-1e6, 1e6, allow_nan=False, width=32), st.sampled_from([0.0, 1.0, 0.1])),
            min_size=n,
            max_size=n,
        ),
        st.lists(st.integers(-3, 3), min_size=n, max_size=n),
    )
)


@settings(max_examples=150, deadline=None)
@given(rewards_and_groups, st.sampled_from(BUILTIN), st.sampled_from([torch.float32, torch.float64]))
def test_advantages_are_finite_and_zero_on_uniform_groups(
    data: tuple[list[float], list[int]], name: str, dtype: torch.dtype
) -> None:
    rewards, groups = torch.tensor(data[0], dtype=dtype), torch.tensor(data[1])
    out = compute_advantages(name, rewards, groups)
    assert out.shape == rewards.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), out
    if name == "reinforce_plus_plus":
        return  # batch baseline: a uniform group need not get 0
    s = group_stats(rewards, groups)
    assert (out[s.uniform[s.index]] == 0).all()
    if name in ("grpo", "dr_grpo", "rloo"):  # group-relative: advantages of each group sum to ~0
        sums = torch.zeros(s.num_groups, dtype=torch.float64).index_add(0, s.index, out.double())
        scale = 1.0 if name == "grpo" else max(1.0, float(rewards.abs().max()))
        assert (sums.abs() <= 1e-3 * scale * s.count).all(), sums


@settings(max_examples=100, deadline=None)
@given(rewards_and_groups, st.sampled_from([n for n in BUILTIN if advantage_scope(n) == "group"]))
def test_group_scoped_estimators_can_run_group_by_group(data: tuple[list[float], list[int]], name: str) -> None:
    """What a streaming runner relies on: each group alone gives the same advantages as the whole batch."""
    rewards, groups = torch.tensor(data[0], dtype=torch.float64), torch.tensor(data[1])
    whole = compute_advantages(name, rewards, groups)
    for g in groups.unique():
        part = groups == g
        torch.testing.assert_close(compute_advantages(name, rewards[part], groups[part]), whole[part])


def test_reward_metrics_by_hand():
    from rlinf_pipe.algorithms import reward_metrics

    # groups: [1, 0, 1, 1] (mixed) and [0, 0, 0] (uniform); 7 rewards, mean 3/7
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    metrics = reward_metrics(rewards, torch.tensor([0, 0, 0, 0, 1, 1, 1]))
    mean = 3 / 7
    std = math.sqrt((3 * (1 - mean) ** 2 + 4 * mean**2) / 6)
    assert metrics == pytest.approx({"reward/mean": mean, "reward/std": std, "reward/uniform_group_frac": 0.5})
