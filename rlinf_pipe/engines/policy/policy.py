"""Megatron policy: log-probs and streamed training of one rank of a TP x PP x CP x DP Megatron model.

`MegatronPolicy` is built on every rank once `torch.distributed` and Megatron's parallel state are initialised
(`rlinf_pipe.models.megatron_gpt.init_model_parallel`). It knows nothing about the RL algorithm: training takes
a `loss_fn(logprobs, entropy, batch) -> LossTerms` per micro-batch. Its parts: this module (forward, backward,
log-probs, HF weights in and out), `building` (options, dtype, the training wrapper, what offload moves),
`optimizer` (the optimizer step with exact normalisation, offload), `checkpoint` (saving and restoring everything).

Collective contract: every rank of a model replica (all its TP, PP and CP ranks) calls each method with the same
arguments (the same micro-batch, in the same order); DP ranks are independent except in `optimizer_step`,
`save_checkpoint` and `load_checkpoint`, which every rank of the job calls together.

Exact loss normalisation: `train_micro_batch` backpropagates the loss NUMERATOR (a sum) and keeps the denominator;
`optimizer_step` divides the summed gradients by the denominator summed over all micro-batches and DP ranks (see
`rlinf_pipe.engines.policy.optimizer`). Under context parallelism every CP rank computes the same loss over the
whole micro-batch (its log-probs gathered over the CP group), its gradient flowing back through this rank's tokens
only; Megatron sums the gradients over the DP x CP ranks, and the denominator is summed over DP alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, overload

import torch
from torch import Tensor

from rlinf_pipe.algorithms.terms import LossTerms
from rlinf_pipe.data.train_batch import TrainBatch
from rlinf_pipe.engines.policy import checkpoint
from rlinf_pipe.engines.policy.logprobs import token_logprobs, token_logprobs_and_entropy
from rlinf_pipe.engines.policy.model_inputs import (
    ModelInputs,
    batch_to_device,
    logprob_micro_batches,
    micro_batch_inputs,
    packing,
)
from rlinf_pipe.engines.policy.building import (
    check_options,
    for_training,
    packs_sequences,
    resolve_dtype,
    state_tensors,
)
from rlinf_pipe.engines.policy.optimizer import DeviceState, PolicyOptimizer

__all__ = ["LossFn", "MegatronPolicy", "resolve_dtype"]

LossFn = Callable[[Tensor, "Tensor | None", TrainBatch], LossTerms]
"""`loss_fn(logprobs [B, L], entropy [B, L] or None, batch) -> LossTerms` (values aligned like `TrainBatch`)."""


class MegatronPolicy:
    """This rank's share of a Megatron GPT policy built from an HF folder (see the module docstring).

    Args:
        model_path: HF model folder (config.json + safetensors weights).
        train: wrap in Megatron DDP and build the optimizer (False: log-prob inference only).
        lr, weight_decay, adam_betas, adam_eps: AdamW (decoupled weight decay; none on biases and norms).
        clip_grad: global gradient-norm clipping threshold (0 disables clipping).
        lr_warmup_steps: linear warmup steps (see `optimizer.warmup_lr`), constant afterwards.
        use_distributed_optimizer: shard optimizer state over DP; default: when DP > 1.
        params_dtype: "float32" / "bfloat16"; default bf16 on CUDA, fp32 on CPU (fp32 master weights and fp32
            gradient reduction either way).
        recompute: activation recompute in the backward pass: "none", "selective" (the attention core) or "full"
            (every layer); see `models.megatron_gpt.recompute_options`.
        temperature: default temperature of the training log-probs (the sampling temperature).
        train_entropy: compute per-token entropy for `loss_fn` by default.
        logprob_max_tokens: token budget of a forward-only micro-batch (real tokens packed; rows x padded length
            otherwise).
        pack_sequences: run the model on each micro-batch's real tokens as one stream (`model_inputs`: the same
            values within float rounding, no compute spent on padding; a batch without padding runs as it is);
            padded when False.
        share_prompts: packed, the rows of a micro-batch with the same prompt run it once (`packed_rows`: the
            same values within float rounding; no context parallelism).
        sequence_parallel: Megatron's sequence parallelism (TP > 1): the norms, dropouts and residuals of each layer
            hold a 1/TP slice of the sequence (every micro-batch's length is made a multiple of TP).
        Context parallelism comes from the parallel state (`init_model_parallel(tp, pp, cp)`); it needs
        `pack_sequences` and a model whose attention runs on SDPA (`models.context_parallel`).
        seed: torch / Megatron model-parallel RNG seed.
        load_weights: False keeps the random initialisation (the folder then needs only `config.json`; for
            memory and speed measurements at a real model's shape).
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
        recompute: str = "none",
        load_weights: bool = True,
        pack_sequences: bool = True,
        share_prompts: bool = True,
        offload_on_cpu: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        path = check_options(model_path, logprob_max_tokens=logprob_max_tokens, lr=lr, clip_grad=clip_grad,
                             lr_warmup_steps=lr_warmup_steps, temperature=temperature)
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        from rlinf_pipe.models.hf_config import load_hf_config
        from rlinf_pipe.models.live_weights import load_hf_checkpoint
        from rlinf_pipe.models.arch import hf_arch
        from rlinf_pipe.models.megatron_gpt import build_gpt_model
        from rlinf_pipe.models.megatron_sdpa import model_supports_packing

        if not dist.is_initialized() or not ps.model_parallel_is_initialized():
            raise RuntimeError("MegatronPolicy needs torch.distributed and Megatron's parallel state initialised first "
                               "(dist.init_process_group, then rlinf_pipe.models.megatron_gpt.init_model_parallel)")
        self.model_path = path
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
            torch.device("cpu"))
        self.params_dtype = resolve_dtype(params_dtype)
        self.temperature = float(temperature)
        self.train_entropy = train_entropy
        self.logprob_max_tokens = logprob_max_tokens
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.dp_size = ps.get_data_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        self.cp_size = ps.get_context_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()
        # (the distributed optimizer's shard of this rank: Megatron shards it over DP x CP)
        self.shard_rank = ps.get_data_parallel_rank(with_context_parallel=True)

        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        hf_config = load_hf_config(path)
        module = build_gpt_model(hf_config, params_dtype=self.params_dtype,
                                 recompute=recompute if train else "none", sequence_parallel=sequence_parallel)
        self.sequence_multiple = self.tp_size if sequence_parallel else 1
        self.arch = load_hf_checkpoint(module, path) if load_weights else hf_arch(hf_config)
        self.vocab_size = self.arch.vocab_size
        self.pack_sequences = packs_sequences(pack_sequences, model_supports_packing(module), self.cp_size)
        self.share_prompts = share_prompts and self.pack_sequences and self.cp_size == 1
        self.config = module.config
        self.config.finalize_model_grads_func = None  # gradients are finalised once, in optimizer_step
        self.use_distributed_optimizer = (self.dp_size > 1) if use_distributed_optimizer is None else (
            use_distributed_optimizer)
        self.model: Any = module
        self.optimizer: PolicyOptimizer | None = None  # train=False: forward only
        if train:
            self.model, self.optimizer = for_training(
                module, self.params_dtype, self.use_distributed_optimizer, lr=lr, weight_decay=weight_decay,
                adam_betas=adam_betas, adam_eps=adam_eps, clip_grad=clip_grad, lr_warmup_steps=lr_warmup_steps)
        self.device_state = DeviceState(lambda: state_tensors(self.model, self.optimizer), self.device,
                                        move_on_cpu=offload_on_cpu)

    # ------------------------------------------------------------------ helpers

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped GPTModel of this rank."""
        from rlinf_pipe.models.live_weights import unwrap_model

        return unwrap_model(self.model)

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        return self.require_optimizer().steps_taken

    def require_optimizer(self) -> PolicyOptimizer:
        if self.optimizer is None:
            raise RuntimeError("this MegatronPolicy was built with train=False (inference only)")
        return self.optimizer

    def model_inputs(self, batch: TrainBatch) -> ModelInputs:
        """`batch` as the model takes it in one micro-batch, on this rank's device: packed or padded (pass the batch
        in host memory: where it packs and what it shares is worked out there)."""
        return micro_batch_inputs(batch, self.device, self.pack_sequences, self.share_prompts,
                                  self.sequence_multiple)

    def _token_values(self, logits: Tensor, inputs: ModelInputs, temperature: float, with_entropy: bool
                      ) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and entropies) `[B, L]` of the micro-batch's tokens from the model's logits; 0 at each row's
        first position (nothing predicts it) and, packed, on padding."""
        def values(logits: Tensor, ids: Tensor) -> tuple[Tensor, Tensor | None]:
            if with_entropy:
                return token_logprobs_and_entropy(logits, ids, temperature, self.vocab_size, self.tp_group)
            return token_logprobs(logits, ids, temperature, self.vocab_size, self.tp_group), None

        lp, ent = values(logits, inputs.ids)
        if inputs.cp is None:
            return inputs.per_token(lp), None if ent is None else inputs.per_token(ent)
        # CP: the tokens after this rank's runs, predicted at each run's end (a pair of positions per end)
        ends = logits[0, inputs.cp.run_ends][:, None].expand(-1, 2, -1)
        next_ids = torch.stack([torch.zeros_like(inputs.next_ids), inputs.next_ids], dim=1)
        lp_ends, ent_ends = values(ends, next_ids)
        return (inputs.per_token(lp, lp_ends[:, 1]),
                None if ent is None else inputs.per_token(ent, ent_ends[:, 1]))

    def _run_schedule(
        self, micro_batches: list[ModelInputs], forward_only: bool, loss_func_factory: Callable[[int], Callable]
    ) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        shapes = {m.shape for m in micro_batches}
        if self.pp_size > 1 and len(shapes) != 1:  # (stages exchange activations of one shape; alone, any goes)
            raise ValueError(f"micro-batches of one pipeline schedule call must share their shape, got "
                             f"{sorted(shapes)}")
        b, length = max(shapes)
        length *= self.cp_size  # (Megatron's schedule divides the sequence by CP for the stages' activations)
        counter = iter(range(len(micro_batches)))

        def forward_step(data_iterator: Iterator[ModelInputs], model: Any) -> tuple[Tensor, Callable]:
            inputs = next(data_iterator)
            return inputs.run(model), loss_func_factory(next(counter))

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[self.model],
            num_microbatches=len(micro_batches), seq_length=length, micro_batch_size=b, forward_only=forward_only)

    # ------------------------------------------------------------------ log-probs

    @overload
    def compute_logprobs(self, batch: TrainBatch, temperature: float = 1.0,
                         with_entropy: Literal[False] = False) -> Tensor | None: ...

    @overload
    def compute_logprobs(self, batch: TrainBatch, temperature: float = 1.0, *,
                         with_entropy: Literal[True]) -> tuple[Tensor, Tensor] | None: ...

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
        packed, shared = packing(batch, self.pack_sequences, self.share_prompts, self.cp_size > 1)
        chunks, micro_batches = logprob_micro_batches(batch, self.logprob_max_tokens, packed, self.device, shared,
                                                      same_shape=self.pp_size > 1, multiple=self.sequence_multiple)

        def factory(index: int) -> Callable:
            inputs = micro_batches[index]

            def loss_func(logits: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
                lp, ent = self._token_values(logits, inputs, temperature, with_entropy)
                out = {"logprobs": lp.float().cpu()}
                if ent is not None:
                    out["entropy"] = ent.float().cpu()
                return torch.zeros((), device=logits.device), torch.tensor(0, dtype=torch.int), out

            return loss_func

        outputs = self._run_schedule(micro_batches, forward_only=True, loss_func_factory=factory)
        if not self.is_last_stage:
            return None
        valid = batch.attention_mask.bool().cpu()

        def gathered(key: str) -> Tensor:  # the chunks' rows in order
            parts = [o[key][: len(rows)] for o, rows in zip(outputs, chunks, strict=True)]
            return torch.cat(parts).masked_fill(~valid, 0.0)

        lp = gathered("logprobs")
        return (lp, gathered("entropy")) if with_entropy else lp

    # ------------------------------------------------------------------ training

    def train_micro_batch(
        self, batch: TrainBatch, loss_fn: LossFn, *, temperature: float | None = None,
        with_entropy: bool | None = None,
    ) -> float | None:
        """Forward + backward of one micro-batch; gradients accumulate until `optimizer_step`. Returns the forward's
        seconds (to the loss; None with PP > 1, where passes interleave): the planner's log-prob speed.

        `loss_fn(logprobs, entropy, batch)` runs on the last pipeline stage with device tensors; its NUMERATOR is
        backpropagated unscaled, its denominator and detached terms are kept for `optimizer_step`. May be called
        any number of times per step (a different number on each DP rank, zero included); all TP/PP ranks of the
        replica must pass the same micro-batches in the same order.
        """
        optimizer = self.require_optimizer()
        if batch.input_ids.dim() != 2 or batch.input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty [batch, seq] tensor, got {tuple(batch.input_ids.shape)}")
        if batch.response_mask.shape != batch.input_ids.shape:
            raise ValueError(f"response_mask {tuple(batch.response_mask.shape)} must match input_ids "
                             f"{tuple(batch.input_ids.shape)}")
        if not bool(batch.response_mask.any()):
            raise ValueError("train_micro_batch: the micro-batch has no response tokens (response_mask is all "
                             "False); drop such rows before training")
        temperature = self.temperature if temperature is None else temperature
        entropy_on = self.train_entropy if with_entropy is None else with_entropy
        dev_batch = batch_to_device(batch, self.device)
        inputs = self.model_inputs(batch)
        kept: list[LossTerms] = []
        forward_end: list[float] = []

        def factory(index: int) -> Callable:
            def loss_func(logits: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
                lp, ent = self._token_values(logits, inputs, temperature, entropy_on)
                terms = loss_fn(lp, ent, dev_batch)
                if not isinstance(terms, LossTerms):
                    raise TypeError(f"loss_fn must return LossTerms, got {type(terms).__name__}")
                if terms.numerator.dim() != 0:
                    raise ValueError(f"loss numerator must be a scalar, got shape {tuple(terms.numerator.shape)}")
                kept.append(terms.detach())
                forward_end.append(time.perf_counter())
                # calculate_per_token_loss=True: the schedule backpropagates this numerator as it is.
                return terms.numerator, torch.tensor(0, dtype=torch.int), {}

            return loss_func

        started = time.perf_counter()
        self._run_schedule([inputs], forward_only=False, loss_func_factory=factory)
        optimizer.accumulate(kept, int(batch.response_mask.sum()))
        return forward_end[0] - started if forward_end and self.pp_size == 1 else None

    def optimizer_step(self, expected_micro_batches: int | None = None, allow_empty: bool = False
                       ) -> dict[str, float] | None:
        """Finish the step: sum gradients over DP, scale them by 1 / (global loss denominator), clip, step, zero.

        Collective over all ranks. Returns (on every rank) `loss` (the normalised loss of all micro-batches since
        the last step, before the update), `loss_fn`'s merged metrics, `grad_norm` (before clipping), `lr`,
        `micro_batches` and `tokens` (response tokens) summed over DP. When no micro-batch of any DP rank had a
        response token, the gradients are dropped and the result is None with `allow_empty`, a `ValueError`
        otherwise. `expected_micro_batches`: how many micro-batches this rank should have trained since the last
        step; another count raises `RuntimeError` before anything changes.
        """
        return self.require_optimizer().step(self.dp_size, self.is_last_stage, self.pp_size, expected_micro_batches,
                                             allow_empty)

    # ------------------------------------------------------------------ weights in and out

    def hf_weights(self, copy: bool = True) -> Iterator[tuple[str, Tensor]]:
        """HF-named weights of this replica, unbucketed, on its device (collective over its TP/PP ranks; yielded
        on tp0/pp0); see `rlinf_pipe.models.live_weights.iter_hf_weights`."""
        from rlinf_pipe.models.live_weights import iter_hf_weights

        return iter_hf_weights(self.model, self.arch, copy=copy)

    def load_hf_weights(self, named_tensors: list[tuple[str, Tensor]]) -> None:
        """Load HF-named tensors (whole conversion groups, e.g. one weight-sync bucket) into this rank's shard."""
        from rlinf_pipe.models.live_weights import load_hf_state_dict

        load_hf_state_dict(self.module, dict(named_tensors), self.arch, partial=True)

    # ------------------------------------------------------------------ offload

    def state_nbytes(self) -> int:
        """Bytes of distinct storage behind weights, gradient buffers and optimizer state on this rank."""
        return self.device_state.nbytes()

    def offload(self, *, force: bool = False) -> int:
        """Move weights, gradient buffers and optimizer state to host memory and free their device storage; returns
        the bytes moved (see `optimizer.DeviceState`)."""
        return self.device_state.offload(force)

    def onload(self) -> int:
        """Undo `offload`; returns the bytes moved back."""
        return self.device_state.onload()

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, folder: str | os.PathLike[str], record: dict[str, Any] | None = None) -> Path:
        """Save model, optimizer state, step and RNG states (collective; see `checkpoint.save_checkpoint`)."""
        return checkpoint.save_checkpoint(self, folder, record)

    def load_checkpoint(self, folder: str | os.PathLike[str]) -> None:
        """Restore a folder written by `save_checkpoint` (collective; see `checkpoint.load_checkpoint`)."""
        checkpoint.load_checkpoint(self, folder)

    def capture_state(self) -> checkpoint.TrainerState:
        """This rank's training state, copied to host memory (a rollback point; see `checkpoint.TrainerState`)."""
        return checkpoint.capture_state(self)

    def restore_state(self, state: checkpoint.TrainerState) -> None:
        """Go back to `state` (taken by `capture_state` on this rank; the state must be onloaded)."""
        checkpoint.restore_state(self, state)
