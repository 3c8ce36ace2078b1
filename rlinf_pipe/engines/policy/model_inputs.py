"""One micro-batch as the Megatron model takes it, padded or packed, and the per-token results back in the batch's
`[B, L]` layout.

Padded, the model runs on the right-padded `[B, L]` ids with a causal mask (right padding: every real token sees
exactly its real prefix). Packed (`rlinf_pipe.models.packed_rows`), it runs on the `[1, T]` stream of the real
tokens with Megatron's packed-sequence parameters: the same values at every real position, within float rounding,
for the compute of T tokens instead of B x L. Rows of one prompt share it in the stream (`shared`, see
`packed_rows`). Either way `per_token` turns the `[b, s]` log-probs of the model's layout into the batch's `[B, L]`.

Under context parallelism (CP > 1) every micro-batch runs packed, and each rank of the CP group runs its share of
the stream (`models.context_parallel`: every sequence cut in `2 * CP` chunks, rank r keeping chunks r and
`2 * CP - 1 - r`); `per_token` gathers the ranks' next-token values into the whole `[B, L]` on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from torch import Tensor

from rlinf_pipe.data.train_batch import TrainBatch
from rlinf_pipe.models.context_parallel import CpLayout, gather_values, local_length
from rlinf_pipe.models.packed_rows import PackedRows, Sharing, shared_prompts, shared_within, stream_length


def context_parallel() -> tuple[int, int, Any]:
    """This rank's context-parallel group: `(size, rank, group)` from Megatron's parallel state."""
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(), ps.get_context_parallel_group()


@dataclass(frozen=True)
class ModelInputs:
    """The model's arguments for one micro-batch: ids and position ids `[b, s]`, the attention mask (padded; None
    when packed), and the packing (`rows`, with Megatron's `packed_seq_params`) when packed; under context
    parallelism, this rank's share of the stream (`cp`) and the token after each of its runs (`next_ids`)."""

    ids: Tensor
    positions: Tensor
    mask: Tensor | None
    rows: PackedRows | None = None
    packed_seq_params: Any = None
    length: int | None = None  # padded: the batch's own length, where `ids` are longer (`multiple`)
    cp: CpLayout | None = None
    next_ids: Tensor | None = None  # [E] under CP: the token after each run end of this rank (`CpLayout.next_ids`)

    @property
    def shape(self) -> tuple[int, int]:
        """`(micro-batch size, sequence length)` as the pipeline schedule sees them."""
        return int(self.ids.shape[0]), int(self.ids.shape[1])

    def run(self, model: Any) -> Tensor:
        """The model's output (logits `[b, s, V]` on the last pipeline stage)."""
        if self.rows is None:
            return model(self.ids, self.positions, self.mask)
        return model(self.ids, self.positions, None, packed_seq_params=self.packed_seq_params)

    def per_token(self, values: Tensor, at_ends: Tensor | None = None) -> Tensor:
        """A `[b, s]` result of `token_logprobs` on `ids` -> `[B, L]` of the batch: each token's value at its
        position, 0 at each row's first position and (packed) on padding. Under CP, `at_ends` holds the values of
        `next_ids` at this rank's run ends, and the result is gathered over the CP group (the same on every rank;
        the backward keeps this rank's tokens' share). Differentiable."""
        if self.cp is not None:
            if at_ends is None:
                raise ValueError("under context parallelism per_token needs the values at the run ends (at_ends)")
            local = self.cp.next_values(values[0], at_ends)
            whole = gather_values(local, self.packed_seq_params.cp_group)
            return self.rows.unpack_predicted(self.cp.stream_values(whole))
        if self.rows is not None:
            return self.rows.unpack_predicted(values[0])
        return values if self.length is None else values[:, : self.length]


def padded_inputs(input_ids: Tensor, device: torch.device, multiple: int = 1) -> ModelInputs:
    """A right-padded `[B, L]` micro-batch with the causal mask (True = masked); with `multiple`, its columns padded
    on the right to a multiple of it (sequence parallelism: a real token never sees the extra ones)."""
    b, length = input_ids.shape
    width = -(-length // multiple) * multiple
    ids = input_ids.to(device, dtype=torch.long)
    if width != length:
        ids = torch.cat([ids, ids.new_zeros(b, width - length)], dim=1)
    positions = torch.arange(width, device=device).unsqueeze(0).expand(b, width)
    mask = torch.triu(torch.ones(1, 1, width, width, dtype=torch.bool, device=device), diagonal=1)
    return ModelInputs(ids, positions, mask, length=None if width == length else length)


def packed_inputs(input_ids: Tensor, attention_mask: Tensor, device: torch.device, total: int | None = None,
                  shared: Sharing | None = None, multiple: int = 1) -> ModelInputs:
    """The real tokens of a right-padded micro-batch as one stream (`total`: its length with filler; `shared`: the
    rows' shared prompts, `packed_rows.shared_prompts`; `multiple`: the stream's length a multiple of it). Under
    context parallelism, this rank's share of the stream, `total` its length."""
    from rlinf_pipe.models.megatron_sdpa import cp_packed_params, packed_params

    cp, rank, group = context_parallel()
    if cp > 1:
        if shared is not None and any(count for _, count in shared):
            raise ValueError("context parallelism cannot run shared prompts (share_prompts must be off)")
        rows = PackedRows.of(attention_mask.to(device))
        stream = rows.pack(input_ids.to(device, dtype=torch.long))
        layout = CpLayout.of(rows, cp, rank, multiple, total)
        return ModelInputs(layout.local_ids(stream)[None], layout.positions[None], None, rows,
                           cp_packed_params(layout, group), cp=layout, next_ids=layout.next_ids(stream))
    rows = PackedRows.of(attention_mask.to(device), total, shared, multiple)
    ids = rows.pack(input_ids.to(device, dtype=torch.long))[None]
    return ModelInputs(ids, rows.positions[None], None, rows, packed_params(rows, group))


def packing(batch: Any, pack: bool, share: bool, always: bool = False) -> tuple[bool, Sharing | None]:
    """Whether a `TrainBatch` runs packed (`pack`: packing is on), and the prompts its rows share (`share`: sharing
    is on): packed where there is padding to drop or a prompt to share (full rows of distinct prompts gain
    nothing from it), or `always` (context parallelism splits packed streams only)."""
    if not pack:
        return False, None
    if always:
        return True, None
    shared = shared_prompts(batch.input_ids, batch.response_mask) if share else None
    shares = shared is not None and any(count for _, count in shared)
    return shares or not bool(batch.attention_mask.all()), shared if shares else None


def micro_batch_inputs(batch: Any, device: torch.device, pack: bool, share: bool, multiple: int = 1) -> ModelInputs:
    """A `TrainBatch` (in host memory) as the model takes it in one micro-batch on `device` (see `packing`), its
    sequence length a multiple of `multiple`."""
    packed, shared = packing(batch, pack, share, context_parallel()[0] > 1)
    if packed:
        return packed_inputs(batch.input_ids, batch.attention_mask, device, shared=shared, multiple=multiple)
    return padded_inputs(batch.input_ids, device, multiple)


def token_chunks(lengths: Sequence[int], budget: int) -> list[range]:
    """Consecutive runs of rows of at most `budget` real tokens each (a longer row alone): the forward-only
    micro-batches of a packed log-prob pass."""
    runs, start, used = [], 0, 0
    for row, length in enumerate(lengths):
        if row > start and used + length > budget:
            runs.append(range(start, row))
            start, used = row, 0
        used += length
    runs.append(range(start, len(lengths)))
    return runs


def logprob_micro_batches(batch: Any, budget: int, packed: bool, device: torch.device, shared: Sharing | None = None,
                          same_shape: bool = True, multiple: int = 1) -> tuple[list[range], list[ModelInputs]]:
    """The forward-only micro-batches of a `TrainBatch` (their rows, and their model inputs): packed, runs of rows of
    at most `budget` real tokens (rows of one prompt sharing it where `shared`, the batch's sharing from `packing`,
    says so); padded, runs of at most `budget // length` rows. With `same_shape` (a pipeline-parallel schedule,
    whose stages exchange activations of one shape) every packed stream is made as long as the longest with filler
    and the last padded run is filled up with copies of its last row; without it each micro-batch keeps its own
    shape, and no compute goes to filler. Every sequence length is a multiple of `multiple`."""
    input_ids, mask = batch.input_ids, batch.attention_mask
    b, length = input_ids.shape
    if packed:
        lengths = mask.sum(dim=1).tolist()
        chunks = token_chunks(lengths, budget)
        shares = [shared_within(shared, r) if shared is not None else [(i, 0) for i in range(len(r))]
                  for r in chunks]
        cp = context_parallel()[0]
        if cp > 1:  # (the length of each rank's share)
            total = max(local_length(lengths[r.start:r.stop], cp, multiple) for r in chunks)
        else:
            total = max(stream_length(lengths[r.start:r.stop], s) for r, s in zip(chunks, shares, strict=True))
        return chunks, [packed_inputs(input_ids[r.start:r.stop], mask[r.start:r.stop], device,
                                      total if same_shape else None, s, multiple)
                        for r, s in zip(chunks, shares, strict=True)]
    rows = max(1, min(b, budget // length))
    chunks = [range(i, min(i + rows, b)) for i in range(0, b, rows)]
    ids = [input_ids[r.start:r.stop] for r in chunks]
    if same_shape and ids[-1].shape[0] < rows:  # pad with copies of the last row
        last = ids[-1]
        ids[-1] = torch.cat([last, last[-1:].expand(rows - last.shape[0], length)])
    return chunks, [padded_inputs(i, device, multiple) for i in ids]


def batch_to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """`batch`'s tensors on `device` (copied without blocking)."""
    def move(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    return msgspec.structs.replace(
        batch, input_ids=move(batch.input_ids), attention_mask=move(batch.attention_mask),
        response_mask=move(batch.response_mask), old_logprobs=move(batch.old_logprobs),
        ref_logprobs=move(batch.ref_logprobs), advantages=move(batch.advantages),
    )
