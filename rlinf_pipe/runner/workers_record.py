"""`workers.json`: where each worker process of a run ran and the most memory it held, written at the end of a run
(`rlinf-pipe rehearse` checks it against the placement; a user reads it to see which process ran where)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.runtime.worker_group import WorkerGroup

WORKERS_FILE = "workers.json"


@dataclass(frozen=True)
class WorkerRecord:
    """One worker process: its group and rank, the node and GPUs it ran on, its pid and peak resident memory."""

    group: str
    rank: int
    node_rank: int
    node_id: str
    ip: str
    global_gpus: tuple[int, ...]
    pid: int
    peak_rss_bytes: int


def record_workers(groups: Sequence[WorkerGroup[Worker]], run_dir: Path) -> list[WorkerRecord]:
    """Ask every worker of `groups` where it runs and its peak memory; write `run_dir/workers.json`."""
    records = []
    for group in groups:
        infos, peaks = group.infos(), group.all.call(Worker.peak_memory).wait()
        for info, peak in zip(infos, peaks, strict=True):
            records.append(WorkerRecord(group.name, info.rank, info.node_rank, info.node_id, info.ip,
                                        tuple(info.global_gpus), info.pid, int(peak)))
    (run_dir / WORKERS_FILE).write_text(json.dumps([asdict(r) for r in records], indent=1))
    return records


def read_workers(run_dir: Path) -> list[WorkerRecord]:
    """The records of a run's `workers.json`."""
    rows = json.loads((run_dir / WORKERS_FILE).read_text())
    return [WorkerRecord(**{**row, "global_gpus": tuple(row["global_gpus"])}) for row in rows]
