"""The sizes the engines work with that the memory estimate counts too, kept once here so that the estimate reads
them without importing an engine (the planning package imports none)."""

from __future__ import annotations

from rlinf_pipe.config.schema import RolloutConfig

TORCH_MAX_RUNNING = 64  # the torch engine's sequences in flight without `rollout.max_running_requests`
SGLANG_MEMORY_FRACTION = 0.85  # of a GPU of its own
SGLANG_COLLOCATED_MEMORY_FRACTION = 0.5  # the actor comes back onto the same GPU
CHUNK_BYTES = 1 << 28  # float32 working memory of one chunk of positions of the log-prob code (256 MiB)

PEER_CONTEXT_BYTES = 1 << 29
"""What a process's CUDA context takes on a GPU (about half a GiB). With TP > 1 and weights over `ipc` or the object
store, every bucket lies on the engine's first GPU and each of sglang's other ranks maps it from there, opening a
context on that GPU: `(tp - 1)` of these beside a KV cache sglang sized before they existed."""


def memory_fraction(rollout: RolloutConfig, collocated: bool) -> float:
    """`rollout.gpu_memory_fraction`, or its default for the mode."""
    if rollout.gpu_memory_fraction is not None:
        return rollout.gpu_memory_fraction
    return SGLANG_COLLOCATED_MEMORY_FRACTION if collocated else SGLANG_MEMORY_FRACTION
