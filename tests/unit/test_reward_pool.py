"""RewardPool: order, counters, and the hard per-item timeout (a real sympy hang and a deterministic spinning scorer),
crashes and exceptions in workers, and shutdown."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rlinf_pipe.engines.reward import RewardPool, RewardPoolError, ScoreConfig, ScoreResult, score

# math-verify evaluates the tower exactly (sympy Integer power) and never returns; with its own signal timeout
# switched off, as in the pool, only killing the process stops it.
POWER_TOWER = "\\boxed{9^{9^{9^{9}}}}"
# The scorers hang for ever, so a batch that returns shows each hang was cut (one that is not would hang the test
# until pytest's timeout); the counters show how many timeouts it cost. No upper bound on time: a loaded 2-core
# machine took 1.6 s for what takes 0.3 s when idle.


# Test-only scorers: module level, so worker processes can unpickle them by name.
def spin_on_hang(response: str, reference: str) -> ScoreResult:
    """Busy-loops forever when the reference is "hang"; otherwise correct iff response == reference."""
    if reference == "hang":
        while True:
            pass
    return ScoreResult(response == reference, True, False, float(response == reference))


def misbehave(response: str, reference: str) -> ScoreResult:
    """Dies on "crash", raises on "raise", else scores like `spin_on_hang`."""
    if reference == "crash":
        os._exit(3)
    if reference == "raise":
        raise ValueError("scorer bug on purpose")
    return spin_on_hang(response, reference)


def test_results_keep_input_order_and_match_in_process_scoring() -> None:
    pairs = [(f"\\boxed{{{i}}}", str(i if i % 3 else i + 1)) for i in range(30)]
    pairs += [("no box", "1"), ("\\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{½}", "1/2")]
    with RewardPool(num_workers=2, timeout_s=5.0) as pool:
        results = pool.score_batch(pairs)
    assert results == [score(response, reference) for response, reference in pairs]


def test_counters_and_metrics() -> None:
    pairs = [("\\boxed{72}", "72"), ("\\boxed{71}", "72"), ("nothing", "72"), ("\\boxed{@@}", "72"), ("\\boxed{1}", 1)]
    with RewardPool(num_workers=1, timeout_s=5.0, config=ScoreConfig(wrong_score=-1.0)) as pool:
        assert [r.reward for r in pool.score_batch(pairs)] == [1.0, -1.0, -1.0, -1.0, 1.0]
        assert pool.score_batch([]) == []
        counters = pool.counters
        assert (counters.items, counters.correct, counters.parse_failures, counters.timeouts) == (5, 2, 2, 0)
        assert pool.metrics() == {
            "items": 5.0,
            "correct": 2.0,
            "parse_failures": 2.0,
            "timeouts": 0.0,
            "errors": 0.0,
            "restarts": 0.0,
            "accuracy": 0.4,
        }


def test_processes_start_once_and_serve_every_batch() -> None:
    with RewardPool(num_workers=2, timeout_s=5.0) as pool:
        pids = pool.pids
        for _ in range(3):
            pool.score_batch([("\\boxed{2}", "2")] * 8)
        assert pool.pids == pids and len(set(pids)) == 2 and pool.counters.restarts == 0


def test_real_sympy_hang_costs_one_timeout_and_the_pool_keeps_working() -> None:
    timeout_s = 1.0
    with RewardPool(num_workers=1, timeout_s=timeout_s) as pool:
        stuck_pid = pool.pids[0]
        started = time.monotonic()
        results = pool.score_batch([("\\boxed{1}", "1"), (POWER_TOWER, "72"), ("\\boxed{2}", "2"), ("\\boxed{3}", "4")])
        assert time.monotonic() - started >= timeout_s  # (the hang is cut at its deadline, not before)
        assert [r.correct for r in results] == [True, False, True, False]
        assert results[1] == ScoreResult(correct=False, parsed=False, timed_out=True, reward=0.0)
        assert pool.counters.timeouts == 1 and pool.counters.restarts == 1
        assert pool.pids != [stuck_pid]
        assert pool.score_batch([("\\boxed{5}", "5")])[0].correct


def test_spinning_scorer_is_killed_at_its_deadline_while_other_workers_continue() -> None:
    timeout_s = 2.0  # (ordinary items run under it too, beside a spinning process: not too short for a busy host)
    with RewardPool(num_workers=2, timeout_s=timeout_s, scorer=spin_on_hang) as pool:
        pairs = [("a", "a"), ("x", "hang")] + [(str(i), str(i)) for i in range(20)] + [("y", "hang"), ("b", "c")]
        results = pool.score_batch(pairs)  # one timeout each, not one per item (the counters below)
        assert [r.timed_out for r in results] == [r == "hang" for _, r in pairs]
        assert [r.correct for r in results] == [p == r for p, r in pairs]
        assert pool.counters.timeouts == 2 and pool.counters.restarts == 2


def test_hung_item_blocks_a_single_worker_pool_for_one_timeout_only() -> None:
    timeout_s = 1.5
    with RewardPool(num_workers=1, timeout_s=timeout_s, scorer=spin_on_hang) as pool:
        for _ in range(2):  # the replacement process is as good as the first
            results = pool.score_batch([("x", "hang"), ("a", "a")])
            assert [r.timed_out for r in results] == [True, False] and results[1].correct
        assert pool.counters.timeouts == 2 and pool.counters.restarts == 2  # one each time


def test_a_result_waiting_to_be_read_when_its_deadline_passes_is_taken_not_timed_out() -> None:
    # Handling another process's message can take the pool past an item's deadline while that item's result is
    # already in its pipe: the result counts, and the process is not killed for it.
    with RewardPool(num_workers=1, timeout_s=60.0, scorer=spin_on_hang) as pool:
        slot, pid = pool._slots[0], pool.pids[0]
        slot.conn.send((1, "a", "a"))
        slot.task = (1, 0, time.monotonic())  # (its deadline: now, so past once the result is there)
        assert slot.conn.poll(60)
        results: list[ScoreResult | None] = [None]
        assert pool._expire(results) == 0 and slot.task is not None
        assert pool._poll(results) == 1 and results[0] is not None and results[0].correct
        assert pool.counters.timeouts == 0 and pool.pids == [pid]


def test_crashing_and_raising_scorers_score_wrong_and_are_counted_as_errors() -> None:
    with RewardPool(num_workers=1, timeout_s=5.0, scorer=misbehave, config=ScoreConfig(wrong_score=-1.0)) as pool:
        results = pool.score_batch([("a", "a"), ("x", "crash"), ("b", "b"), ("y", "raise"), ("c", "c")])
        assert [r.reward for r in results] == [1.0, -1.0, 1.0, -1.0, 1.0]
        counters = pool.counters
        assert (counters.errors, counters.restarts, counters.timeouts, counters.parse_failures) == (2, 1, 0, 0)


def test_close_stops_the_processes_and_refuses_more_work() -> None:
    pool = RewardPool(num_workers=2, timeout_s=5.0)
    processes = [slot.process for slot in pool._slots]
    pool.close()
    pool.close()  # idempotent
    assert not any(p.is_alive() for p in processes)
    with pytest.raises(RewardPoolError, match="closed"):
        pool.score_batch([("\\boxed{1}", "1")])


def test_close_kills_a_busy_process() -> None:
    with RewardPool(num_workers=1, timeout_s=None, scorer=spin_on_hang) as pool:
        slot = pool._slots[0]
        slot.conn.send((1, "x", "hang"))  # what a batch interrupted in the caller leaves behind
        slot.task = (1, 0, float("inf"))
    assert not slot.process.is_alive()  # (killed: it would spin for ever)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool(num_workers=0)


def test_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "reward.md").read_text()
    snippet = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(snippet, "docs/reward.md", "exec"), {"__name__": "__main__"})  # noqa: S102 - our own docs
    printed = capsys.readouterr().out
    assert "'items': 3.0, 'correct': 1.0, 'parse_failures': 1.0, 'timeouts': 1.0" in printed


def test_verify_math_keeps_its_time_limit_off_the_main_thread() -> None:
    """Signals reach the main thread only: from another thread a pathological answer goes to a pool process that
    is killed at the limit, instead of hanging the caller."""
    from concurrent.futures import ThreadPoolExecutor

    from rlinf_pipe.engines.reward import verify_math

    with ThreadPoolExecutor(1) as other_thread:  # without the pool process this call would never return
        assert other_thread.submit(verify_math, POWER_TOWER, "72", timeout_s=1.0).result(timeout=120) is False
        assert other_thread.submit(verify_math, "\\boxed{7}", "7", timeout_s=1.0).result(timeout=60) is True
