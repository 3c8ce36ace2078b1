"""ray_utils/slurm.sbatch against a real Slurm: the test starts munged, slurmctld and slurmd (Debian's slurm-wlm) on
this machine as a one-node cluster, submits the tiny config with `sbatch --wait`, and checks that Ray started,
every GPU joined, the run trained, and the node's Ray is gone afterwards. Skipped where Slurm is not installed or
the test cannot start its daemons (not root): `apt-get install slurm-wlm` to run it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from rlinf_pipe.utils.metrics import read_metrics
from rlinf_pipe.utils.net import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")
MUNGE_KEY = Path("/etc/munge/munge.key")


def missing() -> str | None:
    absent = [d for d in DAEMONS if shutil.which(d) is None]
    if absent:
        return f"Slurm is not installed here ({', '.join(absent)} missing): apt-get install slurm-wlm"
    if os.geteuid() != 0 or not MUNGE_KEY.is_file():
        return "starting munged / slurmctld / slurmd for the test needs root and /etc/munge/munge.key"
    return None


def slurm_conf(folder: Path, host: str, munge_socket: Path) -> str:
    return "\n".join([
        "ClusterName=rlinfpipetest", f"SlurmctldHost={host}", f"SlurmctldPort={free_port('')}",
        f"SlurmdPort={free_port('')}", "AuthType=auth/munge", f"AuthInfo=socket={munge_socket}",
        "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool'}", f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd.pid'}", f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd.log'}", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "MpiDefault=none", "ReturnToService=2", f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP", "",
    ])


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = missing()
    if reason:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (folder / sub).mkdir()
    munge_socket = folder / "munge" / "munge.socket"
    host = socket.gethostname().split(".")[0]
    conf = folder / "slurm.conf"
    conf.write_text(slurm_conf(folder, host, munge_socket))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons: list[subprocess.Popen] = []
    try:
        subprocess.run(["munged", "--force", f"--socket={munge_socket}", f"--key-file={MUNGE_KEY}",
                        f"--pid-file={folder / 'munge' / 'munged.pid'}", f"--log-file={folder / 'munge' / 'log'}",
                        f"--seed-file={folder / 'munge' / 'seed'}"], check=True, capture_output=True, timeout=30)
        for daemon in ("slurmctld", "slurmd"):
            daemons.append(subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                           text=True).stdout:
            if time.monotonic() > deadline:
                pytest.fail(f"the test's Slurm did not come up:\n{(folder / 'slurmctld.log').read_text()}")
            time.sleep(0.5)
        yield env
    finally:
        for daemon in daemons:
            daemon.terminate()
            daemon.wait(timeout=30)
        pid_file = folder / "munge" / "munged.pid"
        if pid_file.is_file():
            subprocess.run(["kill", pid_file.read_text().strip()], check=False)


def processes_with_env(text: str) -> list[int]:
    """Pids whose environment contains `text` (e.g. a path only this test's job exported)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_the_sbatch_template_starts_ray_checks_it_trains_and_stops_it(slurm, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text("runner:\n  max_steps: 2\n  progress: false\n")
    env = {**slurm, "RAY_NUM_GPUS": "3", "RAY_NUM_CPUS": "2", "RAY_PORT": str(free_port("")),
           "RAY_CHECK_TIMEOUT": "120", "RLINF_PIPE_SHARED_DIR": str(tmp_path / "shared"),
           "PYTHON": str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv").is_dir() else "python"}
    out = tmp_path / "job.out"
    proc = subprocess.run(["sbatch", "--wait", f"--output={out}", "--chdir", str(ROOT),
                           str(ROOT / "ray_utils" / "slurm.sbatch"), str(config), f"runner.output_dir={tmp_path}",
                           "runner.tensorboard=false"], env=env, capture_output=True, text=True, timeout=600)
    log = out.read_text() if out.exists() else ""
    assert proc.returncode == 0, f"sbatch: {proc.stdout}{proc.stderr}\njob output:\n{log}"
    assert "Ray head started at" in log and "OK: 3 GPUs on 1 node(s)" in log, log
    (run_dir,) = [p.parent for p in tmp_path.glob("*/*/metrics.jsonl")]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1]
    job = next(iter((tmp_path / "shared").glob("job-*")))
    assert not (job / "ray_head_ip.txt").exists()  # stop_ray.sh on the head removed it
    assert processes_with_env(f"RLINF_PIPE_SHARED_DIR={tmp_path / 'shared'}") == []  # the job's Ray is gone
