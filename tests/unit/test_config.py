"""Config loading: YAML + overrides, unknown keys, types, bounds, derived values."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlinf_pipe.config import Config, load_config
from rlinf_pipe.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "math" / "config"


def write(tmp_path: Path, text: str, name: str = "run") -> Path:
    (tmp_path / f"{name}.yaml").write_text(text)
    return tmp_path


def test_no_file_gives_the_embedded_tiny_pipeline_default():
    cfg = load_config()
    assert cfg.cluster.component_placement == {"rollout": 0, "actor": 1}
    assert cfg.gpus_per_node() == [2] and cfg.rollout.model_path == cfg.actor.model_path == "tiny"


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.yaml")))
def test_every_example_config_is_valid(name):
    assert isinstance(load_config(EXAMPLES, name), Config)


def test_file_values_and_overrides(tmp_path):
    folder = write(tmp_path, "runner:\n  max_steps: 7\n  seed: 3\nactor:\n  lr: 1.0e-4\n")
    cfg = load_config(folder, "run", ["runner.seed=11", "rollout.temperature=0.5"])
    assert (cfg.runner.max_steps, cfg.runner.seed, cfg.actor.lr, cfg.rollout.temperature) == (7, 11, 1e-4, 0.5)
    assert isinstance(cfg.rollout.temperature, float)


def test_config_name_may_carry_the_suffix(tmp_path):
    assert load_config(write(tmp_path, "runner:\n  max_steps: 2\n"), "run.yaml").runner.max_steps == 2


def test_interpolation(tmp_path):
    folder = write(tmp_path, "runner:\n  experiment_name: exp-${runner.seed}\n  seed: 5\n")
    assert load_config(folder, "run").runner.experiment_name == "exp-5"


def test_interpolation_may_name_a_default_from_an_override():
    """The documented `'runner.experiment_name=exp-${runner.seed}'`: runner.seed is set nowhere but the schema."""
    assert load_config(overrides=["runner.experiment_name=exp-${runner.seed}"]).runner.experiment_name == "exp-1"


def test_broken_interpolation_is_a_config_error(tmp_path):
    folder = write(tmp_path, "runner:\n  experiment_name: ${runner.nothing}\n")
    with pytest.raises(ConfigError, match="nothing"):
        load_config(folder, "run")


def test_unknown_key_in_file_names_key_file_and_closest(tmp_path):
    folder = write(tmp_path, "actor:\n  learning_rate: 1.0\n")
    with pytest.raises(ConfigError) as info:
        load_config(folder, "run")
    message = str(info.value)
    assert "`actor.learning_rate`" in message and str(folder / "run.yaml") in message
    assert "valid names" in message and "`lr`" in message


def test_unknown_key_in_override_names_the_override():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["runner.max_step=3"])
    assert "from override `runner.max_step=3`" in str(info.value)
    assert "did you mean `max_steps`" in str(info.value)


def test_unknown_section_suggests_sections():
    with pytest.raises(ConfigError, match=r"unknown key `rolout` .* did you mean `rollout`"):
        load_config(overrides=["rolout.temperature=1"])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("runner.max_steps=abc", "runner.max_steps: expected int, got str 'abc'"),
        ("runner.max_steps=1.5", "expected int, got float"),
        ("rollout.temperature=hot", "rollout.temperature: expected float"),
        ("rollout.backend=vllm", "expected one of 'torch', 'sglang'"),
        ("cluster.num_gpus_per_node=[8,x]", "cluster.num_gpus_per_node: expected int or list of int"),
        ("runner=5", "runner: expected mapping (section)"),
        ("runner.max_steps=true", "expected int, got bool"),
    ],
)
def test_type_errors_name_key_and_expected_type(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert expected in str(info.value) and f"override `{override}`" in str(info.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("runner.max_steps=0", "runner.max_steps: must be >= 1, got 0"),
        ("cluster.num_gpus_per_node=[0]", "cluster.num_gpus_per_node: must be >= 1"),
        ("algorithm.group_size=-2", "algorithm.group_size: must be >= 1"),
        ("runner.max_staleness=-1", "runner.max_staleness: must be >= 0"),
        ("rollout.gpu_memory_fraction=1.0", "rollout.gpu_memory_fraction: must be < 1, got 1.0"),
        ("rollout.gpu_memory_fraction=0.01", "rollout.gpu_memory_fraction: must be >= 0.05"),
        ("algorithm.clip_ratio_low=1.5", "must be below 1"),
        ("algorithm.n_minibatches=3", "does not divide data.rollout_batch_size=16"),
        ("cluster.num_gpus_per_node=[3,3]", "the list has 2 entries but cluster.num_nodes is 1"),
        ("runner.weight_sync=bogus", "expected one of 'auto', 'broadcast', 'ipc', 'object_store'"),
    ],
)
def test_bad_values(override, expected):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(overrides=[override])
    assert expected in str(info.value)


def test_malformed_override():
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_config(overrides=["runner.max_steps"])


@pytest.mark.parametrize("override", ["runner.max_steps=[1,", "runner.max_steps='5", "cluster.component_placement.actor=,",
                                      "runner.max_steps=!!python/object:os.system ls"])
def test_an_override_that_is_not_yaml_is_a_config_error(override):
    with pytest.raises(ConfigError, match=r"is not valid YAML \(.+\); quote a string value") as info:
        load_config(overrides=[override])
    assert f"override `{override}`" in str(info.value)


@pytest.mark.parametrize("text", ["runner:\n  max_steps: [1,\n", "runner:\n  max_steps: !!python/object:os.system ls\n"])
def test_a_file_that_is_not_yaml_is_a_config_error(tmp_path, text):
    with pytest.raises(ConfigError, match=r"run.yaml: not valid YAML: .+line \d+"):
        load_config(write(tmp_path, text), "run")


@pytest.mark.parametrize("override, expected", [
    ("rollout.top_p=5", "rollout.top_p: 5.0 must be in (0, 1]"),
    ("rollout.top_p=0", "rollout.top_p: 0.0 must be in (0, 1]"),
    ("cluster.num_gpus_per_node=1000000000", "at most 1024 per node and 65536 in all are supported"),
    ("cluster.num_nodes=40000", "2 GPUs on a node, 80000 in all"),
])
def test_values_that_would_fail_late_or_never_fail_at_load(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert expected in str(info.value)


def test_wandb_project_needs_wandb_installed_at_load(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="runner.wandb_project: 'x' needs the wandb package"):
        load_config(overrides=["runner.wandb_project=x"])
    assert load_config().runner.wandb_project is None


@pytest.mark.parametrize("override", ["algorithm.clip_ratio_low=.nan", "algorithm.kl_coef=.inf",
                                      "algorithm.entropy_coef=-.inf", "reward.timeout_s=.nan",
                                      "rollout.temperature=.nan", "rollout.gpu_memory_fraction=.nan"])
def test_numbers_must_be_finite(override):
    key = override.partition("=")[0]
    with pytest.raises(ConfigError, match=f"{key}: expected a finite number, got -?(nan|inf) \\(from override"):
        load_config(overrides=[override])


def test_missing_config_name_lists_available():
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLES, "tiny-grpo-megatron-pipline")
    assert "did you mean `tiny-grpo-megatron-pipeline`" in str(info.value)


def test_missing_config_folder():
    with pytest.raises(ConfigError, match="no such folder"):
        load_config("/nonexistent/folder", "x")


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError):
        load_config(write(tmp_path, "- 1\n- 2\n"), "run")


def test_yaml_int_placement_value(tmp_path):
    folder = write(tmp_path, "cluster:\n  num_gpus_per_node: 4\n  component_placement:\n    rollout: 0-1\n"
                             "    inference: 3\n    actor: 2\n")
    assert load_config(folder, "run").cluster.component_placement["inference"] == 3


def test_mapping_override_replaces_instead_of_merging():
    cfg = load_config(EXAMPLES, "tiny-grpo-megatron-pipeline",
                      ['cluster.component_placement={"actor,rollout": all}', "cluster.num_gpus_per_node=2"])
    assert cfg.cluster.component_placement == {"actor,rollout": "all"}


def test_single_placement_key_override_merges():
    cfg = load_config(EXAMPLES, "tiny-grpo-megatron-pipeline",
                      ["cluster.num_gpus_per_node=4", "cluster.component_placement.actor=2-3"])
    assert cfg.cluster.component_placement == {"rollout": 0, "actor": "2-3"}


def test_single_placement_key_override_merges_into_the_default_and_whole_mappings_replace():
    assert load_config(overrides=["cluster.num_gpus_per_node=4", "cluster.component_placement.actor=2-3"]
                       ).cluster.component_placement == {"rollout": 0, "actor": "2-3"}
    collocated = load_config(EXAMPLES, "tiny-grpo-megatron")  # the file's mapping replaces the default one
    assert collocated.cluster.component_placement == {"actor,rollout": "all"}
    whole = load_config(overrides=['cluster.component_placement={"actor,rollout": all}'])
    assert whole.cluster.component_placement == {"actor,rollout": "all"}


def test_derived_rollout_model_path_keeps_explicit_value():
    assert load_config(overrides=["rollout.model_path=/m"]).rollout.model_path == "/m"
    assert load_config(overrides=["actor.model_path=/a"]).rollout.model_path == "/a"


def test_null_for_optional():
    assert load_config(overrides=["runner.resume_dir=null"]).runner.resume_dir is None


def test_dual_clip_must_exceed_one():
    with pytest.raises(ConfigError, match="algorithm.dual_clip_c: 0.5 must be > 1"):
        load_config(overrides=["algorithm.dual_clip_c=0.5"])
    assert load_config(overrides=["algorithm.dual_clip_c=3"]).algorithm.dual_clip_c == 3.0


def test_nested_section_values_types_and_bounds():
    cfg = load_config(overrides=["data.arithmetic.max_value=50", "data.arithmetic.operators=[+,'*']"])
    assert cfg.data.arithmetic.max_value == 50 and cfg.data.arithmetic.operators == ["+", "*"]
    with pytest.raises(ConfigError, match=r"data.arithmetic.num_operands: must be >= 2, got 1"):
        load_config(overrides=["data.arithmetic.num_operands=1"])
    with pytest.raises(ConfigError, match=r"unknown key `data.arithmetic.max` .* valid names: `max_value`"):
        load_config(overrides=["data.arithmetic.max=3"])


def test_schema_defaults_match_the_data_module():
    from rlinf_pipe.data.templates import DEFAULT_SYSTEM_PROMPT

    assert load_config().data.system_prompt == DEFAULT_SYSTEM_PROMPT


@pytest.mark.parametrize("pattern, problem", [("#### (", "not a usable regex"), ("####", "no capture group")])
def test_bad_answer_pattern(pattern, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(overrides=[f"reward.answer_pattern='{pattern}'"])




@pytest.mark.parametrize("section", ["actor", "inference"])
def test_sequence_parallelism_needs_tensor_parallelism(section):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{section}.sequence_parallel=true"])
    assert f"{section}.sequence_parallel: true splits each layer's sequence" in str(info.value)
    assert f"set {section}.tensor_parallel_size to 2 or more" in str(info.value)
    loaded = load_config(overrides=[f"{section}.sequence_parallel=true", f"{section}.tensor_parallel_size=2"])
    assert getattr(loaded, section).sequence_parallel


@pytest.mark.parametrize("section", ["actor", "inference"])
def test_context_parallelism_needs_packed_sequences(section):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{section}.context_parallel_size=2", "actor.pack_sequences=false"])
    assert f"{section}.context_parallel_size: 2 splits packed sequences" in str(info.value)
    assert "set actor.pack_sequences: true" in str(info.value)
    assert load_config(overrides=[f"{section}.context_parallel_size=2"]).actor.pack_sequences
