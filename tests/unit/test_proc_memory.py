"""`rlinf_pipe.utils.proc_memory`: PSS/USS read from /proc, the process tree under a root, and the sampler's peaks
(a child that grows and ends keeps its peak; the total is the sum of one sample)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rlinf_pipe.utils.proc_memory import MemorySampler, descendants, process_name, read_proc_memory

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux smaps_rollup")
MIB = 1 << 20

# a child that holds 64 MiB of its own memory (touched), says so, and waits for its stdin to close
HOLDER = "import sys; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); " \
         "sys.stdin.read()"


def hold() -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    return child


def test_own_memory_adds_up():
    before = read_proc_memory(os.getpid())
    block = bytearray(32 * MIB)
    block[::4096] = b"x" * len(block[::4096])
    after = read_proc_memory(os.getpid())
    assert before is not None and after is not None
    assert after.uss - before.uss >= 30 * MIB and after.pss - before.pss >= 30 * MIB
    assert after.uss <= after.pss <= after.rss  # private pages count whole in both; shared ones in part in PSS


def test_gone_process_reads_none():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert read_proc_memory(child.pid) is None and process_name(child.pid) == ""


def test_descendants_and_the_sampler_keep_a_finished_child_peak():
    sampler = MemorySampler(os.getpid(), interval_s=3600)  # sampled by hand below
    child = hold()
    try:
        assert child.pid in descendants(os.getpid())
        total = sampler.sample()
        own = read_proc_memory(os.getpid())
        assert own is not None and total >= own.pss + 60 * MIB
        assert sampler.peaks[child.pid].memory.uss >= 60 * MIB
        assert sampler.peaks[child.pid].name.startswith("python -c import sys")
    finally:
        child.stdin.close()
        child.wait()
    sampler.sample()  # the child is gone: it keeps its peak, the total its largest sum
    assert child.pid not in descendants(os.getpid())
    assert sampler.peak_of([child.pid])[0].uss >= 60 * MIB and sampler.peak_total >= total
    assert sampler.peak_of([-1]) == [None]


def test_sampler_thread_samples_until_stopped():
    with MemorySampler(os.getpid(), interval_s=0.01) as sampler:
        deadline = time.monotonic() + 10
        while sampler.samples < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    seen = sampler.samples
    assert seen >= 3 and os.getpid() in sampler.peaks
    time.sleep(0.05)
    assert sampler.samples == seen  # stopped


def test_process_names(tmp_path):
    proc = tmp_path
    cases = {1: b"ray::rlinf_pipe:actor:3:ActorWorker.train_step\0", 2: b"ray::IDLE\0",
             3: b"/venv/bin/python\0-u\0/venv/ray/dashboard/agent.py\0--node-ip-address=1\0",
             4: b"/venv/bin/python\0-m\0rlinf_pipe.cli\0rehearse\0", 5: b"/venv/ray/core/src/ray/raylet/raylet\0--x\0",
             6: b"/venv/bin/python\0/venv/bin/rlinf-pipe\0rehearse\0", 7: b"ray::RolloutWorker.generate_step\0"}
    for pid, argv in cases.items():
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cmdline").write_bytes(argv)
    names = {pid: process_name(pid, proc) for pid in cases}
    assert names == {1: "ActorWorker", 2: "IDLE", 3: "dashboard/agent.py", 4: "rlinf_pipe.cli", 5: "raylet",
                     6: "rlinf-pipe", 7: "RolloutWorker"}
