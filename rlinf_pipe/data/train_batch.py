"""`TrainBatch`: the padded training tensors that the reward or log-prob stage packs for the actor (the last of
the channel items of `rlinf_pipe.data.structs`)."""

from __future__ import annotations

import msgspec
import torch


class TrainBatch(msgspec.Struct, kw_only=True, eq=False):
    """Padded training tensors; one row per sample (prompt then response, right-padded).

    Shapes [B, L] unless noted. Per-token values are aligned with `input_ids`: `old_logprobs[b, t]` is
    log p(input_ids[b, t] | input_ids[b, :t]), set where `response_mask` is True and 0 elsewhere; the same holds
    for `ref_logprobs` and `advantages`.

    - input_ids (int64): tokens, padded with the tokenizer's pad id
    - attention_mask (bool): True on real tokens (prompt and response)
    - response_mask (bool): True on response tokens only
    - old_logprobs (float32): log-probs of the policy that sampled the batch (rollout log-probs until a
      log-prob worker replaces them)
    - ref_logprobs (float32 or None): reference-policy log-probs, None when no KL term is used
    - advantages (float32): each sample's advantage on its response tokens
    - rewards (float32 [B]): each sample's reward (for metrics)
    - version: the oldest weight version among the rows
    - num_sequences / num_tokens: rows and response tokens, the batch's weights for loss normalisation
    - slot: the step slot of the group the rows come from (-1 for rows of several groups), which routes it to
      an actor replica and a mini-batch (`rlinf_pipe.data.routing`)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    version: int
    num_sequences: int
    num_tokens: int
    ref_logprobs: torch.Tensor | None = None
    slot: int = -1
