"""Megatron policy: log-probs and streamed training of one rank of a TP x PP x DP Megatron model.

`MegatronPolicy` is built on every rank once `torch.distributed` and `megatron.core.parallel_state` are
initialised. It knows nothing about the RL algorithm: training takes a `loss_fn(logprobs, entropy, batch) ->
LossTerms` per micro-batch.

Collective contract: every rank of a model replica (all its TP and PP ranks) calls each method with the same
arguments (the same micro-batch, in the same order); DP ranks are independent except in `optimizer_step`,
`save_checkpoint` and `load_checkpoint`, which every rank of the job calls together.

Exact loss normalisation: `train_micro_batch` backpropagates the loss NUMERATOR (a sum) and keeps the denominator.
Megatron DDP is configured with `calculate_per_token_loss=True`, so its gradient reduction over DP is a plain SUM
(no 1/DP pre-scaling). `optimizer_step` reduces the gradients (`finalize_model_grads`, with no token count), sums
the denominators of all micro-batches of all DP ranks, scales the gradients by 1/denominator, then clips and steps.
The update therefore equals the gradient of `sum(all numerators) / sum(all denominators)` whatever the split of
the global batch into micro-batches and DP ranks.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from torch import Tensor

from rlinf_pipe.algorithms.terms import LossTerms, Stat, finalize, finalize_metrics, merge
from rlinf_pipe.data.structs import TrainBatch
from rlinf_pipe.workers.actor.logprobs import token_logprobs, token_logprobs_and_entropy

__all__ = ["MegatronPolicy", "LossFn", "warmup_lr", "COMPLETE_MARKER"]

LossFn = Callable[[Tensor, "Tensor | None", TrainBatch], LossTerms]
"""`loss_fn(logprobs [B, L], entropy [B, L] or None, batch) -> LossTerms` (values aligned like `TrainBatch`)."""

COMPLETE_MARKER = "complete"
ACTOR_SUBDIR = "actor"
TRAINER_STATE_FILE = "trainer.json"


def warmup_lr(step: int, peak_lr: float, warmup_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup `peak * (step + 1) / warmup_steps` over the
    first `warmup_steps` steps, then constant `peak`."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return peak_lr
    return peak_lr * (step + 1) / warmup_steps


def _dtype(name: str | torch.dtype | None) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name is None:
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"params_dtype must be one of {sorted(table)} (or None for the default), got {name!r}")
    return table[name]


class MegatronPolicy:
    """This rank's share of a Megatron GPT policy built from an HF folder (see the module docstring).

    Args:
        model_path: HF model folder (config.json + safetensors weights).
        train: wrap in Megatron DDP and build the optimizer (False: log-prob inference only).
        lr, weight_decay, adam_betas, adam_eps: AdamW (decoupled weight decay; none on biases and norms).
        clip_grad: global gradient-norm clipping threshold (0 disables clipping).
        lr_warmup_steps: linear warmup steps (see `warmup_lr`), constant afterwards.
        use_distributed_optimizer: shard optimizer state over DP; default: when DP > 1.
        params_dtype: "float32" / "bfloat16"; default bf16 on CUDA, fp32 on CPU (fp32 master weights and fp32
            gradient reduction either way).
        temperature: default temperature of the training log-probs (the sampling temperature).
        train_entropy: compute per-token entropy for `loss_fn` by default.
        logprob_max_tokens: token budget (rows x padded length) of a forward-only micro-batch.
        seed: torch / Megatron model-parallel RNG seed.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        train: bool = True,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        clip_grad: float = 1.0,
        lr_warmup_steps: int = 0,
        use_distributed_optimizer: bool | None = None,
        params_dtype: str | torch.dtype | None = None,
        temperature: float = 1.0,
        train_entropy: bool = False,
        logprob_max_tokens: int = 8192,
        seed: int = 1234,
    ) -> None:
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
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "MegatronPolicy needs torch.distributed initialised first (dist.init_process_group, then "
                "megatron.core.parallel_state.initialize_model_parallel)"
            )
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        if not ps.model_parallel_is_initialized():
            raise RuntimeError(
                "MegatronPolicy needs megatron.core.parallel_state.initialize_model_parallel(...) called first"
            )

        from rlinf_pipe.models.megatron_cpu import enable_cpu_compat
        from rlinf_pipe.models.megatron_gpt import build_gpt_model

        enable_cpu_compat()  # no-op with CUDA
        from transformers import AutoConfig

        self.model_path = path
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
            torch.device("cpu"))
        self.params_dtype = _dtype(params_dtype)
        self.temperature = float(temperature)
        self.train_entropy = train_entropy
        self.logprob_max_tokens = logprob_max_tokens
        self.peak_lr = float(lr)
        self.lr_warmup_steps = int(lr_warmup_steps)
        self.clip_grad = float(clip_grad)
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.dp_size = ps.get_data_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self._tp_group = ps.get_tensor_model_parallel_group() if self.tp_size > 1 else None

        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        hf_config = AutoConfig.from_pretrained(str(path))
        module = build_gpt_model(hf_config, params_dtype=self.params_dtype)
        from rlinf_pipe.models.convert import load_hf_checkpoint

        self.arch = load_hf_checkpoint(module, path)
        self.vocab_size = self.arch.vocab_size
        self.config = module.config
        self.config.finalize_model_grads_func = None  # gradients are finalised once, in optimizer_step
        self.optimizer: Any = None
        self.training = train
        self.use_distributed_optimizer = (self.dp_size > 1) if use_distributed_optimizer is None else (
            use_distributed_optimizer)
        if train:
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            # SUM (not mean) over DP: the 1/denominator scaling happens in optimizer_step.
            self.config.calculate_per_token_loss = True
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=self.use_distributed_optimizer,
            )
            self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=module)
            bf16 = self.params_dtype == torch.bfloat16
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=self.peak_lr,
                    min_lr=0.0,
                    weight_decay=weight_decay,
                    adam_beta1=adam_betas[0],
                    adam_beta2=adam_betas[1],
                    adam_eps=adam_eps,
                    clip_grad=self.clip_grad,
                    bf16=bf16,
                    params_dtype=self.params_dtype,
                    use_distributed_optimizer=self.use_distributed_optimizer,
                ),
                [self.model],
            )
        else:
            self.model = module
        self.step = 0  # optimizer steps taken
        self._reset_accumulators()

    # ------------------------------------------------------------------ helpers

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped GPTModel of this rank."""
        from rlinf_pipe.models.convert import unwrap_model

        return unwrap_model(self.model)

    def _reset_accumulators(self) -> None:
        self._terms: list[LossTerms] = []
        self._micro_batches = 0
        self._tokens = 0

    def _require_train(self) -> None:
        if not self.training:
            raise RuntimeError("this MegatronPolicy was built with train=False (inference only)")

    def _to_device(self, batch: TrainBatch) -> TrainBatch:
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(self.device, non_blocking=True)

        return msgspec.structs.replace(
            batch,
            input_ids=move(batch.input_ids),
            attention_mask=move(batch.attention_mask),
            response_mask=move(batch.response_mask),
            old_logprobs=move(batch.old_logprobs),
            ref_logprobs=move(batch.ref_logprobs),
            advantages=move(batch.advantages),
        )

    def _model_inputs(self, input_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Token ids, position ids and the causal mask (True = masked) of a right-padded [B, L] batch: with right
        padding a causal mask alone gives every real token exactly its real prefix."""
        b, length = input_ids.shape
        ids = input_ids.to(self.device, dtype=torch.long)
        pos = torch.arange(length, device=self.device).unsqueeze(0).expand(b, length)
        mask = torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool, device=self.device), diagonal=1)
        return ids, pos, mask

    def _run_schedule(
        self, micro_batches: list[Tensor], forward_only: bool, loss_func_factory: Callable[[int], Callable]
    ) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        shapes = {tuple(m.shape) for m in micro_batches}
        if len(shapes) != 1:
            raise ValueError(f"micro-batches of one schedule call must share their shape, got {sorted(shapes)}")
        b, length = micro_batches[0].shape
        counter = iter(range(len(micro_batches)))

        def forward_step(data_iterator: Iterator[Tensor], model: Any) -> tuple[Tensor, Callable]:
            ids = next(data_iterator)
            index = next(counter)
            ids, pos, mask = self._model_inputs(ids)
            return model(ids, pos, mask), loss_func_factory(index)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=length,
            micro_batch_size=b,
            forward_only=forward_only,
        )

    # ------------------------------------------------------------------ log-probs

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, temperature: float = 1.0, with_entropy: bool = False
    ) -> Tensor | tuple[Tensor, Tensor] | None:
        """Per-token log-probs `[B, L]` (float32, CPU; aligned like `TrainBatch`; 0 at position 0 and on padding)
        of `batch` under the current weights, forward only, in micro-batches of at most `logprob_max_tokens`
        tokens. With `with_entropy`, returns `(logprobs, entropy)`. The result exists on the last pipeline stage;
        other stages return None. Every TP/PP rank of the replica must call it with the same batch."""
        input_ids = batch.input_ids
        if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be a non-empty [batch, seq] tensor, got {tuple(input_ids.shape)}")
        b, length = input_ids.shape
        rows = max(1, min(b, self.logprob_max_tokens // length))
        chunks = [input_ids[i : i + rows] for i in range(0, b, rows)]
        if chunks[-1].shape[0] < rows:  # equal shapes for the pipeline: pad with copies of the last row
            last = chunks[-1]
            chunks[-1] = torch.cat([last, last[-1:].expand(rows - last.shape[0], length)])

        def factory(index: int) -> Callable:
            ids = chunks[index].to(self.device)

            def loss_func(logits: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
                if with_entropy:
                    lp, ent = token_logprobs_and_entropy(logits, ids, temperature, self.vocab_size, self._tp_group)
                else:
                    lp, ent = token_logprobs(logits, ids, temperature, self.vocab_size, self._tp_group), None
                out = {"logprobs": lp.float().cpu()}
                if ent is not None:
                    out["entropy"] = ent.float().cpu()
                return torch.zeros((), device=logits.device), torch.tensor(0, dtype=torch.int), out

            return loss_func

        outputs = self._run_schedule(chunks, forward_only=True, loss_func_factory=factory)
        if not self.is_last_stage:
            return None
        valid = batch.attention_mask.bool().cpu()
        lp = torch.cat([o["logprobs"] for o in outputs])[:b].masked_fill(~valid, 0.0)
        if not with_entropy:
            return lp
        ent = torch.cat([o["entropy"] for o in outputs])[:b].masked_fill(~valid, 0.0)
        return lp, ent

    # ------------------------------------------------------------------ training

    def train_micro_batch(
        self, batch: TrainBatch, loss_fn: LossFn, *, temperature: float | None = None,
        with_entropy: bool | None = None,
    ) -> None:
        """Forward + backward of one micro-batch; gradients accumulate until `optimizer_step`.

        `loss_fn(logprobs, entropy, batch)` runs on the last pipeline stage with device tensors; its NUMERATOR is
        backpropagated unscaled, its denominator and detached terms are kept for `optimizer_step`. May be called
        any number of times per step (a different number on each DP rank, zero included); all TP/PP ranks of the
        replica must pass the same micro-batches in the same order.
        """
        self._require_train()
        if batch.input_ids.dim() != 2 or batch.input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty [batch, seq] tensor, got {tuple(batch.input_ids.shape)}")
        if batch.response_mask.shape != batch.input_ids.shape:
            raise ValueError(f"response_mask {tuple(batch.response_mask.shape)} must match input_ids "
                             f"{tuple(batch.input_ids.shape)}")
        if not bool(batch.response_mask.any()):
            raise ValueError(
                "train_micro_batch: the micro-batch has no response tokens (response_mask is all False); "
                "drop such rows before training"
            )
        temperature = self.temperature if temperature is None else temperature
        entropy_on = self.train_entropy if with_entropy is None else with_entropy
        dev_batch = self._to_device(batch)
        kept: list[LossTerms] = []

        def factory(index: int) -> Callable:
            ids = dev_batch.input_ids

            def loss_func(logits: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
                if entropy_on:
                    lp, ent = token_logprobs_and_entropy(logits, ids, temperature, self.vocab_size, self._tp_group)
                else:
                    lp, ent = token_logprobs(logits, ids, temperature, self.vocab_size, self._tp_group), None
                terms = loss_fn(lp, ent, dev_batch)
                if not isinstance(terms, LossTerms):
                    raise TypeError(f"loss_fn must return LossTerms, got {type(terms).__name__}")
                if terms.numerator.dim() != 0:
                    raise ValueError(f"loss numerator must be a scalar, got shape {tuple(terms.numerator.shape)}")
                kept.append(terms.detach())
                # calculate_per_token_loss=True: the schedule backpropagates this numerator as it is.
                return terms.numerator, torch.tensor(0, dtype=torch.int), {}

            return loss_func

        self._run_schedule([batch.input_ids], forward_only=False, loss_func_factory=factory)
        self._terms.extend(_cpu_terms(t) for t in kept)
        self._micro_batches += 1
        self._tokens += int(batch.response_mask.sum())

    def optimizer_step(self, expected_micro_batches: int | None = None) -> dict[str, float]:
        """Finish the step: sum gradients over DP, scale them by 1 / (global loss denominator), clip, step, zero.

        Collective over all ranks. Returns (on every rank) `loss` (the normalised loss of all micro-batches since
        the last step, before the update), `loss_fn`'s merged metrics, `grad_norm` (before clipping), `lr`,
        `micro_batches` and `tokens` (response tokens) summed over DP. Raises `ValueError` (after dropping the
        gradients) when the global denominator is 0, e.g. no micro-batch had a response token.
        `expected_micro_batches`: how many micro-batches the caller sent this rank since the last step; another
        count (a call that overtook one of them) raises `RuntimeError` before anything changes.
        """
        self._require_train()
        if expected_micro_batches is not None and expected_micro_batches != self._micro_batches:
            raise RuntimeError(
                f"optimizer_step: this rank trained {self._micro_batches} micro-batches since the last step but "
                f"was sent {expected_micro_batches}: a call ran out of order (await every train_micro_batch before "
                "calling optimizer_step)"
            )
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model], num_tokens=None)  # DP sum; embedding / layer-norm grads across stages
        summary: dict[str, Any] | None = None
        if self.is_last_stage:
            local = (merge(self._terms) if self._terms else None, self._micro_batches, self._tokens)
            gathered: list[Any] = [local]
            if self.dp_size > 1:  # one replica: nothing to gather (saves pickling every metric each step)
                gathered = [None] * self.dp_size
                dist.all_gather_object(gathered, local, group=_dp_object_group())
            terms = [g[0] for g in gathered if g[0] is not None]
            merged = merge(terms) if terms else None
            summary = {
                "denominator": float(merged.denominator) if merged else 0.0,
                "loss": float(finalize(merged)) if merged else float("nan"),
                "metrics": finalize_metrics(merged) if merged else {},
                "micro_batches": float(sum(g[1] for g in gathered)),
                "tokens": float(sum(g[2] for g in gathered)),
            }
        if self.pp_size > 1:
            box = [summary]
            dist.broadcast_object_list(
                box, src=ps.get_pipeline_model_parallel_last_rank(),
                group=ps.get_pipeline_model_parallel_group(),
            )
            summary = box[0]
        assert summary is not None
        self._reset_accumulators()
        denominator = summary["denominator"]
        if not denominator > 0:
            self._zero_grads()
            raise ValueError(
                "optimizer_step: the loss denominator summed over all micro-batches and DP ranks is 0 "
                "(no response tokens / sequences since the last step); gradients were dropped"
            )
        self.model.scale_gradients(1.0 / denominator)
        lr = warmup_lr(self.step, self.peak_lr, self.lr_warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        ok, grad_norm, _ = self.optimizer.step()
        self._zero_grads()
        if not ok:
            raise RuntimeError("optimizer step failed (non-finite gradients)")
        self.step += 1
        out = dict(summary["metrics"])
        out.update(
            loss=summary["loss"], lr=lr, micro_batches=summary["micro_batches"], tokens=summary["tokens"],
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        )
        return out

    def _zero_grads(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    # ------------------------------------------------------------------ weights out

    def hf_weights(self, copy: bool = True) -> Iterator[tuple[str, Tensor]]:
        """HF-named weights of this replica, unbucketed, on its device (collective over its TP/PP ranks; yielded
        on tp0/pp0); see `rlinf_pipe.models.convert.iter_hf_weights`."""
        from rlinf_pipe.models.convert import iter_hf_weights

        return iter_hf_weights(self.model, self.arch, copy=copy)

    def weight_buckets(self, bucket_bytes: int = 64 << 20) -> Iterator[list[tuple[str, Tensor]]]:
        """HF-named CPU weight buckets of this replica (collective over its TP/PP ranks; yielded on tp0/pp0);
        see `rlinf_pipe.models.convert.iter_hf_weight_buckets`."""
        from rlinf_pipe.models.convert import iter_hf_weight_buckets

        return iter_hf_weight_buckets(self.model, self.arch, bucket_bytes)

    # ------------------------------------------------------------------ offload

    def _state_tensors(self) -> list[Tensor]:
        """Every tensor of weights, gradient buffers, optimizer state and fp32 master weights."""
        tensors: list[Tensor] = [p.data for p in self.model.parameters()]
        tensors += [p.main_grad for p in self.model.parameters() if getattr(p, "main_grad", None) is not None]
        ddp_buffers: list[Any] = []
        for attr in ("buffers", "expert_parallel_buffers"):  # DDP's param/grad buffers (nn.Module.buffers is a method)
            value = getattr(self.model, attr, None)
            if isinstance(value, (list, tuple)):
                ddp_buffers += list(value)
        for buffer in ddp_buffers:
            for name in ("param_data", "grad_data"):
                t = getattr(buffer, name, None)
                if isinstance(t, Tensor):
                    tensors.append(t)
        for inner in _inner_optimizers(self.optimizer):
            for group in inner.param_groups:
                tensors += [p.data for p in group["params"]]
            for state in inner.state.values():
                tensors += [v for v in state.values() if isinstance(v, Tensor)]
        return tensors

    def _storages(self, force: bool) -> list[Any]:
        seen: dict[tuple[str, int], Any] = {}
        for t in self._state_tensors():
            if t.device.type == "cpu" and not force:
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                continue
            seen.setdefault((str(t.device), storage.data_ptr()), storage)
        return list(seen.values())

    def state_nbytes(self) -> int:
        """Bytes of distinct storage behind weights, gradient buffers and optimizer state on this rank."""
        seen: dict[tuple[str, int], int] = {}
        for t in self._state_tensors():
            s = t.untyped_storage()
            seen[(str(t.device), s.data_ptr())] = s.nbytes()
        return sum(seen.values())

    def offload(self, *, force: bool = False) -> int:
        """Move weights, gradient buffers and optimizer state to (pinned) CPU memory and free their device
        storage; returns the bytes moved. Views (DDP buffers, main grads) stay valid: each distinct storage is
        copied out and resized to 0, and `onload` resizes and refills the same storage.

        On CPU there is nowhere to move to: nothing happens and the bytes that would move are returned
        (`force=True` runs the copy-out / free / refill cycle on CPU storage anyway, for tests)."""
        if getattr(self, "_offloaded", None) is not None:
            return 0
        if self.device.type == "cpu" and not force:
            self._offloaded = []
            return self.state_nbytes()
        moved = []
        for storage in self._storages(force):
            backup = torch.UntypedStorage(storage.nbytes(), device="cpu")
            if self.device.type == "cuda":
                backup = backup.pin_memory()
            backup.copy_(storage)
            moved.append((storage, backup))
        for storage, _ in moved:
            storage.resize_(0)
        self._offloaded = moved
        return sum(b.nbytes() for _, b in moved)

    def onload(self) -> int:
        """Undo `offload`; returns the bytes moved back (on CPU without `force`: the bytes that would move)."""
        moved = getattr(self, "_offloaded", None)
        if moved is None:
            return 0
        self._offloaded = None
        if not moved:
            return self.state_nbytes()
        total = 0
        for storage, backup in moved:
            storage.resize_(backup.nbytes())
            storage.copy_(backup)
            total += backup.nbytes()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return total

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, ckpt_dir: str | os.PathLike[str]) -> Path:
        """Save model shards (the rlinf_pipe Megatron folder format, readable by `rlinf-pipe convert --to hf`),
        optimizer state, step and every rank's RNG states to `ckpt_dir`. Collective over all ranks; the folder
        must be on a file system all ranks share. Written to a temporary sibling, then renamed into place by rank
        0 after a barrier, with the `complete` marker as its last file; an existing `ckpt_dir` is replaced."""
        self._require_train()
        import torch.distributed as dist

        from rlinf_pipe.models.megatron_checkpoint import save_model_shard, write_megatron_meta

        final = Path(ckpt_dir).resolve()
        tmp = final.with_name(f".{final.name}.tmp")
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / ACTOR_SUBDIR).mkdir(parents=True)
        dist.barrier()
        if self.dp_rank == 0:
            save_model_shard(tmp, self.tp_rank, self.pp_rank, self.module.state_dict())
        if self.use_distributed_optimizer or self.dp_rank == 0:
            torch.save(_optimizer_state(self.optimizer), tmp / ACTOR_SUBDIR / self._optim_file())
        torch.save(_rng_state(), tmp / ACTOR_SUBDIR / f"rng_rank{rank:05d}.pt")
        dist.barrier()
        if rank == 0:
            write_megatron_meta(tmp, self.tp_size, self.pp_size, self.model_path)
            state = {
                "step": self.step, "peak_lr": self.peak_lr, "lr_warmup_steps": self.lr_warmup_steps,
                "tp": self.tp_size, "pp": self.pp_size, "dp": self.dp_size,
                "world_size": dist.get_world_size(), "use_distributed_optimizer": self.use_distributed_optimizer,
                "params_dtype": str(self.params_dtype),
            }
            (tmp / ACTOR_SUBDIR / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
            (tmp / COMPLETE_MARKER).write_text("ok\n")
            old = final.with_name(f".{final.name}.old")
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def _optim_file(self) -> str:
        dp = self.dp_rank if self.use_distributed_optimizer else 0
        return f"optim_tp{self.tp_rank:02d}_pp{self.pp_rank:03d}_dp{dp:03d}.pt"

    def load_checkpoint(self, ckpt_dir: str | os.PathLike[str]) -> None:
        """Restore a folder written by `save_checkpoint` with the same TP / PP / DP layout: weights, optimizer
        state, step and this rank's RNG states. Collective over all ranks."""
        self._require_train()
        import torch.distributed as dist

        from rlinf_pipe.models.megatron_checkpoint import load_model_shard

        path = Path(ckpt_dir)
        if not (path / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(f"{path} is not a complete actor checkpoint (no {COMPLETE_MARKER!r} marker)")
        state = json.loads((path / ACTOR_SUBDIR / TRAINER_STATE_FILE).read_text())
        layout = {"tp": self.tp_size, "pp": self.pp_size, "dp": self.dp_size,
                  "world_size": dist.get_world_size(), "use_distributed_optimizer": self.use_distributed_optimizer}
        saved = {k: state[k] for k in layout}
        if saved != layout:
            raise ValueError(f"checkpoint {path} was saved with {saved}, this job runs {layout}; resume with the same "
                             "parallel layout")
        shard = load_model_shard(path, self.tp_rank, self.pp_rank)
        targets = {k: v for k, v in self.module.state_dict(keep_vars=True).items()
                   if isinstance(v, Tensor) and not k.endswith("._extra_state")}
        if set(shard) != set(targets):
            raise ValueError(f"checkpoint shard tensors differ from the model's: missing {sorted(set(targets) - set(shard))}, "
                             f"unexpected {sorted(set(shard) - set(targets))}")
        with torch.no_grad():
            for name, dst in targets.items():
                dst.data.copy_(shard[name])
        optim = torch.load(path / ACTOR_SUBDIR / self._optim_file(), map_location="cpu", weights_only=False)
        _load_optimizer_state(self.optimizer, optim)
        _set_rng_state(torch.load(path / ACTOR_SUBDIR / f"rng_rank{dist.get_rank():05d}.pt", weights_only=False))
        self.step = int(state["step"])
        self._zero_grads()
        self._reset_accumulators()
        dist.barrier()


# ---------------------------------------------------------------------- module helpers


def _dp_object_group() -> Any:
    """The DP group for pickled-object collectives: its gloo twin when Megatron made one (no device copies)."""
    from megatron.core import parallel_state as ps

    try:
        group = ps.get_data_parallel_group_gloo()
    except (AssertionError, RuntimeError):
        group = None
    return group if group is not None else ps.get_data_parallel_group()


def _cpu_terms(t: LossTerms) -> LossTerms:
    metrics = {k: Stat(s.value.detach().cpu(), s.count.detach().cpu(), s.reduce) for k, s in t.metrics.items()}
    return replace(t, numerator=t.numerator.detach().double().cpu(), denominator=t.denominator.detach().cpu(),
                   metrics=metrics)


def _inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", None)
    wrappers = list(chained) if chained is not None else [optimizer]
    return [w.optimizer for w in wrappers if getattr(w, "optimizer", None) is not None]


def _optimizer_state(optimizer: Any) -> list[dict[str, Any]]:
    """Per inner torch optimizer: its state dict and its (fp32 master / shard) parameters, on CPU."""
    out = []
    for inner in _inner_optimizers(optimizer):
        params = [p.detach().cpu().clone() for g in inner.param_groups for p in g["params"]]
        sd = inner.state_dict()
        sd = {"state": {k: {n: (v.cpu().clone() if isinstance(v, Tensor) else v) for n, v in s.items()}
                        for k, s in sd["state"].items()},
              "param_groups": sd["param_groups"]}
        out.append({"optimizer": sd, "params": params})
    return out


def _load_optimizer_state(optimizer: Any, saved: list[dict[str, Any]]) -> None:
    inners = _inner_optimizers(optimizer)
    if len(inners) != len(saved):
        raise ValueError(f"checkpoint holds {len(saved)} optimizer states, this optimizer has {len(inners)}")
    with torch.no_grad():
        for inner, entry in zip(inners, saved, strict=True):
            params = [p for g in inner.param_groups for p in g["params"]]
            if len(params) != len(entry["params"]):
                raise ValueError("checkpoint optimizer parameters do not match this optimizer's")
            for p, src in zip(params, entry["params"], strict=True):
                if p.shape != src.shape:
                    raise ValueError(f"optimizer parameter shape {tuple(p.shape)} != saved {tuple(src.shape)}")
                p.data.copy_(src)
            inner.load_state_dict(entry["optimizer"])


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "megatron_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])

