"""HF-named weights into and out of a live megatron-core GPTModel (this rank's shard, TP / PP ranks from
`megatron.core.parallel_state`), following `weight_map`: loading a state dict or checkpoint in place, and
streaming a replica's weights out (a collective over its TP and PP groups)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from rlinf_pipe.models.megatron_checkpoint import LazySafetensors
from rlinf_pipe.models.arch import HfArch
from rlinf_pipe.models.weight_map import (
    M_OUTPUT,
    ConversionError,
    check_sizes,
    get_hf,
    hf_weight_shape,
    read_hf_arch,
    shard_into,
    shard_shape,
    stage_units,
    unshard,
)

__all__ = ["unwrap_model", "load_hf_state_dict", "load_hf_checkpoint", "iter_hf_weights"]


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
    check_sizes(arch, tp, pp)
    target = _model_tensors(unwrap_model(model))
    rules = [rule for unit in stage_units(arch, pp, pp_rank) for rule in unit]
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
        tensors = [get_hf(hf_state, arch, name) for name in rule.hf]
        dst, shape = target[rule.megatron], shard_shape(rule, tensors, arch, tp)
        if tuple(dst.shape) != shape:
            raise ConversionError(f"{rule.megatron}: model shape {tuple(dst.shape)} != converted {shape}")
        shard_into(dst.data, rule, tensors, arch, tp, tp_rank)
    return {rule.megatron for rule in rules}


def load_hf_checkpoint(model: Any, hf_dir: str | os.PathLike[str]) -> HfArch:
    """Load the HF safetensors checkpoint in `hf_dir` (single file or sharded with an index) into this rank's
    GPTModel in place, reading only this pipeline stage's tensors. Returns the checkpoint's `HfArch`."""
    arch = read_hf_arch(hf_dir)
    load_hf_state_dict(model, LazySafetensors(hf_dir), arch)
    return arch


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
    check_sizes(arch, tp, pp)
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
        for unit in stage_units(arch, pp, stage):
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
                        named.extend(zip(rule.hf, unshard(rule, parts, arch, copy=copy), strict=True))
                if tp_rank == 0 and stage != 0:
                    for _, t in named:
                        dist.send(t.contiguous(), dst=first_rank, group=pp_group)
                if device.type == "cuda":  # NCCL's gathers and sends return before their peers took part (the root
                    # receives a stage only after packing and sending the ones before): a rank that went on would
                    # hold every unit's buffers until then; one unit in flight per rank, not a whole stage
                    torch.cuda.current_stream(device).synchronize()
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
