"""The trainable side of a policy: Megatron's optimizer with exact loss normalisation, the learning-rate schedule,
and moving the training state off and back onto the device.

`PolicyOptimizer` keeps the loss terms of the micro-batches since the last step. `step()` reduces the gradients
over data-parallel ranks (`finalize_model_grads`: a plain SUM, because DDP runs with `calculate_per_token_loss`;
over the DP x CP ranks under context parallelism, whose ranks hold the gradients of their own tokens), sums the
denominators of all micro-batches of all DP ranks (the CP ranks of a replica hold the same loss terms), scales the
gradients by 1/denominator, then clips and steps: the update is the gradient of `sum(numerators) /
sum(denominators)` however the batch was split.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from rlinf_pipe.algorithms.terms import LossTerms, Stat, finalize, finalize_metrics, merge
from rlinf_pipe.engines.policy.parallel import dp_object_group
from rlinf_pipe.utils.device_memory import hand_back_cached_memory


def warmup_lr(step: int, peak_lr: float, warmup_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup `peak * (step + 1) / warmup_steps` over the
    first `warmup_steps` steps, then constant `peak`."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return peak_lr
    return peak_lr * (step + 1) / warmup_steps


def _cpu_terms(t: LossTerms) -> LossTerms:
    metrics = {k: Stat(s.value.detach().cpu(), s.count.detach().cpu(), s.reduce) for k, s in t.metrics.items()}
    return replace(t, numerator=t.numerator.detach().double().cpu(), denominator=t.denominator.detach().cpu(),
                   metrics=metrics)


class PolicyOptimizer:
    """Megatron's Adam over one DDP-wrapped model, its schedule, and the loss terms since the last step.

    Args:
        model: the `DistributedDataParallel` model (its config has `calculate_per_token_loss=True`).
        params_dtype: the parameters' dtype (bf16 keeps fp32 master weights in the optimizer).
        lr, weight_decay, adam_betas, adam_eps, clip_grad, lr_warmup_steps: see `MegatronPolicy`.
        use_distributed_optimizer: shard the optimizer state over data-parallel ranks.
    """

    def __init__(
        self, model: Any, *, params_dtype: torch.dtype, lr: float, weight_decay: float,
        adam_betas: tuple[float, float], adam_eps: float, clip_grad: float, lr_warmup_steps: int,
        use_distributed_optimizer: bool,
    ) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.model = model
        self.peak_lr = float(lr)
        self.lr_warmup_steps = int(lr_warmup_steps)
        self.use_distributed_optimizer = use_distributed_optimizer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=self.peak_lr, min_lr=0.0, weight_decay=weight_decay,
                adam_beta1=adam_betas[0], adam_beta2=adam_betas[1], adam_eps=adam_eps, clip_grad=float(clip_grad),
                bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype,
                use_distributed_optimizer=use_distributed_optimizer,
            ),
            [model],
        )
        # made here, where every rank is (a collective at its first use), for `_summary` on the last stage alone
        self.dp_group = dp_object_group()
        self.steps_taken = 0
        self.terms: list[LossTerms] = []
        self.micro_batches = 0
        self.tokens = 0

    def accumulate(self, terms: list[LossTerms], tokens: int) -> None:
        """Keep one micro-batch's detached loss terms (its numerator was backpropagated)."""
        self.terms.extend(_cpu_terms(t) for t in terms)
        self.micro_batches += 1
        self.tokens += tokens

    def _reset(self) -> None:
        self.terms, self.micro_batches, self.tokens = [], 0, 0

    def zero_grads(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._reset()

    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers inside Megatron's wrapper(s)."""
        chained = getattr(self.optimizer, "chained_optimizers", None)
        wrappers = list(chained) if chained is not None else [self.optimizer]
        return [w.optimizer for w in wrappers if getattr(w, "optimizer", None) is not None]

    def _summary(self, dp_size: int, is_last_stage: bool, pp_size: int) -> dict[str, Any]:
        """Loss, metrics, denominator and counts summed over DP ranks, on every rank."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        summary: dict[str, Any] | None = None
        if is_last_stage:
            local = (merge(self.terms) if self.terms else None, self.micro_batches, self.tokens)
            gathered: list[Any] = [local]
            if dp_size > 1:  # one replica: nothing to gather (saves pickling every metric each step)
                gathered = [None] * dp_size
                dist.all_gather_object(gathered, local, group=self.dp_group)
            terms = [g[0] for g in gathered if g[0] is not None]
            merged = merge(terms) if terms else None
            summary = {
                "denominator": float(merged.denominator) if merged else 0.0,
                "loss": float(finalize(merged)) if merged else float("nan"),
                "metrics": finalize_metrics(merged) if merged else {},
                "micro_batches": float(sum(g[1] for g in gathered)),
                "tokens": float(sum(g[2] for g in gathered)),
            }
        if pp_size > 1:
            box = [summary]
            dist.broadcast_object_list(
                box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
            )
            summary = box[0]
        if summary is None:
            raise RuntimeError("optimizer step: no loss summary reached this rank")
        return summary

    def step(self, dp_size: int, is_last_stage: bool, pp_size: int, expected_micro_batches: int | None = None,
             allow_empty: bool = False) -> dict[str, float] | None:
        """Collective over all ranks: reduce, normalise, clip and apply the gradients of the micro-batches since the
        last step. Returns the step's metrics on every rank. When no rank trained a response token since the last
        step, the gradients are dropped and the result is None with `allow_empty`, a `ValueError` otherwise.
        `expected_micro_batches`: how many micro-batches this rank should have trained (a `RuntimeError` before
        anything changes when it trained another number)."""
        from megatron.core.distributed import finalize_model_grads

        if expected_micro_batches is not None and expected_micro_batches != self.micro_batches:
            raise RuntimeError(
                f"optimizer_step: this rank trained {self.micro_batches} micro-batches since the last step but was "
                f"sent {expected_micro_batches}: a call ran out of order (await every train_micro_batch before "
                "calling optimizer_step)"
            )
        from megatron.core import parallel_state as ps

        if dp_size > 1 or pp_size > 1 or ps.get_tensor_model_parallel_world_size() > 1 or (
                ps.get_context_parallel_world_size() > 1):  # (alone: nothing to sum)
            # the sum over DP x CP ranks; embedding / layer-norm grads across stages and TP ranks
            finalize_model_grads([self.model], num_tokens=None)
        summary = self._summary(dp_size, is_last_stage, pp_size)
        denominator = summary["denominator"]
        if not denominator > 0:
            self.zero_grads()
            if allow_empty:
                return None
            raise ValueError(
                "optimizer_step: the loss denominator summed over all micro-batches and DP ranks is 0 "
                "(no response tokens / sequences since the last step); gradients were dropped"
            )
        self.model.scale_gradients(1.0 / denominator)
        lr = warmup_lr(self.steps_taken, self.peak_lr, self.lr_warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        ok, grad_norm, _ = self.optimizer.step()
        self.zero_grads()
        if not ok:
            raise RuntimeError("optimizer step failed (non-finite gradients)")
        self.steps_taken += 1
        out = dict(summary["metrics"])
        out.update(
            loss=summary["loss"], lr=lr, micro_batches=summary["micro_batches"], tokens=summary["tokens"],
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        )
        return out

    def state_tensors(self) -> list[Tensor]:
        """The optimizer's tensors: fp32 master / shard parameters and Adam moments."""
        tensors: list[Tensor] = []
        for inner in self.inner_optimizers():
            for group in inner.param_groups:
                tensors += [p.data for p in group["params"]]
            for state in inner.state.values():
                tensors += [v for v in state.values() if isinstance(v, Tensor)]
        return tensors

    def state_dict(self) -> list[dict[str, Any]]:
        """Per inner torch optimizer: its state dict and its (fp32 master / shard) parameters, on CPU."""
        out = []
        for inner in self.inner_optimizers():
            params = [p.detach().cpu().clone() for g in inner.param_groups for p in g["params"]]
            sd = inner.state_dict()
            sd = {"state": {k: {n: (v.cpu().clone() if isinstance(v, Tensor) else v) for n, v in s.items()}
                            for k, s in sd["state"].items()},
                  "param_groups": sd["param_groups"]}
            out.append({"optimizer": sd, "params": params})
        return out

    def load_state_dict(self, saved: list[dict[str, Any]]) -> None:
        inners = self.inner_optimizers()
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
                # torch adopts a saved tensor already on its parameter's device (and the step counter wherever it
                # is) as the state itself: those are cloned, so the state owns its memory (a checkpoint's tensors
                # are the file's records, which offload cannot resize; a rollback point must stay as captured).
                # The others torch copies to the device itself.
                saved_state = entry["optimizer"]
                inner.load_state_dict({**saved_state, "state": {
                    k: {n: _owned(v, params[k]) for n, v in s.items()} for k, s in saved_state["state"].items()}})


def _owned(value: Any, param: Tensor) -> Any:
    """`value` as the optimizer state of `param` may keep it: a clone where torch would adopt the tensor itself."""
    adopted = isinstance(value, Tensor) and (value.device == param.device or value.dim() == 0)
    return value.clone() if adopted else value


def _as_bytes(storage: Any) -> torch.Tensor:
    """`storage` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class DeviceState:
    """Moves a set of tensors' storages off the device and back (collocated mode's offload / onload).

    Each distinct storage is copied out to host memory and resized to 0; views (DDP buffers, main grads) stay valid
    because `onload` resizes and refills the same storage. A storage whose bytes are all zero is not copied: onload
    zero-fills it (the gradient buffer, zeroed after every optimizer step, is as large as the fp32 weights: no host
    buffer for it, and no transfer either way). On CUDA the host copies are pinned buffers allocated once
    per storage and reused every cycle (allocating pinned memory is slow, and pinning a pageable copy would hold two),
    and after offloading the allocator's cache is emptied, so the freed memory goes back to the GPU for the engines.
    On CPU there is nowhere to move to: nothing happens and the bytes that would move are reported, unless
    `move_on_cpu` (or `force=True` for one call) runs the cycle on CPU storage as on a GPU, so that a CPU run fails
    where a GPU run would touch the state while it is offloaded.
    """

    def __init__(self, tensors: Any, device: torch.device, move_on_cpu: bool = False):
        self.tensors = tensors  # a callable returning the current tensors (optimizer state appears after a step)
        self.device = device
        self.move_on_cpu = move_on_cpu
        # (device storage, host backup or None for all zeros, bytes) while offloaded
        self.offloaded: list[tuple[Any, Any, int]] | None = None
        self.backups: dict[int, Any] = {}  # host buffer per storage (by its StorageImpl), kept between cycles

    def _storages(self, include_cpu: bool) -> list[Any]:
        seen: dict[tuple[str, int], Any] = {}
        for t in self.tensors():
            if t.device.type == "cpu" and not include_cpu:
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                continue
            seen.setdefault((str(t.device), storage.data_ptr()), storage)
        return list(seen.values())

    def nbytes(self) -> int:
        """Bytes of distinct storage behind the tensors on the state's kind of device (what `offload` moves: not
        the optimizer's step counters that live on the host beside a GPU state)."""
        seen: dict[tuple[str, int], int] = {}
        for t in self.tensors():
            if t.device.type != self.device.type:
                continue
            s = t.untyped_storage()
            seen[(str(t.device), s.data_ptr())] = s.nbytes()
        return sum(seen.values())

    def _backup(self, storage: Any) -> Any:
        """The host buffer of `storage` (its StorageImpl stays the same through resizes): allocated on first use."""
        backup = self.backups.get(storage._cdata)  # noqa: SLF001 - the storage's identity
        if backup is None or backup.nbytes() != storage.nbytes():
            pinned = self.device.type == "cuda"
            backup = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned).untyped_storage()
            self.backups[storage._cdata] = backup  # noqa: SLF001
        return backup

    def offload(self, force: bool = False) -> int:
        """Copy the storages to host memory (those not all zeros) and free them on the device; returns the bytes
        freed there."""
        if self.offloaded is not None:
            return 0
        on_cpu = self.device.type == "cpu"
        force = force or (self.move_on_cpu and on_cpu)
        if on_cpu and not force:
            self.offloaded = []
            return self.nbytes()
        moved = []
        storages = self._storages(include_cpu=force)
        current = {storage._cdata for storage in storages}  # noqa: SLF001
        for key in [key for key in self.backups if key not in current]:  # storages replaced since (a restored
            del self.backups[key]  # rollback point brings new optimizer moments): their host buffers go
        for storage in storages:
            if not bool(_as_bytes(storage).any()):
                moved.append((storage, None, storage.nbytes()))
                continue
            backup = self._backup(storage)
            backup.copy_(storage)
            moved.append((storage, backup, storage.nbytes()))
        for storage, _, _ in moved:
            storage.resize_(0)
        if self.device.type == "cuda":
            hand_back_cached_memory()  # the freed blocks, for the engines that share this GPU
        self.offloaded = moved
        return sum(nbytes for _, _, nbytes in moved)

    def onload(self) -> int:
        """Undo `offload`; returns the bytes moved back (on CPU without `force`: the bytes that would move)."""
        moved, self.offloaded = self.offloaded, None
        if moved is None:
            return 0
        if not moved:
            return self.nbytes()
        for storage, backup, nbytes in moved:
            storage.resize_(nbytes)
            if backup is None:
                _as_bytes(storage).zero_()
            else:
                storage.copy_(backup)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return sum(nbytes for _, _, nbytes in moved)
