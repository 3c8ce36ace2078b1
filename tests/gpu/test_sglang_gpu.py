"""The SGLang adapter on real sglang 0.5.23, inside an async Ray actor as the rollout worker runs it: generate,
sleep, a weight update over CUDA IPC (one GPU) and over an NCCL broadcast into sglang's own ranks (two GPUs),
verified by reading weights back by name, wake, generate again, decode; seeds that repeat under deterministic
inference; TP 2 on two GPUs. Skipped where sglang or Ray is not installed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.gpu import dry_run, gpu_count, needs_gpus

pytestmark = pytest.mark.gpu
if dry_run():
    pytest.skip("sglang needs a real GPU", allow_module_level=True)
pytest.importorskip("sglang")
ray = pytest.importorskip("ray")

PROMPTS = [[5, 17, 33], [40, 41, 42, 43, 44, 45, 46]]
DTYPE = torch.bfloat16
BUCKET_BYTES = 1 << 20


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """A small Llama (sglang reads Llama's weights back by name, not Qwen2's) with 64-wide heads (its kernels')."""
    from rlinf_pipe.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("models"), arch="llama", hidden_size=256, num_heads=4,
                                 num_kv_heads=2, intermediate_size=512))


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(address="local", num_gpus=gpu_count(), include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()


class SGLangHost:
    """An async actor holding one engine, the way `RolloutWorker` does."""

    def __init__(self, model_path: str, tp: int):
        from rlinf_pipe.engines.rollout.sglang_engine import SGLangEngine

        self.engine = SGLangEngine(model_path, tp_size=tp, mem_fraction_static=0.3, seed=7, deterministic=True,
                                   dtype="bfloat16")
        self.receiver: Any = None

    async def tokens(self, seed: int) -> tuple[list[list[int]], str]:
        from rlinf_pipe.engines.rollout import GenerateRequest, SamplingParams

        requests = [GenerateRequest(request_id=str(i), prompt_ids=p,
                                    sampling=SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=seed + i))
                    for i, p in enumerate(PROMPTS)]
        out = {r.request_id: r async for r in self.engine.generate(requests)}
        ids = [s.response_ids for i in range(len(PROMPTS)) for s in out[str(i)].samples]
        return ids, self.engine.tokenizer.decode(ids[0])

    async def sleep(self) -> None:
        await self.engine.sleep()

    async def wake(self) -> None:
        await self.engine.wake()

    async def open(self, transport: str, layout: Any, rendezvous: Any, rank: int) -> bool:
        self.receiver = await self.engine.open_weight_receiver(transport, layout, rendezvous, rank)
        return self.receiver is not None

    async def receive(self, version: int) -> Any:
        from rlinf_pipe.weights import WeightVersion

        async with self.engine.weight_update(version) as load:
            return await self.receiver.receive(WeightVersion(version), load, verify=False)

    async def verify(self, published: Any) -> str:
        return await self.engine.verify_weights(published)

    def version(self) -> int:
        return self.engine.version

    def gpu_ids(self) -> list[int]:
        return [int(i) for i in ray.get_gpu_ids()]


def _host(model_path: str, tp: int = 1) -> Any:
    return ray.remote(num_gpus=tp)(SGLangHost).remote(model_path, tp)


def _weights(model_path: str, arch: Any, scale: float) -> list[tuple[str, torch.Tensor]]:
    """The model's weights in the layout's (HF) order, perturbed by `scale`."""
    from transformers import AutoModelForCausalLM

    from rlinf_pipe.models.weight_map import hf_weight_names

    state = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPE).state_dict()
    g = torch.Generator().manual_seed(1)
    return [(n, (state[n] + scale * torch.randn(state[n].shape, generator=g).to(DTYPE)).contiguous())
            for n in hf_weight_names(arch)]


def _send(host: Any, transport: str, model_path: str, sender_gpu: int) -> None:
    """Open the transport between this process (the actor's part) and the engine; load perturbed weights (verified
    by name), then the original ones: generation must then repeat what it gave before."""
    from transformers import AutoConfig

    from rlinf_pipe.models.arch import hf_arch
    from rlinf_pipe.utils.net import free_port
    from rlinf_pipe.weights import plan_weight_layout
    from rlinf_pipe.weights.process_group import Rendezvous
    from rlinf_pipe.weights.transports import open_sender

    torch.cuda.set_device(sender_gpu)
    arch = hf_arch(AutoConfig.from_pretrained(model_path))
    layout = plan_weight_layout(arch, DTYPE, BUCKET_BYTES, trailer=transport != "broadcast")
    backend = "nccl" if transport == "broadcast" else "gloo"
    rendezvous = Rendezvous("127.0.0.1", free_port(), 2, backend, f"sglang-gpu-{transport}")
    opened = host.open.remote(transport, layout, rendezvous, 1)
    sender = open_sender(transport, layout, rendezvous)
    assert ray.get(opened)  # the engine's own receiver, not a generic one
    first, _ = ray.get(host.tokens.remote(seed=3))
    for version, scale in ((1, 0.3), (2, 0.0)):
        weights = [(n, t.to(f"cuda:{sender_gpu}")) for n, t in _weights(model_path, arch, scale)]
        loading = host.receive.remote(version)
        published = sender.publish(version, iter(weights), checksum=True)
        loaded = ray.get(loading)
        assert (loaded.version, loaded.num_bytes) == (version, published.num_bytes)
        assert ray.get(host.verify.remote(published)) == "name"  # sglang holds what was sent
        again, text = ray.get(host.tokens.remote(seed=3))
        assert (again != first) if scale else (again == first), f"version {version}"
        assert text
    assert ray.get(host.version.remote()) == 2


def test_sglang_cycle_in_an_async_actor_with_ipc_weights(model_path):
    host = _host(model_path)
    first, text = ray.get(host.tokens.remote(seed=3))
    assert ray.get(host.tokens.remote(seed=3))[0] == first and text  # seeds repeat (deterministic inference)
    ray.get(host.sleep.remote())
    ray.get(host.wake.remote())
    (gpu,) = ray.get(host.gpu_ids.remote())
    _send(host, "ipc", model_path, sender_gpu=gpu)  # same GPU: CUDA IPC


@needs_gpus(2)
def test_sglang_receives_an_nccl_broadcast_into_its_own_ranks(model_path):
    host = _host(model_path)
    (gpu,) = ray.get(host.gpu_ids.remote())
    _send(host, "broadcast", model_path, sender_gpu=1 - gpu if gpu < 2 else 0)


@needs_gpus(2)
def test_sglang_tensor_parallel_two_uses_both_gpus(model_path):
    free_before = [torch.cuda.mem_get_info(i)[0] for i in range(2)]
    host = _host(model_path, tp=2)
    ids, _ = ray.get(host.tokens.remote(seed=3))
    assert all(ids)
    taken = [free_before[i] - torch.cuda.mem_get_info(i)[0] for i in range(2)]
    assert all(t > 0.2 * torch.cuda.get_device_properties(i).total_memory for i, t in enumerate(taken)), taken
