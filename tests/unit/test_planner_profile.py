"""read_profile on a run folder written by hand: the figures a timeline allows, and what an old run lacks."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml

from rlinf_pipe.config import load_config
from rlinf_pipe.planning.costs import default_costs
from rlinf_pipe.planning.profile import read_profile
from rlinf_pipe.planning.validate import validate_run
from rlinf_pipe.utils.timeline import write_chrome_trace
from rlinf_pipe.utils.tracing import Span

OVERRIDES = ["data.rollout_batch_size=2", "algorithm.group_size=2", "reward.num_workers=2"]


def step_spans(step: int, t: float, new_args: bool, forward_s: float | None = None) -> list[Span]:
    """Step `step` from `t`, 1 s long: the engine's 0.2 s generation of 2 prompts (4 samples, 40 tokens), two 0.1 s
    reward spans, two 0.25 s train spans of 60 sequence tokens (with `forward_s`: their forwards' seconds), a 0.05 s
    optimizer step, a 0.02 s weight sync."""
    reward_args = lambda lengths: ({"prompt_tokens": 20, "response_tokens": lengths} if new_args else {})  # noqa: E731
    train_args = {"sequence_tokens": 60} if new_args else {}
    if forward_s is not None:
        train_args["forward_s"] = forward_s
    return [
        Span("step", "driver", t, t + 1.0, (), {"step": step}),
        Span("weight_sync", "rollout/0", t, t + 0.02, (0,), {"version": step}),
        Span("generate", "rollout/0", t + 0.02, t + 0.22, (0,), {"step": step, "prompts": 2, "tokens": 40}),
        Span("reward", "reward/0", t + 0.22, t + 0.32, (), {"step": step, "samples": 2, **reward_args([5, 15])}),
        Span("reward", "reward/0", t + 0.32, t + 0.42, (), {"step": step, "samples": 2, **reward_args([8, 12])}),
        Span("train", "actor/0", t + 0.42, t + 0.67, (1,), {"tokens": 20, "sequences": 2, **train_args}),
        Span("train", "actor/0", t + 0.67, t + 0.92, (1,), {"tokens": 20, "sequences": 2, **train_args}),
        Span("optimizer_step", "actor/0", t + 0.92, t + 0.97, (1,), {"step": step, "minibatch": 0}),
    ]


def write_spans(folder: Path, spans: list[Span], overrides: tuple[str, ...] = (),
                metrics: list[dict] | None = None) -> Path:
    """A run folder: the config of `OVERRIDES` and `overrides`, `spans` as its timeline, `metrics` (one row)."""
    cfg = load_config(overrides=OVERRIDES + list(overrides))
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    write_chrome_trace(spans, folder / "timeline.json")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in (metrics or [{"step": 0}])))
    return folder


def write_run(folder: Path, new_args: bool = True, gap: float = 0.0, forward_s: float | None = None,
              extra_metrics: dict | None = None, overrides: tuple[str, ...] = ()) -> Path:
    """A 3-step run of `step_spans`, each step `gap` s after the one before."""
    spans = [Span("launch", "driver", -30.0, -0.5, (), {"phase": "job"})]
    spans += [s for step in range(3) for s in step_spans(step, step * (1.0 + gap), new_args, forward_s)]
    spans.append(Span("generate", "rollout/0", 0.02, 5.0, (0,), {"step": 0, "prompts": 2, "tokens": 40}))  # warm-up
    return write_spans(folder, spans, overrides, [
        {"step": s, "response_length/mean": 10.0, "throughput/tokens_per_s": 40.0, **(extra_metrics or {})}
        for s in range(3)])


def test_a_profile_reads_the_rates_of_the_steps_after_the_first(tmp_path):
    costs = read_profile(write_run(tmp_path / "run"))
    assert costs.source == f"profile of {tmp_path / 'run'}"
    assert sorted(costs.response_lengths) == [5, 5, 8, 8, 12, 12, 15, 15]  # steps 1 and 2 (step 0 left out)
    assert costs.prompt_tokens == 20
    # two spans of 0.25 s, each one group of 2 rows (20 response tokens, 40 prompt tokens): its prompt run once
    assert costs.train_tokens_per_s == pytest.approx(2 * (20 + 40 / 2) / 0.5)
    assert costs.optimizer_step_s == pytest.approx(0.05)
    assert costs.reward_s_per_sample == pytest.approx(0.1)  # 2 samples on 2 pool workers: one round of 0.1 s
    # what it measured, for pooling with other runs: a pipeline run, one transport's sync, no phase switch
    assert {"train_tokens_per_s", "optimizer_step_s", "reward_s_per_sample"} <= set(costs.measured)
    assert [m for m in costs.measured if m.startswith(("weight_sync_s.", "switch_s."))] == ["weight_sync_s.broadcast"]
    assert costs.sync_s("broadcast") == pytest.approx(0.02)
    assert costs.launch_s == pytest.approx(29.5)
    assert costs.logprob_tokens_per_s == pytest.approx(3 * 160)  # no log-prob stage: 3 x training
    assert any("log-prob spans" in m for m in costs.missing)
    assert not any("reward spans" in m or "train span" in m for m in costs.missing)
    # the decode curve is the default's shape, scaled so that the engine's 4 requests of 40 tokens take 0.2 s
    default = default_costs(load_config(overrides=OVERRIDES), "cpu")
    ratio = costs.decode.at(1) / default.decode.at(1)
    assert all(y == pytest.approx(y0 * ratio) for (_, y), (_, y0) in zip(costs.decode.points, default.decode.points))


def test_an_old_run_without_token_args_falls_back_and_says_so(tmp_path):
    costs = read_profile(write_run(tmp_path / "old", new_args=False))
    assert costs.prompt_tokens == 64  # half of data.max_prompt_length (128)
    assert costs.mean_response == pytest.approx(10.0, rel=0.05)  # the default shape scaled to the metrics' mean
    assert costs.train_tokens_per_s == pytest.approx((20 + 2 * 64 / 2) * 2 / 0.5)  # response + the prompt
    missing = " ".join(costs.missing)
    for figure in ("response length of each sample", "prompt tokens", "sequence tokens per train span"):
        assert figure in missing


def test_validate_puts_the_prediction_beside_the_measurement(tmp_path):
    run = write_run(tmp_path / "run")
    v = validate_run(run, read_profile(run))
    assert v.measured_step_s == pytest.approx(1.0) and v.steps == 2
    assert v.measured_tokens_per_s == pytest.approx(40.0)
    assert math.isfinite(v.prediction.step_s) and v.prediction.step_s > 0


def test_warmup_leaves_out_more_steps_and_keeps_at_least_the_last(tmp_path):
    run = write_run(tmp_path / "run")
    assert sorted(read_profile(run, warmup=2).response_lengths) == [5, 8, 12, 15]  # step 2 only
    assert sorted(read_profile(run, warmup=9).response_lengths) == [5, 8, 12, 15]  # (the last step stays)
    assert sorted(read_profile(run, warmup=0).response_lengths) == [5] * 3 + [8] * 3 + [12] * 3 + [15] * 3
    assert validate_run(run, read_profile(run), warmup=2).steps == 1
    assert validate_run(run, read_profile(run), warmup=0).steps == 3


def test_a_folder_without_a_config_is_a_clear_error(tmp_path):
    from rlinf_pipe.errors import ConfigError

    with pytest.raises(ConfigError, match="config.yaml does not exist"):
        read_profile(tmp_path)


def test_plan_validate_prints_the_prediction_beside_the_measurement(tmp_path, capsys):
    from rlinf_pipe.cli import main

    run = write_run(tmp_path / "run")
    assert main(["plan", "--validate", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"costs: profile of {run}" in out and "step s" in out and "1.000" in out  # (the measured step)
    assert main(["plan", "--validate", str(run), "--json", "--costs", "1,2,0.5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["measured_step_s"] == pytest.approx(1.0) and data["source"].startswith("RLinf-style --costs")


def test_the_driver_the_collectives_and_the_forward_passes_are_read_from_the_run(tmp_path):
    """A run whose train spans time their forwards, whose metrics have the heartbeat's round trips and the weight
    version's bytes, with 0.1 s between steps and a broadcast's receiver taking 0.02 s a version."""
    run = write_run(tmp_path / "run", gap=0.1, forward_s=0.1,
                    extra_metrics={"timing/call_round_trip": 0.004, "weight_sync/bytes": 0})
    costs = read_profile(run)
    assert costs.logprob_tokens_per_s == pytest.approx(80 / 0.2)  # two 40-token forwards of 0.1 s
    assert not any("log-prob spans" in m for m in costs.missing)
    assert costs.call_s == pytest.approx(0.004) and costs.step_gap_s == pytest.approx(0.1)
    assert costs.collective_s == pytest.approx(0.02)  # the receiver's sync, no bytes to move
    v = validate_run(run, costs)
    assert v.measured_step_s == pytest.approx((3.2 - 1.1) / 2)  # steps 1 and 2, the gap between them counted
    assert validate_run(run, costs, warmup=0).measured_step_s == pytest.approx(3.2 / 3)


def test_a_profile_at_two_replicas_keeps_the_optimizer_step_without_its_reduction(tmp_path):
    """The actor on 2 GPUs (DP 2): the measured optimizer step less `reduce_s` at 2 ranks is kept, and a prediction
    at DP 2 adds it back."""
    run = write_run(tmp_path / "run", extra_metrics={"weight_sync/bytes": 0},
                    overrides=("cluster.num_gpus_per_node=3", "cluster.component_placement={rollout: 0, actor: 1-2}"))
    costs = read_profile(run)
    from rlinf_pipe.planning.costs import Parallel

    reduce = costs.reduce_s(Parallel(), 2)
    assert reduce == pytest.approx(4 * 2 * 0.02 + costs.grad_bytes / costs.collective_bytes_per_s)
    assert costs.optimizer_step_s == pytest.approx(max(0.0, 0.05 - reduce))
    assert costs.optimizer_s(Parallel(), 2) == pytest.approx(max(0.05, reduce))
    assert costs.optimizer_s(Parallel(), 1) == pytest.approx(costs.optimizer_step_s)


def test_rows_that_do_not_share_their_prompt_run_it_each(tmp_path):
    """Without `actor.share_prompts` every row runs its prompt: the same spans are 60 tokens each."""
    costs = read_profile(write_run(tmp_path / "run", overrides=("actor.share_prompts=false",)))
    assert costs.train_tokens_per_s == pytest.approx(120 / 0.5)


def test_the_torch_engines_decode_steps_give_the_decode_curve(tmp_path):
    """Generate spans with decode steps by batch size: the curve's points are rows x steps / seconds per bin of
    rows (powers of two), the prefill rate the prompts' tokens over their seconds; nothing said missing of them."""
    run = write_run(tmp_path / "run")
    spans = json.loads((run / "timeline.json").read_text())
    for event in spans["traceEvents"]:
        if event.get("name") == "generate":
            event["args"] |= {"decode_steps": [[1, 5, 0.008], [2, 5, 0.01], [3, 10, 0.04], [4, 10, 0.04]],
                              "prefill": [80, 0.02], "decode_calls": 4}
    (run / "timeline.json").write_text(json.dumps(spans))
    costs = read_profile(run)
    # bins: 1 row (5 / 0.008), 2-3 rows (10 + 30 rows x steps over 15 steps, 0.05 s), 4 rows (40 / 0.04)
    assert [v for point in costs.decode.points for v in point] == pytest.approx([1, 625, 40 / 15, 800, 4, 1000])
    assert costs.prefill_tokens_per_s == pytest.approx(4000.0)
    assert costs.decode_call_s == pytest.approx((0.2 - 0.098 - 0.02) / 4)  # each 0.2 s span outside its steps
    assert not any("decode steps" in m for m in costs.missing)
    assert any("decode steps" in m for m in read_profile(write_run(tmp_path / "old")).missing)


def test_a_log_prob_workers_reading_and_the_call_that_starts_training_are_read_from_the_run(tmp_path):
    """The actor computes the log-probs (`algorithm.n_minibatches=2`): per step three passes 0.02, 0.01 and 0.04 s
    apart (the lower quartile of the gaps, 0.01 s, is a group read while the next waited), then its training starts
    0.03 s after the last (the driver's call)."""
    spans = []
    for step in range(3):
        t = float(step)
        spans += [Span("step", "driver", t, t + 1.0, (), {"step": step}),
                  Span("generate", "rollout/0", t, t + 0.2, (0,), {"step": step, "prompts": 2, "tokens": 40})]
        for start in (0.3, 0.37, 0.43, 0.52):
            spans.append(Span("logprob", "actor/0", t + start, t + start + 0.05, (1,),
                              {"step": step, "sequences": 2, "tokens": 60}))
        spans.append(Span("train", "actor/0", t + 0.6, t + 0.8, (1,),
                          {"version": step, "tokens": 20, "sequences": 2, "sequence_tokens": 60}))
    costs = read_profile(write_spans(tmp_path / "run", spans, ("algorithm.n_minibatches=2",),
                                     [{"step": 0, "timing/call_round_trip": 0.004}]))
    assert costs.logprob_handoff_s == pytest.approx(0.01)
    assert costs.phase_call_s == pytest.approx(0.03) and costs.phase_call == pytest.approx(0.03)
    assert read_profile(write_run(tmp_path / "plain")).phase_call_s == 0.0  # (no log-prob stage: not measured)


def test_passes_of_different_sizes_give_a_passs_fixed_cost_and_one_size_does_not(tmp_path):
    from rlinf_pipe.planning.pass_cost import fit_pass_cost

    # 0.01 s + 1,000 tokens/s, passes of 100 to 400 tokens
    assert fit_pass_cost([(100, 0.11), (200, 0.21), (400, 0.41)]) == pytest.approx((0.01, 1000.0))
    assert fit_pass_cost([(300, 0.31), (400, 0.41)]) is None  # (less than 2x apart)
    assert fit_pass_cost([(100, 0.2), (400, 0.1)]) is None  # (larger passes faster: no fit)
    # write_run's train spans are all one size: its rate alone, and `missing` says so
    costs = read_profile(write_run(tmp_path / "one"))
    assert costs.train_pass_s == 0.0 and any("train pass's fixed cost" in m for m in costs.missing)
    # a run training passes of 60 and 180 tokens (rows each running their prompt) in 0.07 and 0.19 s
    spans = []
    for step in range(3):
        t = float(step)
        spans += [Span("step", "driver", t, t + 1.0, (), {"step": step}),
                  Span("train", "actor/0", t + 0.3, t + 0.37, (1,), {"tokens": 20, "sequences": 2,
                                                                     "sequence_tokens": 60}),
                  Span("train", "actor/0", t + 0.4, t + 0.59, (1,), {"tokens": 60, "sequences": 6,
                                                                     "sequence_tokens": 180})]
    costs = read_profile(write_spans(tmp_path / "two", spans, ("actor.share_prompts=false",)))
    assert costs.train_pass_s == pytest.approx(0.01) and costs.train_tokens_per_s == pytest.approx(1000.0)


def test_log_prob_passes_of_one_size_take_their_fixed_cost_from_the_line_through_the_training_forwards(tmp_path):
    from rlinf_pipe.planning.pass_cost import fixed_cost_beside

    # every pass 0.01 s + 1,000 tokens/s: log-prob passes of 60 tokens (0.07 s), forwards of 180 and 300 tokens
    assert fixed_cost_beside([(60, 0.07)] * 3, [(180, 0.19), (300, 0.31)]) == pytest.approx((0.01, 1000.0))
    assert fixed_cost_beside([(60, 0.07)], [(61, 0.5)]) is None  # (no line: sizes too close)
    assert fixed_cost_beside([(60, 0.001)], [(180, 0.19), (300, 0.31)]) is None  # (nothing beyond the fixed cost)
    spans = []
    for step in range(3):
        t = float(step)
        spans += [Span("step", "driver", t, t + 1.0, (), {"step": step})]
        spans += [Span("logprob", "actor/0", t + start, t + start + 0.07, (1,),
                       {"step": step, "sequences": 2, "tokens": 60}) for start in (0.1, 0.2)]
        spans += [Span("train", "actor/0", t + start, t + start + 0.3, (1,),
                       {"tokens": 20, "sequences": 2, "sequence_tokens": n, "forward_s": fwd})
                  for start, n, fwd in ((0.3, 180, 0.19), (0.6, 300, 0.31))]
    costs = read_profile(write_spans(tmp_path / "run", spans, ("algorithm.n_minibatches=2",
                                                                "actor.share_prompts=false")))
    assert costs.logprob_pass_s == pytest.approx(0.01) and costs.logprob_tokens_per_s == pytest.approx(1000.0)
    assert not any("logprob pass's fixed cost" in m for m in costs.missing)


def test_sglangs_requests_give_its_decode_curve_by_how_many_run_at_once(tmp_path):
    """Two samples: one in flight over [0, 2] s with 20 tokens (10 tokens/s), one over [1, 2] with 10 (10 tokens/s):
    alone over [0, 1] the engine decodes 10 tokens/s, two together 20; at most one running (the other queued),
    one point of 30 tokens in 2 s."""
    from rlinf_pipe.planning.decode_profile import decode_curve_of_requests

    span = Span("generate", "rollout/0", 0.0, 2.0, (0,), {"requests": [[0.0, 2.0, 5, 20], [1.0, 2.0, 5, 10]]})
    flat = lambda curve: [v for point in curve.points for v in point]  # noqa: E731
    assert flat(decode_curve_of_requests([span], cap=64)) == pytest.approx([1.0, 10.0, 2.0, 20.0])
    assert flat(decode_curve_of_requests([span], cap=1)) == pytest.approx([1.0, 15.0])
    assert decode_curve_of_requests([Span("generate", "rollout/0", 0.0, 2.0, (0,), {})], cap=64) is None
    # a run of SGLang engines whose spans have them: the decode curve is theirs, not the default's shape
    spans = []
    for step in range(3):
        t = float(step)
        spans += [Span("step", "driver", t, t + 1.0, (), {"step": step}),
                  Span("generate", "rollout/0", t, t + 0.2, (0,), {"step": step, "prompts": 2, "tokens": 40,
                       "requests": [[0.0, 0.2, 20, 20], [0.0, 0.1, 20, 10], [0.1, 0.2, 20, 5], [0.1, 0.2, 20, 5]]})]
    costs = read_profile(write_spans(tmp_path / "run", spans, ("rollout.backend=sglang",)))
    # two in flight (100 + 100 tokens/s), then three (100 + 50 + 50): one bin (2-3), 2.5 on average, 200 tokens/s
    assert flat(costs.decode) == pytest.approx([2.5, 200.0])
    assert not any("decode steps" in m for m in costs.missing)
