"""`cluster.ray_address=auto`: RAY_ADDRESS, then the address start_ray.sh recorded, then a local cluster of the
job's own (never a cluster Ray's discovery finds on the machine)."""

from __future__ import annotations

import os

import pytest

from rlinf_pipe.errors import ClusterError
from rlinf_pipe.runtime.cluster import Cluster, resolve_address


@pytest.fixture
def clean_env(tmp_path):
    """resolve_address() may set RAY_AUTH_* in os.environ: restore the whole environment afterwards."""
    saved = dict(os.environ)
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN_FILE", "RAY_AUTH_TOKEN"):
        os.environ.pop(name, None)
    os.environ["RAY_HEAD_IP_FILE"] = str(tmp_path / "ray_head_ip.txt")
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved)


def test_explicit_values_pass_through(clean_env):
    assert resolve_address("local").address == "local"
    assert resolve_address("10.0.0.1:29500").address == "10.0.0.1:29500"


def test_auto_without_hints_is_a_local_cluster_of_its_own(clean_env):
    assert resolve_address("auto").address == "local"


def test_auto_prefers_ray_address(clean_env):
    (clean_env / "ray_head_ip.txt").write_text("10.0.0.2:29500\n")
    os.environ["RAY_ADDRESS"] = "10.0.0.3:6379"
    assert resolve_address("auto").address == "10.0.0.3:6379"


def test_auto_reads_the_head_ip_file(clean_env):
    (clean_env / "ray_head_ip.txt").write_text("10.0.0.2:29500\n")
    assert resolve_address("auto").address == "10.0.0.2:29500"
    assert "RAY_AUTH_MODE" not in os.environ


def test_auto_adopts_token_auth_from_start_ray(clean_env):
    (clean_env / "ray_head_ip.txt").write_text("10.0.0.2:29500\n")
    (clean_env / "ray_auth_token").write_text("secret\n")
    assert resolve_address("auto").address == "10.0.0.2:29500"
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str((clean_env / "ray_auth_token").resolve())


def test_explicit_auth_mode_is_respected(clean_env):
    (clean_env / "ray_auth_token").write_text("secret\n")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    resolve_address("auto")
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN_PATH" not in os.environ


def test_token_mode_without_a_token_takes_the_one_start_ray_wrote(clean_env):
    """`ray_utils/slurm.sbatch` passes RAY_AUTH_MODE=token on to the job but not where the token is: the driver
    takes start_ray.sh's token file (Ray would find none, or a stale ~/.ray/auth_token, and refuse the job)."""
    (clean_env / "ray_auth_token").write_text("secret\n")
    os.environ["RAY_AUTH_MODE"] = "token"
    resolve_address("auto")
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str((clean_env / "ray_auth_token").resolve())
    os.environ.pop("RAY_AUTH_TOKEN_PATH")
    os.environ["RAY_AUTH_TOKEN"] = "given"  # a token of the user's own stands
    resolve_address("auto")
    assert "RAY_AUTH_TOKEN_PATH" not in os.environ


def test_the_head_address_file_is_the_checkouts_wherever_the_job_starts(clean_env, monkeypatch):
    from pathlib import Path

    from rlinf_pipe.runtime.cluster import head_ip_file

    monkeypatch.delenv("RAY_HEAD_IP_FILE")
    monkeypatch.chdir(clean_env)
    assert head_ip_file() == Path(__file__).resolve().parents[2] / "ray_utils" / "ray_head_ip.txt"


def test_a_stale_recorded_address_says_the_recorded_cluster_is_gone(clean_env):
    from rlinf_pipe.config import load_config
    from rlinf_pipe.utils.net import free_port

    (clean_env / "ray_head_ip.txt").write_text(f"127.0.0.1:{free_port('127.0.0.1')}\n")  # nothing listens there
    with pytest.raises(ClusterError) as err:
        Cluster(load_config(overrides=["cluster.ray_address=auto"]))
    message = str(err.value)
    assert "written by ray_utils/start_ray.sh" in message and "the cluster start_ray.sh recorded there is gone" in message
    assert f"delete {clean_env / 'ray_head_ip.txt'}" in message and "use cluster.ray_address=auto" not in message
