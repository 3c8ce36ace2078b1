"""The ipc weight transport on a node whose /dev/shm is smaller than its buckets (a container's 64 MiB): a clear
error naming the sizes and the fix, where the block's first write past the free space used to kill the actor with
SIGBUS and no message. Run in a mount namespace with an 8 MiB tmpfs on /dev/shm; skipped where mount namespaces
cannot be made (not root, no `unshare`)."""

from __future__ import annotations

import os
import sys

from support.namespaces import run_in_mount_namespace

CHILD = """
import torch
from rlinf_pipe.weights.checks import WeightSyncError
from rlinf_pipe.weights.ipc import _SharedSlot

small = _SharedSlot(1 << 20, torch.device("cpu"))
small.tensor.fill_(1)
print("small slot written", int(small.tensor.sum()))
small.close()
try:
    _SharedSlot(32 << 20, torch.device("cpu")).tensor.fill_(1)
except WeightSyncError as exc:
    print("refused:", exc)
"""


def test_the_ipc_transport_says_when_dev_shm_cannot_hold_its_buckets():
    script = f'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec {sys.executable} -c "$CHILD"'
    proc = run_in_mount_namespace(script, {**os.environ, "CHILD": CHILD})
    assert proc.returncode == 0, proc.stderr[-2000:]  # (-7: SIGBUS)
    assert f"small slot written {1 << 20}" in proc.stdout
    refused = proc.stdout.split("refused: ", 1)[1]
    assert "/dev/shm (8 MiB free of 8 MiB) cannot hold a shared-memory block of 32.0 MiB" in refused
    assert "--shm-size" in refused and "runner.weight_sync: broadcast" in refused
