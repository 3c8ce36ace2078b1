"""A worker's GPUs are indices into the GPUs its node's Ray sees, whatever CUDA_VISIBLE_DEVICES Ray started with
(Slurm's device sets, GPU UUIDs), never physical device numbers."""

from __future__ import annotations

import pytest

from rlinf_pipe.errors import ClusterError
from rlinf_pipe.runtime.worker import NODE_VISIBLE_ENV, claim_devices, visible_devices


def test_local_gpus_index_the_devices_the_node_sees():
    assert visible_devices(None, (0, 1)) == "0,1"
    assert visible_devices("", (2,)) == "2"
    assert visible_devices("4,5,6,7", (1, 3)) == "5,7"  # Slurm gave this node's Ray GPUs 4-7
    assert visible_devices("GPU-aa, GPU-bb", (1,)) == "GPU-bb"
    with pytest.raises(ClusterError, match=r"GPU 4, but the node's Ray sees only 4 \(CUDA_VISIBLE_DEVICES='4,5,6,7'"):
        visible_devices("4,5,6,7", (4,))


def test_claiming_twice_keeps_the_node_list(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(NODE_VISIBLE_ENV, "")  # recorded, so what claim_devices sets is undone after the test
    monkeypatch.delenv(NODE_VISIBLE_ENV)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("RLINF_PIPE_LOCAL_GPUS", "2,3")
    claim_devices()
    claim_devices()
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7" and os.environ[NODE_VISIBLE_ENV] == "4,5,6,7"
