"""`RolloutWorker`: the Ray worker of the `rollout:` placement; a generation engine feeding the rollout channel.

Each step it turns its share of the prompts into requests (one per prompt, `group_size` samples, seeded from the
run seed and the prompt's identity, so a prompt's samples do not depend on which worker or batch drew it) and puts
each `RolloutGroup` into the channel as soon as its samples finish, then ends the step. In collocated mode the
whole wake -> generate -> sleep phase holds its GPUs' share (`DeviceShare`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager

import msgspec

from rlinf_pipe.config.schema import RolloutConfig
from rlinf_pipe.data.structs import PromptItem, RolloutGroup
from rlinf_pipe.engines.evaluation import EvalOutput, generate_texts
from rlinf_pipe.engines.rollout.engine import (
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    request_seed,
    to_rollout_samples,
)
from rlinf_pipe.engines.rollout.factory import build_engine
from rlinf_pipe.channels import Channel
from rlinf_pipe.runtime.locks import DeviceShare
from rlinf_pipe.runtime.worker import control_call
from rlinf_pipe.weights import WeightVersion
from rlinf_pipe.weights.transport_names import Transport
from rlinf_pipe.workers.weight_inbox import NativeReceiver
from rlinf_pipe.workers.weight_receiver import WeightReceiverWorker


class RolloutWorker(WeightReceiverWorker):
    """Generates prompt groups into the rollout channel; loads the weight versions the actor publishes into its
    engine (`WeightReceiverWorker`)."""

    def __init__(self, rollout: RolloutConfig, model_path: str, sampling: SamplingParams, run_seed: int,
                 share: DeviceShare = DeviceShare(), first_batch_size: int | None = None):
        super().__init__(model_path)
        self.engine = build_engine(rollout, model_path, seed=run_seed + self.rank, collocated=share.in_turns,
                                   first_batch_size=first_batch_size,
                                   first_gpu=self.info.local_gpus[0] if self.info.local_gpus else None)
        self.sampling, self.run_seed, self.share = sampling, run_seed, share

    @control_call
    def before_stop(self) -> None:
        """Shut the engine down before the kill: SGLang's scheduler processes then release their GPUs (and shared
        memory) at once, before a relaunched engine measures what is free, rather than when they notice this
        process is gone."""
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def on_abandon(self) -> None:
        self.engine.abort()
        super().on_abandon()

    async def release_devices(self) -> None:
        """Collocated: put the engine to sleep until its first generation (the actor shares its GPUs)."""
        await self.engine.sleep()

    def _request(self, index: int, prompt: PromptItem) -> GenerateRequest:
        seed = request_seed(self.run_seed, prompt.id, prompt.epoch)
        return GenerateRequest(request_id=str(index), prompt_ids=list(prompt.prompt_ids),
                               sampling=msgspec.structs.replace(self.sampling, seed=seed))

    async def generate_step(self, prompts: Sequence[PromptItem], step: int, dst: Channel[RolloutGroup],
                            weights: int | None = None) -> dict[str, float]:
        """Generate `prompts`' groups into the rollout channel `dst` as each finishes, then end the step; returns
        counts.
        With `weights`, first wait until the engine holds that weight version (its sync may still be loading)."""
        if weights is not None:
            await self.wait_for_weights(weights)
        version = self.engine.version
        requests = [self._request(i, p) for i, p in enumerate(prompts)]
        tokens = groups = 0
        async with self._on_devices(step):
            with self.tracer.span("generate", step=step, version=version, prompts=len(prompts)) as args:
                if (timing := getattr(self.engine, "timing", None)) is not None:
                    timing.take()  # (an evaluation's steps before this generation are not its own)
                async for result in self.engine.generate(requests):
                    group = RolloutGroup.of(prompts[int(result.request_id)],
                                            to_rollout_samples(result, self.engine.tokenizer))
                    await dst.aput(group, weight=group.num_sequences)
                    tokens += group.num_tokens
                    groups += 1
                args.update(tokens=tokens)
                if timing is not None:  # (the planner's decode curve: the torch engine's decode steps by batch
                    args.update(timing.take())  # size, SGLang's requests' send and return times)
        dst.end_step()
        return {"groups": groups, "tokens": tokens}

    async def evaluate(self, requests: Sequence[GenerateRequest], step: int) -> list[EvalOutput]:
        """Generate evaluation requests (`rlinf_pipe.engines.evaluation`) with the loaded weights; the decoded
        outputs go back to the driver, not into the rollout channel."""
        async with self._on_devices(step):
            with self.tracer.span("evaluate", step=step, version=self.engine.version, requests=len(requests)):
                return await generate_texts(self.engine, requests)

    def _on_devices(self, step: int) -> AbstractAsyncContextManager[None]:
        """Hold the GPUs for a generation: taken in turns, the engine awake inside the hold."""

        async def wake() -> None:
            with self.tracer.span("wake", step=step):
                await self.engine.wake()

        async def sleep() -> None:  # (an abandoned step too: the devices go, so the memory must)
            with self.tracer.span("sleep", step=step):
                await self.engine.sleep()

        return self.share.hold(self.info.global_gpus, self.owner, after_take=wake, before_give_back=sleep)

    def weight_target(self) -> RolloutEngine:
        return self.engine

    def native_receiver(self) -> NativeReceiver:
        return self.engine.open_weight_receiver

    def weight_group_ranks(self, transport: Transport) -> int:
        """Ranks this worker's engine takes in `transport`'s process group (SGLang over broadcast: its TP size)."""
        return self.engine.weight_group_ranks(transport)

    def native_weight_receiver(self, transport: Transport) -> bool:
        """Whether the engine receives `transport` with a receiver of its own (SGLang: broadcast and ipc)."""
        return transport in self.engine.native_transports

    async def verify_weights(self, published: WeightVersion) -> str:
        """Verify the loaded version where the receiver could not (see `RolloutEngine.verify_weights`)."""
        return await self.engine.verify_weights(published)
