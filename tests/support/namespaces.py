"""Commands in a mount namespace of their own, so that what they mount (a resolv.conf, a small tmpfs on /dev/shm)
is seen by them alone: the machine's own files stay as they are."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def require_mount_namespace() -> None:
    """Skip the test where mount namespaces cannot be made (not Linux, not root, no `unshare`, or refused)."""
    if sys.platform != "linux" or shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs Linux, root and unshare(1) for a mount namespace")
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("this machine does not allow mount namespaces")


def run_in_mount_namespace(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run the shell `script` in a new mount namespace from the repository's root, with `env` (the repository on
    PYTHONPATH); its output as text."""
    require_mount_namespace()
    return subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**env, "PYTHONPATH": str(REPO)})
