"""The typed verbs of a `WorkerGroup` (`rlinf_pipe.runtime.verbs`): a call goes to each rank's actor by the method's
name (a subclass's override runs), a sharded call gives each replica its contiguous shard, and the type checker
rejects a call the worker's method does not take (mypy over a snippet of driver code)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlinf_pipe.planning.placement import ComponentPlacement, ProcessPlacement
from rlinf_pipe.runtime import verbs
from rlinf_pipe.runtime.group_call import Member
from rlinf_pipe.runtime.verbs import method_name
from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.runtime.worker_group import WorkerGroup

ROOT = Path(__file__).resolve().parents[2]


class Sharder(Worker):
    def count(self, shard: list[int], scale: int = 1) -> int:
        return len(shard) * scale

    def on_abandon(self) -> None:
        """(an override: the call names the base class's method, the actor runs this one)"""


class _Actor:
    """A Ray actor handle's stand-in: `actor.<method>.remote(...)` records the call and returns a reference."""

    def __init__(self, rank: int, sent: list[tuple[int, str, tuple, dict]]):
        self.rank, self.sent = rank, sent

    def __getattr__(self, name: str):
        def remote(*args, **kwargs):
            self.sent.append((self.rank, name, args, kwargs))
            return f"ref-{self.rank}-{name}"

        return type("Method", (), {"remote": staticmethod(remote)})()


@pytest.fixture(autouse=True)
def _no_object_store(monkeypatch):
    """An argument for several ranks goes into the object store: here it stays as it is, marked."""
    monkeypatch.setattr(verbs.ray, "put", lambda value: ("put", value))


def _group(tp: int, ranks: int, sent: list) -> WorkerGroup[Sharder]:
    processes = tuple(ProcessPlacement(r, 0, (r,), (r,)) for r in range(ranks))
    placement = ComponentPlacement("actor", "actor", tuple(range(ranks)), tp, 1, processes)
    members = [Member(r, p, _Actor(r, sent), f"actor:{r}") for r, p in enumerate(processes)]
    return WorkerGroup("actor", placement, members)


def test_a_call_goes_to_each_rank_by_the_methods_name():
    sent: list = []
    group = _group(tp=1, ranks=3, sent=sent)
    call = group.some([2, 0]).call(Sharder.count, [1], scale=2)
    assert sent[0][2:] == ((("put", [1]),), {"scale": 2})  # shared by reference
    assert [(rank, name) for rank, name, _, _ in sent] == [(2, "count"), (0, "count")]
    assert call.refs == ["ref-2-count", "ref-0-count"] and call.method == "count"
    sent.clear()
    group.rank(1).call(Worker.on_abandon)  # by name: the actor's own `on_abandon` runs
    assert sent == [(1, "on_abandon", (), {})]


def test_a_sharded_call_gives_each_replica_its_shard_and_its_other_ranks_the_same():
    sent: list = []
    group = _group(tp=2, ranks=4, sent=sent)  # replicas: ranks 0-1 and 2-3
    group.sharded.call(Sharder.count, [10, 11, 12], 3)
    assert {rank: args for rank, _, args, _ in sent} == {0: (("put", [10]), 3), 1: (("put", [10]), 3),
                                                         2: (("put", [11, 12]), 3), 3: (("put", [11, 12]), 3)}


@pytest.mark.parametrize("method", [lambda worker: 1, Worker.__init__], ids=["lambda", "private"])
def test_a_verb_calls_only_a_public_method(method):
    with pytest.raises(TypeError, match="public method of the worker class"):
        method_name(method)


SNIPPET = '''
from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.runtime.worker_group import WorkerGroup


class Adder(Worker):
    def add(self, x: int, y: int = 0) -> int:
        return x + y

    async def names(self, names: list[str], suffix: str) -> list[str]:
        return [n + suffix for n in names]


def driver(group: WorkerGroup[Adder]) -> None:
    total: list[int] = group.all.call(Adder.add, 1, y=2).wait()
    first: int = group.rank(0).call(Adder.add, 1).wait()
    named: list[list[str]] = group.sharded.call(Adder.names, ["a", "b"], "!").wait()
    group.all.call(Worker.ping)
    group.all.call(Adder.add, "one")  # error: an argument of the wrong type
    group.all.call(Adder.add, 1, z=2)  # error: an argument the method does not take
    group.leader(0).call(Adder.names, ["a"])  # error: an argument missing
    wrong: str = group.rank(0).call(Adder.add, 1).wait()  # error: the result is an int
    group.sharded.call(Adder.names, [1, 2], "!")  # error: the method takes shards of str
'''


@pytest.mark.slow
def test_mypy_checks_a_call_against_the_workers_method(tmp_path):
    """(Run in the repository with its mypy cache: fast once `scripts/test.sh`'s mypy pass has filled it.)"""
    pytest.importorskip("mypy")
    (tmp_path / "driver.py").write_text(SNIPPET)
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", str(tmp_path / "driver.py")],  # (pyproject's settings)
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = SNIPPET.splitlines()
    flagged = sorted({int(line.split(":")[1]) for line in out.stdout.splitlines() if ": error:" in line})
    expected = [i + 1 for i, line in enumerate(lines) if "# error:" in line]
    assert flagged == expected, out.stdout
