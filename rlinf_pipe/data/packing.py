"""Pure functions between scored groups and padded training batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from rlinf_pipe.data.structs import ScoredGroup
from rlinf_pipe.data.train_batch import TrainBatch


def pack_train_batch(groups: Sequence[ScoredGroup], pad_token_id: int) -> TrainBatch:
    """Pack groups into one right-padded TrainBatch, one row per sample in group order.

    Each row is `prompt_ids + response_ids`, padded with `pad_token_id` to the longest row. The response mask
    covers the response tokens only; old log-probs are the samples' rollout log-probs; advantages are each
    sample's advantage on its response tokens; `ref_logprobs` is None; `slot` is the group's (one group) or -1.
    Samples are packed as they are (filtering aborted or truncated ones is the caller's choice).
    """
    rows = [(scored, index) for scored in groups for index in range(len(scored.group.samples))]
    if not rows:
        raise ValueError("pack_train_batch: no samples to pack")
    lengths = [len(s.group.prompt.prompt_ids) + s.group.samples[i].num_tokens for s, i in rows]
    shape = (len(rows), max(lengths))
    input_ids = np.full(shape, pad_token_id, dtype=np.int64)
    attention_mask = np.zeros(shape, dtype=bool)
    response_mask = np.zeros(shape, dtype=bool)
    old_logprobs = np.zeros(shape, dtype=np.float32)
    advantages = np.zeros(shape, dtype=np.float32)
    rewards = np.zeros(len(rows), dtype=np.float32)
    for row, ((scored, index), length) in enumerate(zip(rows, lengths, strict=True)):
        prompt_ids = scored.group.prompt.prompt_ids
        sample = scored.group.samples[index]
        start = len(prompt_ids)
        input_ids[row, :start] = prompt_ids
        input_ids[row, start:length] = sample.response_ids
        attention_mask[row, :length] = True
        response_mask[row, start:length] = True
        old_logprobs[row, start:length] = sample.logprobs
        advantages[row, start:length] = scored.advantages[index]
        rewards[row] = scored.rewards[index]
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        response_mask=torch.from_numpy(response_mask),
        old_logprobs=torch.from_numpy(old_logprobs),
        advantages=torch.from_numpy(advantages),
        rewards=torch.from_numpy(rewards),
        version=min(min(scored.version, scored.group.version) for scored in groups),
        num_sequences=len(rows),
        num_tokens=int(response_mask.sum()),
        slot=groups[0].slot if len(groups) == 1 else -1,
    )


def tokens_of(rows: int, width: int, real: int, packed: bool) -> int:
    """The tokens a micro-batch computes: its real tokens when packed, rows x longest row when padded."""
    return real if packed else rows * width


def row_chunks(lengths: Sequence[int], max_rows: int, max_tokens: int | None = None, packed: bool = False
               ) -> list[range]:
    """Consecutive runs of rows, each of at most `max_rows` rows and, when `max_tokens` is set, at most that many
    tokens (`tokens_of`: real tokens when `packed`, else rows x the run's longest row); a row longer than the
    budget is a run of its own."""
    if max_rows < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {max_rows}")
    runs, start, width, real = [], 0, 0, 0
    for row, length in enumerate(lengths):
        rows, wider = row - start, max(width, length)
        over = max_tokens is not None and tokens_of(rows + 1, wider, real + length, packed) > max_tokens
        if rows and (rows >= max_rows or over):
            runs.append(range(start, row))
            start, wider, real = row, length, 0
        width, real = wider, real + length
    if lengths:
        runs.append(range(start, len(lengths)))
    return runs


def split_train_batch(batch: TrainBatch, micro_batch_size: int, max_tokens: int | None = None, packed: bool = False
                      ) -> list[TrainBatch]:
    """Consecutive micro-batches of at most `micro_batch_size` rows (and `max_tokens` tokens, see `row_chunks`),
    each trimmed to its own longest row. A run of rows without response tokens joins the run before
    it (or after it, when first), so every micro-batch has something to train on (unless the whole batch has not).
    Their num_sequences / num_tokens add up to the batch's; the version is the batch's."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    runs = row_chunks(lengths, micro_batch_size, max_tokens, packed)
    answered = [bool(batch.response_mask[r.start:r.stop].any()) for r in runs]
    merged: list[range] = []
    merged_has_tokens = False
    for run, has_tokens in zip(runs, answered, strict=True):
        if merged and (not has_tokens or not merged_has_tokens):
            merged[-1] = range(merged[-1].start, run.stop)
            merged_has_tokens = merged_has_tokens or has_tokens
        else:
            merged.append(run)
            merged_has_tokens = has_tokens
    return [_rows_of(batch, slice(run.start, run.stop)) for run in merged]


def _rows_of(batch: TrainBatch, rows: slice) -> TrainBatch:
    """The rows `rows` of `batch`, trimmed to their longest row."""
    width = int(batch.attention_mask[rows].sum(dim=1).max())
    cut = (rows, slice(0, width))
    response_mask = batch.response_mask[cut]
    return msgspec.structs.replace(
        batch,
        input_ids=batch.input_ids[cut],
        attention_mask=batch.attention_mask[cut],
        response_mask=response_mask,
        old_logprobs=batch.old_logprobs[cut],
        ref_logprobs=None if batch.ref_logprobs is None else batch.ref_logprobs[cut],
        advantages=batch.advantages[cut],
        rewards=batch.rewards[rows],
        num_sequences=int(response_mask.shape[0]),
        num_tokens=int(response_mask.sum()),
    )


@dataclass
class MicroBatcher:
    """Collects arriving `TrainBatch`es into micro-batches of `micro_batch_size` sequences and, when `max_tokens` is
    set, at most that many tokens (`tokens_of`: real tokens when `packed`, else rows x longest row). A batch over
    either limit on its own (a group of long responses) is split by rows first (`split_train_batch`); a single row
    over the token budget still trains, alone. With `max_size`, a batch added while more are `waiting` (already
    arrived) does not complete a micro-batch before it holds `max_size` sequences: the reader catches up in fewer,
    larger micro-batches, never over `max_size` (or the token budget)."""

    micro_batch_size: int
    max_tokens: int | None = None
    packed: bool = False
    max_size: int | None = None
    pending: list[TrainBatch] = field(default_factory=list)
    pending_sequences: int = 0
    pending_width: int = 0
    pending_real: int = 0

    def __post_init__(self) -> None:
        if self.max_size is not None:  # never below micro_batch_size
            self.max_size = max(self.max_size, self.micro_batch_size)

    def add(self, batch: TrainBatch, waiting: bool = False) -> list[list[TrainBatch]]:
        """Add a batch (`waiting`: more have arrived behind it); returns the micro-batches (lists of batches) now
        complete."""
        width, real = int(batch.input_ids.shape[1]), int(batch.attention_mask.sum())
        too_many = batch.num_sequences > self.micro_batch_size
        if too_many or self._over(batch.num_sequences, width, real):
            pieces = split_train_batch(batch, self.micro_batch_size, self.max_tokens, self.packed)
            if len(pieces) > 1:
                return [ready for piece in pieces for ready in self.add(piece, waiting)]
        ready = []
        rows = self.pending_sequences + batch.num_sequences
        if self.pending and (self._over(rows, max(self.pending_width, width), self.pending_real + real)
                             or (self.max_size is not None and rows > self.max_size)):
            ready.append(self.flush())  # the new batch would break the token budget or max_size: send what is pending
        self.pending.append(batch)
        self.pending_sequences += batch.num_sequences
        self.pending_width = max(self.pending_width, width)
        self.pending_real += real
        if self.pending_sequences >= (self.max_size if waiting and self.max_size else self.micro_batch_size):
            ready.append(self.flush())
        return ready

    @property
    def can_grow(self) -> bool:
        """Whether a micro-batch may grow past `micro_batch_size` while more batches wait (`max_size` is set)."""
        return self.max_size is not None

    def flush_full(self) -> list[TrainBatch]:
        """The pending batches as one micro-batch when they hold at least `micro_batch_size` sequences (one that grew
        while more were waiting, once none are), else none."""
        return self.flush() if self.pending_sequences >= self.micro_batch_size else []

    def _over(self, rows: int, width: int, real: int) -> bool:
        return self.max_tokens is not None and tokens_of(rows, width, real, self.packed) > self.max_tokens

    def flush(self) -> list[TrainBatch]:
        """The pending batches (possibly none) as one micro-batch."""
        out, self.pending = self.pending, []
        self.pending_sequences = self.pending_width = self.pending_real = 0
        return out


def concat_train_batches(batches: Sequence[TrainBatch], pad_token_id: int) -> TrainBatch:
    """One `TrainBatch` of the rows of `batches`, right-padded to the widest (per-token fields padded with 0)."""
    if len(batches) == 1:
        return batches[0]
    width = max(b.input_ids.shape[1] for b in batches)

    def cat(field_name: str, fill: float | int | bool) -> torch.Tensor:
        parts = []
        for b in batches:
            t = getattr(b, field_name)
            pad = width - t.shape[1]
            parts.append(torch.nn.functional.pad(t, (0, pad), value=fill) if pad else t)
        return torch.cat(parts)

    has_ref = all(b.ref_logprobs is not None for b in batches)
    first: TrainBatch = batches[0]
    return msgspec.structs.replace(
        first,
        input_ids=cat("input_ids", pad_token_id),
        attention_mask=cat("attention_mask", False),
        response_mask=cat("response_mask", False),
        old_logprobs=cat("old_logprobs", 0.0),
        ref_logprobs=cat("ref_logprobs", 0.0) if has_ref else None,
        advantages=cat("advantages", 0.0),
        rewards=torch.cat([b.rewards for b in batches]),
        version=min(b.version for b in batches),
        num_sequences=sum(b.num_sequences for b in batches),
        num_tokens=sum(b.num_tokens for b in batches),
        slot=-1,
    )
