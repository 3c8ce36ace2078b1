"""What a model's `config.json` says about its architecture, and the parallel sizes it can take: without torch, so
that `rlinf-pipe plan` and a run's checks before Ray starts refuse a model or a split in one line.

Supported families (`FAMILIES`): Llama (Llama 2, Llama 3.x with `llama3` rotary scaling, SmolLM2), Qwen2 / Qwen2.5
(q/k/v biases; the DeepSeek-R1 distills), Qwen3 dense (per-head q/k RMSNorm, an explicit `head_dim`). `hf_arch`
refuses everything else with the reason; `parallel_size_problems` states each rule a split breaks, as Megatron and
SGLang would refuse it once started.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlinf_pipe.errors import RlinfPipeError
from rlinf_pipe.models.hf_config import MODEL_TYPES, ROPE_KEYS, Llama3Scaling, light_hf_config, load_hf_config, \
    read_json, rope_of

FAMILIES = "Llama (2, 3.x, SmolLM2), Qwen2 / Qwen2.5 (and their distills), Qwen3 dense"
"""The supported families in words (errors name them)."""


class UnsupportedModelError(RlinfPipeError, ValueError):
    """The HF config describes an architecture or feature the Megatron builder does not support, or a parallel size
    the model cannot be split by."""


@dataclass(frozen=True)
class HfArch:
    """What the Megatron builder, the weight converter and the memory estimate need to know about an HF model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head, before the rotary embedding
    rope_scaling: Llama3Scaling | None = None  # Llama 3.x's frequency-dependent rotary scaling


def _rope(hf_config: Any) -> tuple[float, Llama3Scaling | None]:
    rope = rope_of({key: getattr(hf_config, key, None) for key in ROPE_KEYS}
                   | {"max_position_embeddings": getattr(hf_config, "max_position_embeddings", None)})
    if rope.kind not in ("default", "llama3"):
        raise UnsupportedModelError(
            f"RoPE scaling {rope.kind!r} is not supported (only the default RoPE and Llama 3's `llama3`)")
    if rope.kind == "llama3" and rope.llama3 is None:
        raise UnsupportedModelError("RoPE scaling `llama3` needs factor, low_freq_factor, high_freq_factor and "
                                    "original_max_position_embeddings (or max_position_embeddings)")
    if rope.partial_factor != 1.0:
        raise UnsupportedModelError(
            f"partial_rotary_factor {rope.partial_factor} is not supported (only RoPE over whole heads)")
    if rope.theta is None:
        raise UnsupportedModelError("the HF config has no rope_theta")
    return rope.theta, rope.llama3


def _check_features(hf_config: Any, model_type: str) -> None:
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf_config.hidden_act!r} is not supported (only silu)")
    if model_type in ("qwen2", "qwen3") and getattr(hf_config, "use_sliding_window", False):
        raise UnsupportedModelError(f"{model_type} sliding-window attention is not supported")
    if getattr(hf_config, "mlp_bias", False):
        raise UnsupportedModelError(f"{model_type} mlp_bias=True is not supported")
    if model_type in ("llama", "qwen3") and getattr(hf_config, "attention_bias", False):
        raise UnsupportedModelError(f"{model_type} attention_bias=True (biases on q/k/v and the output projection) "
                                    "is not supported")
    if getattr(hf_config, "pretraining_tp", 1) not in (1, None):
        raise UnsupportedModelError(f"pretraining_tp {hf_config.pretraining_tp} is not supported (only 1)")


def hf_arch(hf_config: Any) -> HfArch:
    """Read and check the architecture facts of an HF config (Llama, Qwen2 or Qwen3; `UnsupportedModelError`
    naming what is not supported otherwise)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(MODEL_TYPES)} ({FAMILIES})")
    _check_features(hf_config, model_type)
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    theta, scaling = _rope(hf_config)
    return HfArch(
        model_type=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=theta,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        rope_scaling=scaling,
    )


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Megatron's vocabulary: the HF vocabulary rounded up to a multiple of `tp` (rows past the HF
    vocabulary are zero and their logits must be masked out before any softmax)."""
    return -(-vocab_size // tp) * tp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def megatron_size_problems(arch: HfArch, tp: int, pp: int) -> list[str]:
    """The rules a Megatron TP x PP split of `arch` breaks (empty: it splits), each with the sizes that would do."""
    problems = []
    parts = [(name, value) for name, value in (("num_attention_heads", arch.num_heads),
                                               ("num_key_value_heads", arch.num_kv_heads),
                                               ("intermediate_size", arch.intermediate_size)) if value % tp]
    if parts:
        fits = _divisors(math.gcd(arch.num_heads, arch.num_kv_heads, arch.intermediate_size))
        problems.append(f"tensor_parallel_size {tp} must divide {', '.join(f'{n} {v}' for n, v in parts)} (Megatron "
                        f"gives each TP rank whole heads and key/value groups); TP sizes that do: {fits}")
    if arch.num_layers % pp:
        problems.append(f"pipeline_parallel_size {pp} must divide num_hidden_layers {arch.num_layers} (each stage "
                        f"holds as many layers); PP sizes that do: {_divisors(arch.num_layers)}")
    return problems


SGLANG_SPARE_TOKENS = 2
"""Tokens of a request's length that sglang 0.5.23 never gives it: a request may be at most one token shorter than
the context or the KV cache (tp_worker.py `max_req_len`), and its new tokens stop one short of that (scheduler.py)."""


def sglang_tp_problem(arch: HfArch, tp: int) -> str:
    """Why SGLang cannot run `arch` at `tp` GPUs per engine ("" if it can): each rank takes whole query heads, and
    key/value heads are split (TP divides them) or replicated (the count divides TP)."""
    if arch.num_heads % tp:
        return (f"tensor_parallel_size {tp} must divide num_attention_heads {arch.num_heads} (SGLang gives each rank "
                f"whole heads); sizes that do: {_divisors(arch.num_heads)}")
    if arch.num_kv_heads % tp and tp % arch.num_kv_heads:
        fits = [d for d in _divisors(arch.num_heads) if arch.num_kv_heads % d == 0 or d % arch.num_kv_heads == 0]
        return (f"tensor_parallel_size {tp} and num_key_value_heads {arch.num_kv_heads}: one must divide the other "
                f"(SGLang splits or replicates key/value heads); sizes that do: {fits}")
    return ""


def check_parallel_sizes(arch: HfArch, tp: int, pp: int) -> None:
    """Raise `UnsupportedModelError` naming the size that does not divide the model (`megatron_size_problems`)."""
    problems = megatron_size_problems(arch, tp, pp)
    if problems:
        raise UnsupportedModelError("; ".join(problems))


def model_config(name_or_path: str | os.PathLike[str]) -> tuple[Any | None, str]:
    """A config's model's HF config from its `config.json` alone (the folder's, or for the tiny model its spec's
    values, or a copy shipped in `models.known`), and where it came from; (None, why) if there is none to read. A
    folder whose model type is not supported raises `UnsupportedModelError` naming the file, before transformers
    is asked to read it."""
    from rlinf_pipe.models.known import known_config

    name = os.fspath(name_or_path)
    if name == "tiny":
        from rlinf_pipe.models.tiny import TinySpec, config_values

        spec = TinySpec()
        return light_hf_config(config_values(spec, spec.vocab_size, 0, 1, 2)), "the tiny model"
    folder, source = Path(name).expanduser(), ""
    if not (folder / "config.json").is_file():
        shipped = known_config(name)
        if shipped is None:
            return None, (f"no config.json at {name} (only that file is read: run this where the model folder is, "
                          "or on a copy of it)")
        folder, source = shipped.parent, f", the copy shipped with rlinf_pipe: no model folder at {name} on this machine"
    file = folder / "config.json"
    raw = read_json(file)
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in MODEL_TYPES:
        raise UnsupportedModelError(f"{file}: model_type {model_type!r} is not supported; supported: "
                                    f"{', '.join(MODEL_TYPES)} ({FAMILIES}). See docs/models.md")
    return load_hf_config(folder), f"{file}{source}"


def model_arch(name_or_path: str | os.PathLike[str]) -> tuple[HfArch | None, str]:
    """The architecture of a config's model (`model_config`), checked by `hf_arch`; (None, why) where there is no
    config to read. `UnsupportedModelError` names the file and what it cannot run."""
    config, source = model_config(name_or_path)
    if config is None:
        return None, source
    try:
        return hf_arch(config), source
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{source.split(',')[0]}: {exc}. See docs/models.md") from None
