"""The rehearsal report's memory lines (`rehearse.memory_lines`): PSS per component from the sampler's peaks of the
workers' pids, and every process together split into workers, driver and the rest."""

from __future__ import annotations

from rlinf_pipe.runner.rehearse import GIB, memory_lines
from rlinf_pipe.runner.workers_record import WorkerRecord
from rlinf_pipe.utils.proc_memory import MemorySampler, Peak, ProcMemory


def record(group: str, rank: int, node: int, pid: int) -> WorkerRecord:
    return WorkerRecord(group, rank, node, f"node{node}", "10.0.0.1", (rank,), pid, peak_rss_bytes=GIB)


def test_memory_lines_report_pss_per_component_and_the_whole():
    records = [record("rollout", 0, 0, 11), record("rollout", 1, 1, 12), record("actor", 0, 0, 21),
               record("inference", 0, 1, 31)]  # (pid 31 never sampled)
    sampler = MemorySampler(root=1)
    for pid, name, pss in [(11, "RolloutWorker", 0.2), (12, "RolloutWorker", 0.3), (21, "ActorWorker", 0.5),
                           (1, "rlinf_pipe.cli", 0.4), (5, "raylet", 0.05), (6, "raylet", 0.05), (7, "gcs_server", 0.1)]:
        sampler.peaks[pid] = Peak(name, ProcMemory(pss=int(pss * GIB), uss=int(pss * GIB * 0.9), rss=int(pss * GIB * 2)))
    sampler.peak_total = int(1.5 * GIB)
    lines = memory_lines(records, ["rollout", "actor", "inference"], sampler,
                         {"workers_s": {"rollout": 12.0, "actor": 30.5}, "to_first_step_s": 61.0})
    assert lines[1] == "  rollout      2  nodes 0,1  0.30 / 0.25 GiB (USS 0.27, RSS 0.60)  12.0"
    assert lines[2] == "  actor        1  nodes 0  0.50 / 0.50 GiB (USS 0.45, RSS 1.00)  30.5"
    assert lines[3] == "  inference    1  nodes 1  not sampled  nan"
    assert lines[4] == ("  every process together: 1.5 GiB PSS at the peak (each one's peak: workers 1.0, driver 0.4, "
                        "the rest 0.2: raylet 0.10, gcs_server 0.10)")
    assert lines[5] == "  launch to the first step 61.0 s"
