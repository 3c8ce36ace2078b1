"""Commands run in sessions of their own, and every process they leave behind found and stopped: by an environment
variable that every process they start inherits (Ray's daemons included), never by a machine-wide `ray stop`."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SESSION_ENV = "RLINF_PIPE_TEST_SESSION"


class Sessions:
    """Runs commands in new sessions and stops every process they left (found by an environment variable they all
    inherit, or by `marker` in the command line)."""

    def __init__(self, logdir: Path, marker: str | None = None):
        self.logdir = logdir
        self.marker = marker
        self.count = 0
        # Every process these commands start inherits this variable. A session id alone is not proof: the pid it
        # came from is reused once its process is gone (and Ray starts its daemons in sessions of their own).
        self.token = f"{SESSION_ENV}={uuid.uuid4().hex}".encode()

    def start(self, cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
        # Output goes to a file: Ray's daemons could keep a pipe open long after the script has exited.
        self.count += 1
        log = self.logdir / f"cmd{self.count}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd, env={**env, SESSION_ENV: self.token.decode().split("=", 1)[1]}, cwd=REPO, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return proc, log

    def run(self, cmd: list[str], env: dict[str, str], timeout: float = 120) -> tuple[int, str]:
        proc, log = self.start(cmd, env)
        rc = proc.wait(timeout=timeout)
        return rc, log.read_text()

    def pids(self) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            state = stat[stat.rindex(")") + 2 :].split()[0]
            if state == "Z":  # exited, only waiting for its parent to reap it
                continue
            if self.token in environ.split(b"\0") or (self.marker and self.marker in cmdline):
                found.append(int(entry))
        return found

    def _signal_until_gone(self, sig: signal.Signals, grace_s: float) -> list[int]:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while (left := self.pids()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def stop_all(self) -> None:
        # SIGTERM lets raylets unregister; Ray 2.60's GCS may hang while flushing events, hence the SIGKILL.
        if self._signal_until_gone(signal.SIGTERM, grace_s=3.0):
            left = self._signal_until_gone(signal.SIGKILL, grace_s=10.0)
            assert not left, f"processes of the test cluster survived SIGKILL: {left}"
