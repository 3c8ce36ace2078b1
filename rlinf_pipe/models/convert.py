"""HF (Llama / Qwen2) <-> megatron-core GPTModel conversion of whole state dicts and checkpoint folders (the
per-tensor map, and the layouts it follows, are `weight_map`'s; loading into and streaming out of a live model
are `live_weights`')."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from torch import Tensor

from rlinf_pipe.models.megatron_checkpoint import (
    LazySafetensors,
    copy_hf_side_files,
    load_model_shard,
    read_megatron_meta,
    save_hf_safetensors,
    save_model_shard,
    write_megatron_meta,
)
from rlinf_pipe.models.arch import HfArch
from rlinf_pipe.models.weight_map import (
    M_OUTPUT,
    ConversionError,
    check_sizes,
    get_hf,
    hf_weight_names,
    read_hf_arch,
    shard,
    stage_units,
    unshard,
)
from rlinf_pipe.utils.folders import mark_complete

__all__ = ["ConversionError", "hf_to_megatron", "megatron_to_hf", "convert_hf_to_megatron", "convert_megatron_to_hf"]


def hf_to_megatron(
    hf_state: Mapping[str, Tensor], arch: HfArch, *, tp: int, pp: int, tp_rank: int, pp_rank: int
) -> dict[str, Tensor]:
    """Rank (tp_rank, pp_rank)'s GPTModel state dict (without `_extra_state`) from a full HF state dict.

    Only the HF tensors this stage needs are looked up (so `hf_state` may be lazy). Vocabulary rows are padded
    with zeros up to `padded_vocab_size(vocab, tp)`. Raises `ConversionError`.
    """
    check_sizes(arch, tp, pp)
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise ConversionError(f"rank (tp {tp_rank}, pp {pp_rank}) is outside tp={tp} x pp={pp}")
    out: dict[str, Tensor] = {}
    for unit in stage_units(arch, pp, pp_rank):
        for rule in unit:
            tensors = [get_hf(hf_state, arch, name) for name in rule.hf]
            out[rule.megatron] = shard(rule, tensors, arch, tp, tp_rank)
    return out


def megatron_to_hf(
    shards: Mapping[tuple[int, int], Mapping[str, Tensor]], arch: HfArch, *, tp: int, pp: int
) -> dict[str, Tensor]:
    """The full HF state dict (in `hf_weight_names` order) from every rank's GPTModel state dict, keyed by
    (tp_rank, pp_rank). Vocabulary padding is trimmed; `lm_head.weight` is omitted when tied."""
    check_sizes(arch, tp, pp)
    missing = [(t, p) for p in range(pp) for t in range(tp) if (t, p) not in shards]
    if missing:
        raise ConversionError(f"Megatron shards of ranks (tp, pp) {missing} are missing")
    out: dict[str, Tensor] = {}
    for p in range(pp):
        for unit in stage_units(arch, pp, p):
            for rule in unit:
                if rule.megatron == M_OUTPUT and arch.tie_word_embeddings:
                    continue  # the last stage's copy of the tied embedding
                parts = []
                for t in range(tp):
                    if rule.megatron not in shards[(t, p)]:
                        raise ConversionError(f"Megatron shard (tp {t}, pp {p}) has no tensor {rule.megatron!r}")
                    parts.append(shards[(t, p)][rule.megatron])
                out.update(zip(rule.hf, unshard(rule, parts, arch), strict=True))
    return {name: out[name] for name in hf_weight_names(arch)}


def convert_hf_to_megatron(
    hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, tp: int, pp: int,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write a Megatron checkpoint folder (see `megatron_checkpoint`) for a tp x pp split of `hf_dir`."""
    arch = read_hf_arch(hf_dir)
    check_sizes(arch, tp, pp)
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
