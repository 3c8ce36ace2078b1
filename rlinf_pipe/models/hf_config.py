"""A model folder's `config.json`, read without transformers where that gives what transformers' config gives.

The workers read a handful of numbers from it (`megatron_gpt.hf_arch`: sizes, heads, norm epsilon, rotary base,
ties; `scheduler.memory`: the weights' dtype). transformers' `AutoConfig` imports the library first (about 1 s of
CPU per process), and for a Llama model its config module also loads transformers' activations and through them
DTensor and sympy (about 2 s more): paid at every actor, log-prob and rollout worker's launch. `load_hf_config`
returns the file's own values as attributes when it states every value those readers take from it, for the model
types they support (Llama, Qwen2); otherwise (a value left to the config class's default, another model type) it
returns `AutoConfig.from_pretrained` as before. `tests/unit/test_hf_config.py` compares the two on the readers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

MODEL_TYPES = ("llama", "qwen2")
STATED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "hidden_act")
"""What the file must state itself (the config classes' defaults for these differ by model type)."""


def light_hf_config(raw: dict[str, Any]) -> SimpleNamespace | None:
    """The values of a `config.json`'s contents as attributes, or None where transformers' config class would fill
    in one of `STATED` or the rotary base, or the model type is not Llama or Qwen2."""
    if raw.get("model_type") not in MODEL_TYPES or any(raw.get(key) is None for key in STATED):
        return None
    if not (raw.get("rope_parameters") or {}).get("rope_theta") and raw.get("rope_theta") is None:
        return None
    return SimpleNamespace(**raw)


def load_hf_config(folder: str | os.PathLike[str]) -> Any:
    """The HF config of a model folder (see the module docstring): its `config.json` as read by `light_hf_config`,
    else `AutoConfig.from_pretrained(folder)`."""
    file = Path(folder) / "config.json"
    if file.is_file():
        light = light_hf_config(json.loads(file.read_text()))
        if light is not None:
            return light
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))
