"""HF (Llama / Qwen2) <-> megatron-core GPTModel weight conversion.

Layouts (checked against megatron-core 0.16's source, `transformer/attention.py` and `transformer/mlp.py`):

* `linear_qkv` (weight and bias) is grouped by query group: for each of the `num_kv_heads` groups, that
  group's `num_heads / num_kv_heads` query heads, then its key head, then its value head. TP rank r holds
  the r-th of `tp` equal row blocks (whole groups, since `tp` divides `num_kv_heads`).
* `linear_fc1` fuses gate and up: TP rank r holds `[gate rows of shard r; up rows of shard r]` (megatron
  chunks its local output in two: SiLU(first half) * second half).
* `linear_proj` / `linear_fc2` are row-parallel (split along the input dim); the others column-parallel.
* word embeddings / output layer are vocab-parallel over `padded_vocab_size(vocab, tp)` rows; padding rows
  are zero and are dropped when converting back. Tied embeddings: `lm_head.weight` is not stored on the HF
  side; with pp > 1 the last stage holds a copy of the embedding in `output_layer.weight`.
* Pipeline stage p holds global layers `p * L/pp ... (p+1) * L/pp - 1` as local layers `0 ... L/pp - 1`.

Everything here is pure tensor slicing (bit-exact), except `load_hf_state_dict` / `load_hf_checkpoint` (which
read TP/PP ranks from `megatron.core.parallel_state`) and `iter_hf_weights` (a collective).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlinf_pipe.errors import RlinfPipeError
from rlinf_pipe.models.megatron_checkpoint import (
    CheckpointError,
    LazySafetensors,
    copy_hf_side_files,
    load_model_shard,
    read_megatron_meta,
    save_hf_safetensors,
    save_model_shard,
    write_megatron_meta,
)
from rlinf_pipe.models.megatron_gpt import (
    HfArch,
    UnsupportedModelError,
    check_parallel_sizes,
    hf_arch,
    padded_vocab_size,
)
from rlinf_pipe.utils.folders import mark_complete

__all__ = [
    "ConversionError",
    "hf_weight_names",
    "hf_weight_groups",
    "hf_weight_shape",
    "hf_to_megatron",
    "megatron_to_hf",
    "load_hf_state_dict",
    "load_hf_checkpoint",
    "read_hf_arch",
    "iter_hf_weights",
    "convert_hf_to_megatron",
    "convert_megatron_to_hf",
]

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
M_EMBED = "embedding.word_embeddings.weight"
M_FINAL_NORM = "decoder.final_layernorm.weight"
M_OUTPUT = "output_layer.weight"


class ConversionError(RlinfPipeError):
    """The checkpoint cannot be converted (unsupported model, TP/PP sizes that do not divide it, missing or
    mis-shaped tensors)."""


# --- the per-tensor mapping -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rule:
    """One Megatron tensor and the HF tensors it is made of. `kind` is how TP shards it:
    "replicated", "column" (dim 0), "row" (dim 1), "qkv", "fc1" or "vocab"."""

    megatron: str
    hf: tuple[str, ...]
    kind: str


def _layer_rules(arch: HfArch, layer: int, local: int) -> list[_Rule]:
    """The rules of HF layer `layer` stored as Megatron local layer `local`, in HF stream order."""
    h, m = f"model.layers.{layer}.", f"decoder.layers.{local}."
    attn = f"{h}self_attn."
    rules = [
        _Rule(f"{m}input_layernorm.weight", (f"{h}input_layernorm.weight",), "replicated"),
        _Rule(f"{m}self_attention.linear_qkv.weight", tuple(f"{attn}{p}_proj.weight" for p in "qkv"), "qkv"),
    ]
    if arch.qkv_bias:
        rules.append(_Rule(f"{m}self_attention.linear_qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), "qkv"))
    rules += [
        _Rule(f"{m}self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), "row"),
        _Rule(f"{m}pre_mlp_layernorm.weight", (f"{h}post_attention_layernorm.weight",), "replicated"),
        _Rule(f"{m}mlp.linear_fc1.weight", (f"{h}mlp.gate_proj.weight", f"{h}mlp.up_proj.weight"), "fc1"),
        _Rule(f"{m}mlp.linear_fc2.weight", (f"{h}mlp.down_proj.weight",), "row"),
    ]
    return rules


def _layers_per_stage(arch: HfArch, pp: int) -> int:
    return arch.num_layers // pp


def _has_output_layer(arch: HfArch, pp: int, pp_rank: int) -> bool:
    """Whether stage `pp_rank` stores `output_layer.weight` (last stage; tied with pp == 1 shares the embedding)."""
    return pp_rank == pp - 1 and (not arch.tie_word_embeddings or pp > 1)


def _stage_units(arch: HfArch, pp: int, pp_rank: int) -> list[list[_Rule]]:
    """The rules of stage `pp_rank`, grouped in units (embedding, each layer, final norm + head) in HF order."""
    units: list[list[_Rule]] = []
    if pp_rank == 0:
        units.append([_Rule(M_EMBED, (EMBED,), "vocab")])
    per = _layers_per_stage(arch, pp)
    for local in range(per):
        units.append(_layer_rules(arch, pp_rank * per + local, local))
    if pp_rank == pp - 1:
        tail = [_Rule(M_FINAL_NORM, (FINAL_NORM,), "replicated")]
        if _has_output_layer(arch, pp, pp_rank):
            source = EMBED if arch.tie_word_embeddings else LM_HEAD
            tail.append(_Rule(M_OUTPUT, (source,), "vocab"))
        units.append(tail)
    return units


def hf_weight_names(arch: HfArch) -> list[str]:
    """The HF tensor names of a checkpoint, in the order `iter_hf_weights` streams them: embedding,
    then per layer input norm, q/k/v weights (and biases), o_proj, post-attention norm, gate/up/down, then the
    final norm and (untied only) `lm_head.weight`."""
    return [name for group in hf_weight_groups(arch) for name in group]


def hf_weight_groups(arch: HfArch) -> list[tuple[str, ...]]:
    """`hf_weight_names` grouped by the Megatron tensor they make (q/k/v, gate/up; one name otherwise), in
    stream order: a group converts on its own (`load_hf_state_dict(..., partial=True)`)."""
    groups: list[tuple[str, ...]] = [(EMBED,)]
    for layer in range(arch.num_layers):
        groups.extend(rule.hf for rule in _layer_rules(arch, layer, layer))
    groups.append((FINAL_NORM,))
    if not arch.tie_word_embeddings:
        groups.append((LM_HEAD,))
    return groups


def hf_weight_shape(arch: HfArch, name: str) -> tuple[int, ...]:
    """The shape of HF tensor `name` of a model of `arch`."""
    h, hd = arch.hidden_size, arch.head_dim
    if name in (EMBED, LM_HEAD):
        return (arch.vocab_size, h)
    if name.endswith("norm.weight"):
        return (h,)
    leaf = name.rsplit(".", 2)[-2:]
    rows = {"q_proj": arch.num_heads * hd, "k_proj": arch.num_kv_heads * hd, "v_proj": arch.num_kv_heads * hd,
            "o_proj": h, "gate_proj": arch.intermediate_size, "up_proj": arch.intermediate_size, "down_proj": h}
    cols = {"o_proj": arch.num_heads * hd, "down_proj": arch.intermediate_size}
    if leaf[1] == "bias":
        return (rows[leaf[0]],)
    return (rows[leaf[0]], cols.get(leaf[0], h))


def _qkv_group_sizes(arch: HfArch) -> list[int]:
    return [arch.num_heads // arch.num_kv_heads * arch.head_dim, arch.head_dim, arch.head_dim]


def _shard_shape(rule: _Rule, tensors: Sequence[Tensor], arch: HfArch, tp: int) -> tuple[int, ...]:
    """The shape of a TP rank's Megatron tensor made from the HF tensors of `rule`."""
    first = tuple(tensors[0].shape)
    if rule.kind == "replicated":
        return first
    if rule.kind == "row":
        return (first[0], first[1] // tp, *first[2:])
    if rule.kind == "vocab":
        return (padded_vocab_size(arch.vocab_size, tp) // tp, *first[1:])
    return (sum(t.shape[0] for t in tensors) // tp, *first[1:])  # column, fc1, qkv


def _shard_into(dst: Tensor, rule: _Rule, tensors: Sequence[Tensor], arch: HfArch, tp: int, tp_rank: int) -> None:
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
        parts = torch.split(dst.view(groups // tp, -1, *dst.shape[1:]), _qkv_group_sizes(arch), dim=1)
        for part, src in zip(parts, tensors, strict=True):
            part.copy_(src.reshape(groups, -1, *src.shape[1:]).chunk(tp, dim=0)[tp_rank])
    else:
        raise AssertionError(f"unknown rule kind {rule.kind!r}")


def _shard(rule: _Rule, tensors: Sequence[Tensor], arch: HfArch, tp: int, tp_rank: int) -> Tensor:
    """TP rank `tp_rank`'s Megatron tensor made from the HF tensors of `rule` (a new tensor)."""
    dst = tensors[0].new_empty(_shard_shape(rule, tensors, arch, tp))
    _shard_into(dst, rule, tensors, arch, tp, tp_rank)
    return dst


def _unshard(rule: _Rule, shards: Sequence[Tensor], arch: HfArch, copy: bool = True) -> list[Tensor]:
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
            return [p.flatten(0, 1) for p in torch.split(grouped, _qkv_group_sizes(arch), dim=1)]
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
        parts = torch.split(grouped, _qkv_group_sizes(arch), dim=1)
        return [p.reshape(-1, *fused.shape[1:]).contiguous() for p in parts]
    raise AssertionError(f"unknown rule kind {rule.kind!r}")


def _check_sizes(arch: HfArch, tp: int, pp: int) -> None:
    if tp < 1 or pp < 1:
        raise ConversionError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
    try:
        check_parallel_sizes(arch, tp, pp)
    except UnsupportedModelError as exc:
        raise ConversionError(str(exc)) from exc


def _get_hf(hf_state: Mapping[str, Tensor], arch: HfArch, name: str) -> Tensor:
    try:
        tensor = hf_state[name]
    except KeyError:
        raise ConversionError(f"the HF checkpoint has no tensor {name!r}") from None
    expected = hf_weight_shape(arch, name)
    if tuple(tensor.shape) != expected:
        raise ConversionError(f"HF tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
    return tensor


# --- pure conversion --------------------------------------------------------------------------------------


def hf_to_megatron(
    hf_state: Mapping[str, Tensor], arch: HfArch, *, tp: int, pp: int, tp_rank: int, pp_rank: int
) -> dict[str, Tensor]:
    """Rank (tp_rank, pp_rank)'s GPTModel state dict (without `_extra_state`) from a full HF state dict.

    Only the HF tensors this stage needs are looked up (so `hf_state` may be lazy). Vocabulary rows are padded
    with zeros up to `padded_vocab_size(vocab, tp)`. Raises `ConversionError`.
    """
    _check_sizes(arch, tp, pp)
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise ConversionError(f"rank (tp {tp_rank}, pp {pp_rank}) is outside tp={tp} x pp={pp}")
    out: dict[str, Tensor] = {}
    for unit in _stage_units(arch, pp, pp_rank):
        for rule in unit:
            tensors = [_get_hf(hf_state, arch, name) for name in rule.hf]
            out[rule.megatron] = _shard(rule, tensors, arch, tp, tp_rank)
    return out


def megatron_to_hf(
    shards: Mapping[tuple[int, int], Mapping[str, Tensor]], arch: HfArch, *, tp: int, pp: int
) -> dict[str, Tensor]:
    """The full HF state dict (in `hf_weight_names` order) from every rank's GPTModel state dict, keyed by
    (tp_rank, pp_rank). Vocabulary padding is trimmed; `lm_head.weight` is omitted when tied."""
    _check_sizes(arch, tp, pp)
    missing = [(t, p) for p in range(pp) for t in range(tp) if (t, p) not in shards]
    if missing:
        raise ConversionError(f"Megatron shards of ranks (tp, pp) {missing} are missing")
    out: dict[str, Tensor] = {}
    for p in range(pp):
        for unit in _stage_units(arch, pp, p):
            for rule in unit:
                if rule.megatron == M_OUTPUT and arch.tie_word_embeddings:
                    continue  # the last stage's copy of the tied embedding
                parts = []
                for t in range(tp):
                    if rule.megatron not in shards[(t, p)]:
                        raise ConversionError(f"Megatron shard (tp {t}, pp {p}) has no tensor {rule.megatron!r}")
                    parts.append(shards[(t, p)][rule.megatron])
                out.update(zip(rule.hf, _unshard(rule, parts, arch), strict=True))
    return {name: out[name] for name in hf_weight_names(arch)}


# --- loading into a live model ----------------------------------------------------------------------------


def unwrap_model(model: Any) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (one model chunk only)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ConversionError("virtual pipeline parallelism (several model chunks) is not supported")
        model = model[0]
    while hasattr(model, "module"):
        model = model.module
    return model


def _model_tensors(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's state-dict tensors (parameters as Parameters), without `_extra_state` entries."""
    return {
        k: v for k, v in model.state_dict(keep_vars=True).items()
        if isinstance(v, Tensor) and not k.endswith("._extra_state")
    }


def _parallel_ranks() -> tuple[int, int, int, int]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
    )


@torch.no_grad()
def load_hf_state_dict(model: Any, hf_state: Mapping[str, Tensor], arch: HfArch, *, partial: bool = False) -> set[str]:
    """Copy an HF state dict into this rank's (possibly DDP-wrapped) GPTModel in place (`param.data.copy_`,
    so optimizer and DDP buffers stay valid). TP/PP ranks come from `megatron.core.parallel_state`. Every
    model tensor must be covered, with the same shape; `ConversionError` otherwise. `partial=True` loads only
    the model tensors whose HF tensors are all in `hf_state` (one bucket of a stream; see `hf_weight_groups`).
    Returns the names of the model tensors loaded."""
    tp, pp, tp_rank, pp_rank = _parallel_ranks()
    _check_sizes(arch, tp, pp)
    target = _model_tensors(unwrap_model(model))
    rules = [rule for unit in _stage_units(arch, pp, pp_rank) for rule in unit]
    if partial:
        rules = [rule for rule in rules if all(name in hf_state for name in rule.hf)]
    where = f"rank (tp {tp_rank}, pp {pp_rank})"
    missing = sorted(set(target) - {rule.megatron for rule in rules})
    unexpected = sorted({rule.megatron for rule in rules} - set(target))
    if unexpected or (missing and not partial):
        raise ConversionError(
            f"HF -> Megatron mismatch on {where}: model tensors not in the checkpoint {missing}, converted "
            f"tensors the model lacks {unexpected}"
        )
    for rule in rules:
        tensors = [_get_hf(hf_state, arch, name) for name in rule.hf]
        dst, shape = target[rule.megatron], _shard_shape(rule, tensors, arch, tp)
        if tuple(dst.shape) != shape:
            raise ConversionError(f"{rule.megatron}: model shape {tuple(dst.shape)} != converted {shape}")
        _shard_into(dst.data, rule, tensors, arch, tp, tp_rank)
    return {rule.megatron for rule in rules}


def read_hf_arch(hf_dir: str | os.PathLike[str]) -> HfArch:
    """`hf_arch` of the HF folder's config; `ConversionError` for a missing folder or unsupported model."""
    from transformers import AutoConfig

    path = Path(hf_dir)
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{path} is not a Hugging Face model folder (no config.json); pass the folder holding config.json"
        )
    try:
        return hf_arch(AutoConfig.from_pretrained(str(path)))
    except UnsupportedModelError as exc:
        raise ConversionError(f"{path}: {exc}") from exc
    except ValueError as exc:  # AutoConfig: unknown model_type
        raise ConversionError(f"{path}: cannot read config.json: {exc}".splitlines()[0]) from exc


def load_hf_checkpoint(model: Any, hf_dir: str | os.PathLike[str]) -> HfArch:
    """Load the HF safetensors checkpoint in `hf_dir` (single file or sharded with an index) into this rank's
    GPTModel in place, reading only this pipeline stage's tensors. Returns the checkpoint's `HfArch`."""
    arch = read_hf_arch(hf_dir)
    load_hf_state_dict(model, LazySafetensors(hf_dir), arch)
    return arch


# --- streaming HF weights out of a live TP x PP model -----------------------------------------------------


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _gather_tp(tensor: Tensor, group: Any, tp: int) -> list[Tensor]:
    import torch.distributed as dist

    if tp == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


@torch.no_grad()
def iter_hf_weights(model: Any, arch: HfArch, *, copy: bool = True) -> Iterator[tuple[str, Tensor]]:
    """Stream this model replica's weights as HF-named tensors, in `hf_weight_names(arch)` order, on the
    replica's (tp 0, pp 0) rank (other ranks yield nothing).

    A collective over this data-parallel replica's TP and PP groups: every TP/PP rank of the replica must
    iterate it to the end (DP ranks other than 0 do not call it). Unit by unit (embedding, one layer, final
    norm + head), the owning stage all-gathers TP shards and its TP rank 0 converts them; other stages send
    the result to the replica's (tp 0, pp 0) rank. Tensors are on the model's device. `copy=False` (TP 1)
    yields views of the live parameters where it can: copy each one before asking for the next unit's.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp, pp, tp_rank, pp_rank = _parallel_ranks()
    _check_sizes(arch, tp, pp)
    tp_group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    pp_group = ps.get_pipeline_model_parallel_group() if pp > 1 else None
    first_rank = ps.get_pipeline_model_parallel_first_rank() if pp > 1 else None
    local = _model_tensors(unwrap_model(model))
    dtypes = {t.dtype for t in local.values()}
    if len(dtypes) != 1:
        found = sorted(map(str, dtypes))
        raise ConversionError(f"iter_hf_weights needs one parameter dtype, the model has {found}")
    dtype = dtypes.pop()
    device = next(iter(local.values())).device
    is_root = tp_rank == 0 and pp_rank == 0

    for stage in range(pp):
        for unit in _stage_units(arch, pp, stage):
            named: list[tuple[str, Tensor]] = []
            if stage == pp_rank:
                for rule in unit:
                    if rule.megatron == M_OUTPUT and arch.tie_word_embeddings:
                        continue
                    if rule.megatron not in local:
                        where = f"rank (tp {tp_rank}, pp {pp_rank})"
                        raise ConversionError(f"the model on {where} has no {rule.megatron!r}")
                    tensor = local[rule.megatron].detach()
                    # replicated tensors (norms) are equal on every TP rank: no gather needed
                    parts = [tensor] if rule.kind == "replicated" else _gather_tp(tensor, tp_group, tp)
                    if tp_rank == 0:
                        named.extend(zip(rule.hf, _unshard(rule, parts, arch, copy=copy), strict=True))
                if tp_rank == 0 and stage != 0:
                    for _, t in named:
                        dist.send(t.contiguous(), dst=first_rank, group=pp_group)
            elif is_root and stage != 0:
                for rule in unit:
                    if rule.megatron == M_OUTPUT and arch.tie_word_embeddings:
                        continue
                    for name in rule.hf:
                        t = torch.empty(hf_weight_shape(arch, name), dtype=dtype, device=device)
                        dist.recv(t, src=_stage_rank(ps, stage), group=pp_group)
                        named.append((name, t))
            if is_root:
                yield from named


def _stage_rank(ps: Any, stage: int) -> int:
    """The global rank of pipeline stage `stage` in this rank's pipeline group."""
    import torch.distributed as dist

    return dist.get_global_rank(ps.get_pipeline_model_parallel_group(), stage)


# --- whole-checkpoint conversion (CLI) --------------------------------------------------------------------


def convert_hf_to_megatron(
    hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, tp: int, pp: int,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write a Megatron checkpoint folder (see `megatron_checkpoint`) for a tp x pp split of `hf_dir`."""
    arch = read_hf_arch(hf_dir)
    _check_sizes(arch, tp, pp)
    hf_state = LazySafetensors(hf_dir)
    for p in range(pp):
        for t in range(tp):
            path = save_model_shard(out_dir, t, p, hf_to_megatron(hf_state, arch, tp=tp, pp=pp, tp_rank=t, pp_rank=p))
            if log:
                log(f"wrote {path}")
    write_megatron_meta(out_dir, tp, pp, hf_dir)
    mark_complete(out_dir, {"tp": tp, "pp": pp, "source": str(hf_dir)})
    return Path(out_dir)


def convert_megatron_to_hf(
    ckpt_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write an HF folder (safetensors + config, generation config, tokenizer) from a Megatron checkpoint."""
    meta = read_megatron_meta(ckpt_dir)
    arch = read_hf_arch(meta.hf_dir)
    shards = {(t, p): load_model_shard(ckpt_dir, t, p) for p in range(meta.pp) for t in range(meta.tp)}
    state = megatron_to_hf(shards, arch, tp=meta.tp, pp=meta.pp)
    copy_hf_side_files(meta.hf_dir, out_dir)
    for path in save_hf_safetensors(state, out_dir):
        if log:
            log(f"wrote {path}")
    return Path(out_dir)
