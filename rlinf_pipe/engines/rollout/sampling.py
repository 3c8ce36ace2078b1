"""Next-token selection for a batch of rows, each with its own temperature, top-k, top-p and random generator.

`select_tokens` returns the chosen tokens and their log-probs, defined as
`log_softmax(logits / temperature)` at the chosen token, BEFORE top-k / top-p truncation (greedy rows, with
temperature 0, use temperature 1). Each row samples with one uniform draw of its own per step: `row_uniforms`
draws a row's whole stream from its CPU `torch.Generator` at once (the same values, in the same order, as one draw
a step: torch's CPU generator fills a tensor draw by draw), and a step takes each row's next one, so a row's tokens
depend only on its own logits and generator, never on the other rows or the device, at one tensor op a step
instead of one generator call per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def truncation_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Boolean [B, V] mask of the tokens kept by top-k (<= 0: off) then top-p (1.0: off); the top token is kept."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
    k = torch.where(top_k > 0, top_k, probs.shape[-1]).unsqueeze(-1)
    keep_sorted = rank < k
    # top-p over the top-k survivors: keep a token while the mass before it is below top_p
    kept = sorted_probs * keep_sorted
    mass_before = kept.cumsum(dim=-1) - kept
    total = kept.sum(dim=-1, keepdim=True)
    keep_sorted &= mass_before < top_p.unsqueeze(-1) * total
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def row_uniforms(generators: Sequence[torch.Generator], draws: int) -> torch.Tensor:
    """`[B, draws]` float64: the next `draws` uniform draws of each row's generator (row b's step t uses column t)."""
    return torch.stack([torch.rand(draws, generator=g, dtype=torch.float64) for g in generators])


def select_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    truncate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of `logits` [B, V]; return (tokens int64 [B], log-probs float32 [B]).

    `temperature`, `top_p` (float) and `top_k` (int) are [B] tensors on the logits' device; `uniforms` is each
    row's uniform draw for this step (float64 [B], on the CPU; greedy rows take one too, keeping streams aligned).
    `truncate` False says no row uses top-k or top-p: the sort they need is skipped (the result is the same).
    """
    logits = logits.float()
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    logp = torch.log_softmax(logits / scale, dim=-1)
    probs = logp.exp()
    if truncate:
        probs = probs * truncation_mask(probs, top_k, top_p)
    cdf = probs.cumsum(dim=-1)
    u = uniforms.to(logits.device)
    target = (u * cdf[:, -1].double()).unsqueeze(-1)
    sampled = torch.searchsorted(cdf.double(), target, right=True).squeeze(-1)
    sampled = sampled.clamp_(max=logits.shape[-1] - 1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled) if bool(greedy.any()) else sampled
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
