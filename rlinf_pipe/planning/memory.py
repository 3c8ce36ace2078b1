"""A per-GPU memory estimate of every component, from the config, the placement and the model's `config.json`
(no weights, no GPU): what `rlinf-pipe plan` shows and what a run checks before it launches.

The model of the estimate (docs/memory.md walks through it):

* **weights**: the parameters a rank holds (its pipeline stage's layers, split by tensor parallelism; the first stage
  holds the embedding, the last the output layer), in the parameter dtype (bf16 on GPUs);
* **grads**: Megatron's fp32 gradient buffer (`grad_reduce_in_fp32`), 4 bytes per parameter of the rank;
* **optimizer**: Adam's two fp32 moments and, with bf16 parameters, fp32 master weights, divided over the data-
  parallel replicas by the distributed optimizer (on whenever DP > 1);
* **activations** (and working memory): what one training micro-batch keeps for its backward pass at its token
  budget (`model_sizes.layer_activations`: every tensor a layer saves, in bf16 without sequence parallelism, counted
  from the model's real widths: grouped K/V heads and the gated MLP's `intermediate_size`, plus the attention scores
  that the local layer spec materialises), reduced by `actor.recompute`; the micro-batch's bf16 logits and their gradient,
  and the log-prob code's float32 chunks (`engines.policy.logprobs.CHUNK_BYTES` each); 2.5 GiB per process on the
  GPU for what it holds outside the allocator's blocks (CUDA context, NCCL and library workspaces). Checked against
  a measured step on an H200 (docs/memory.md). The log-prob workers: one layer's forward working set at
  `inference.max_tokens_per_batch`, the logits and the chunks (`model_sizes.forward_activations`); with context
  parallelism, as the actor's, 1/CP of the tokens a rank plus the keys and values gathered from the other CP ranks;
* **kv_cache**: SGLang's static share (`rollout.gpu_memory_fraction` of the memory free when it starts: the
  capacity less what the set's other processes hold, as sglang 0.5.23 measures it) less its weights; the torch
  engine's cache for `max_running_requests` sequences at full length;
* **resident**: what stays on the GPU while this component runs, whatever it is doing: the log-prob workers' models
  on a set they share with the engines (they stay loaded; the engines release theirs while they sleep); with the
  `ipc` weight transport, its two bucket slots on the actor's GPUs (each the size of the largest bucket: the
  embedding or output layer when it is larger than `runner.weight_bucket_mb`), kept through every phase; and for
  an actor whose GPUs SGLang engines share, with a group transport, the engines' weights, which SGLang takes back
  onto the GPU to load a version while the actor still holds its state there (the version moves at the end of the
  actor's phase); for an SGLang engine of TP > 1 fed over `ipc` or the object store, the CUDA contexts its other
  ranks open on its first GPU to map the buckets there (`PEER_CONTEXT_BYTES` each, after it sized its KV cache:
  beyond the share, refused with the fix when the GPU cannot hold them; the worker checks the GPU's free memory
  again before the transport opens).

Components that share a GPU set take turns on it, so each is checked on its own (the other's state is offloaded, or
released by the engine, meanwhile; each other process on the set still holds its CUDA context); an actor that
computes the log-probs (no inference workers) also holds the reference model. Inference workers placed for an
algorithm with no log-prob pass are not started, so they have no estimate and hold no share of their GPUs. An
SGLang engine whose share cannot hold its weights does not fit whatever the total (sglang refuses to start).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlinf_pipe.algorithms.logprob_needs import needs_ref
from rlinf_pipe.config.schema import Config
from rlinf_pipe.config.validate import token_budget
from rlinf_pipe.planning.engine_sizes import PEER_CONTEXT_BYTES, TORCH_MAX_RUNNING, memory_fraction
from rlinf_pipe.models.arch import SGLANG_SPARE_TOKENS
from rlinf_pipe.planning.model_sizes import (
    forward_activations,
    kv_cache_bytes,
    params_per_rank,
    training_activations,
)
from rlinf_pipe.planning.placement import ComponentPlacement
from rlinf_pipe.planning.run_plan import RunPlan

if TYPE_CHECKING:
    from rlinf_pipe.models.arch import HfArch

GIB = 1 << 30
DEFAULT_CAPACITY_GB = 80.0
PROCESS_OVERHEAD = 5 * GIB // 2  # measured 2.28 GiB beyond the allocator in a trainer process (H200, docs/memory.md)
KINDS = ("weights", "grads", "optimizer", "activations", "kv_cache", "resident")
@dataclass(frozen=True)
class ComponentMemory:
    """The estimated peak bytes on one GPU of a component, and the capacity it is checked against."""

    component: str
    per_gpu_bytes: dict[str, int]
    capacity_bytes: int
    problem: str = ""  # why it cannot run whatever the total ("" when it can)
    fix: str = ""  # a setting that makes it fit, where the estimate found one

    @property
    def total(self) -> int:
        return sum(self.per_gpu_bytes.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity_bytes and not self.problem

    def to_json(self) -> dict[str, Any]:
        return {"per_gpu_bytes": {**self.per_gpu_bytes, "total": self.total}, "capacity_bytes": self.capacity_bytes,
                "fits": self.fits, **({"problem": self.problem} if self.problem else {}),
                **({"fix": self.fix} if self.fix else {})}


def _bytes(kinds: dict[str, float], processes: int) -> dict[str, int]:
    out = {kind: int(kinds.get(kind, 0)) for kind in KINDS}
    out["activations"] += processes * PROCESS_OVERHEAD
    return out


def ipc_slot_bytes(cfg: Config, shape: HfArch, dtype_bytes: int) -> int:
    """Bytes of the `ipc` transport's bucket slots on a sending actor GPU: two (one if the version is one bucket),
    each the size of the largest bucket of `runner.weight_bucket_mb` in the actor's dtype."""
    import torch

    from rlinf_pipe.weights.layout import plan_weight_layout

    dtype = torch.float32 if dtype_bytes == 4 else torch.bfloat16
    layout = plan_weight_layout(shape, dtype, cfg.runner.weight_bucket_mb << 20, trailer=False)
    return min(2, len(layout.buckets)) * layout.max_bucket_bytes


def estimate_memory(cfg: Config, plan: RunPlan, shape: HfArch, capacity_bytes: int,
                    checkpoint_dtype_bytes: int = 2) -> dict[str, ComponentMemory]:
    """The estimate of every GPU component the run `plan` starts (see the module docstring).
    `checkpoint_dtype_bytes`: bytes a value of the model folder's weights (SGLang loads them as they are; the torch
    engine in bf16)."""
    placement, weight_transport = plan.placement, plan.weight_transport
    seq_len = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    dtype_bytes = 4 if cfg.actor.params_dtype == "float32" else 2  # auto: bf16 on GPUs
    started = {name for name in placement.components if name != "inference" or plan.inference_workers}
    sharing = {name: len(started.intersection(gpu_set.components))
               for gpu_set in placement.gpu_sets() for name in gpu_set.components}
    resident = {}
    if plan.inference_shares_rollout:  # (their models stay on the GPUs)
        resident["rollout"] = _inference(cfg, placement.components["inference"], shape, dtype_bytes)["weights"]
    with_ref = plan.actor_logprobs and needs_ref(cfg)  # (the actor holds the reference model too)
    time_shared = "rollout" in plan.turns  # (the engines take turns: they sleep between generations)
    sglang = cfg.rollout.backend == "sglang"
    engine_bytes = checkpoint_dtype_bytes if sglang else 2
    actor_gpus = set(placement.components["actor"].gpus) if "actor" in placement.components else set()
    slots = ipc_slot_bytes(cfg, shape, dtype_bytes) if weight_transport == "ipc" else 0
    out: dict[str, ComponentMemory] = {}
    for name, comp in placement.components.items():
        if not comp.gpus or name not in started or name not in ("actor", "inference", "rollout"):
            continue
        context = sharing[name] * PROCESS_OVERHEAD  # every process on the set holds its CUDA context
        others = resident.get(name, 0.0)
        later = slots if actor_gpus & set(comp.gpus) else 0  # (made after the engines sized their caches)
        peers = 0
        if name == "actor" and sglang and plan.engines_share_actor and weight_transport in ("ipc", "broadcast"):
            later += params_per_rank(shape, cfg.rollout.tensor_parallel_size, 1) * engine_bytes
        problem, fix = "", ""
        if name == "actor":
            kinds = _actor(cfg, comp, shape, seq_len, dtype_bytes, with_ref)
            fix = _context_parallel_fix(cfg, comp, shape, seq_len, dtype_bytes, with_ref,
                                        capacity_bytes - context - others - later, kinds)
        elif name == "inference":
            kinds = _inference(cfg, comp, shape, dtype_bytes)
        else:
            kinds, problem = _rollout(cfg, shape, seq_len, capacity_bytes - others - context, engine_bytes,
                                      time_shared, plan.inference_shares_rollout)
            peers = peer_contexts(cfg, weight_transport)
            later += peers
        memory = ComponentMemory(name, _bytes({**kinds, "resident": others + later}, sharing[name]), capacity_bytes,
                                 problem, fix)
        if name == "rollout" and peers and not problem and not memory.fits:
            memory = ComponentMemory(memory.component, memory.per_gpu_bytes, capacity_bytes,
                                     _peer_problem(cfg, weight_transport, peers, capacity_bytes - others - context,
                                                   time_shared))
        out[name] = memory
    return out


def _context_parallel_fix(cfg: Config, comp: ComponentPlacement, shape: HfArch, seq_len: int, dtype_bytes: int,
                          with_ref: bool, room: float, kinds: dict[str, float]) -> str:
    """Where the actor's activations are what does not fit into `room`: the smallest larger context-parallel size
    its GPUs divide into that fits (each rank then holds a slice of every sequence), or ""."""
    if sum(kinds.values()) <= room or max(kinds, key=kinds.__getitem__) != "activations":
        return ""
    for cp in (2, 4, 8, 16, 32, 64):
        if cp <= comp.cp or len(comp.gpus) % (comp.tp * comp.pp * cp):
            continue
        trial = _actor(cfg, comp, shape, seq_len, dtype_bytes, with_ref, cp)
        if sum(trial.values()) <= room:
            return (f"actor.context_parallel_size: {cp} fits {seq_len}-token samples (activations "
                    f"{trial['activations'] / GIB:.1f} GiB per GPU)")
    return ""


def peer_contexts(cfg: Config, weight_transport: str) -> int:
    """Bytes of the CUDA contexts an SGLang engine's other TP ranks open on its first GPU, where every bucket lies
    when weights come over `ipc` or the object store (0 otherwise)."""
    tp = cfg.rollout.tensor_parallel_size
    if cfg.rollout.backend != "sglang" or tp < 2 or weight_transport not in ("ipc", "object_store"):
        return 0
    return (tp - 1) * PEER_CONTEXT_BYTES


def _peer_problem(cfg: Config, transport: str, peers: int, free_at_start: float, time_shared: bool) -> str:
    """What to change when the engine's first GPU cannot hold its other ranks' contexts beside SGLang's share."""
    tp = cfg.rollout.tensor_parallel_size
    fraction = memory_fraction(cfg.rollout, time_shared)
    fitting = max(0.0, (free_at_start - peers) / free_at_start)
    return (f"SGLang engines of rollout.tensor_parallel_size {tp} over runner.weight_sync={transport}: the {tp - 1} "
            f"other TP ranks map every bucket on the engine's first GPU and each opens a CUDA context there "
            f"({peers / GIB:.1f} GiB in all), which SGLang's share (rollout.gpu_memory_fraction {fraction:g} of the "
            f"free memory) leaves no room for; use runner.weight_sync=broadcast (each rank receives on its own GPU) "
            f"or rollout.gpu_memory_fraction <= {int(fitting * 100) / 100:.2f}")


def _actor(cfg: Config, comp: ComponentPlacement, shape: HfArch, seq_len: int, dtype_bytes: int,
           with_ref: bool, cp: int | None = None) -> dict[str, float]:
    cp = comp.cp if cp is None else cp
    dp = len(comp.gpus) // (comp.tp * comp.pp * cp) if comp.gpus else comp.dp
    params = params_per_rank(shape, comp.tp, comp.pp)
    distributed_optimizer = dp > 1
    master = 4 if dtype_bytes < 4 else 0
    rows = max(cfg.actor.max_micro_batch_size or 0, cfg.actor.micro_batch_size)  # (it grows to max when behind)
    tokens = token_budget(cfg.actor) or rows * seq_len
    return {
        "weights": params * dtype_bytes * (2 if with_ref else 1),
        "grads": params * 4,
        "optimizer": params * (8 + master) / (dp * cp if distributed_optimizer else 1),  # (sharded over DP x CP)
        "activations": training_activations(shape, tokens, min(seq_len, tokens), comp.tp, comp.pp,
                                            cfg.actor.recompute, cfg.actor.sequence_parallel, cp),
    }


def _inference(cfg: Config, comp: ComponentPlacement, shape: HfArch, dtype_bytes: int) -> dict[str, float]:
    params = params_per_rank(shape, comp.tp, comp.pp)
    copies = 2 if needs_ref(cfg) else 1
    return {
        "weights": params * dtype_bytes * copies,
        "activations": forward_activations(shape, cfg.inference.max_tokens_per_batch, comp.tp, comp.cp),
    }


def _rollout(cfg: Config, shape: HfArch, seq_len: int, free_at_start: float, dtype_bytes: int, time_shared: bool,
             inference_shares: bool) -> tuple[dict[str, float], str]:
    """The engine's bytes by kind, and what stops it whatever the total ("" if nothing). `free_at_start`: the GPU
    memory free when the engine starts (capacity less what the set's processes hold); `time_shared`: the engines
    take turns on their GPUs (SGLang's smaller default share); `inference_shares`: the log-prob workers' models are
    among what they hold."""
    sglang = cfg.rollout.backend == "sglang"
    tp = cfg.rollout.tensor_parallel_size if sglang else 1  # (the torch engine holds the whole model on one GPU)
    weights = params_per_rank(shape, tp, 1) * dtype_bytes
    if sglang:
        fraction = memory_fraction(cfg.rollout, time_shared)
        share = fraction * free_at_start  # sglang 0.5.23: its KV cache is what this share leaves after the weights
        if share <= weights:
            held = " and the log-prob workers' models" if inference_shares else ""
            return {"weights": weights}, (
                f"SGLang's share, rollout.gpu_memory_fraction {fraction:g} of the {free_at_start / GIB:.1f} GiB free "
                f"when it starts (the capacity less the CUDA contexts{held} on its GPUs) = {share / GIB:.1f} GiB, "
                f"does not hold its weights ({weights / GIB:.1f} GiB): no room for a KV cache, sglang refuses to "
                "start; raise rollout.gpu_memory_fraction or rollout.tensor_parallel_size"
                + (", or inference.tensor_parallel_size" if held else ""))
        kv = share - weights
        tokens = int(kv / kv_cache_bytes(shape, 1, 1, tp, dtype_bytes))
        if tokens < seq_len + SGLANG_SPARE_TOKENS:
            return {"weights": weights, "kv_cache": kv}, (
                f"SGLang's KV cache ({kv / GIB:.2f} GiB a GPU) holds {tokens} tokens, fewer than one sample's "
                f"data.max_prompt_length + rollout.max_new_tokens = {seq_len} (+ {SGLANG_SPARE_TOKENS} sglang keeps "
                "spare): sglang would cut responses short to fit without a word; raise rollout.gpu_memory_fraction "
                "or rollout.tensor_parallel_size, or lower rollout.max_new_tokens")
        return {"weights": weights, "kv_cache": kv}, ""
    sequences = cfg.rollout.max_running_requests or TORCH_MAX_RUNNING
    return {"weights": weights, "kv_cache": kv_cache_bytes(shape, sequences, seq_len, tp, dtype_bytes),
            "activations": forward_activations(shape, sequences, tp)}, ""


def advice(memory: ComponentMemory) -> str:
    """One line naming the largest part and the keys that shrink it (or what stops it whatever the total)."""
    if memory.problem:
        return f"{memory.component}: {memory.problem}"
    parts = memory.per_gpu_bytes
    largest = max(parts, key=parts.__getitem__)
    keys = {
        "activations": {
            "actor": "actor.micro_batch_tokens (or actor.micro_batch_size and max_micro_batch_size), actor.recompute: "
                     "selective or full, actor.tensor_parallel_size with actor.sequence_parallel, "
                     "actor.context_parallel_size",
            "inference": "inference.max_tokens_per_batch, inference.tensor_parallel_size or "
                         "inference.context_parallel_size",
            "rollout": "rollout.max_running_requests",
        }.get(memory.component, ""),
        "weights": f"{memory.component}.tensor_parallel_size or pipeline_parallel_size",
        "grads": "actor.tensor_parallel_size or actor.pipeline_parallel_size",
        "optimizer": "more actor GPUs (data-parallel replicas shard the optimizer state)",
        "kv_cache": "rollout.gpu_memory_fraction" if memory.component == "rollout" else "",
        "resident": "inference.tensor_parallel_size (the log-prob workers' models stay on the engines' GPUs)",
    }[largest]
    return (f"{memory.component}: about {memory.total / GIB:.1f} GiB per GPU of {memory.capacity_bytes / GIB:.1f} GiB "
            f"({largest} {parts[largest] / GIB:.1f} GiB); lower it with {keys}"
            + (f"; {memory.fix}" if memory.fix else ""))


@dataclass(frozen=True)
class MemoryReport:
    """The estimate of a run (`components` empty when the model's architecture could not be read: `note` says
    why), the model it was made for and the capacity each GPU is checked against."""

    components: dict[str, ComponentMemory]
    model: str
    capacity_bytes: int
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {name: m.to_json() for name, m in self.components.items()}

    def warnings(self) -> list[str]:
        """One line per component that does not fit, naming the keys that shrink it."""
        return [advice(m) for m in self.components.values() if not m.fits]


def gpu_capacity_bytes(cfg: Config) -> int:
    """`cluster.gpu_memory_gb`, else the memory of this machine's GPU, else 80 GB."""
    if cfg.cluster.gpu_memory_gb is not None:
        return int(cfg.cluster.gpu_memory_gb * 1e9)
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return int(DEFAULT_CAPACITY_GB * 1e9)


def dtype_bytes_of(hf_config: Any) -> int:
    """Bytes a value of the weights the HF config says its folder holds (`dtype`, formerly `torch_dtype`): 4 for
    float32, else 2 (bf16 and fp16, and when it says nothing)."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return 4 if str(dtype).removeprefix("torch.") == "float32" else 2


def memory_report(cfg: Config, plan: RunPlan) -> MemoryReport:
    """The per-GPU estimate of the components the run `plan` starts (see the module docstring)."""
    from rlinf_pipe.models.arch import hf_arch, model_config

    capacity = gpu_capacity_bytes(cfg)
    config, source = model_config(cfg.actor.model_path)
    if config is None:
        return MemoryReport({}, cfg.actor.model_path, capacity, note=source)
    return MemoryReport(estimate_memory(cfg, plan, hf_arch(config), capacity, dtype_bytes_of(config)), source,
                        capacity)
