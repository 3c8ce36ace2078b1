"""`ActorWorker`: the `actor:` placement's Megatron trainer.

Each step every replica reads the training batches routed to it from its own train channel and trains them in
micro-batches, stepping the optimizer after each mini-batch (`train_feed`); the driver only says which step it is.
The loss is `rlinf_pipe.algorithms.policy_loss` configured from `algorithm.*` (the policy knows nothing about it).
`publish_weights` sends a version through the weight transport. Built with `computes_logprobs` (no inference
workers) the actor also computes the log-probs (`logprob_step`, before it trains).
Given a `DeviceShare` taken in turns (rollout on the actor's GPUs) it holds its GPUs for each phase: `begin_phase`
(take + onload) ... `end_phase` (offload + give back), its state offloaded in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlinf_pipe.algorithms.logprob_needs import needs_ref, old_is_current, recomputes_old
from rlinf_pipe.algorithms.losses import policy_loss
from rlinf_pipe.algorithms.terms import LossTerms
from rlinf_pipe.config.schema import Config
from rlinf_pipe.config.validate import token_budget
from rlinf_pipe.data.packing import MicroBatcher
from rlinf_pipe.data.structs import ScoredGroup
from rlinf_pipe.data.train_batch import TrainBatch
from rlinf_pipe.engines.policy import MegatronPolicy, ReplicaRanks
from rlinf_pipe.engines.policy.checkpoint import TrainerState
from rlinf_pipe.models.megatron_gpt import init_model_parallel
from rlinf_pipe.channels import Channel
from rlinf_pipe.runtime.locks import DeviceShare
from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.utils.device_memory import hand_back_cached_memory
from rlinf_pipe.weights import WeightLayout, WeightSender, WeightVersion, plan_weight_layout, publish_whole
from rlinf_pipe.weights.process_group import Rendezvous
from rlinf_pipe.weights.transport_names import Transport
from rlinf_pipe.weights.transports import open_sender
from rlinf_pipe.workers.logprob_stage import LogprobStage, pad_token_id, policy_options, train_routing
from rlinf_pipe.workers.replica_balance import TrainRoute
from rlinf_pipe.workers.replica_input import ReplicaInputFailed, read_shared
from rlinf_pipe.workers.train_feed import OptimizerStep, TrainMicroBatch, TrainOp, train_ops
from rlinf_pipe.workers.version_wait import VersionWait

ACTOR_GANG = "actor"  # the actor's ranks take their GPUs as one gang: they meet in collectives in a phase


def make_loss_fn(cfg: Config) -> Any:
    """`loss_fn(logprobs, entropy, batch) -> LossTerms` for the policy, from `algorithm.*`."""
    a = cfg.algorithm
    loss = functools.partial(
        policy_loss, clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, dual_clip_c=a.dual_clip_c,
        kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef, loss_agg=a.loss_agg,
    )

    current = old_is_current(cfg)

    def loss_fn(logprobs: Any, entropy: Any, batch: TrainBatch) -> LossTerms:
        old = logprobs.detach() if current else batch.old_logprobs
        return loss(logprobs, old, batch.ref_logprobs, batch.advantages, batch.response_mask, entropy=entropy)

    return loss_fn


@dataclass
class TrainResult:
    """One step of one replica: the metrics of each optimizer step (None: the mini-batch was empty everywhere)
    and the bytes of training data the replica read from its channel."""

    optimizer_steps: list[dict[str, float] | None] = field(default_factory=list)
    data_bytes: int = 0
    tokens: int = 0  # real tokens of the groups the replica trained


class ActorWorker(Worker):
    """Trains the policy (see the module docstring). `computes_logprobs`: it also computes the log-probs (no
    inference workers); `share`: its GPUs' share, taken in turns with the engines or its own."""

    def __init__(self, cfg: Config, model_path: str, computes_logprobs: bool = False,
                 share: DeviceShare = DeviceShare(), balancer: Any = None, pad_id: int | None = None):
        super().__init__()
        a = cfg.actor
        init_model_parallel(a.tensor_parallel_size, a.pipeline_parallel_size, a.context_parallel_size)
        self.policy = MegatronPolicy(
            model_path, train=True, lr=a.lr, weight_decay=a.weight_decay, clip_grad=a.clip_grad,
            lr_warmup_steps=a.lr_warmup_steps, train_entropy=cfg.algorithm.entropy_coef != 0, recompute=a.recompute,
            **policy_options(cfg, "actor"),
        )
        self.ranks = ReplicaRanks.current()
        self.loss_fn = make_loss_fn(cfg)
        self.routing = train_routing(cfg, self.ranks.dp_size)
        self.balancer = balancer  # (`ReplicaBalancer`: groups reach this replica by tokens, not by slot)
        self.micro_batch_size, self.micro_batch_tokens = a.micro_batch_size, token_budget(a)
        self.max_micro_batch_size = a.max_micro_batch_size  # (MicroBatcher keeps it at least micro_batch_size)
        self.pad_token_id = pad_token_id(model_path, pad_id)
        self.bucket_bytes = cfg.runner.weight_bucket_mb << 20
        self.sender: WeightSender | None = None  # the weight transport's sending end, on a sending rank once opened
        self.sending_replicas: set[int] = set()  # the replicas whose gathering rank sends
        self.trailer = True  # whether weight buckets carry the version / CRC32 trailer
        self.version = 0  # the weight version the policy holds: step s trains version s + 1
        self.trained = VersionWait(self.owner, "train")  # a send of the next version waits here for its training
        self.ref = MegatronPolicy(model_path, train=False, **policy_options(cfg, "actor")) if (
            computes_logprobs and needs_ref(cfg)) else None
        self.stage = None if not computes_logprobs else LogprobStage(
            self.policy, self.ref, TrainRoute(self.routing, balancer), self.pad_token_id,
            recompute_old=recomputes_old(cfg), tracer=self.tracer)
        self.share = share
        self.phase_held = False  # between begin_phase and end_phase: the devices held, the state onloaded
        if share.in_turns:
            self._move("offload")
        # With restarts allowed (and rollout in step), each step's training starts from a copy of the state taken
        # first, in host memory: a step abandoned after a lost worker is retried from it (`rollback`).
        self.keep_rollback = cfg.runner.max_restarts > 0 and cfg.runner.max_staleness == 0
        self.rollback_point: tuple[int, TrainerState] | None = None

    # --- training ----------------------------------------------------------------------------------------------
    async def _next_op(self, ops: Any) -> TrainOp | None:
        """The replica's next op: read on the input rank, shared with the replica's other ranks (None: the end)."""
        return await read_shared(self.ranks, lambda: anext(ops, None))

    def _train(self, op: TrainMicroBatch) -> None:
        with self.tracer.span("train", cpu_threads=self.compute.threads) as args:
            batch = op.batch
            args.update(version=batch.version, sequences=batch.num_sequences, tokens=batch.num_tokens,
                        sequence_tokens=int(batch.attention_mask.sum()))
            forward_s = self.policy.train_micro_batch(batch, self.loss_fn)
            if forward_s is not None:  # (the planner's log-prob speed where a run has no log-prob stage)
                args["forward_s"] = round(forward_s, 6)

    def _optimizer_step(self, step: int, minibatch: int) -> dict[str, float] | None:
        with self.tracer.span("optimizer_step", step=step, minibatch=minibatch):
            return self.policy.optimizer_step(allow_empty=True)

    async def train_step(self, step: int, src: Sequence[Channel[TrainBatch]]) -> TrainResult:
        """Train the step's batches routed to this replica, read from its train channel in `src` (one per replica;
        collective over every rank of the actor).

        Before each optimizer step the replicas vote (`ReplicaRanks.agree`): a replica that fails (its channel
        aborted when the step is abandoned, or an error) votes no at its next vote, so no other replica is left
        waiting in the optimizer's collectives, and every replica ends the step. A send of version `step + 1`
        asked for meanwhile (`publish_weights(..., trained=True)`) goes out once it ended."""
        with self.trained.making(step + 1):
            result = await self._train_step(step, src)
            self._holds(step + 1)
        if self.share.in_turns:  # (the engines on these GPUs take the version next, sglang into memory it
            await self.compute.run(hand_back_cached_memory)  # allocates itself: what training cached goes back)
        return result

    async def _train_step(self, step: int, src: Sequence[Channel[TrainBatch]]) -> TrainResult:
        if self.keep_rollback:
            with self.tracer.span("rollback_point", step=step):
                self.rollback_point = (step, await self.compute.run(self.policy.capture_state))
        ops = None
        if self.ranks.is_input:
            batcher = MicroBatcher(self.micro_batch_size, self.micro_batch_tokens, self.policy.pack_sequences,
                                   self.max_micro_batch_size)
            ops = train_ops(src[self.ranks.dp_rank], self.routing, self.ranks.dp_rank, batcher, self.pad_token_id,
                            by_slot=self.balancer is None)
        result = TrainResult()
        votes, voted_no = 0, False
        # Without model-parallel peers (whose collectives must not overlap the input rank's next read) the next
        # micro-batch waits in the compute thread's queue while one trains: no hand-off back and forth between them.
        ahead = 1 if self.ranks.mp_size == 1 else 0
        queued: deque[asyncio.Future] = deque()
        try:
            while (op := await self._next_op(ops)) is not None:
                if isinstance(op, TrainMicroBatch):
                    queued.append(asyncio.ensure_future(self.compute.run(self._train, op)))
                    while len(queued) > ahead:
                        await queued.popleft()
                elif isinstance(op, OptimizerStep):
                    while queued:
                        await queued.popleft()
                    votes += 1
                    if not await asyncio.to_thread(self.ranks.agree, True):
                        voted_no = True
                        raise ReplicaInputFailed(f"step {step} ended by another actor replica (it failed)")
                    result.optimizer_steps.append(await self.compute.run(self._optimizer_step, step, op.minibatch))
                    result.data_bytes += op.data_bytes
                    result.tokens += op.tokens
        except Exception:
            await asyncio.gather(*queued, return_exceptions=True)  # nothing trains on once the step failed
            if not voted_no and votes < self.routing.n_minibatches:
                await asyncio.to_thread(self.ranks.agree, False)
            raise
        return result

    async def rollback(self, step: int) -> bool:
        """Go back to the state before step `step`'s training (the step is retried after a lost worker): the copy
        taken when its training began, if it began; otherwise the state is that already. Gradients and loss terms
        of the abandoned step are dropped. Returns whether a copy was restored."""
        point = self.rollback_point[1] if self.rollback_point is not None and self.rollback_point[0] == step else None

        def roll_back() -> None:
            if point is not None:
                self.policy.restore_state(point)
            else:
                self.policy.require_optimizer().zero_grads()

        with self.tracer.span("rollback", step=step, restored=point is not None):
            async with self._state_on_devices(step):  # both write the state: never while it is offloaded
                await self.compute.run(roll_back)
        self._holds(step)
        return point is not None

    def _holds(self, version: int) -> None:
        """The policy now holds weight version `version`; the log-probs this actor computes come from it."""
        self.version = version
        if self.stage is not None:
            self.stage.version = version

    @contextlib.asynccontextmanager
    async def _state_on_devices(self, step: int) -> AsyncIterator[None]:
        """The training state on the devices for the block: with the engines on the actor's GPUs (state offloaded
        between phases), a device phase of its own around it."""
        if not self.share.in_turns or self.phase_held:  # (inside a phase already: it stays the phase's to end)
            yield
            return
        await self.begin_phase(step)
        try:
            yield
        finally:
            await self.end_phase(step)

    def on_abandon(self) -> None:
        self.trained.cancel()
        if self.sender is not None:
            self.sender.cancel()

    async def logprob_step(self, step: int, src: Channel[ScoredGroup], dst: Sequence[Channel[TrainBatch]]) -> int:
        """The step's old (and reference) log-probs from the scored channel `src` into the train channels `dst`,
        computed with the weights before the step's updates (an actor built with `computes_logprobs`)."""
        if self.stage is None:
            raise RuntimeError("this actor computes no log-probs: the inference workers do")
        return await self.stage.run(step, src, dst)

    # --- device phases (GPUs shared with the engines) ----------------------------------------------------------
    def _move(self, direction: str) -> int:
        return sum(getattr(policy, direction)() for policy in (self.policy, self.ref) if policy is not None)

    async def begin_phase(self, step: int) -> int:
        """Take this rank's devices and bring the state back onto them; returns the bytes moved."""
        await self.share.take(self.info.global_gpus, self.owner, ACTOR_GANG)
        self.phase_held = True
        with self.tracer.span("onload", step=step) as args:
            args["bytes"] = moved = self._move("onload")
        return moved

    async def end_phase(self, step: int) -> int:
        """Move the state off the devices and give them back; returns the bytes moved."""
        try:
            with self.tracer.span("offload", step=step) as args:
                args["bytes"] = moved = self._move("offload")
        finally:
            await self.share.give_back(self.owner, ACTOR_GANG)
            self.phase_held = False
        return moved

    async def settle_devices(self) -> None:
        """After an abandoned step: end a phase it left open (state offloaded, the devices given back)."""
        if self.phase_held:
            await self.end_phase(-1)

    # --- weights -----------------------------------------------------------------------------------------------
    def weight_layout(self, trailer: bool = True) -> WeightLayout:
        """The layout of this policy's weight versions (`runner.weight_bucket_mb` buckets of its dtype)."""
        return plan_weight_layout(self.policy.arch, self.policy.params_dtype, self.bucket_bytes, trailer)

    def weight_backend(self) -> str:
        """The process-group backend of a weight broadcast from here: NCCL on GPUs, gloo on CPU."""
        return self.backend or "gloo"

    def open_weights(self, transport: Transport, rendezvous: dict[int, Rendezvous | None], replicas: set[int],
                     trailer: bool) -> None:
        """The ranks in `rendezvous` (the gathering rank of each replica in `replicas`) open the transport's sending
        end; the other ranks of those replicas only help gather."""
        self.trailer = trailer
        self.sending_replicas = set(replicas)
        if self.rank in rendezvous:
            self.sender = open_sender(transport, self.weight_layout(trailer), rendezvous[self.rank])

    async def publish_weights(self, version: int, checksum: bool = False,
                              trained: bool = False) -> WeightVersion | None:
        """Send the current weights as `version` (collective over the sending replicas' ranks; a sending rank returns
        what it published, the others None). `trained`: asked for while the step that trains `version` runs, the
        send waits until that step ended (and fails if it failed or was abandoned)."""
        if self.ranks.dp_rank not in self.sending_replicas:
            return None
        if trained:
            await self.trained.wait_for(version, lambda: self.version)

        def publish() -> WeightVersion | None:
            with self.tracer.span("publish_weights", version=version) as args:
                tensors = self.policy.hf_weights(copy=False)
                if self.sender is None:  # a TP/PP peer of the sender: only takes part in the gathering
                    for _ in tensors:
                        pass
                    return None
                published = publish_whole(self.sender, version, tensors, checksum)
                args["bytes"] = published.num_bytes
                return published

        return await self.compute.run(publish)

    # --- checkpoints -------------------------------------------------------------------------------------------
    async def save_checkpoint(self, folder: str, step: int, record: dict[str, Any] | None = None) -> str:
        """Save the state before step `step` (collective): with the engines on the actor's GPUs, in a device phase
        of its own (the state is offloaded between phases)."""
        async with self._state_on_devices(step):
            with self.tracer.span("save_checkpoint", step=step):
                return str(await self.compute.run(self.policy.save_checkpoint, folder, record))

    async def load_checkpoint(self, folder: str, version: int) -> None:
        """Restore model, optimizer, schedule and RNG; the restored weights are weight version `version` (the step
        the run resumes at)."""
        async with self._state_on_devices(version):
            await self.compute.run(self.policy.load_checkpoint, folder)
        self._holds(version)
