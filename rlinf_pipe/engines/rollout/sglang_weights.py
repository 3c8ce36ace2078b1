"""How weight versions reach an `SGLangEngine`, behind the weights interface.

* `broadcast`: sglang's own TP ranks join the weight group (`init_weights_update_group`, at consecutive ranks) and
  receive each bucket as one flattened broadcast (`update_weights_from_distributed`, `load_format=
  "flattened_bucket"`): the bytes go from the actor's GPU straight into sglang's, never through this process. The
  layout then has no trailers (sglang receives exactly the tensors' bytes), so the version is checked by the driver.
* `ipc`: each bucket's handle (the actor's shared slot, a pickled flattened bucket with CUDA IPC handles) goes to
  sglang's scheduler as it is (`update_weights_from_tensor`) for an engine of one TP rank; with more, and on CPU
  (a stand-in of sglang, whose slot is shared memory), the slot is mapped here and passed on as tensors.
* anything else (the object store): the engine's weight session copies each bucket to the GPU and passes it on.

sglang's own ranks load the bytes where this process cannot see what they kept, so these receivers report
`verified_by=""` (over ipc on GPUs too, where this process may have read the slot);
with `runner.verify_weights` the driver then has the engine read a few tensors back by name (`verify_by_name`,
sglang's `get_weights_by_name`) and compare them with the fingerprint the actor recorded. sglang implements that
only for some model classes (Llama's, not Qwen2's); the driver says which engines it could not verify.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator
from typing import Any

import torch

from rlinf_pipe.engines.rollout.sglang_launch import GIB, MIB
from rlinf_pipe.planning.engine_sizes import PEER_CONTEXT_BYTES
from rlinf_pipe.weights import LoadBucket, LoadedWeights, WeightLayout, WeightReceiver, WeightSyncError, WeightVersion
from rlinf_pipe.weights.ipc import Handle, IpcReceiver, cuda_handle
from rlinf_pipe.weights.layout import BucketLayout
from rlinf_pipe.weights.process_group import Rendezvous
from rlinf_pipe.weights.record import FINGERPRINT_VALUES


def tensor_payloads(bucket: list[tuple[str, torch.Tensor]], ranks: int) -> tuple[list[bytes], torch.Tensor]:
    """A bucket as sglang's flattened-bucket payloads, one per TP rank, and the flat tensor they share (keep it
    alive until sglang has loaded it). On a GPU the bucket is copied into one device buffer that every rank maps by
    its IPC handle. Each rank gets a pickle of its own: torch counts the processes using a CUDA IPC handle per
    pickling, so ranks sharing one would let the buffer be freed while one of them still reads it (sglang 0.5.23
    asks for one payload per rank, `tp_worker.deserialize_own_rank`)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sizes = [t.numel() * t.element_size() for _, t in bucket]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    metadata, offset = [], 0
    for (name, tensor), nbytes in zip(bucket, sizes, strict=True):
        flat[offset : offset + nbytes].copy_(tensor.contiguous().view(-1).view(torch.uint8))
        metadata.append(types.SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                                              end_idx=offset + nbytes, numel=nbytes))
        offset += nbytes
    payload = {"flattened_tensor": flat, "metadata": metadata}
    return [cuda_handle(payload) for _ in range(ranks)], flat


def _first_values(nested: Any, count: int) -> list[float]:
    """The first `count` numbers of a nested list (sglang returns a parameter's leading rows)."""

    def walk(x: Any) -> Iterator[float]:
        if isinstance(x, (list, tuple)):
            for item in x:
                yield from walk(item)
        else:
            yield float(x)

    out: list[float] = []
    for value in walk(nested):
        out.append(value)
        if len(out) == count:
            break
    return out


async def verify_by_name(engine: Any, published: WeightVersion) -> str:
    """Read the fingerprint's tensors back from sglang and compare their first values with what the actor sent:
    "name" if they match, "" if sglang cannot read this model's weights by name; `WeightSyncError` on a mismatch."""
    if not published.fingerprint:
        raise WeightSyncError(f"weight sync of version {published.version}: the actor sent no fingerprint to verify "
                              "against (runner.verify_weights makes it record one)")
    for name, sent in published.fingerprint:
        got = await engine.tm.get_weights_by_name(
            engine.requests.GetWeightsByNameReqInput(name=name, truncate_size=FINGERPRINT_VALUES), None)
        if got is None:
            return ""
        values = _first_values(got, len(sent))
        if values != list(sent):
            raise WeightSyncError(f"weight sync of version {published.version}: sglang's {name!r} starts with "
                                  f"{values}, the actor sent {list(sent)}")
    return "name"


# sglang 0.5.23's reply when a bucket's broadcast arrived but its model could not load it (model_runner_components/
# weight_updater.py, `load_weights_from_distributed`); a failed receive says "Failed to receive weights".
LOADED_BUT_FAILED = "Failed to update parameter online"


class SGLangGroupError(WeightSyncError):
    """sglang refused a bucket of the weight group where it may not have taken its broadcast."""


class SGLangGroupReceiver(WeightReceiver):
    """sglang's TP ranks as members of the broadcast group (see the module docstring)."""

    transport = "broadcast"

    def __init__(self, engine: Any, layout: WeightLayout, group_name: str):
        self.engine, self.layout, self.group_name = engine, layout, group_name

    async def receive(self, published: WeightVersion, load_bucket: LoadBucket, verify: bool = False) -> LoadedWeights:
        """One `update_weights_from_distributed` per bucket. A bucket sglang received but failed to load (its model's
        `load_weights` raised: `LOADED_BUT_FAILED`) does not stop the version: the sender broadcasts every bucket,
        so the rest are taken in before `WeightSyncError` names the failures (as every receiver does). Any other
        refusal may have come before sglang joined the bucket's broadcast (no session, a failed receive): the
        group is out of step, and it raises at once."""
        layout, requests = self.layout, self.engine.requests
        failed: list[str] = []
        for index, bucket in enumerate(layout.buckets):
            request = requests.UpdateWeightsFromDistributedReqInput(
                names=[s.name for s in bucket.slots], dtypes=[layout.dtype] * len(bucket.slots),
                shapes=[list(s.shape) for s in bucket.slots], group_name=self.group_name, flush_cache=False,
                load_format="flattened_bucket")
            ok, message = (await self.engine.call("update_weights_from_distributed", request, check=False))[:2]
            if ok:
                continue
            if not str(message).startswith(LOADED_BUT_FAILED):
                raise SGLangGroupError(f"weight sync of version {published.version}: sglang refused bucket {index} "
                                       f"({message}); its ranks are out of step with the weight group")
            failed.append(f"bucket {index}: {message}")
        if failed:
            raise WeightSyncError(f"weight sync of version {published.version}: sglang could not load "
                                  + "; ".join(failed))
        return LoadedWeights(published.version, layout.num_bytes, layout.num_tensors, len(layout.buckets))


class SGLangIpcReceiver(IpcReceiver):
    """The engine's worker in the IPC control group: CUDA handles go to sglang's scheduler unopened when the engine
    has one TP rank; with more (or shared memory) this process maps each bucket and passes it on (`load_handle`)."""

    def __init__(self, rendezvous: Rendezvous, rank: int, layout: WeightLayout, engine: Any):
        super().__init__(rendezvous, rank, layout)
        self.engine = engine
        self.cuda_handles = False

    async def load_handle(self, index: int, bucket: BucketLayout, handle: Handle, load_bucket: LoadBucket,
                          verify: bool) -> tuple[str | None, int | None]:
        self.cuda_handles = self.cuda_handles or handle.cuda  # (sglang loads them: verified by name, if at all)
        if not handle.cuda or self.engine.tp_size > 1:
            # Shared memory (CPU), or TP ranks on several GPUs: map the slot here (the engine's GPUs are this
            # process's) and pass the tensors on through the engine's session, whose buffers torch keeps until
            # every rank has freed its mapping. sglang 0.5.23 answers after a barrier of its ranks, but a rank frees
            # its mapping, which waits for its copies, only after that barrier: when the actor rewrites the slot
            # two buckets later, a rank copying across GPUs could still be reading it.
            return await super().load_handle(index, bucket, handle, load_bucket, verify)
        # (One rank, on the slot's GPU: it synchronises its stream when it frees the mapping, before it answers.
        # The actor's slots live until its sender closes, so the pickle's use count frees nothing early.)
        await self.engine.load_payload([handle.data])
        return None, None

    async def receive(self, published: WeightVersion, load_bucket: LoadBucket, verify: bool = False) -> LoadedWeights:
        loaded = await super().receive(published, load_bucket, verify)
        if self.cuda_handles:  # sglang's ranks hold the bytes: what they kept was not verified here
            return dataclasses.replace(loaded, checksums=(), verified_by="")
        return loaded


MAPPED_ON_FIRST_GPU = ("ipc", "object_store")  # transports whose buckets the engine's ranks map on its first GPU


def peer_context_error(tp_size: int, transport: str, bucket_bytes: int, free_bytes: int) -> str:
    """Why the engine's first GPU cannot take the CUDA contexts of its other TP ranks and a bucket's copy (each rank
    maps the buckets there with `ipc` and the object store), with the fix; "" when it can or they do not apply."""
    if tp_size < 2 or transport not in MAPPED_ON_FIRST_GPU:
        return ""
    need = (tp_size - 1) * PEER_CONTEXT_BYTES + bucket_bytes
    if free_bytes >= need:
        return ""
    return (f"SGLang engine of rollout.tensor_parallel_size {tp_size} over runner.weight_sync={transport}: its "
            f"{tp_size - 1} other TP ranks map every bucket on its first GPU and each opens a CUDA context there "
            f"({tp_size - 1} x {PEER_CONTEXT_BYTES / GIB:.1f} GiB) beside a {bucket_bytes / MIB:.0f} MiB bucket, "
            f"{need / GIB:.2f} GiB, but only {free_bytes / GIB:.2f} GiB is free there beside its KV cache; use "
            "runner.weight_sync=broadcast (each rank receives on its own GPU), or lower rollout.gpu_memory_fraction "
            f"by at least {(need - free_bytes) / GIB:.2f} GiB of the GPU's memory (`rlinf-pipe plan` shows it)")


def free_gpu_bytes() -> int | None:
    """Free memory of this process's first GPU, the engine's (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info(0)[0])


def check_peer_contexts(engine: Any, transport: str, layout: WeightLayout) -> None:
    """Before the weight transport opens: refuse (`SGLangError`) when the engine's first GPU has no room for its other
    ranks' CUDA contexts (`peer_context_error`)."""
    from rlinf_pipe.engines.rollout.sglang_errors import SGLangError

    free = free_gpu_bytes()
    if free is not None and (problem := peer_context_error(engine.tp_size, transport, layout.max_bucket_bytes, free)):
        raise SGLangError(problem)


async def open_native_receiver(engine: Any, transport: str, layout: WeightLayout, rendezvous: Rendezvous | None,
                               rank: int) -> WeightReceiver | None:
    """The engine's receiver for `transport` (joining its group at `rank`), or None for the object store; first
    `check_peer_contexts`."""
    import asyncio

    check_peer_contexts(engine, transport, layout)

    if transport == "broadcast":
        if rendezvous is None:
            raise ValueError("the broadcast transport needs a rendezvous")
        if layout.has_trailer:
            raise WeightSyncError("an SGLang engine receives buckets without trailers: the actor's weight layout must "
                                  "be planned without them (the runner does so when SGLang engines are in the group)")
        await engine.call("init_weights_update_group", engine.requests.InitWeightsUpdateGroupReqInput(
            master_address=rendezvous.addr, master_port=rendezvous.port, rank_offset=rank,
            world_size=rendezvous.world, group_name=rendezvous.group_name, backend=rendezvous.backend))
        return SGLangGroupReceiver(engine, layout, rendezvous.group_name)
    if transport == "ipc":
        if rendezvous is None:
            raise ValueError("the ipc transport needs a rendezvous")
        return await asyncio.to_thread(SGLangIpcReceiver, rendezvous, rank, layout, engine)
    return None
