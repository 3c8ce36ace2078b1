"""The items that flow through the pipeline's channels.

    PromptItem --rollout--> RolloutGroup --reward, advantages--> ScoredGroup --pack--> TrainBatch
    TrainBatch --split--> micro-batches (TrainBatch too)

`TrainBatch`, the one of torch tensors, is in `train_batch` (so that what reads prompts needs no torch). All are
msgspec Structs, so channels encode them with typed decoding; numpy arrays and torch CPU tensors inside them
travel as out-of-band frames (see `rlinf_pipe.channels.codec`). Every item carries the weight `version`
behind it, so a consumer can check staleness. Structs holding arrays compare by identity (`eq=False`):
compare their fields instead.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np

FinishReason = Literal["stop", "length", "abort"]


class ChatMessage(msgspec.Struct, frozen=True):
    """One message of a chat-message prompt (`role`: system, user, assistant, ...)."""

    role: str
    content: str


class PromptItem(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt, ready for generation.

    `id` is stable across runs (dataset name + record number in its source); `index` is its position in the
    dataset the sampler draws from and `epoch` the pass over that dataset that drew it, so (index, epoch)
    identifies a draw for resumption. `prompt` is the raw question (for a chat-message prompt, its last user
    message) and `messages` the record's own chat messages, rendered as given (empty for a plain question);
    `prompt_ids` the tokens of the rendered prompt (template applied; empty until rendered). `version` is the
    weight version the prompt was dispatched under (-1 until dispatched) and `slot` its position in that step's
    batch (see `rlinf_pipe.data.routing`).

    What the reward reads: `answer` is the parsed reference answer, `answers` every one when the record has
    several (a response is correct when it matches any; empty: `answer` alone). `data_source`, `extra_info` (JSON
    text of the record's object, "" when it has none) and `ground_truth` (JSON text of a verl record's
    `reward_model.ground_truth` as stored, "" otherwise) are what a reward function receives
    (`rlinf_pipe.engines.reward.context`).
    """

    id: str
    prompt: str
    answer: str
    index: int
    epoch: int = 0
    prompt_ids: list[int] = []
    version: int = -1
    slot: int = -1
    messages: tuple[ChatMessage, ...] = ()
    answers: tuple[str, ...] = ()
    data_source: str = ""
    extra_info: str = ""
    ground_truth: str = ""

    @property
    def references(self) -> tuple[str, ...]:
        """Every reference answer: `answers`, or `(answer,)` when the record has one."""
        return self.answers or (self.answer,)


class RolloutSample(msgspec.Struct, kw_only=True, eq=False):
    """One generated response.

    `response_ids` (int32 [T]) are the generated tokens, without the prompt; `logprobs` (float32 [T]) their
    log-probabilities under the weights that sampled them; `finish_reason` is `stop` (eos/stop string),
    `length` (hit the token limit) or `abort` (interrupted, e.g. by a weight update). Lists are accepted and
    converted. `version`: the weight version that generated it (the oldest, if generation spanned a sync).
    """

    response_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: FinishReason
    version: int
    text: str = ""

    def __post_init__(self) -> None:
        self.response_ids = np.asarray(self.response_ids, dtype=np.int32)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        if self.response_ids.ndim != 1 or self.response_ids.shape != self.logprobs.shape:
            raise ValueError(
                f"RolloutSample: response_ids {tuple(self.response_ids.shape)} and logprobs "
                f"{tuple(self.logprobs.shape)} must be 1-D and of equal length"
            )

    @property
    def num_tokens(self) -> int:
        """Response length in tokens."""
        return int(self.response_ids.shape[0])


class RolloutGroup(msgspec.Struct, kw_only=True, eq=False):
    """One prompt and its `group_size` samples. `version`: the oldest sample version (see `of`)."""

    prompt: PromptItem
    samples: list[RolloutSample]
    version: int

    @classmethod
    def of(cls, prompt: PromptItem, samples: list[RolloutSample]) -> RolloutGroup:
        """A group whose version is the oldest of its samples."""
        if not samples:
            raise ValueError(f"RolloutGroup of prompt {prompt.id!r} has no samples")
        return cls(prompt=prompt, samples=samples, version=min(s.version for s in samples))

    @property
    def num_sequences(self) -> int:
        return len(self.samples)

    @property
    def num_tokens(self) -> int:
        """Response tokens of all samples (a channel weight)."""
        return sum(s.num_tokens for s in self.samples)


class ScoredGroup(msgspec.Struct, kw_only=True, eq=False):
    """A RolloutGroup with one reward and one advantage per sample (float32 [group_size]; lists converted).
    The advantage applies to every response token of its sample. `slot`: where it trains (see
    `rlinf_pipe.data.routing`)."""

    group: RolloutGroup
    rewards: np.ndarray
    advantages: np.ndarray
    version: int
    slot: int = -1

    def __post_init__(self) -> None:
        self.rewards = np.asarray(self.rewards, dtype=np.float32)
        self.advantages = np.asarray(self.advantages, dtype=np.float32)
        size = len(self.group.samples)
        if self.rewards.shape != (size,) or self.advantages.shape != (size,):
            raise ValueError(
                f"ScoredGroup of prompt {self.group.prompt.id!r}: rewards {tuple(self.rewards.shape)} and "
                f"advantages {tuple(self.advantages.shape)} must both have shape ({size},), one per sample"
            )

    @property
    def num_sequences(self) -> int:
        return self.group.num_sequences

    @property
    def num_tokens(self) -> int:
        return self.group.num_tokens
