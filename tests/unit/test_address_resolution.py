"""`cluster.ray_address=auto`: RAY_ADDRESS, then the address start_ray.sh recorded, then Ray's discovery."""

from __future__ import annotations

import os

import pytest

from rlinf_pipe.scheduler.cluster import resolve_address


@pytest.fixture
def clean_env(tmp_path):
    """resolve_address() may set RAY_AUTH_* in os.environ: restore the whole environment afterwards."""
    saved = dict(os.environ)
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN_FILE"):
        os.environ.pop(name, None)
    os.environ["RAY_HEAD_IP_FILE"] = str(tmp_path / "ray_head_ip.txt")
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved)


def test_explicit_values_pass_through(clean_env):
    assert resolve_address("local") == "local"
    assert resolve_address("10.0.0.1:29500") == "10.0.0.1:29500"


def test_auto_without_hints_is_rays_discovery(clean_env):
    assert resolve_address("auto") == "auto"


def test_auto_prefers_ray_address(clean_env):
    (clean_env / "ray_head_ip.txt").write_text("10.0.0.2:29500\n")
    os.environ["RAY_ADDRESS"] = "10.0.0.3:6379"
    assert resolve_address("auto") == "10.0.0.3:6379"


def test_auto_reads_the_head_ip_file(clean_env):
    (clean_env / "ray_head_ip.txt").write_text("10.0.0.2:29500\n")
    assert resolve_address("auto") == "10.0.0.2:29500"
    assert "RAY_AUTH_MODE" not in os.environ


def test_auto_adopts_token_auth_from_start_ray(clean_env):
    (clean_env / "ray_head_ip.txt").write_text("10.0.0.2:29500\n")
    (clean_env / "ray_auth_token").write_text("secret\n")
    assert resolve_address("auto") == "10.0.0.2:29500"
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str((clean_env / "ray_auth_token").resolve())


def test_explicit_auth_mode_is_respected(clean_env):
    (clean_env / "ray_auth_token").write_text("secret\n")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    resolve_address("auto")
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN_PATH" not in os.environ
