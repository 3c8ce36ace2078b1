"""`rlinf_pipe.runner.run`'s start-up: the run's checks come before Ray starts, and a run whose preparation (done
while Ray starts) fails stops the local Ray it started. Real local Ray; no workers launch."""

from __future__ import annotations

import pytest
import ray

from rlinf_pipe.config import load_config
from rlinf_pipe.data.errors import DataError
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.runner import run


@pytest.fixture(autouse=True)
def no_ray_before():
    assert not ray.is_initialized(), "another test left Ray running"
    yield
    ray.shutdown()


def test_a_run_that_fails_its_checks_starts_nothing(tmp_path, capsys):
    out = tmp_path / "runs"
    with pytest.raises(ConfigError, match="no estimator named 'grpoo'"):
        run(load_config(overrides=[f"runner.output_dir={out}", "algorithm.adv_estimator=grpoo"]))
    with pytest.raises(DataError, match="data.dataset: .*missing.jsonl does not exist"):
        run(load_config(overrides=[f"runner.output_dir={out}", f"data.dataset={tmp_path / 'missing.jsonl'}"]))
    (tmp_path / "no-config").mkdir()
    with pytest.raises(ConfigError, match="rollout.model_path: model folder .*no-config.* has no config.json"):
        run(load_config(overrides=[f"runner.output_dir={out}", f"rollout.model_path={tmp_path / 'no-config'}"]))
    assert not ray.is_initialized() and not out.exists()  # no Ray, no run folder
    assert "Ray: started" not in capsys.readouterr().out


def test_a_run_whose_preparation_fails_stops_the_ray_it_started(tmp_path, capsys):
    data = tmp_path / "broken.jsonl"
    data.write_text("not json\n{also not json\n")  # present, so it passes the checks; no usable record in it
    with pytest.raises(DataError, match="2 of 2 records are malformed"):
        run(load_config(overrides=[f"runner.output_dir={tmp_path / 'runs'}", f"data.dataset={data}"]))
    assert "Ray: started a local cluster" in capsys.readouterr().out
    assert not ray.is_initialized()
