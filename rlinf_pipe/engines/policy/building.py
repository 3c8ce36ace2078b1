"""How a `MegatronPolicy` is set up: its options checked, its parameters' dtype, its module wrapped for training
(Megatron's DDP and our optimizer), whether it packs, and the tensors its device state moves on offload."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlinf_pipe.engines.policy.optimizer import PolicyOptimizer


def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype:
    """The parameters' dtype: `float32` / `bfloat16` (or aliases); None: bf16 on CUDA, fp32 on CPU."""
    if isinstance(name, torch.dtype):
        return name
    if name is None:
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"params_dtype must be one of {sorted(table)} (or None for the default), got {name!r}")
    return table[name]


def check_options(model_path: str | os.PathLike[str], *, logprob_max_tokens: int, lr: float, clip_grad: float,
                  lr_warmup_steps: int, temperature: float) -> Path:
    """The policy's numeric options in range and its model folder an HF folder; returns the folder."""
    if logprob_max_tokens < 1:
        raise ValueError(f"logprob_max_tokens must be >= 1, got {logprob_max_tokens}")
    if lr < 0 or clip_grad < 0 or lr_warmup_steps < 0:
        raise ValueError(f"need lr >= 0, clip_grad >= 0, lr_warmup_steps >= 0; got {lr}, {clip_grad}, "
                         f"{lr_warmup_steps}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model folder {path} does not exist or has no config.json; pass a Hugging Face model folder"
        )
    return path


def for_training(module: Any, params_dtype: torch.dtype, use_distributed_optimizer: bool,
                 **optimizer_options: Any) -> tuple[Any, PolicyOptimizer]:
    """`module` wrapped in Megatron's DDP (gradients in fp32 buffers, SUMMED over DP: the 1/denominator scaling
    happens in the optimizer step) and its optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    module.config.calculate_per_token_loss = True
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer)
    model = DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)
    optimizer = PolicyOptimizer(model, params_dtype=params_dtype, use_distributed_optimizer=use_distributed_optimizer,
                                **optimizer_options)
    return model, optimizer


def state_tensors(model: Any, optimizer: PolicyOptimizer | None) -> list[Tensor]:
    """Every tensor of weights, gradient buffers, optimizer state and fp32 master weights."""
    tensors: list[Tensor] = [p.data for p in model.parameters()]
    tensors += [p.main_grad for p in model.parameters() if getattr(p, "main_grad", None) is not None]
    for attr in ("buffers", "expert_parallel_buffers"):  # DDP's param/grad buffers (nn.Module.buffers is a method)
        value = getattr(model, attr, None)
        for buffer in value if isinstance(value, (list, tuple)) else []:
            tensors += [t for t in (getattr(buffer, "param_data", None), getattr(buffer, "grad_data", None))
                        if isinstance(t, Tensor)]
    if optimizer is not None:
        tensors += optimizer.state_tensors()
    return tensors


def packs_sequences(requested: bool, supported: bool, cp_size: int) -> bool:
    """Whether the policy packs its micro-batches: asked for and the model's attention can (SDPA); context
    parallelism needs it (it splits packed sequences)."""
    if cp_size > 1 and not (requested and supported):
        reason = ("set pack_sequences on (actor.pack_sequences / inference.pack_sequences)" if not requested
                  else "this model's attention cannot run on SDPA (attention dropout, bias, softmax offset or "
                  "sliding window)")
        raise ValueError(f"context parallelism (CP {cp_size}) splits packed sequences for attention on SDPA: "
                         f"{reason}, or use CP 1")
    return requested and supported
