"""Which workers a recovery relaunches for a lost one (`rlinf_pipe.runner.recovery.lost_unit`)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rlinf_pipe.runner.recovery import LostUnit, RecoveryFailed, lost_unit


@dataclass
class _Group:
    name: str
    size: int


class _Job:
    """The part of `Components` that `lost_unit` reads."""

    def __init__(self, **sizes: int):
        self.groups = {name: _Group(name, size) for name, size in sizes.items()}

    def group(self, name: str) -> _Group:
        if name not in self.groups:
            raise ValueError(f"no group {name!r}")
        return self.groups[name]


def test_independent_ranks_go_alone_and_a_distributed_world_goes_whole():
    job = _Job(rollout=4, reward=2, inference=2, actor=4)
    assert lost_unit(job, "rlinf_pipe:rollout:3") == LostUnit("rollout", (3,))
    assert lost_unit(job, "rlinf_pipe:reward:1") == LostUnit("reward", (1,))
    assert lost_unit(job, "rlinf_pipe:inference:1") == LostUnit("inference", (0, 1))
    assert lost_unit(job, "rlinf_pipe:actor:2") == LostUnit("actor", (0, 1, 2, 3))
    assert LostUnit("actor", (0, 1)).describe() == "actor ranks 0, 1"
    assert LostUnit("rollout", (3,)).describe() == "rollout rank 3"


@pytest.mark.parametrize("worker", ["rlinf_pipe:critic:0", "rollout-0", "rlinf_pipe:rollout:x"])
def test_an_unknown_worker_is_a_recovery_failure(worker):
    with pytest.raises(RecoveryFailed, match="cannot tell which worker"):
        lost_unit(_Job(rollout=1), worker)
