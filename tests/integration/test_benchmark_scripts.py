"""Benchmark scripts that run in one process (or spawn their own ranks), without Ray or shared memory, run at their
smallest settings and report finite figures (no timed assertions). They run beside other tests; the benchmarks that
start Ray or use shared memory are in tests/e2e/test_benchmarks.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_pipeline_vs_collocated_script_starts():
    """The script imports and parses its options (its figures are tested on real runs in test_runner.py)."""
    proc = subprocess.run([sys.executable, "benchmarks/pipeline_vs_collocated.py", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "--gloo-iters" in proc.stdout, proc.stderr[-2000:]


def test_the_single_process_baseline_loop_trains_a_step():
    """benchmarks/single_process_grpo.py's plain loop (the baseline of the default run) generates, scores and
    updates the warm-started tiny model on the default config; the comparison itself is the script's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_single", ROOT / "benchmarks" / "single_process_grpo.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = bench.default_config(2, ["data.rollout_batch_size=4"])
    loop = bench.PlainLoop(cfg)
    before = {k: v.clone() for k, v in loop.model.state_dict().items()}
    seconds, reward = loop.step()
    assert seconds > 0 and 0.0 <= reward <= 1.0
    assert any(not torch.equal(before[k], v) for k, v in loop.model.state_dict().items())  # it updated


def test_the_memory_estimate_covers_what_a_layer_saves_for_backward():
    """`activation_bytes.py` counts what a Megatron layer saves (saved-tensor hooks, bf16, the local spec) at
    DeepSeek-R1-Distill-Qwen-1.5B's width ratios; the estimate's `layer_activations` must not be below it (less the
    float32 norm intermediates that only CPU keeps). The first estimate (Korthikanti's 34 x hidden) fails this."""
    proc = subprocess.run([sys.executable, "benchmarks/activation_bytes.py", "--tokens", "256", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["per_layer_fused"] > 34 * summary["hidden"]  # the gated MLP keeps far more than a 4x one
    assert summary["layer_activations"] >= summary["per_layer_fused"]


def test_the_replica_balance_simulation_compares_both_routings():
    """Both routings place every group; by tokens the busiest replica is no busier than by slot on the median."""
    proc = subprocess.run([sys.executable, "benchmarks/replica_balance_sim.py", "--trials", "200", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for routing in ("by_slot", "by_tokens"):
        assert 1.0 <= result[routing]["median"] <= result[routing]["p90"], result
    assert result["by_tokens"]["median"] < result["by_slot"]["median"]


def test_the_timeline_benchmark_times_both_ways_of_analysing_and_drawing():
    proc = subprocess.run([sys.executable, "benchmarks/timeline_bench.py", "--steps", "5", "--repeats", "1", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["spans"] == 5 * 13  # a step line and four spans on each of three tracks
    for part in ("analysis", "picture"):
        assert all(math.isfinite(result[part][k]) and result[part][k] > 0 for k in ("now_s", "before_s")), result


def test_the_prompt_encoding_benchmark_encodes_both_ways_alike():
    proc = subprocess.run([sys.executable, "benchmarks/prompt_encoding.py", "--prompts", "50", "--repeats", "1",
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]  # (it exits non-zero if the two ways give other ids)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["prompts"] == 50 and math.isfinite(result["ratio"]) and result["ratio"] > 0


def test_megatron_step_bench_reports_finite_timings():
    proc = subprocess.run(
        [sys.executable, "benchmarks/megatron_step_bench.py", "--repeats", "2", "--warmup", "1", "--batch", "4",
         "--seq-len", "24", "--response-len", "8", "--threads", "1", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("step_s", "forward_s", "fwd_bwd_s", "optimizer_s"):
        assert set(summary[key]) == {"megatron", "hf"}
        assert all(math.isfinite(v) and v > 0 for v in summary[key].values()), summary[key]
    for key in ("megatron_over_hf_step_time", "megatron_over_hf_forward_time"):
        assert math.isfinite(summary[key]) and summary[key] > 0, summary[key]
    assert summary["repeats"] == 2 and summary["batch"] == 4 and summary["params"] > 0


def test_logprob_pass_bench_reports_the_filler_it_saves():
    """Both passes run the same micro-batches; the equal-shape one carries filler, the log-probs agree."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/logprob_pass_bench.py", "--repeats", "1", "--rows", "16", "--max-response", "64",
         "--budget", "96", "--threads", "1", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(math.isfinite(summary[k]) and summary[k] > 0 for k in ("own_shape_s", "equal_shape_s"))
    assert summary["micro_batches"] > 1 and 0 < summary["filler_fraction"] < 1
    assert summary["max_abs_diff"] < 1e-5


def test_planner_accuracy_compares_kept_runs_without_training(tmp_path):
    """`planner_accuracy.py --predict-only DIR` re-predicts the runs a `runs.json` names (here one hand-written run
    under two placements' names): its last line has the summary's keys, each run predicted from the profiled one."""
    from tests.unit.test_planner_profile import write_run

    run = write_run(tmp_path / "run")
    (tmp_path / "runs.json").write_text(json.dumps({
        "runs": {"disaggregated": str(run), "staleness-1": str(run)}, "profiled": "disaggregated", "warmup": 1,
        "settings": {"steps": 3}}))
    proc = subprocess.run([sys.executable, "benchmarks/planner_accuracy.py", "--predict-only", str(tmp_path), "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {r["name"]: r for r in summary["placements"]}
    assert set(rows) == {"disaggregated", "staleness-1"} and rows["disaggregated"]["profiled"]
    assert all(r["measured_step_s"] == 1.0 and math.isfinite(r["predicted_step_s"]) for r in rows.values())
    error = rows["staleness-1"]["error"]  # (the same run: only the other one counts in the errors)
    assert summary["median_abs_error"] == summary["max_abs_error"] == abs(error)
    assert isinstance(summary["same_ranking"], bool) and sorted(summary["measured_ranking"]) == sorted(rows)
    missing = subprocess.run([sys.executable, "benchmarks/planner_accuracy.py", "--predict-only", str(tmp_path / "no")],
                             cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert missing.returncode != 0 and "no runs.json there" in missing.stderr and "Traceback" not in missing.stderr
    # both placements' runs as one profile (their co-run slowdowns fitted together); one it never ran is named
    both = subprocess.run([sys.executable, "benchmarks/planner_accuracy.py", "--predict-only", str(tmp_path), "--json",
                           "--profile-placement", "disaggregated", "staleness-1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert both.returncode == 0, both.stderr[-3000:]
    summary = json.loads(both.stdout.strip().splitlines()[-1])
    assert summary["profiled"] == ["disaggregated", "staleness-1"] and len(summary["profile_runs"]) == 2
    assert all(r["profiled"] for r in summary["placements"])
    assert summary["costs"]["source"].startswith("profile of 2 runs")
    absent = subprocess.run([sys.executable, "benchmarks/planner_accuracy.py", "--predict-only", str(tmp_path),
                             "--profile-placement", "collocated-1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert absent.returncode != 0 and "Traceback" not in absent.stderr
    assert "--profile-placement collocated-1: not among the runs" in absent.stderr


def test_planner_accuracy_pools_invocations_and_tells_pairs_apart_by_their_runs():
    """`pooled`: runs pooled per placement, predictions by their median; a pair is told apart where a run of the
    faster beats a run of the other in at least 3 of 4 pairings. Here "b" beats "c" in 3 of 4 (told apart,
    predicted in the other order), "a" beats "b" in every pairing (told apart, predicted alike)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_accuracy", ROOT / "benchmarks" / "planner_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_accuracy"] = module  # (its dataclass looks its module up)
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["bench_accuracy"]

    def summary(measured: dict[str, list[float]], predicted: dict[str, float]) -> dict:
        return {"placements": [{"name": n, "profiled": n == "a", "measured_runs_s": runs,
                                "predicted_step_s": predicted[n]} for n, runs in measured.items()]}

    pooled = module.pooled([summary({"a": [1.0], "b": [2.0], "c": [2.5]}, {"a": 1.0, "b": 2.2, "c": 2.1}),
                            summary({"a": [1.2], "b": [2.4], "c": [2.2]}, {"a": 1.1, "b": 2.4, "c": 2.3})])
    rows = {r["name"]: r for r in pooled["placements"]}
    assert rows["b"]["measured_step_s"] == pytest.approx(2.2) and rows["b"]["predicted_step_s"] == pytest.approx(2.3)
    assert rows["c"]["error"] == pytest.approx((2.2 - 2.35) / 2.35, abs=1e-4) and rows["c"]["runs"] == 2
    pairs = {(p["faster"], p["slower"]): p for p in pooled["pairs"]}
    assert pairs[("a", "b")]["win"] == 1.0 and pairs[("a", "b")]["predicted_alike"]
    assert pairs[("b", "c")]["win"] == 0.75 and not pairs[("b", "c")]["predicted_alike"]
    assert pooled["told_apart_pairs"] == 3 and pooled["told_apart_pairs_ordered_alike"] == 2
    assert pooled["same_ranking"] is False and pooled["max_abs_error"] == pytest.approx(abs(rows["c"]["error"]))
    # every two told apart: the runs measure a < b < c, which the prediction (c before b) does not follow
    assert pooled["ranked_placements"] == ["a", "b", "c"] and pooled["ranked_alike"] is False


def test_the_ranking_the_runs_measure_is_the_largest_set_they_tell_apart_two_by_two():
    """`told_apart_ranking`: a < b < c < d measured, every pair told apart but b and c (their runs overlap): the
    largest sets are {a, b, d} and {a, c, d}. Predicting c before b orders both as measured; predicting d before c
    does not order {a, c, d} so."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from accuracy_summary import told_apart_ranking
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    measured = {"a": 1.0, "b": 2.0, "c": 2.1, "d": 3.0}
    told = {frozenset(p) for p in (("a", "b"), ("a", "c"), ("a", "d"), ("b", "d"), ("c", "d"))}
    swapped_tie = told_apart_ranking(measured, {"a": 1.0, "c": 1.9, "b": 2.0, "d": 3.1}, told)
    assert swapped_tie == {"ranked_placements": ["a", "b", "d"], "ranked_alike": True}
    swapped_told = told_apart_ranking(measured, {"a": 1.0, "b": 2.0, "d": 2.2, "c": 2.5}, told)
    assert swapped_told["ranked_alike"] is False
    assert told_apart_ranking(measured, measured, set()) == {"ranked_placements": ["a"], "ranked_alike": True}
