"""A model folder's config read without transformers (`rlinf_pipe.models.hf_config`) gives its readers what
transformers' `AutoConfig` gives them, on the configs we ship and build and on older and edited ones; where it
would not, it hands over to `AutoConfig`."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from rlinf_pipe.models import ensure_tiny_model
from rlinf_pipe.models.hf_config import STATED, ModelFolderError, light_hf_config, load_hf_config, rope_of
from rlinf_pipe.models.known import known_config
from rlinf_pipe.models.arch import UnsupportedModelError, hf_arch
from rlinf_pipe.planning.memory import dtype_bytes_of


def readings(config) -> tuple:
    """What the readers take from a config: the architecture (or why it is refused) and the weights' bytes."""
    try:
        arch = hf_arch(config)
    except UnsupportedModelError as exc:
        arch = str(exc)
    return arch, dtype_bytes_of(config)


def folder_with(tmp_path: Path, source: Path, edit) -> Path:
    folder = Path(shutil.copytree(source, tmp_path / "edited"))
    raw = json.loads((folder / "config.json").read_text())
    edit(raw)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def shipped_folder() -> Path:
    shipped = known_config("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B")
    assert shipped is not None
    return shipped.parent


@pytest.fixture(params=["qwen2", "llama", "shipped"])
def source(request, tmp_path) -> Path:
    if request.param == "shipped":
        return shipped_folder()
    return ensure_tiny_model(tmp_path / "cache", arch=request.param)


def _older_format(raw: dict) -> None:  # transformers 4's rope keys and dtype name
    raw["rope_theta"] = (raw.pop("rope_parameters", None) or {}).get("rope_theta", raw.get("rope_theta"))
    raw["rope_scaling"] = None
    if "dtype" in raw:
        raw["torch_dtype"] = raw.pop("dtype")


EDITS = {
    "as saved": lambda raw: None,
    "older format": _older_format,
    "bf16 weights": lambda raw: raw.update(dtype="bfloat16", torch_dtype="bfloat16"),
    "linear rope scaling": lambda raw: raw.update(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "gelu": lambda raw: raw.update(hidden_act="gelu"),
    "sliding window": lambda raw: raw.update(use_sliding_window=True, sliding_window=64),
    "head size of its own": lambda raw: raw.update(head_dim=32),
    "partial rotary": lambda raw: raw.update(partial_rotary_factor=0.5),
    "older dynamic scaling": lambda raw: (_older_format(raw), raw.update(rope_scaling={"type": "dynamic",
                                                                                       "factor": 2.0})),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_the_readers_see_what_autoconfig_gives_them(tmp_path, source, edit):
    folder = folder_with(tmp_path, source, EDITS[edit])
    config = load_hf_config(folder)
    assert light_hf_config(json.loads((folder / "config.json").read_text())) is not None  # (read without it)
    assert readings(config) == readings(AutoConfig.from_pretrained(folder))


@pytest.mark.parametrize("missing", [*STATED, "rope"])
def test_a_value_left_to_the_config_class_hands_over_to_autoconfig(tmp_path, missing):
    def drop(raw: dict) -> None:
        if missing == "rope":
            raw.pop("rope_parameters", None), raw.pop("rope_theta", None)
        else:
            raw.pop(missing)

    folder = folder_with(tmp_path, ensure_tiny_model(tmp_path / "cache", arch="llama"), drop)
    assert light_hf_config(json.loads((folder / "config.json").read_text())) is None
    if missing == "model_type":
        return  # (AutoConfig itself cannot read a folder without one)
    config = load_hf_config(folder)
    assert type(config).__name__ == "LlamaConfig"
    assert readings(config) == readings(AutoConfig.from_pretrained(folder))


def test_other_model_types_hand_over_to_autoconfig(tmp_path):
    folder = folder_with(tmp_path, ensure_tiny_model(tmp_path / "cache"), lambda raw: raw.update(model_type="mistral"))
    assert type(load_hf_config(folder)) is type(AutoConfig.from_pretrained(folder))
    assert light_hf_config(json.loads((folder / "config.json").read_text())) is None


ROPE_LAYOUTS = {
    "transformers 5": {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
    "transformers 4": {"rope_theta": 500.0, "rope_scaling": None},
    "older scaling with type": {"rope_theta": 500.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "scaling beside parameters": {"rope_parameters": {"rope_type": "default", "rope_theta": 7.0},
                                  "rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 9.0}},
    "base at the top": {"rope_parameters": {"rope_type": "default"}, "rope_theta": 321.0},
    "partial at the top": {"rope_parameters": {"rope_type": "default", "rope_theta": 5.0},
                           "partial_rotary_factor": 0.5},
    "partial inside": {"rope_parameters": {"rope_type": "default", "rope_theta": 5.0, "partial_rotary_factor": 0.25}},
}


@pytest.mark.parametrize("layout", sorted(ROPE_LAYOUTS))
def test_the_rotary_settings_are_read_where_transformers_reads_them(tmp_path, layout):
    def edit(raw: dict) -> None:
        for key in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"):
            raw.pop(key, None)
        raw.update(ROPE_LAYOUTS[layout])

    folder = folder_with(tmp_path, ensure_tiny_model(tmp_path / "cache", arch="llama"), edit)
    rope, params = rope_of(json.loads((folder / "config.json").read_text())), AutoConfig.from_pretrained(
        folder).rope_parameters
    assert (rope.kind, rope.theta, rope.partial_factor) == (
        params["rope_type"], params["rope_theta"], params.get("partial_rotary_factor", 1.0))


def test_a_partial_rotary_embedding_is_refused_by_the_actor(tmp_path):
    folder = folder_with(tmp_path, ensure_tiny_model(tmp_path / "cache"), EDITS["partial rotary"])
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.5"):
        hf_arch(load_hf_config(folder))


def _readers() -> dict:
    from rlinf_pipe.engines.rollout.torch_engine import generation_eos_ids
    from rlinf_pipe.models.megatron_checkpoint import hf_weight_files

    return {"config.json": load_hf_config, "generation_config.json": generation_eos_ids,
            "model.safetensors.index.json": hf_weight_files}


@pytest.mark.parametrize("file", ["config.json", "generation_config.json", "model.safetensors.index.json"])
def test_a_damaged_json_file_of_a_model_folder_is_named(tmp_path, file):
    folder = Path(shutil.copytree(ensure_tiny_model(tmp_path / "cache"), tmp_path / "damaged"))
    if file.endswith("index.json"):  # (read where there is no model.safetensors: a sharded checkpoint)
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / file).write_text('{"model_type": "qwen2", "vocab')
    with pytest.raises(ModelFolderError, match=re.escape(f"damaged/{file} is not valid JSON")):
        _readers()[file](folder)


def test_the_weights_read_are_the_files_transformers_loads(tmp_path):
    """model.safetensors, else the index's shards: neither another *.safetensors file in the folder (an adapter,
    say) nor an index left beside model.safetensors is the model's weights."""
    from safetensors.torch import load_file, save_file

    from rlinf_pipe.engines.rollout.lean_model import load_lean_model
    from rlinf_pipe.models.megatron_checkpoint import hf_weight_files

    folder = Path(shutil.copytree(ensure_tiny_model(tmp_path / "cache"), tmp_path / "folder"))
    names = set(load_file(folder / "model.safetensors"))
    save_file({"extra": torch.zeros(2)}, folder / "adapter_model.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"extra": "gone.safetensors"}}))
    assert hf_weight_files(folder) == dict.fromkeys(names, folder / "model.safetensors")
    assert load_lean_model(folder, torch.float32) is not None  # (its check of the stored names would refuse extra)

    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ModelFolderError, match=r"index.json has no `weight_map`"):
        hf_weight_files(folder)
