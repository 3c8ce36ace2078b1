"""Tiny HF causal LMs (Qwen2, Qwen3, Llama, Llama 3.x) built from a config, with the tiny tokenizer; no downloads.

`create_tiny_model(out_dir, ...)` writes a folder that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load: safetensors weights, config, tokenizer and `generation_config.json`.
Weights depend only on the knobs and `seed`. `ensure_tiny_model(cache_dir, ...)` builds it once per set of
knobs and reuses it afterwards. `arch` is a family: `qwen2` (q/k/v biases), `qwen3` (per-head q/k norms; its heads
twice as wide as hidden / heads unless `head_dim` says otherwise, so the explicit head size is exercised),
`llama`, and `llama3` (a Llama with Llama 3.x's `llama3` rotary scaling over an original context of 64 positions,
so that all three of its frequency bands occur).

CLI: `python -m rlinf_pipe.models.tiny --arch qwen2 --out DIR [--hidden-size 64 ...]`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rlinf_pipe.models.hf_config import weight_files
from rlinf_pipe.models.tokenizer import DEFAULT_VOCAB_SIZE, train_tiny_tokenizer
from rlinf_pipe.utils.folders import build_folder_once

if TYPE_CHECKING:  # torch and transformers load only when a model is built: resolving a cached folder is light
    from transformers import PretrainedConfig

Arch = Literal["qwen2", "qwen3", "llama", "llama3"]
ARCHS: tuple[str, ...] = ("qwen2", "qwen3", "llama", "llama3")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CACHE_ENV = "RLINF_PIPE_CACHE"


@dataclass(frozen=True)
class TinySpec:
    """The knobs of a tiny model; equal specs give identical folders."""

    arch: str = "qwen2"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    seed: int = 0
    head_dim: int | None = None  # None: hidden / heads (Qwen3: twice that)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {list(ARCHS)}, got {self.arch!r}")
        sizes = (self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads, self.intermediate_size)
        if min(sizes) < 1 or self.max_position_embeddings < 1:
            raise ValueError(f"model sizes must be positive, got {self}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim {self.resolved_head_dim} must be even (rotary embeddings)")

    @property
    def resolved_head_dim(self) -> int:
        """The head size the config states (see `head_dim`)."""
        return self.head_dim or (2 if self.arch == "qwen3" else 1) * (self.hidden_size // self.num_heads)

    def knobs(self) -> dict[str, Any]:
        """The knobs as a dict (an unset `head_dim` left out, so that the specs from before it existed keep their
        hashes and cached folders)."""
        return {k: v for k, v in asdict(self).items() if not (k == "head_dim" and v is None)}

    def digest(self) -> str:
        """A short stable hash of the knobs (names cache folders)."""
        return hashlib.sha256(json.dumps(self.knobs(), sort_keys=True).encode()).hexdigest()[:12]


def config_values(spec: TinySpec, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> dict[str, Any]:
    """The `config.json` values of `spec`'s model, every one stated (so `hf_config.light_hf_config` reads them as
    transformers would, without importing it): Qwen2 has q/k/v biases; Llama and Qwen3 none."""
    family = "llama" if spec.arch == "llama3" else spec.arch
    values: dict[str, Any] = {
        "model_type": family,
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(spec.rope_theta)},
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "pad_token_id": pad_id,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "dtype": "float32",
    }
    if spec.head_dim is not None or spec.arch == "qwen3":
        values["head_dim"] = spec.resolved_head_dim
    if family in ("qwen2", "qwen3"):
        values.update(use_sliding_window=False, max_window_layers=spec.num_layers)
    if family in ("llama", "qwen3"):
        values.update(attention_bias=False)
    if family == "llama":
        values.update(mlp_bias=False)
    if spec.arch == "llama3":
        values["rope_parameters"] = {**LLAMA3_ROPE, "rope_theta": float(spec.rope_theta)}
    return values


def build_config(spec: TinySpec, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> PretrainedConfig:
    """The HF config of `config_values`. Only the class of `spec.arch` is imported: transformers' Llama config module
    loads its activations, and through them DTensor and sympy."""
    values = config_values(spec, vocab_size, pad_id, bos_id, eos_id)
    family = values.pop("model_type")
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**values)
    if family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**values)
    from transformers import LlamaConfig

    return LlamaConfig(**values)


def _write_model(spec: TinySpec, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = train_tiny_tokenizer(vocab_size=spec.vocab_size)
    pad, bos, eos = tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    config = build_config(spec, len(tokenizer), pad, bos, eos)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def create_tiny_model(
    out_dir: str | os.PathLike[str],
    arch: Arch = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    rope_theta: float = 10000.0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    head_dim: int | None = None,
) -> Path:
    """Write a tiny randomly initialised model + tokenizer to `out_dir` (created if needed); return its path."""
    spec = TinySpec(
        arch, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings,
        tie_word_embeddings, rope_theta, vocab_size, seed, head_dim,
    )
    out = Path(out_dir)
    _write_model(spec, out)
    return out


def default_cache_dir() -> Path:
    """`$RLINF_PIPE_CACHE/models`, else `~/.cache/rlinf_pipe/models`."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "rlinf_pipe") / "models"


def ensure_tiny_model(cache_dir: str | os.PathLike[str] | None = None, arch: Arch = "qwen2", **knobs: object) -> Path:
    """The folder of the tiny model with these knobs under `cache_dir`, created on first use.

    The folder is built in a temporary sibling and renamed into place with its marker file already written,
    so a half-written folder is never reused; a folder without the marker is deleted and rebuilt.
    `knobs` are `create_tiny_model`'s keyword arguments.
    """
    spec = TinySpec(arch=arch, **knobs)  # type: ignore[arg-type]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    def build(tmp: Path) -> dict:
        _write_model(spec, tmp)
        return spec.knobs()

    return build_folder_once(root / f"tiny-{spec.arch}-{spec.digest()}", build)


def count_parameters(folder: str | os.PathLike[str]) -> int:
    """Number of parameters stored in `folder`'s safetensors weights (`hf_config.weight_files`; tied embeddings
    counted once)."""
    from safetensors import safe_open

    found = weight_files(Path(folder))
    total = 0
    for path in [] if found is None else found.files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                total += math.prod(handle.get_slice(key).get_shape())
    return total


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: create a tiny model folder and print its path and parameter count."""
    d = TinySpec()
    parser = argparse.ArgumentParser(prog="python -m rlinf_pipe.models.tiny", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=ARCHS, default=d.arch)
    parser.add_argument("--out", required=True, help="output folder (created if needed)")
    parser.add_argument("--hidden-size", type=int, default=d.hidden_size)
    parser.add_argument("--num-layers", type=int, default=d.num_layers)
    parser.add_argument("--num-heads", type=int, default=d.num_heads)
    parser.add_argument("--num-kv-heads", type=int, default=d.num_kv_heads)
    parser.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    parser.add_argument("--max-position-embeddings", type=int, default=d.max_position_embeddings)
    parser.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=d.tie_word_embeddings)
    parser.add_argument("--rope-theta", type=float, default=d.rope_theta)
    parser.add_argument("--vocab-size", type=int, default=d.vocab_size, help="tokenizer vocabulary (< 1000)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--head-dim", type=int, default=None, help="head size (default: hidden / heads; Qwen3: twice)")
    args = parser.parse_args(argv)
    try:
        out = create_tiny_model(
            args.out, arch=args.arch, hidden_size=args.hidden_size, num_layers=args.num_layers,
            num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, intermediate_size=args.intermediate_size,
            max_position_embeddings=args.max_position_embeddings, tie_word_embeddings=args.tie_word_embeddings,
            seed=args.seed, rope_theta=args.rope_theta, vocab_size=args.vocab_size, head_dim=args.head_dim,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(f"{out}\t{count_parameters(out):,} parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
