"""`RewardContext`: what a reward learns of a sample besides its response.

The math reward reads `references` (a response is correct when its answer matches any); a reward function from a
file receives `data_source`, `ground_truth` and `extra_info`, the arguments verl passes:

- `ground_truth`: a verl record's `reward_model.ground_truth` as stored; otherwise the parsed reference answer (a
  string), or the list of them when the record has several (RLinf's `solutions`);
- `extra_info`: the record's `extra_info` as stored (`{}` when it has none);
- `data_source`: the record's `data_source`, else the dataset's name (`arithmetic`, `gsm8k`, a file's stem).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rlinf_pipe.data.structs import PromptItem


@dataclass(frozen=True)
class RewardContext:
    """The reference answers and verl's arguments of one prompt (see the module docstring). Picklable: it travels
    to the reward pool's processes with each response."""

    references: tuple[str, ...]
    data_source: str = ""
    ground_truth: Any = None
    extra_info: Any = field(default_factory=dict)

    @classmethod
    def of_reference(cls, reference: object) -> RewardContext:
        """The context of a bare reference answer (a string, or a list or tuple of several)."""
        refs = tuple(map(str, reference)) if isinstance(reference, (list, tuple)) else (str(reference),)
        return cls(refs, ground_truth=refs[0] if len(refs) == 1 else list(refs))


def reward_context(prompt: PromptItem) -> RewardContext:
    """The context of a prompt's samples (decoded once per prompt group)."""
    refs = prompt.references
    if prompt.ground_truth:
        truth = json.loads(prompt.ground_truth)
    else:
        truth = refs[0] if len(refs) == 1 else list(refs)
    extra = json.loads(prompt.extra_info) if prompt.extra_info else None
    return RewardContext(refs, prompt.data_source, truth, {} if extra is None else extra)


def references_of(reference: object) -> tuple[str, ...]:
    """The reference answers of what the pool scores against: a RewardContext, a string, or a list of strings."""
    if isinstance(reference, RewardContext):
        return reference.references
    if isinstance(reference, (list, tuple)):
        return tuple(map(str, reference))
    return ("" if reference is None else str(reference),)
