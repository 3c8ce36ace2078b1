"""One static decode batch for `TorchEngine`: left-padded prefill, then one KV-cached token per step.

Rows that finish are dropped from the batch (and from the KV cache), so they stop costing compute. Positions
come from the attention mask, so a row sees the same positions as when run alone. All methods block; the
engine calls them off the event loop, under its model lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlinf_pipe.engines.rollout.engine import FinishReason
from rlinf_pipe.engines.rollout.llama_forward import LlamaForward
from rlinf_pipe.engines.rollout.sampling import row_uniforms, select_tokens


@dataclass
class SampleState:
    """One sample being generated: where its result goes, how to sample it, and what it produced so far."""

    request_index: int
    sample_index: int
    prompt_ids: list[int]
    generator: torch.Generator
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    stop_ids: frozenset[int]
    version: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None


class DecodeBatch:
    """Runs `rows` together on `model` until each hits a stop token or its token limit: through `lean` (the
    lean forward of a Llama-family model, with a preallocated cache) when given, else transformers' forward."""

    def __init__(self, model: torch.nn.Module, rows: list[SampleState], pad_id: int, device: torch.device,
                 lean: LlamaForward | None = None):
        self.model, self.rows, self.device, self.lean = model, list(rows), device, lean
        width = max(len(r.prompt_ids) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - len(r.prompt_ids):] = 1
        self._ids, self.mask = ids.to(device), mask.to(device)
        self.temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([r.top_k for r in rows], dtype=torch.long, device=device)
        self.top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device)
        self.truncate = any(r.top_k > 0 or r.top_p < 1.0 for r in rows)  # else sampling skips the top-k/p sort
        self.uniforms = row_uniforms([r.generator for r in rows], max(r.max_new_tokens for r in rows))
        self.steps = 0  # tokens every row has sampled so far (rows start together and leave when done)
        self.cache: Any = lean.new_cache(len(rows), width + max(r.max_new_tokens for r in rows)) if lean else None
        self.logits: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        """Whether any row is still generating."""
        return bool(self.rows)

    @torch.no_grad()
    def prefill(self) -> None:
        """Run the prompts through the model, filling the KV cache and the first next-token logits. Through the
        lean forward, rows with the same prompt (a request's samples) run it once and take copies of its keys,
        values and logits: a row's prefill depends on its own prompt only."""
        positions = (self.mask.cumsum(-1) - 1).clamp_(min=0)
        firsts: dict[tuple[int, ...], int] = {}
        owner = [firsts.setdefault(tuple(r.prompt_ids), len(firsts)) for r in self.rows]
        if self.lean is None or len(firsts) == len(self.rows):
            self._forward(self._ids, positions, logits_to_keep=1)
            return
        unique = torch.tensor([owner.index(i) for i in range(len(firsts))], device=self.device)
        copies = torch.tensor(owner, device=self.device)
        cache = self.lean.new_cache(len(firsts), self.cache.keys[0].shape[2])
        logits = self.lean(self._ids[unique], positions[unique], self.mask[unique], cache)
        for full, part in zip(self.cache.keys + self.cache.values, cache.keys + cache.values, strict=True):
            full[:, :, : cache.length] = part[copies, :, : cache.length]
        self.cache.length, self.logits = cache.length, logits[copies]

    @torch.no_grad()
    def step(self) -> list[SampleState]:
        """Sample one token for every row; return the rows that finished (removed from the batch)."""
        assert self.logits is not None, "prefill() first"
        tokens, logps = select_tokens(
            self.logits, self.temperature, self.top_k, self.top_p, self.uniforms[:, self.steps], self.truncate
        )
        self.steps += 1
        finished: list[SampleState] = []
        keep: list[int] = []
        for i, (row, tok, lp) in enumerate(zip(self.rows, tokens.tolist(), logps.tolist(), strict=True)):
            row.tokens.append(tok)
            row.logprobs.append(lp)
            if tok in row.stop_ids:
                row.finish_reason = "stop"
            elif len(row.tokens) >= row.max_new_tokens:
                row.finish_reason = "length"
            if row.finish_reason:
                finished.append(row)
            else:
                keep.append(i)
        if not keep:
            self.rows, self.cache, self.logits = [], None, None
            return finished
        if finished:
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            self.rows = [self.rows[i] for i in keep]
            self.mask, tokens = self.mask[index], tokens[index]
            self.temperature, self.top_k, self.top_p = self.temperature[index], self.top_k[index], self.top_p[index]
            self.uniforms = self.uniforms[index.cpu()]
            if self.lean is not None:
                self.cache.select(index)
            else:
                self.cache.batch_select_indices(index)
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=-1)
        positions = self.mask.sum(-1, keepdim=True) - 1
        self._forward(tokens.unsqueeze(-1), positions)
        return finished

    def step_until_a_row_finishes(self, stop: Callable[[], bool]) -> list[SampleState]:
        """`step()` until a row finishes, the batch is done, or `stop()` says so (checked before each step): many
        tokens per call, so a caller that runs each call in a thread pays the thread hop per finish, not per
        token."""
        while self.rows and not stop():
            finished = self.step()
            if finished:
                return finished
        return []

    def abort_all(self) -> list[SampleState]:
        """End every remaining row with finish reason `abort`; return them."""
        rows = self.rows
        for row in rows:
            row.finish_reason = "abort"
        self.rows, self.cache, self.logits = [], None, None
        return rows

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, logits_to_keep: int = 0) -> None:
        if self.lean is not None:
            self.logits = self.lean(ids, positions, self.mask, self.cache)
            return
        kwargs = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
        out = self.model(
            input_ids=ids, attention_mask=self.mask, position_ids=positions,
            past_key_values=self.cache, use_cache=True, **kwargs,
        )
        self.cache, self.logits = out.past_key_values, out.logits[:, -1, :]
