"""Reward functions from a file (`reward.function: PATH.py:NAME`): called as verl calls them, in the reward pool's
processes under its time limit; a float or a dict (extra numeric keys are the step's `reward/<key>` means); a call
that raises is reported once with its file and line, counted and scored 0, or stops the caller with
`reward.fail_on_error`; a bad `reward.function` is refused before launch in one line."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from rlinf_pipe.algorithms.scoring import RewardTally
from rlinf_pipe.config import load_config
from rlinf_pipe.config.schema import RewardConfig
from rlinf_pipe.data.structs import PromptItem, RolloutGroup, RolloutSample
from rlinf_pipe.engines.reward import RewardContext, RewardFunctionError, check_reward_function, reward_pool
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.runner.preflight import preflight

ROOT = Path(__file__).resolve().parents[2]

REWARDS = '''\
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the response is the ground truth (or one of them); what it was given, to check the call."""
    truths = ground_truth if isinstance(ground_truth, list) else [ground_truth]
    if solution_str == "raise":
        raise ValueError(f"cannot score {solution_str!r}")  # RAISES HERE
    if solution_str == "hang":
        while True:
            time.sleep(0.01)
    if solution_str == "bad":
        return "not a number"
    if solution_str == "nan":
        return float("nan")
    if solution_str == "echo":
        return {"score": 0.5, "source_len": len(data_source), "index": extra_info["index"], "note": "text"}
    return float(solution_str in truths)

def with_extras(data_source, solution_str, ground_truth, extra_info):
    right = solution_str == ground_truth
    return {"score": 2.0 if right else -1.0, "acc": right, "length": len(solution_str), "pred": solution_str}

def other_names(source, response, truth, info):
    return 1.0 if response == truth else 0.0
'''


def line_of(text: str, marker: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), start=1) if marker in line)


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "my_reward.py"
    path.write_text(REWARDS)
    return path


def context(truth: object, source: str = "openai/gsm8k", index: int = 0) -> RewardContext:
    refs = tuple(map(str, truth)) if isinstance(truth, list) else (str(truth),)
    return RewardContext(refs, source, truth, {"split": "train", "index": index})


def pool_for(path: Path, name: str = "compute_score", **keys: object):
    return reward_pool(RewardConfig(function=f"{path}:{name}", timeout_s=keys.pop("timeout_s", 5.0), **keys))


def test_a_function_scores_floats_and_dicts_with_verls_arguments(rewards_file):
    with pool_for(rewards_file) as pool:
        results = pool.score_batch([("72", context("72")), ("71", context("72")), ("0.5", context(["1/2", "0.5"])),
                                    ("echo", context("1", source="abc", index=7))])
    assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.5]
    assert [r.correct for r in results] == [True, False, True, True]  # (no `acc`: a score above 0)
    assert results[3].extras == {"source_len": 3.0, "index": 7.0}  # numeric keys only
    assert all(r.error is None and not r.timed_out for r in results)


def test_positional_parameters_of_other_names_work_too(rewards_file):
    with pool_for(rewards_file, "other_names") as pool:
        assert [r.reward for r in pool.score_batch([("4", context("4")), ("5", context("4"))])] == [1.0, 0.0]


def test_extra_keys_become_the_steps_reward_means(rewards_file):
    with pool_for(rewards_file, "with_extras") as pool:
        results = pool.score_batch([("ab", context("ab")), ("abcd", context("ab")), ("a", context("ab"))])
    assert [r.reward for r in results] == [2.0, -1.0, -1.0] and [r.correct for r in results] == [True, False, False]
    tally = RewardTally()
    group = RolloutGroup.of(PromptItem(id="p", prompt="q", answer="ab", index=0, prompt_ids=[1]), [
        RolloutSample(response_ids=[1], logprobs=[0.0], finish_reason="stop", version=0) for _ in results])
    tally.add(group, [r.reward for r in results], [r.correct for r in results], [r.parsed for r in results],
              [r.timed_out for r in results], [r.error is not None for r in results], [r.extras for r in results])
    metrics = tally.merge(RewardTally()).metrics()
    assert metrics["reward/acc"] == pytest.approx(1 / 3) and metrics["reward/length"] == pytest.approx(7 / 3)
    assert "reward/pred" not in metrics and metrics["reward/accuracy"] == pytest.approx(1 / 3)
    assert metrics["reward/errors"] == 0.0 and metrics["reward/parse_failures"] == 0.0


def test_a_raising_function_is_reported_once_with_its_line_counted_and_scores_zero(rewards_file, caplog):
    with caplog.at_level(logging.WARNING), pool_for(rewards_file) as pool:
        results = pool.score_batch([("raise", context("1")), ("1", context("1")), ("raise", context("2"))])
        results += pool.score_batch([("raise", context("3")), ("bad", context("3"))])
        counters = pool.counters
    assert [r.reward for r in results] == [0.0, 1.0, 0.0, 0.0, 0.0]
    where = f"{rewards_file}:{line_of(REWARDS, 'RAISES HERE')} in compute_score"
    assert str(results[0].error) == f"{where}: ValueError: cannot score 'raise'"
    assert (counters.errors, counters.items, counters.parse_failures) == (4, 5, 0)
    raised = [r for r in caplog.records if "ValueError" in r.getMessage()]
    assert len(raised) == 1 and where in raised[0].getMessage()  # once, however often it raises there
    bad = [r for r in caplog.records if "bad return" in r.getMessage()]
    assert len(bad) == 1 and f"{rewards_file}:3 in compute_score: bad return: returned str 'not a number'" in \
        bad[0].getMessage()


def test_fail_on_error_stops_the_caller_with_the_failure(rewards_file):
    with pool_for(rewards_file, fail_on_error=True) as pool:
        assert pool.score_batch([("1", context("1"))])[0].reward == 1.0
        with pytest.raises(RewardFunctionError) as info:
            pool.score_batch([("1", context("1")), ("nan", context("1"))])
        assert pool.score_batch([("2", context("2"))])[0].reward == 1.0  # (the pool itself is fine)
    message = str(info.value)
    assert "\n" not in message and "returned float nan; return a float, or a dict with a numeric `score`" in message
    assert "reward.fail_on_error is true, so the run stops" in message


def test_a_hanging_function_times_out_and_the_pool_goes_on(rewards_file):
    with pool_for(rewards_file, timeout_s=1.0) as pool:
        results = pool.score_batch([("hang", context("1")), ("1", context("1"))])
        assert [(r.timed_out, r.reward) for r in results] == [(True, 0.0), (False, 1.0)]
        assert pool.counters.timeouts == 1 and pool.counters.restarts == 1


@pytest.mark.parametrize(("source", "value", "fragment"), [
    (None, "absent.py", "absent.py does not exist; give the Python file that defines the reward function"),
    (REWARDS, "{path}:missing", "has no 'missing' (its functions: compute_score, other_names, with_extras)"),
    (REWARDS + "\nscore_table = {}\n", "{path}:score_table", "score_table in {path} is dict, not a function"),
    ("def compute_score(solution_str):\n    return 1.0\n", "{path}",
     "compute_score in {path} takes (solution_str), so it cannot be called as compute_score(data_source, "
     "solution_str, ground_truth, extra_info)"),
    ("async def compute_score(a, b, c, d):\n    return 1.0\n", "{path}", "is an `async def`"),
    ("import no_such_module_anywhere\n", "{path}", "importing {path} failed at {path}:1: ModuleNotFoundError: No "
                                                   "module named 'no_such_module_anywhere'"),
    ("def compute_score(:\n", "{path}", "importing {path} failed at {path}:1: SyntaxError"),
    (None, "reward.txt", "'reward.txt' is not `PATH.py` or `PATH.py:NAME`"),
])
def test_a_bad_reward_function_is_refused_before_launch_in_one_line(tmp_path, source, value, fragment):
    path = tmp_path / "reward_fn.py"
    if source is not None:
        path.write_text(source)
    value = value.format(path=path) if "{path}" in value else str(tmp_path / value) if value.endswith(".py") \
        else value
    try:
        cfg = load_config(overrides=[f"reward.function={value}"])
    except ConfigError as exc:  # (a value that names no Python file at all)
        message = str(exc)
    else:
        preflight(cfg, files=False)  # (the file is read by the checks of files only: `plan --no-files` skips it)
        with pytest.raises(ConfigError) as info:
            preflight(cfg)
        message = str(info.value)
    assert message.startswith("reward.function: ") and "\n" not in message
    assert fragment.format(path=path) in message


def test_check_reward_function_takes_the_default_name_and_the_example_file():
    check_reward_function(str(ROOT / "examples/math/reward/verl_reward.py"))  # compute_score
    with pytest.raises(ConfigError, match="is not a Python function name"):
        check_reward_function("x.py:1abc")


def test_the_reward_type_is_a_registry_name():
    preflight(load_config(overrides=["reward.reward_type=math"]), files=False)
    with pytest.raises(ConfigError, match=r"reward.reward_type: no built-in reward named 'maths'; did you mean `math`"):
        preflight(load_config(overrides=["reward.reward_type=maths"]), files=False)


def test_relative_paths_become_absolute_when_the_config_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(overrides=["reward.function=rewards/mine.py:score_it"])
    assert cfg.reward.function == f"{tmp_path}/rewards/mine.py:score_it"


def test_plan_on_the_command_line_refuses_a_missing_file_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlinf_pipe.cli", "plan", f"reward.function={tmp_path}/no.py"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: reward.function: {tmp_path}/no.py does not exist; give the Python file that defines the reward "
        "function (`rlinf-pipe plan --no-files` skips the checks of files, to plan from a machine without them)"]


def test_the_example_reward_file_scores_as_documented():
    from rlinf_pipe.config.function_ref import parse_function_ref
    from rlinf_pipe.engines.reward.function import load_reward_function

    score, style = load_reward_function(parse_function_ref(str(ROOT / "examples/math/reward/verl_reward.py")))
    assert style == "keywords"
    assert score("arithmetic", "3 + 9 = 12. \\boxed{12}", "12", {}) == {"score": 1.0, "acc": True, "answered": 1.0}
    assert score("x", "#### 1,000", ["7", "1000"], None)["acc"] is True  # several ground truths: any of them
    assert score("x", "no answer", "3", {"index": 1}) == {"score": 0.0, "acc": False, "answered": 0.0}
