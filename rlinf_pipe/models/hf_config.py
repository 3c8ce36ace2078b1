"""A model folder's `config.json`, read without transformers where that gives what transformers' config gives.

The workers read a handful of numbers from it (`arch.hf_arch`: sizes, heads, norm epsilon, rotary base and
scaling, ties; `scheduler.memory`: the weights' dtype). transformers' `AutoConfig` imports the library first (about 1 s of
CPU per process), and for a Llama model its config module also loads transformers' activations and through them
DTensor and sympy (about 2 s more): paid at every actor, log-prob and rollout worker's launch. `load_hf_config`
returns the file's own values as attributes when it states every value those readers take from it, for the model
types they support (Llama, Qwen2, Qwen3); otherwise (a value left to the config class's default, another model type) it
returns `AutoConfig.from_pretrained` as before. `tests/unit/test_hf_config.py` compares the two on the readers.
`rope_of` is the one reader of a config's rotary settings (the lean model, `hf_arch` and this module use it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlinf_pipe.errors import RlinfPipeError

MODEL_TYPES = ("llama", "qwen2", "qwen3")
STATED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "hidden_act")
"""What the file must state itself (the config classes' defaults for these differ by model type)."""
STATED_BY_TYPE = {"qwen3": ("head_dim",)}
"""What a model type's file must state besides `STATED` (Qwen3's class defaults `head_dim` to 128, not the hidden
size over the heads)."""
WEIGHTS_FILE, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
ROPE_KEYS = ("rope_scaling", "rope_parameters", "rope_theta", "partial_rotary_factor")
"""Where a config (transformers 5's `rope_parameters`, or the older `rope_theta` and `rope_scaling`) keeps its
rotary settings."""


class ModelFolderError(RlinfPipeError):
    """A model folder's JSON file (config, weight index) cannot be read."""


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.x's rotary scaling (`rope_type: llama3`): wavelengths longer than the original context over
    `low_freq_factor` are stretched by `factor`, those shorter than it over `high_freq_factor` kept, those between
    interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class Rope:
    """A config's rotary embedding: its type (`default`: unscaled), base (None: not stated), the fraction of
    each head it rotates, and Llama 3's scaling (None unless `kind` is `llama3` with every value it needs)."""

    kind: str
    theta: float | None
    partial_factor: float
    llama3: Llama3Scaling | None = None

    @property
    def plain(self) -> bool:
        """The default rotary embedding over whole heads, with a stated base."""
        return self.kind == "default" and self.partial_factor == 1.0 and self.theta is not None


def rope_of(values: Mapping[str, Any]) -> Rope:
    """The rotary settings of a config's values (`ROPE_KEYS`), where transformers looks for them: `rope_scaling`,
    else `rope_parameters`, their base and partial factor defaulting to the top-level keys (Llama 3's original
    context to `max_position_embeddings`, as transformers does). Per-layer-type settings (a dict of dicts) read as
    kind `per-layer`."""
    params = values.get("rope_scaling") or values.get("rope_parameters") or {}
    if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
        return Rope("per-layer", None, 1.0)
    theta = params.get("rope_theta", values.get("rope_theta"))
    partial = params.get("partial_rotary_factor", values.get("partial_rotary_factor"))
    kind = str(params.get("rope_type") or params.get("type") or "default")
    return Rope(
        kind=kind,
        theta=_number(theta),
        partial_factor=1.0 if partial is None else float(partial),
        llama3=_llama3(params, values) if kind == "llama3" else None,
    )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _llama3(params: Mapping[str, Any], values: Mapping[str, Any]) -> Llama3Scaling | None:
    numbers = [_number(params.get(key)) for key in ("factor", "low_freq_factor", "high_freq_factor")]
    original = _number(params.get("original_max_position_embeddings", values.get("max_position_embeddings")))
    if any(n is None for n in numbers) or original is None or numbers[1] == numbers[2]:
        return None
    factor, low, high = (float(n) for n in numbers if n is not None)
    return Llama3Scaling(factor, low, high, int(original))


def read_json(file: Path) -> Any:
    """A model folder's JSON file, or a `ModelFolderError` naming it when it is not valid JSON."""
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFolderError(f"{file} is not valid JSON ({exc}): the model folder is damaged or was copied "
                               "part-way; download or convert it again") from exc


@dataclass(frozen=True)
class WeightFiles:
    """A folder's safetensors weights: its files, and for a sharded checkpoint each tensor name's shard."""

    files: list[Path]
    shard_of: dict[str, Path] | None


def weight_files(folder: Path) -> WeightFiles | None:
    """Where transformers loads a folder's safetensors weights from: `model.safetensors`, else the shards that
    `model.safetensors.index.json` names (other `*.safetensors` files in the folder are not the model's); None
    where the folder has neither. A damaged index raises `ModelFolderError` naming it."""
    if (folder / WEIGHTS_FILE).is_file():
        return WeightFiles([folder / WEIGHTS_FILE], None)
    index = folder / WEIGHTS_INDEX
    if not index.is_file():
        return None
    contents = read_json(index)
    weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelFolderError(f"{index} has no `weight_map` of tensor names to shard files: the model folder is "
                               "damaged; download or convert it again")
    shard_of = {name: folder / shard for name, shard in weight_map.items()}
    return WeightFiles(sorted(set(shard_of.values())), shard_of)


def light_hf_config(raw: dict[str, Any]) -> SimpleNamespace | None:
    """The values of a `config.json`'s contents as attributes, or None where transformers' config class would fill
    in one of `STATED` (and `STATED_BY_TYPE`) or the rotary base, or the model type is not one of `MODEL_TYPES`."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES or any(raw.get(key) is None for key in STATED + STATED_BY_TYPE.get(model_type,
                                                                                                       ())):
        return None
    if rope_of(raw).theta is None:
        return None
    return SimpleNamespace(**raw)


def load_hf_config(folder: str | os.PathLike[str]) -> Any:
    """The HF config of a model folder (see the module docstring): its `config.json` as read by `light_hf_config`,
    else `AutoConfig.from_pretrained(folder)`."""
    file = Path(folder) / "config.json"
    if file.is_file():
        light = light_hf_config(read_json(file))
        if light is not None:
            return light
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))
