"""`RolloutWorker`: the Ray worker of the `rollout:` placement; a generation engine feeding the rollout channel.

Each step it turns its share of the prompts into requests (one per prompt, `group_size` samples, seeded from
the run seed and the prompt's identity, so a prompt's samples do not depend on which worker or batch drew it)
and puts each `RolloutGroup` into the channel as soon as its samples finish, then ends the step. In collocated mode the
whole wake -> generate -> sleep phase holds the device lock of its GPUs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from rlinf_pipe.data.structs import PromptItem, RolloutGroup
from rlinf_pipe.runner.weight_sync import WeightManifest, check_version, fetch_buckets, flatten
from rlinf_pipe.scheduler.locks import device_lock
from rlinf_pipe.scheduler.worker import Worker
from rlinf_pipe.utils.tracing import Tracer
from rlinf_pipe.workers.rollout.engine import GenerateRequest, SamplingParams, to_rollout_samples


def request_seed(run_seed: int, prompt: PromptItem) -> int:
    """The seed of a prompt's request: a stable hash of the run seed, the prompt id and the epoch that drew it."""
    digest = hashlib.blake2b(f"{run_seed}/{prompt.id}/{prompt.epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def build_engine(backend: str, model_path: str, seed: int, **options: Any) -> Any:
    """The rollout engine of `rollout.backend` on this process's device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "torch":
        from rlinf_pipe.workers.rollout.torch_engine import TorchEngine

        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        return TorchEngine(model_path, device=device, dtype=dtype, seed=seed, **options)
    if backend == "sglang":
        from rlinf_pipe.workers.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(model_path=model_path, seed=seed, **options)
    raise ValueError(f"unknown rollout.backend {backend!r}; expected torch or sglang")


class RolloutWorker(Worker):
    """Generates prompt groups into a channel; loads weight versions published by the actor."""

    def __init__(self, model_path: str, backend: str, sampling: SamplingParams, run_seed: int, locks: Any = None,
                 max_batch_size: int = 64):
        self.engine = build_engine(backend, model_path, seed=run_seed, max_batch_size=max_batch_size)
        self.model_path = model_path
        self.sampling, self.run_seed, self.locks = sampling, run_seed, locks
        info = self.info
        self.devices = info.global_gpus
        self.owner = f"rollout/{info.rank}"
        self.tracer = Tracer(self.owner, self.devices)
        self.collocated = locks is not None
        if self.collocated:
            self.engine.sleep()

    async def generate_step(self, prompts: Sequence[PromptItem], step: int, out: Any) -> dict[str, float]:
        """Generate `prompts`' groups into channel `out` as each finishes, then end the step; returns counts."""
        version = self.engine.version
        requests = [
            GenerateRequest(
                request_id=str(i), prompt_ids=list(p.prompt_ids),
                sampling=SamplingParams(**{**_fields(self.sampling), "seed": request_seed(self.run_seed, p)}),
            )
            for i, p in enumerate(prompts)
        ]
        tokens = groups = 0
        async with device_lock(self.locks, self.devices, self.owner):
            if self.collocated:
                with self.tracer.span("wake", step=step):
                    self.engine.wake()
            with self.tracer.span("generate", step=step, version=version, prompts=len(prompts)) as args:
                async for result in self.engine.generate(requests):
                    prompt = prompts[int(result.request_id)]
                    samples = to_rollout_samples(result, self.engine.tokenizer)
                    group = RolloutGroup.of(prompt, samples)
                    await out.aput(group, weight=group.num_sequences)
                    tokens += group.num_tokens
                    groups += 1
                args.update(tokens=tokens)
            if self.collocated:
                with self.tracer.span("sleep", step=step):
                    self.engine.sleep()
        out.end_step()
        return {"groups": groups, "tokens": tokens}

    async def update_weights(self, manifest: WeightManifest, verify: bool = False) -> dict[str, float]:
        """Load the published weights of `manifest.version` into the engine."""
        check_version(self.engine.version, manifest.version, self.owner)
        with self.tracer.span("weight_sync", version=manifest.version, bytes=manifest.num_bytes):
            buckets = await fetch_buckets(manifest, verify)
            self.engine.update_weights(flatten(buckets), manifest.version)
        return {"version": self.engine.version}

    def join_weight_group(self, addr: str, port: int, rank: int, world: int) -> None:
        """Join the weight-broadcast group as a receiver (checks the sender's layout against this model)."""
        from rlinf_pipe.models.convert import read_hf_arch
        from rlinf_pipe.runner.weight_broadcast import join_as_receiver

        self.weight_group = join_as_receiver(addr, port, rank, world, read_hf_arch(self.model_path), self.owner)

    def receive_weights(self, version: int, verify: bool = False) -> int:
        """Receive `version` from the broadcast group, bucket by bucket, into the engine."""
        check_version(self.engine.version, version, self.owner)
        with self.tracer.span("weight_sync", version=version):
            self.engine.update_weights(flatten(self.weight_group.receive(version, verify)), version)
        return version

    def version(self) -> int:
        return self.engine.version


    def close_channel(self, channel: Any) -> None:
        channel.close()


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {f: getattr(params, f) for f in params.__struct_fields__}
