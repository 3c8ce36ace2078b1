"""GPU ids as placement YAML writes them: the grammar (`all`, `N`, `a-b`, comma lists, YAML lists) and global id <->
(node, local id). Pure functions; every broken rule raises a `PlacementError` naming the key, the value and a fix.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from collections.abc import Sequence
from itertools import accumulate

from rlinf_pipe.errors import PlacementError


class NodeLayout:
    """Global GPU id <-> (node rank, local id): ids are cumulative over the node order."""

    def __init__(self, gpus_per_node: Sequence[int]):
        self.gpus_per_node = tuple(gpus_per_node)
        self.offsets = (0, *accumulate(self.gpus_per_node))

    @property
    def world_size(self) -> int:
        return self.offsets[-1]

    def node_of(self, gpu: int) -> int:
        if not 0 <= gpu < self.world_size:
            raise ValueError(f"GPU {gpu} is outside the cluster ({self.world_size} GPUs)")
        return bisect.bisect_right(self.offsets, gpu) - 1

    def local_id(self, gpu: int) -> int:
        return gpu - self.offsets[self.node_of(gpu)]

    def describe(self) -> str:
        if len(set(self.gpus_per_node)) == 1:
            per = f"{self.gpus_per_node[0]} GPUs each"
        else:
            per = "GPUs per node " + "/".join(map(str, self.gpus_per_node))
        return f"{len(self.gpus_per_node)} node(s), {per}, global ids 0-{self.world_size - 1}"


def format_ids(ids: Sequence[int]) -> str:
    """Compact id list: [0, 1, 2, 5] -> "0-2,5"."""
    ids = sorted(ids)
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


_TOKEN = re.compile(r"^(\d+)(?:\s*-\s*(\d+))?$")


def parse_gpu_ids(key: str, value: object, layout: NodeLayout) -> tuple[int, ...]:
    """Parse one placement value (`all`, `N`, `a-b`, comma lists with an optional trailing comma, or a YAML list of
    ints) into sorted ids."""
    world = layout.world_size
    if value is None:
        raise PlacementError(
            key,
            "null",
            "no GPUs given: YAML reads an empty value (`actor:`) or `null` as null",
            "give the GPUs, e.g. `0-3` or `all`, or remove the entry",
        )
    if isinstance(value, bool):
        raise PlacementError(key, value, "a placement value is GPU ids, not a boolean", "write e.g. `0-3` or `all`")
    if isinstance(value, int):
        tokens: list[str] = [str(value)]
    elif isinstance(value, list):
        tokens = [str(v).strip() for v in value]
    else:
        text = str(value).strip()
        if text.lower() == "all":
            return tuple(range(world))
        tokens = [t.strip() for t in text.split(",")]
        while tokens and not tokens[-1]:  # `0-3,`: a trailing comma is tolerated
            tokens.pop()
    ids: list[int] = []
    for token in tokens:
        match = _TOKEN.match(token)
        if not match:
            rule = (
                "an empty entry between two commas" if not token
                else f"`{token}` is not a GPU id or an inclusive range a-b (grammar: `all`, `N`, `a-b`, comma lists)"
            )
            fix = "remove the extra comma" if not token else (
                f"write non-negative ids, e.g. `0-3,8-11`; the cluster has ids 0-{world - 1}")
            raise PlacementError(key, value, rule, fix)
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low:
            raise PlacementError(
                key, value, f"range `{token}` is reversed (ranges are inclusive and ascending)", f"write `{high}-{low}`"
            )
        if high >= world:
            raise PlacementError(
                key,
                value,
                f"GPU id {high} is out of range: the cluster has {layout.describe()}{_base_60_note(value)}",
                f"use ids up to {world - 1}, or raise cluster.num_nodes / cluster.num_gpus_per_node",
            )
        ids.extend(range(low, high + 1))
    if not ids:
        raise PlacementError(key, value, "no GPUs given", "write e.g. `0-3` or `all`, or remove the entry")
    duplicates = sorted(i for i, n in Counter(ids).items() if n > 1)
    if duplicates:
        raise PlacementError(
            key, value, f"GPU id(s) {format_ids(duplicates)} listed twice", "list each GPU once"
        )
    return tuple(sorted(ids))


def _base_60_note(value: object) -> str:
    """YAML 1.1 reads an unquoted `1:0` as the base-60 number 60: say so when an int could have come from that."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 60:
        return (f". If the YAML says `{value // 60}:{value % 60:02d}` (or `{value // 60}:{value % 60}`), YAML read it "
                f"as the base-60 number {value}: GPU ids are plain global ids or ranges `a-b`, quoted if in doubt")
    return ""
