"""The models a run names, checked before Ray starts (`runner.model_fit`, `models.arch`): an unsupported family and
every parallel size a model cannot take are refused by `rlinf-pipe plan`, the run's pre-launch check and `convert`
in one line each, with the rule and the sizes that would do; Qwen3 and Llama 3.x folders are planned and estimated."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rlinf_pipe.cli import main
from rlinf_pipe.config import load_config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.models.arch import hf_arch, megatron_size_problems, model_arch, sglang_tp_problem
from rlinf_pipe.models.hf_config import light_hf_config
from rlinf_pipe.models.known import known_config
from rlinf_pipe.runner.preflight import preflight
from rlinf_pipe.planning.model_sizes import num_params

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "math" / "config"
R1_1NODE = str(CONFIGS / "qwen2.5-1.5b-grpo-megatron-pipeline-1node.yaml")
R1_4X8 = str(CONFIGS / "qwen2.5-1.5b-grpo-megatron-pipeline.yaml")
R1_COLLOCATED = str(CONFIGS / "qwen2.5-1.5b-grpo-megatron.yaml")
R1 = "DeepSeek-R1-Distill-Qwen-1.5B"
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 100}
# The sizes of published models (their config.json files' values), for the checks that read only the file:
QWEN3_1_7B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
              "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
              "rope_theta": 1000000, "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
              "use_sliding_window": False, "torch_dtype": "bfloat16"}
LLAMA_3_1_8B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
                "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192},
                "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                "torch_dtype": "bfloat16"}


def folder(tmp_path: Path, name: str, config: dict) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def meta_count(path: Path) -> int:
    """The parameters of transformers' class for the folder's config, built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


def plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_gpt2_folder_is_refused_by_plan_train_and_convert_in_one_line(tmp_path, capsys):
    gpt2 = folder(tmp_path, "gpt2", GPT2)
    code, out, err = plan(capsys, f"actor.model_path={gpt2}")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: actor.model_path: {gpt2}/config.json: model_type 'gpt2' is not supported")
    assert "qwen3" in err and "Llama (2, 3.x" in err
    with pytest.raises(ConfigError, match="actor.model_path: .*model_type 'gpt2' is not supported"):
        preflight(load_config(None, None, [f"actor.model_path={gpt2}"]))
    with pytest.raises(ConfigError, match="rollout.model_path: .*model_type 'gpt2'"):
        preflight(load_config(None, None, [f"rollout.model_path={gpt2}"]))
    assert main(["convert", gpt2, str(tmp_path / "out"), "--to", "megatron"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model_type 'gpt2' is not supported" in err and "Traceback" not in err


def test_tp_over_the_key_value_heads_is_refused_with_the_sizes_that_fit(tmp_path, capsys):
    # DeepSeek-R1-Distill-Qwen-1.5B: 12 heads, 2 key/value heads (the shipped config.json)
    code, out, err = plan(capsys, R1_COLLOCATED, "actor.tensor_parallel_size=4")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "actor.tensor_parallel_size 4 must divide num_key_value_heads 2" in err and "TP sizes that do: [1, 2]" in err
    r1 = folder(tmp_path, "DeepSeek-R1-Distill-Qwen-1.5B", json.loads(known_config(R1).read_text()))
    with pytest.raises(ConfigError, match="actor.tensor_parallel_size 4 must divide num_key_value_heads 2"):
        preflight(load_config(CONFIGS, "qwen2.5-1.5b-grpo-megatron", ["actor.tensor_parallel_size=4",
                                                                       f"actor.model_path={r1}"]))


@pytest.mark.parametrize("config, overrides, expected", [
    (R1_4X8, ["inference.tensor_parallel_size=4"], "inference.tensor_parallel_size 4 must divide num_key_value_heads 2"),
    (R1_4X8, ["actor.pipeline_parallel_size=8"], "actor.pipeline_parallel_size 8 must divide num_hidden_layers 28"),
    (R1_COLLOCATED, ["rollout.tensor_parallel_size=8"], "rollout.tensor_parallel_size 8 must divide "
                                                        "num_attention_heads 12"),
])
def test_every_component_split_is_checked(capsys, config, overrides, expected):
    code, _, err = plan(capsys, config, *overrides)
    assert code == 2 and expected in err, err


def test_sglang_splits_or_replicates_key_value_heads():
    arch, _ = model_arch(str(CONFIGS / "nowhere" / R1))  # (the shipped copy)
    assert arch is not None and (arch.num_heads, arch.num_kv_heads) == (12, 2)
    assert sglang_tp_problem(arch, 4) == "" and sglang_tp_problem(arch, 2) == ""  # replicated / split
    four_groups = replace(arch, num_kv_heads=4)
    assert "6 and num_key_value_heads 4: one must divide the other" in sglang_tp_problem(four_groups, 6)
    assert "sizes that do: [1, 2, 4, 12]" in sglang_tp_problem(four_groups, 6)
    assert megatron_size_problems(arch, 2, 2) == [] and len(megatron_size_problems(arch, 4, 3)) == 2


@pytest.mark.parametrize("name, config", [("Qwen3-1.7B", QWEN3_1_7B), ("Llama-3.1-8B", LLAMA_3_1_8B)])
def test_qwen3_and_llama3_folders_are_planned_and_estimated(tmp_path, capsys, name, config):
    path = folder(tmp_path, name, config)
    code, out, err = plan(capsys, "--no-files", R1_1NODE, f"actor.model_path={path}", "cluster.gpu_memory_gb=1000")
    assert code == 0, err
    assert f"memory estimate (model: {path}/config.json" in out and "DOES NOT FIT" not in out
    arch = hf_arch(light_hf_config(config))
    assert (arch.qk_norm, arch.rope_scaling is not None) == (name.startswith("Qwen3"), name.startswith("Llama"))
    assert num_params(arch) == meta_count(Path(path))  # (1.72 B with the tied embedding, 8.03 B)
    preflight(load_config(CONFIGS, "qwen2.5-1.5b-grpo-megatron-pipeline-1node",
                          [f"actor.model_path={path}", "data.dataset=arithmetic"]))


def test_an_unsupported_feature_of_a_supported_family_names_the_file(tmp_path, capsys):
    path = folder(tmp_path, "yarn", {**QWEN3_1_7B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    code, _, err = plan(capsys, f"actor.model_path={path}")
    assert code == 2 and f"{path}/config.json: RoPE scaling 'yarn' is not supported" in err
