"""The sizes the memory estimate counts, from a model's shape alone (`HfArch`: no weights): parameters per rank of a
TP x PP split, the bytes a layer saves for its backward per token (with sequence and context parallelism), a
forward pass's working set, the KV cache (see `planning.memory` for how they add up per GPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from rlinf_pipe.planning.engine_sizes import CHUNK_BYTES

if TYPE_CHECKING:
    from rlinf_pipe.models.arch import HfArch

Recompute = Literal["none", "selective", "full"]


def layer_params(arch: HfArch) -> int:
    """Parameters of one transformer layer (attention with its biases and q/k norms, the gated MLP, two norms)."""
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if arch.qkv_bias else 0) + (2 * hd if arch.qk_norm else 0)
    return attention + 3 * h * arch.intermediate_size + 2 * h


def num_params(arch: HfArch) -> int:
    """Parameters of the whole model (a tied output layer counted once)."""
    embedding = arch.vocab_size * arch.hidden_size
    untied_head = 0 if arch.tie_word_embeddings else embedding
    return embedding + arch.num_layers * layer_params(arch) + arch.hidden_size + untied_head


def params_per_rank(arch: HfArch, tp: int, pp: int) -> int:
    """Parameters of the heaviest rank of a TP x PP split: its layers, and the embedding and / or output layer of
    the first / last stage (a tied output layer is a copy on the last stage when PP > 1)."""
    layers = -(-arch.num_layers // pp) * layer_params(arch) // tp
    embedding = arch.vocab_size * arch.hidden_size // tp
    output = embedding if (pp > 1 or not arch.tie_word_embeddings) else 0
    ends = embedding + output if pp == 1 else max(embedding, output + arch.hidden_size)
    return layers + ends


def layer_activations(shape: HfArch, tp: int, sequence_parallel: bool = False) -> float:
    """Bytes per token that one layer of the local layer spec saves for its backward on one of `tp` ranks (bf16,
    attention scores not included), as counted by `benchmarks/activation_bytes.py`: its two
    norms' inputs (fused norms: input and one statistic); the QKV projection's input and output, the rotated queries
    and keys, the output projection's input; the MLP's input, the fused gate / up output and the gated unit's three
    intermediate tensors (the down projection's input among them). Korthikanti et al.'s 34 x hidden assumes a 4x MLP
    and full multi-head attention; a Qwen2 model's gated MLP alone keeps about 58 x hidden. With sequence parallelism
    the tensors TP alone replicates on every rank (the norms' and the projections' inputs: each rank keeps its slice
    of the sequence and gathers the rest again in the backward pass) are divided by TP too."""
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    sp = tp if sequence_parallel else 1
    norms = 2 * 2 * h / sp
    attention = 2 * h / sp + 2 * (q + 2 * kv) / tp + 2 * (q + kv) / tp + 2 * q / tp
    mlp = 2 * h / sp + 2 * 5 * shape.intermediate_size / tp
    return norms + attention + mlp


def training_activations(shape: HfArch, tokens: int, seq_len: int, tp: int, pp: int,
                         recompute: Recompute, sequence_parallel: bool = False, cp: int = 1) -> float:
    """Bytes one micro-batch of `tokens` (rows of up to `seq_len`) keeps for backward on one rank (bf16). With
    context parallelism each rank holds 1/CP of every sequence, its queries' scores still span the whole sequence,
    and it keeps the other ranks' keys and values, gathered for its attention."""
    h, layers = shape.hidden_size, -(-shape.num_layers // pp)
    local = tokens / cp
    layer = layer_activations(shape, tp, sequence_parallel)
    attention_scores = 5 * shape.num_heads * seq_len / tp  # per local token: scores + softmax over every key
    gathered = tokens * (cp - 1) / cp * 2 * 2 * shape.num_kv_heads * shape.head_dim / tp  # (bf16 K and V)
    per_layer = {
        "none": local * (layer + attention_scores) + gathered,
        "selective": local * layer + gathered,  # the scores are recomputed
        "full": local * h * 2 / (tp if sequence_parallel else 1),  # the layer input only; the rest is recomputed
    }[recompute]
    recomputing = local * layer + gathered if recompute == "full" else 0.0
    logits = 2 * local * shape.vocab_size / tp * 2 + 3 * CHUNK_BYTES  # bf16 logits + their gradient
    return layers * per_layer + recomputing + logits


def forward_activations(shape: HfArch, tokens: int, tp: int, cp: int = 1) -> float:
    """Bytes of a forward-only pass over `tokens` (the micro-batch's whole budget) on one rank: one layer's working
    set, the logits and the log-prob chunks. With context parallelism the rank runs 1/CP of every sequence and holds
    the whole sequences' keys and values of the layer it runs (gathered from the other CP ranks). Sequence
    parallelism keeps the same peak: each projection gathers the whole sequence again."""
    local = tokens / cp
    layer = local * shape.hidden_size * 16 / tp + local * shape.intermediate_size * 2 * 3 / tp
    gathered = tokens * (cp - 1) / cp * 2 * 2 * shape.num_kv_heads * shape.head_dim / tp  # (bf16 K and V)
    return layer + gathered + local * shape.vocab_size / tp * 2 + 2 * CHUNK_BYTES


def kv_cache_bytes(shape: HfArch, sequences: int, seq_len: int, tp: int, dtype_bytes: int = 2) -> float:
    """Keys and values of `sequences` sequences of `seq_len` tokens, on one of `tp` ranks (which holds at least one
    KV head: with more ranks than KV heads they are replicated)."""
    per_token = 2 * shape.num_layers * max(shape.num_kv_heads / tp, 1) * shape.head_dim * dtype_bytes
    return sequences * seq_len * per_token
