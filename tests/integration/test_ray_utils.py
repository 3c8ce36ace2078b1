"""ray_utils/start_ray.sh and check_ray.sh against real Ray processes (no mocks).

A two-node cluster with virtual GPUs runs on this machine (head: 2 GPUs, RANK=0; worker: 3 GPUs, RANK=1), once
with RAY_AUTH_MODE=disabled and once with no auth setting at all (the default: token). Every script runs in its
own session with a variable of its own in its environment, which every process it starts inherits, so teardown
stops exactly the processes of this cluster (never with a machine-wide `ray stop`, and never by a session id,
whose pid may have been reused by then).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlinf_pipe.utils.net import free_port
from support.faults import wait_for
from support.processes import Sessions

REPO = Path(__file__).resolve().parents[2]
START = REPO / "ray_utils" / "start_ray.sh"
CHECK = REPO / "ray_utils" / "check_ray.sh"
STOP = REPO / "ray_utils" / "stop_ray.sh"


def _script_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The caller's environment without any RAY_* setting, pointed at files under `tmp`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_HEAD_IP_FILE=str(tmp / "ray_head_ip.txt"))
    env.update(extra)
    return env


def _wait(proc: subprocess.Popen, log: Path, what: str, timeout: float = 120) -> str:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish within {timeout}s:\n{log.read_text()}")
    text = log.read_text()
    assert rc == 0, f"{what} failed (rc={rc}):\n{text}"
    return text


@pytest.fixture(scope="module", params=["disabled", "token"])
def cluster(request, tmp_path_factory):
    auth_mode = request.param  # ("token": started with no RAY_AUTH_MODE at all, the scripts' default)
    tmp = tmp_path_factory.mktemp(f"ray_utils_{auth_mode}")
    # Ray's unix socket paths (temp dir + session name + socket name) must stay under 108 bytes: keep it short.
    ray_tmp = Path(tempfile.mkdtemp(prefix="rlp-ray-"))
    sessions = Sessions(tmp, marker=str(ray_tmp))
    port = free_port("")
    common = dict(RAY_PORT=str(port), RAY_NUM_CPUS="1", RAY_JOIN_TIMEOUT="90")
    if auth_mode == "disabled":
        common["RAY_AUTH_MODE"] = "disabled"
    head_env = _script_env(tmp, RANK="0", RAY_NUM_GPUS="2", RAY_TEMP_DIR=str(ray_tmp / "h"),
                           RAY_EXTRA_ARGS="--include-dashboard=false", **common)
    worker_env = _script_env(tmp, RANK="1", RAY_NUM_GPUS="3", RAY_TEMP_DIR=str(ray_tmp / "w"), **common)
    try:
        # Both at once, as on a real cluster: the worker waits for the head's address file.
        worker, worker_log = sessions.start(["bash", str(START)], worker_env)
        head, head_log = sessions.start(["bash", str(START)], head_env)
        head_out = _wait(head, head_log, "RANK=0 start_ray.sh")
        worker_out = _wait(worker, worker_log, "RANK=1 start_ray.sh")
        address = (tmp / "ray_head_ip.txt").read_text().strip()
        assert address.endswith(f":{port}")
        assert f"Ray head started at {address}" in head_out
        assert f"Ray started: node rank 1 joined {address}" in worker_out
        driver_env = _script_env(tmp, RAY_AUTH_MODE=auth_mode)
        if auth_mode == "token":
            token_file = tmp / "ray_auth_token"
            assert token_file.stat().st_mode & 0o077 == 0, "the token file must be readable by its owner only"
            driver_env["RAY_AUTH_TOKEN_PATH"] = str(token_file)
        yield {"sessions": sessions, "tmp": tmp, "address": address, "driver_env": driver_env, "auth": auth_mode,
               "outputs": [head_out, worker_out]}
    finally:
        sessions.stop_all()
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
def test_check_ray_sees_both_nodes(cluster):
    env = _script_env(cluster["tmp"], RAY_CHECK_TIMEOUT="60")  # (the auth mode and token found as start_ray.sh left them)
    rc, out = cluster["sessions"].run(["bash", str(CHECK), "5"], env)
    assert rc == 0, out
    assert f"OK: 5 GPUs on 2 node(s) at {cluster['address']}" in out
    assert re.search(r"node rank 0  ip \S+  2 GPUs  id \w+ \(head\)", out), out
    assert re.search(r"node rank 1  ip \S+  3 GPUs  id \w+$", out, re.MULTILINE), out


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["disabled"], indirect=True)  # the auth mode does not matter here
def test_check_ray_fails_on_wrong_gpu_count(cluster):
    env = _script_env(cluster["tmp"], RAY_AUTH_MODE=cluster["driver_env"]["RAY_AUTH_MODE"], RAY_CHECK_TIMEOUT="2")
    rc, out = cluster["sessions"].run(["bash", str(CHECK), "6"], env)
    assert rc == 1, out
    assert "timed out after 2s: saw 5 of 6 expected GPUs on 2 alive node(s)" in out
    assert "RAY_NUM_GPUS" in out

    rc, out = cluster["sessions"].run(["bash", str(CHECK), "4"], env)
    assert rc == 1, out
    assert "has 5 GPUs on 2 node(s), more than the expected 4" in out


QUERY = """
import json, ray
ray.init(address="{address}", log_to_driver=False, logging_level="ERROR")
nodes = [(n["Labels"].get("rlinf_pipe/node-rank"), n["Resources"].get("GPU")) for n in ray.nodes() if n["Alive"]]
print("NODES=" + json.dumps(sorted(nodes)))
"""


@pytest.mark.slow
def test_nodes_carry_rank_labels(cluster):
    # The driver's environment here is what rlinf_pipe's driver needs: RAY_AUTH_MODE (+ the token file for `token`).
    cmd = [sys.executable, "-c", QUERY.format(address=cluster["address"])]
    rc, out = cluster["sessions"].run(cmd, cluster["driver_env"], timeout=60)
    assert rc == 0, out
    line = next(x for x in out.splitlines() if x.startswith("NODES="))
    assert line == 'NODES=[["0", 2.0], ["1", 3.0]]'


DRIVER = """
import ray
from rlinf_pipe.runtime.cluster import resolve_address
where = resolve_address("auto")
ray.init(address=where.address, log_to_driver=False, logging_level="ERROR")
print("JOINED", where.address, sum(n["Alive"] for n in ray.nodes()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["token"], indirect=True)
def test_a_job_given_only_the_token_mode_joins_with_the_token_start_ray_wrote(cluster, tmp_path):
    """As `ray_utils/slurm.sbatch` runs the job: RAY_AUTH_MODE=token and no token path (and no ~/.ray/auth_token:
    an empty HOME), so Ray alone would find no token and refuse the job."""
    env = _script_env(cluster["tmp"], RAY_AUTH_MODE="token", HOME=str(tmp_path))
    rc, out = cluster["sessions"].run([sys.executable, "-c", DRIVER], env, timeout=60)
    assert rc == 0, out
    assert f"JOINED {cluster['address']} 2" in out


@pytest.mark.slow
def test_start_ray_says_which_auth_it_started_and_warns_only_without_one(cluster):
    warnings = [line for out in cluster["outputs"] for line in out.splitlines() if "warning: RAY_AUTH_MODE" in line]
    assert all(f"auth {cluster['auth']})" in out for out in cluster["outputs"])
    if cluster["auth"] == "token":
        assert warnings == []
    else:
        assert len(warnings) == 2 and "anyone who can reach this cluster's Ray ports" in warnings[0]


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["token"], indirect=True)
def test_a_cluster_started_with_no_auth_setting_refuses_a_client_without_its_token(cluster):
    """ShadowRay (CVE-2023-48022) needs a head that answers anyone: the GCS of a cluster that start_ray.sh started
    with no settings refuses a call without the token or with another one, and answers one with the token."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    token = (cluster["tmp"] / "ray_auth_token").read_text().strip()
    with grpc.insecure_channel(cluster["address"]) as channel:
        gcs = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        for metadata in ((), (("authorization", "Bearer " + "0" * len(token)),)):
            with pytest.raises(grpc.RpcError) as refused:
                gcs.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), metadata=metadata, timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        gcs.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), metadata=(("authorization", f"Bearer {token}"),),
                         timeout=30)


def _command_lines(pids: list[int]) -> dict[int, str]:
    """Each process's command line, parent and node tag (for a failure message)."""
    lines = {}
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = Path(f"/proc/{pid}/stat").read_text()
            tags = [e for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    if e.startswith(b"RLINF_PIPE_RAY_NODE=")]
            lines[pid] = f"{cmdline.strip()[:160]} (state/ppid {stat[stat.rindex(')') + 2:].split()[:2]}, tag {tags})"
        except OSError:
            lines[pid] = "(gone)"
    return lines


def _node_pids(node_id: str) -> list[int]:
    """Processes whose environment holds `RLINF_PIPE_RAY_NODE=<node_id>` (what start_ray.sh gives its node)."""
    wanted = f"RLINF_PIPE_RAY_NODE={node_id}".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if wanted in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["token"], indirect=True)
def test_stop_ray_stops_its_own_node_and_nothing_else(cluster):  # the last test on this cluster: it stops it
    tmp, sessions = cluster["tmp"], cluster["sessions"]
    node_ids = {rank: next(tmp.glob(f"ray_node_{rank}_*.id")).read_text().strip() for rank in (0, 1)}
    assert all(_node_pids(node_id) for node_id in node_ids.values())
    # Ray's processes (and so the workers) do not inherit the node's RANK under torch's name for a process's rank
    for pid in [p for node_id in node_ids.values() for p in _node_pids(node_id)]:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # (gone meanwhile)
            continue
        assert not any(e.startswith(b"RANK=") for e in environ), _command_lines([pid])
    rc, out = sessions.run(["bash", str(STOP)], _script_env(tmp, RANK="1", RAY_STOP_GRACE="3"), timeout=60)
    assert rc == 0 and re.search(r"Ray node rank 1 on \S+ stopped \([1-9]\d* processes\)", out), out
    assert not _node_pids(node_ids[1]) and _node_pids(node_ids[0])  # the other node (another Ray) lives on
    rc, out = sessions.run(["bash", str(STOP)], _script_env(tmp, RANK="0", RAY_STOP_GRACE="3"), timeout=60)
    assert rc == 0, out
    assert not _node_pids(node_ids[0])
    # (a process signalled by the stop may take a moment to exit on a loaded machine)
    assert wait_for(lambda: not sessions.pids(), timeout_s=20), _command_lines(sessions.pids())
    assert not (tmp / "ray_head_ip.txt").exists() and not (tmp / "ray_auth_token").exists()
    rc, out = sessions.run(["bash", str(STOP)], _script_env(tmp, RANK="0"), timeout=60)
    assert rc == 1 and "no Ray node of rank 0 started by start_ray.sh" in out


def test_worker_without_head_file_fails_clearly(tmp_path):
    sessions = Sessions(tmp_path)
    try:
        env = _script_env(tmp_path, RANK="1", RAY_JOIN_TIMEOUT="1")
        rc, out = sessions.run(["bash", str(START)], env, timeout=30)
    finally:
        sessions.stop_all()
    assert rc == 1, out
    assert f"the head address file {tmp_path / 'ray_head_ip.txt'} did not appear within 1s" in out
    assert "Start the head node first (RANK=0 bash ray_utils/start_ray.sh)" in out
    assert "RAY_HEAD_IP_FILE" in out


@pytest.mark.parametrize("rank", ["", "-1", "abc", "1.5"])
def test_invalid_rank_fails_clearly(tmp_path, rank):
    env = _script_env(tmp_path, RANK=rank)
    res = subprocess.run(["bash", str(START)], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "RANK must be a non-negative integer (0 on the head node, 1, 2, ... on the others)" in res.stderr
    assert f"got '{rank}'" in res.stderr
    assert not (tmp_path / "ray_head_ip.txt").exists()


@pytest.mark.parametrize("args", [[], ["0"], ["x"], ["4", "8"]])
def test_check_ray_usage(args):
    res = subprocess.run(["bash", str(CHECK), *args], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "usage: bash ray_utils/check_ray.sh N" in res.stderr

