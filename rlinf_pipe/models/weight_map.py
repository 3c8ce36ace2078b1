"""The tensor map between HF (Llama / Qwen2 / Qwen3) checkpoints and megatron-core GPTModel shards: which Megatron tensor
each HF tensor goes into, how tensor parallelism slices it, which pipeline stage holds it.

Layouts (checked against megatron-core 0.16's source, `transformer/attention.py` and `transformer/mlp.py`):

* `linear_qkv` (weight and bias) is grouped by query group: for each of the `num_kv_heads` groups, that
  group's `num_heads / num_kv_heads` query heads, then its key head, then its value head. TP rank r holds
  the r-th of `tp` equal row blocks (whole groups, since `tp` divides `num_kv_heads`).
* `linear_fc1` fuses gate and up: TP rank r holds `[gate rows of shard r; up rows of shard r]` (megatron
  chunks its local output in two: SiLU(first half) * second half).
* Qwen3's `q_layernorm` / `k_layernorm` (`self_attn.q_norm` / `k_norm`) normalise each head: one `head_dim`
  weight, the same on every TP rank.
* `linear_proj` / `linear_fc2` are row-parallel (split along the input dim); the others column-parallel.
* word embeddings / output layer are vocab-parallel over `padded_vocab_size(vocab, tp)` rows; padding rows
  are zero and are dropped when converting back. Tied embeddings: `lm_head.weight` is not stored on the HF
  side; with pp > 1 the last stage holds a copy of the embedding in `output_layer.weight`.
* Pipeline stage p holds global layers `p * L/pp ... (p+1) * L/pp - 1` as local layers `0 ... L/pp - 1`.

Everything here is pure tensor slicing (bit-exact). `convert` applies the map to whole state dicts and checkpoint
folders, `live_weights` to a live (possibly parallel) model.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from rlinf_pipe.errors import RlinfPipeError
from rlinf_pipe.models.megatron_checkpoint import CheckpointError
from rlinf_pipe.models.arch import (
    HfArch,
    UnsupportedModelError,
    check_parallel_sizes,
    model_arch,
    padded_vocab_size,
)

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
M_EMBED = "embedding.word_embeddings.weight"
M_FINAL_NORM = "decoder.final_layernorm.weight"
M_OUTPUT = "output_layer.weight"


class ConversionError(RlinfPipeError):
    """The checkpoint cannot be converted (unsupported model, TP/PP sizes that do not divide it, missing or
    mis-shaped tensors)."""



@dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the HF tensors it is made of. `kind` is how TP shards it:
    "replicated", "column" (dim 0), "row" (dim 1), "qkv", "fc1" or "vocab"."""

    megatron: str
    hf: tuple[str, ...]
    kind: str


def layer_rules(arch: HfArch, layer: int, local: int) -> list[Rule]:
    """The rules of HF layer `layer` stored as Megatron local layer `local`, in HF stream order."""
    h, m = f"model.layers.{layer}.", f"decoder.layers.{local}."
    attn = f"{h}self_attn."
    rules = [
        Rule(f"{m}input_layernorm.weight", (f"{h}input_layernorm.weight",), "replicated"),
        Rule(f"{m}self_attention.linear_qkv.weight", tuple(f"{attn}{p}_proj.weight" for p in "qkv"), "qkv"),
    ]
    if arch.qkv_bias:
        rules.append(Rule(f"{m}self_attention.linear_qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), "qkv"))
    if arch.qk_norm:  # (one norm over each head's features: the same on every TP rank)
        rules += [Rule(f"{m}self_attention.{p}_layernorm.weight", (f"{attn}{p}_norm.weight",), "replicated")
                  for p in "qk"]
    rules += [
        Rule(f"{m}self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), "row"),
        Rule(f"{m}pre_mlp_layernorm.weight", (f"{h}post_attention_layernorm.weight",), "replicated"),
        Rule(f"{m}mlp.linear_fc1.weight", (f"{h}mlp.gate_proj.weight", f"{h}mlp.up_proj.weight"), "fc1"),
        Rule(f"{m}mlp.linear_fc2.weight", (f"{h}mlp.down_proj.weight",), "row"),
    ]
    return rules


def layers_per_stage(arch: HfArch, pp: int) -> int:
    return arch.num_layers // pp


def has_output_layer(arch: HfArch, pp: int, pp_rank: int) -> bool:
    """Whether stage `pp_rank` stores `output_layer.weight` (last stage; tied with pp == 1 shares the embedding)."""
    return pp_rank == pp - 1 and (not arch.tie_word_embeddings or pp > 1)


def stage_units(arch: HfArch, pp: int, pp_rank: int) -> list[list[Rule]]:
    """The rules of stage `pp_rank`, grouped in units (embedding, each layer, final norm + head) in HF order."""
    units: list[list[Rule]] = []
    if pp_rank == 0:
        units.append([Rule(M_EMBED, (EMBED,), "vocab")])
    per = layers_per_stage(arch, pp)
    for local in range(per):
        units.append(layer_rules(arch, pp_rank * per + local, local))
    if pp_rank == pp - 1:
        tail = [Rule(M_FINAL_NORM, (FINAL_NORM,), "replicated")]
        if has_output_layer(arch, pp, pp_rank):
            source = EMBED if arch.tie_word_embeddings else LM_HEAD
            tail.append(Rule(M_OUTPUT, (source,), "vocab"))
        units.append(tail)
    return units


def hf_weight_names(arch: HfArch) -> list[str]:
    """The HF tensor names of a checkpoint, in the order `iter_hf_weights` streams them: embedding, then per layer
    input norm, q/k/v weights (and biases, and q/k norms), o_proj, post-attention norm, gate/up/down, then the
    final norm and (untied only) `lm_head.weight`."""
    return [name for group in hf_weight_groups(arch) for name in group]


def hf_weight_groups(arch: HfArch) -> list[tuple[str, ...]]:
    """`hf_weight_names` grouped by the Megatron tensor they make (q/k/v, gate/up; one name otherwise), in
    stream order: a group converts on its own (`load_hf_state_dict(..., partial=True)`)."""
    groups: list[tuple[str, ...]] = [(EMBED,)]
    for layer in range(arch.num_layers):
        groups.extend(rule.hf for rule in layer_rules(arch, layer, layer))
    groups.append((FINAL_NORM,))
    if not arch.tie_word_embeddings:
        groups.append((LM_HEAD,))
    return groups


def hf_weight_shape(arch: HfArch, name: str) -> tuple[int, ...]:
    """The shape of HF tensor `name` of a model of `arch`."""
    h, hd = arch.hidden_size, arch.head_dim
    if name in (EMBED, LM_HEAD):
        return (arch.vocab_size, h)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return (hd,)
    if name.endswith("norm.weight"):
        return (h,)
    leaf = name.rsplit(".", 2)[-2:]
    rows = {"q_proj": arch.num_heads * hd, "k_proj": arch.num_kv_heads * hd, "v_proj": arch.num_kv_heads * hd,
            "o_proj": h, "gate_proj": arch.intermediate_size, "up_proj": arch.intermediate_size, "down_proj": h}
    cols = {"o_proj": arch.num_heads * hd, "down_proj": arch.intermediate_size}
    if leaf[1] == "bias":
        return (rows[leaf[0]],)
    return (rows[leaf[0]], cols.get(leaf[0], h))


def qkv_group_sizes(arch: HfArch) -> list[int]:
    return [arch.num_heads // arch.num_kv_heads * arch.head_dim, arch.head_dim, arch.head_dim]


def shard_shape(rule: Rule, tensors: Sequence[Tensor], arch: HfArch, tp: int) -> tuple[int, ...]:
    """The shape of a TP rank's Megatron tensor made from the HF tensors of `rule`."""
    first = tuple(tensors[0].shape)
    if rule.kind == "replicated":
        return first
    if rule.kind == "row":
        return (first[0], first[1] // tp, *first[2:])
    if rule.kind == "vocab":
        return (padded_vocab_size(arch.vocab_size, tp) // tp, *first[1:])
    return (sum(t.shape[0] for t in tensors) // tp, *first[1:])  # column, fc1, qkv


def shard_into(dst: Tensor, rule: Rule, tensors: Sequence[Tensor], arch: HfArch, tp: int, tp_rank: int) -> None:
    """Write TP rank `tp_rank`'s Megatron tensor made from the HF tensors of `rule` into `dst` (one copy)."""
    if rule.kind == "replicated":
        dst.copy_(tensors[0])
    elif rule.kind == "column":
        dst.copy_(tensors[0].chunk(tp, dim=0)[tp_rank])
    elif rule.kind == "row":
        dst.copy_(tensors[0].chunk(tp, dim=1)[tp_rank])
    elif rule.kind == "fc1":  # [gate shard; up shard]
        for part, src in zip(dst.chunk(2, dim=0), tensors, strict=True):
            part.copy_(src.chunk(tp, dim=0)[tp_rank])
    elif rule.kind == "vocab":
        full, rows = tensors[0], dst.shape[0]
        start = tp_rank * rows
        stop = max(start, min(start + rows, full.shape[0]))
        dst[: stop - start].copy_(full[start:stop])
        dst[stop - start :].zero_()
    elif rule.kind == "qkv":  # per query group: its q heads, then its k head, then its v head
        groups = arch.num_kv_heads
        parts = torch.split(dst.view(groups // tp, -1, *dst.shape[1:]), qkv_group_sizes(arch), dim=1)
        for part, src in zip(parts, tensors, strict=True):
            part.copy_(src.reshape(groups, -1, *src.shape[1:]).chunk(tp, dim=0)[tp_rank])
    else:
        raise AssertionError(f"unknown rule kind {rule.kind!r}")


def shard(rule: Rule, tensors: Sequence[Tensor], arch: HfArch, tp: int, tp_rank: int) -> Tensor:
    """TP rank `tp_rank`'s Megatron tensor made from the HF tensors of `rule` (a new tensor)."""
    dst = tensors[0].new_empty(shard_shape(rule, tensors, arch, tp))
    shard_into(dst, rule, tensors, arch, tp, tp_rank)
    return dst


def unshard(rule: Rule, shards: Sequence[Tensor], arch: HfArch, copy: bool = True) -> list[Tensor]:
    """The HF tensors of `rule` from all TP ranks' Megatron tensors (in TP rank order). `copy=False` with one
    shard (TP 1) returns views of it where the layout allows (possibly non-contiguous)."""
    if not copy and len(shards) == 1:
        (shard,) = shards
        if rule.kind == "fc1":
            return list(shard.chunk(2, dim=0))
        if rule.kind == "vocab":
            return [shard[: arch.vocab_size]]
        if rule.kind == "qkv":
            grouped = shard.reshape(arch.num_kv_heads, -1, *shard.shape[1:])
            return [p.flatten(0, 1) for p in torch.split(grouped, qkv_group_sizes(arch), dim=1)]
        return [shard]
    if rule.kind == "replicated":
        return [shards[0].clone()]
    if rule.kind == "column":
        return [torch.cat(list(shards), dim=0)]
    if rule.kind == "row":
        return [torch.cat(list(shards), dim=1)]
    if rule.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([g for g, _ in halves], dim=0), torch.cat([u for _, u in halves], dim=0)]
    if rule.kind == "vocab":
        return [torch.cat(list(shards), dim=0)[: arch.vocab_size].clone()]
    if rule.kind == "qkv":
        fused = torch.cat(list(shards), dim=0)
        grouped = fused.reshape(arch.num_kv_heads, -1, *fused.shape[1:])
        parts = torch.split(grouped, qkv_group_sizes(arch), dim=1)
        return [p.reshape(-1, *fused.shape[1:]).contiguous() for p in parts]
    raise AssertionError(f"unknown rule kind {rule.kind!r}")


def check_sizes(arch: HfArch, tp: int, pp: int) -> None:
    if tp < 1 or pp < 1:
        raise ConversionError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
    try:
        check_parallel_sizes(arch, tp, pp)
    except UnsupportedModelError as exc:
        raise ConversionError(str(exc)) from exc


def get_hf(hf_state: Mapping[str, Tensor], arch: HfArch, name: str) -> Tensor:
    try:
        tensor = hf_state[name]
    except KeyError:
        raise ConversionError(f"the HF checkpoint has no tensor {name!r}") from None
    expected = hf_weight_shape(arch, name)
    if tuple(tensor.shape) != expected:
        raise ConversionError(f"HF tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
    return tensor


def read_hf_arch(hf_dir: str | os.PathLike[str]) -> HfArch:
    """`hf_arch` of the HF folder's config (`arch.model_arch`: an unsupported model type is refused before
    transformers reads the file); `ConversionError` for a missing folder or unsupported model."""
    path = Path(hf_dir)
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{path} is not a Hugging Face model folder (no config.json); pass the folder holding config.json"
        )
    try:
        arch, _ = model_arch(path)
    except UnsupportedModelError as exc:
        raise ConversionError(str(exc)) from exc
    except ValueError as exc:  # AutoConfig: unknown model_type
        raise ConversionError(f"{path}: cannot read config.json: {exc}".splitlines()[0]) from exc
    assert arch is not None  # (config.json exists)
    return arch
