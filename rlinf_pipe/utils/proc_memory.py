"""What the processes of a machine really cost in memory: proportional (PSS) and unique (USS) set sizes, read from
Linux's `/proc/PID/smaps_rollup`, and `MemorySampler`, which follows every process under a root process (a
driver and the local Ray cluster it started, its workers included) and keeps each one's peak and the peak of their
sum.

Resident memory (RSS) counts a page once in every process that maps it: the shared libraries and files many worker
processes map (torch, Python) are counted again in each, so a sum of RSS overstates what a machine needs. PSS
divides every shared page among the processes mapping it, so the PSS of all processes adds up to the memory they
hold together; USS counts only the pages no other process maps, what ending the process would give back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcMemory:
    """One process's memory now, in bytes: proportional set (PSS), unique set (USS), resident set (RSS)."""

    pss: int
    uss: int
    rss: int


def read_proc_memory(pid: int, proc: Path = PROC) -> ProcMemory | None:
    """The memory of process `pid` (None when it is gone, not readable, or the kernel has no `smaps_rollup`)."""
    fields: dict[str, int] = {}
    try:
        with open(proc / str(pid) / "smaps_rollup") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("Rss", "Pss", "Private_Clean", "Private_Dirty"):
                    fields[key] = int(value.split()[0]) * 1024  # (kB)
    except (OSError, ValueError):
        return None
    if "Pss" not in fields:
        return None
    return ProcMemory(pss=fields["Pss"], uss=fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
                      rss=fields.get("Rss", 0))


def _parent(pid: str, proc: Path) -> int | None:
    try:
        stat = (proc / pid / "stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2:].split()[1])  # (the name, in parentheses, may hold spaces)


def descendants(root: int, proc: Path = PROC) -> list[int]:
    """`root` and every process below it (children, their children, ...), as now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir(proc):
        if entry.isdigit() and (parent := _parent(entry, proc)) is not None:
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def process_name(pid: int, proc: Path = PROC) -> str:
    """A short name for `pid`: a Ray worker's title (`ray::<actor>`: its class; `ray::IDLE`), else the program
    (`raylet`, `gcs_server`) or the Python script it runs; "" when it is gone."""
    try:
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    words = [a.decode(errors="replace") for a in argv if a]
    if not words:
        return ""
    if words[0].startswith("ray::"):
        title = words[0].split()[0][len("ray::"):]
        return title.split(":")[-1].split(".")[0] if ":" in title else title.split(".")[0]
    script = next((w for w in words[1:] if w.endswith(".py")), None)
    if script is not None:
        return Path(script).stem if Path(script).stem not in ("main", "agent") else "/".join(Path(script).parts[-2:])
    if "-c" in words[:-1]:
        command = words[words.index("-c") + 1]
        return "python -c " + command.split(";")[0].removeprefix("from ")[:40]
    if len(words) > 2 and words[1] == "-m":
        return words[2]
    program = next((w for w in words[1:] if not w.startswith("-")), None) if "python" in words[0] else None
    return Path(program or words[0]).name


@dataclass
class Peak:
    """A process's largest PSS seen, with its USS and RSS at that moment, and its name."""

    name: str
    memory: ProcMemory


@dataclass
class MemorySampler:
    """Samples the memory of `root` and every process under it each `interval_s` seconds in a thread of its own
    (`start`, `stop`, or `with`): `peaks` per pid (a process that ended keeps its peak) and `peak_total`, the
    largest sum of PSS over all of them at one sample."""

    root: int
    interval_s: float = 2.0
    proc: Path = PROC
    peaks: dict[int, Peak] = field(default_factory=dict)
    peak_total: int = 0
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def sample(self) -> int:
        """Read every process once now; returns their PSS together."""
        total = 0
        for pid in descendants(self.root, self.proc):
            memory = read_proc_memory(pid, self.proc)
            if memory is None:
                continue
            total += memory.pss
            peak = self.peaks.get(pid)
            if peak is None or memory.pss > peak.memory.pss:
                self.peaks[pid] = Peak(process_name(pid, self.proc) or (peak.name if peak else ""), memory)
        self.peak_total = max(self.peak_total, total)
        self.samples += 1
        return total

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> MemorySampler:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def peak_of(self, pids: Iterable[int]) -> list[ProcMemory | None]:
        """The peak memory of each of `pids` (None for one never seen)."""
        return [p.memory if (p := self.peaks.get(pid)) else None for pid in pids]
