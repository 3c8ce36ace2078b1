"""A profile from several runs (`pool_costs`, `plan --profile RUN RUN ...`): the median of each figure over the runs
that measured it, every run's response lengths, what every run missed; runs of different replica sizes refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_planner_profile import write_run

from rlinf_pipe.errors import ConfigError
from rlinf_pipe.planning.costs import Curve, Parallel
from rlinf_pipe.planning.profile import read_profile
from rlinf_pipe.planning.profile_pool import pool_costs, read_profiles


def test_each_figure_is_the_median_of_the_runs_and_the_samples_are_all_kept(tmp_path):
    base = read_profile(write_run(tmp_path / "run"))
    runs = [dataclasses.replace(base, train_tokens_per_s=rate, co_run_slowdown=c, weight_sync_s={"broadcast": sync},
                                decode=Curve(points), response_lengths=lengths, missing=missing)
            for rate, c, sync, points, lengths, missing in (
                (100.0, 0.11, 0.03, ((1, 10.0), (4, 40.0)), (5,), ("a", "c")),
                (300.0, 0.26, 0.01, ((1, 20.0), (2, 30.0)), (7, 9), ("b", "c")),
                (200.0, 0.21, 0.02, ((1, 30.0), (4, 20.0)), (11,), ("a", "c")))]
    pooled = pool_costs(runs, ["r1", "r2", "r3"])
    assert pooled.train_tokens_per_s == 200.0 and pooled.co_run_slowdown == 0.21
    assert pooled.weight_sync_s == {"broadcast": 0.02}
    # at x=2 the runs' curves read 20 (a third of the way from 10 to 40), 30, and 26.7 (from 30 to 20); at x=4:
    # 40, 30 (flat past its last point) and 20
    assert pooled.decode.points == ((1, 20.0), (2, pytest.approx(80 / 3)), (4, 30.0))
    assert sorted(pooled.response_lengths) == [5, 7, 9, 11]
    assert pooled.missing == ("c",)  # (what every run missed)
    assert pooled.source.startswith("profile of 3 runs") and "r1, r2, r3" in pooled.source
    assert pooled.optimizer_step_s == base.optimizer_step_s  # (alike in every run)


def test_a_figure_is_pooled_over_the_runs_that_measured_it_only(tmp_path):
    # a pipeline run measures a pushed broadcast's hop and no phase switch; a collocated run the reverse (its
    # stand-ins: the default's 2e-5 s hop, a 0.5 s switch). Each figure comes from the run that measured it, each
    # transport's sync from the run that used it; a rate both measured is their median.
    base = read_profile(write_run(tmp_path / "run"))
    pipeline = dataclasses.replace(base, collective_s=1e-3, switch_s={"actor": 0.5}, train_tokens_per_s=100.0,
                                   weight_sync_s={"broadcast": 0.02, "ipc": 0.01},
                                   measured=("collective_s", "train_tokens_per_s", "weight_sync_s.broadcast"))
    collocated = dataclasses.replace(base, collective_s=2e-5, switch_s={"actor": 0.004}, train_tokens_per_s=300.0,
                                     weight_sync_s={"broadcast": 0.04, "ipc": 0.006},
                                     measured=("switch_s.actor", "train_tokens_per_s", "weight_sync_s.ipc"))
    pooled = pool_costs([pipeline, collocated], ["p", "c"])
    assert pooled.collective_s == 1e-3 and pooled.switch_s == {"actor": 0.004}
    assert pooled.weight_sync_s == {"broadcast": 0.02, "ipc": 0.006}
    assert pooled.train_tokens_per_s == 200.0
    assert pooled.measured == ("collective_s", "switch_s.actor", "train_tokens_per_s", "weight_sync_s.broadcast",
                               "weight_sync_s.ipc")
    # a figure neither measured: the median of their stand-ins
    assert pool_costs([dataclasses.replace(pipeline, measured=()), dataclasses.replace(collocated, measured=())],
                      ["p", "c"]).collective_s == pytest.approx((1e-3 + 2e-5) / 2)


def test_one_run_is_its_own_profile_and_runs_of_other_replica_sizes_are_refused(tmp_path):
    run = write_run(tmp_path / "run")
    assert read_profiles([run]) == read_profile(run)
    other = dataclasses.replace(read_profile(run), train_parallel=Parallel(tp=2))
    with pytest.raises(ConfigError, match="train replicas of different sizes.*give one run"):
        pool_costs([read_profile(run), other], ["a", "b"])


def test_plan_validate_takes_several_profile_runs(tmp_path, capsys):
    from rlinf_pipe.cli import main

    first, second = write_run(tmp_path / "a"), write_run(tmp_path / "b", gap=0.1)
    assert main(["plan", "--validate", str(first), "--json", "--profile", str(first), str(second)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["source"].startswith("profile of 2 runs")
    alone = [read_profile(first).step_gap_s, read_profile(second).step_gap_s]
    assert read_profiles([first, second]).step_gap_s == pytest.approx(sum(alone) / 2)  # (the median of two)


def test_a_config_file_taken_into_the_profile_list_is_named(tmp_path, capsys):
    from rlinf_pipe.cli import main

    run = write_run(tmp_path / "run")
    config = tmp_path / "my.yaml"
    config.write_text("cluster: {}\n")
    assert main(["plan", "--search", "--profile", str(run), str(config)]) == 2
    err = capsys.readouterr().err
    assert f"--profile {config}: a file, where run folders go; give the config before --profile" in err
