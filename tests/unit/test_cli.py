"""`rlinf-pipe plan`: the grid, --json, and user errors as exit 2 without a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlinf_pipe.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = str(ROOT / "examples" / "math" / "config")


def run_plan(capsys, *args: str) -> tuple[int, str, str]:
    """`plan --no-files` (the example configs name model and data folders this machine does not have)."""
    code = main(["plan", "--no-files", "--config-path", CONFIGS, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_default_prints_grid_mode_and_parallelism(capsys):
    code, out, _ = run_plan(capsys)
    assert code == 0
    assert out.startswith("mode: disaggregated")
    grid_row = next(line for line in out.splitlines() if line.startswith("node 0"))
    assert grid_row.split()[2:4] == ["R0", "A0"]
    assert any(line.split()[:2] == ["actor", "actor"] for line in out.splitlines())


def test_plan_four_node_pipeline_grid(capsys):
    code, out, _ = run_plan(capsys, "--config-name", "qwen2.5-1.5b-grpo-megatron-pipeline")
    assert code == 0
    rows = {line.split()[1]: line.split()[2:10] for line in out.splitlines() if line.startswith("node ")}
    assert rows["0"] == [f"R{i}" for i in range(8)]
    assert rows["2"] == ["R16", "R17", "R18", "R19", "I0", "I1", "I2", "I3"]
    assert rows["3"] == [f"A{i}" for i in range(8)]
    actor_row = next(line.split() for line in out.splitlines() if line.startswith("actor "))
    assert actor_row[-3:] == ["1", "1", "8"]  # TP PP DP
    # the memory table: GiB per GPU for every component
    assert "memory estimate (model: " in out and "DeepSeek-R1-Distill-Qwen-1.5B" in out
    table = {line.split()[0]: line.split()[1:] for line in out.splitlines()
             if line.split()[:1] in (["rollout"], ["inference"], ["actor"]) and line.split()[-1] == "fits"}
    assert set(table) == {"rollout", "inference", "actor"} and "warning" not in out


def test_plan_warns_when_a_component_does_not_fit(capsys):
    code, out, _ = run_plan(capsys, "--config-name", "qwen2.5-1.5b-grpo-megatron-pipeline",
                            "actor.micro_batch_tokens=null", "actor.micro_batch_size=4", "actor.recompute=none")
    assert code == 0 and "DOES NOT FIT" in out
    warning = next(line for line in out.splitlines() if line.startswith("warning: actor:"))
    assert "activations" in warning and "actor.micro_batch_tokens" in warning and "actor.recompute" in warning


def test_plan_collocated_cells_show_both_components(capsys):
    code, out, _ = run_plan(capsys, "--config-name", "tiny-grpo-megatron")
    assert code == 0 and "mode: collocated" in out and "A0+R0" in out and "A1+R1" in out


def test_plan_prints_warnings(capsys):
    code, out, _ = run_plan(capsys, "cluster.num_gpus_per_node=5")
    assert code == 0 and "warning: GPU(s) 2-4 are not used" in out


def test_plan_warns_that_inference_has_nothing_to_compute(capsys):
    three = ["cluster.num_gpus_per_node=3", "cluster.component_placement={rollout: 0, inference: 1, actor: 2}"]
    code, out, _ = run_plan(capsys, *three)
    assert code == 0 and "warning: inference (GPU(s) 1) has nothing to compute" in out
    code, out, _ = run_plan(capsys, *three, "algorithm.compute_ref_logprobs=true")
    assert code == 0 and "warning" not in out
    code, out, _ = run_plan(capsys, "--json", *three)
    assert any(w.startswith("inference (GPU(s) 1) has nothing") for w in json.loads(out)["warnings"])


def test_plan_json(capsys):
    code, out, _ = run_plan(capsys, "--config-name", "qwen2.5-1.5b-grpo-megatron-pipeline", "--json",
                            "cluster.gpu_memory_gb=80")
    data = json.loads(out)
    assert code == 0 and data["mode"] == "disaggregated"
    assert data["num_nodes"] == 4 and data["gpus_per_node"] == [8, 8, 8, 8]
    assert len(data["components"]["rollout"]) == 20
    assert data["components"]["rollout"][9] == {"rank": 9, "node_rank": 1, "local_gpus": [1], "global_gpus": [9]}
    assert data["components"]["actor"][0]["global_gpus"] == [24]
    memory = data["memory"]
    assert set(memory) == {"rollout", "inference", "actor"}
    for component in memory.values():
        kinds = component["per_gpu_bytes"]
        assert set(kinds) == {"weights", "grads", "optimizer", "activations", "kv_cache", "resident", "total"}
        assert kinds["total"] == sum(v for k, v in kinds.items() if k != "total") <= component["capacity_bytes"]
        assert component["capacity_bytes"] == 80 * 10**9 and component["fits"] is True
    assert memory["actor"]["per_gpu_bytes"]["optimizer"] > 0 == memory["rollout"]["per_gpu_bytes"]["optimizer"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["cluster.component_placement.actor=9"], "invalid placement `actor: 9`"),
        (["runner.max_step=1"], "unknown key `runner.max_step`"),
        (["--config-name", "nope"], "--config-name nope"),
        (["cluster.component_placement={actor,rollout: all}"], "YAML splits `{actor,rollout: all}` at the comma"),
        (["cluster.component_placement={actor,rollout:all}"],
         "write `rollout: all`; and `actor` got no GPUs. YAML splits"),
        (["cluster.component_placement={rollout:0,actor:1}"],
         "a space after the colon, or it reads one key with no value; write `rollout: 0`, `actor: 1`"),
    ],
)
def test_user_errors_exit_2_with_message(capsys, args, expected):
    code, out, err = run_plan(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and expected in err and "Traceback" not in err


def test_plan_runs_the_file_checks_of_train_unless_told_not_to(capsys):
    code = main(["plan", "--config-path", CONFIGS, "--config-name", "qwen2.5-1.5b-grpo-megatron-pipeline"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "actor.model_path: unknown model '/mnt/models/DeepSeek-R1-Distill-Qwen-1.5B'" in err
    assert "`rlinf-pipe plan --no-files` skips the checks of files" in err
    code, out, _ = run_plan(capsys, "--config-name", "qwen2.5-1.5b-grpo-megatron-pipeline")
    assert code == 0 and "checks skipped (--no-files): model names, dataset files, reward function, resume checkpoint" in out
    checks = next(line for line in out.splitlines() if line.startswith("checks passed: "))
    assert "models' families and parallel sizes" in checks and "data settings" in checks


def test_plan_says_which_weight_transport_the_run_takes_and_why(capsys):
    code, out, _ = run_plan(capsys, "--config-name", "tiny-grpo-megatron-hybrid")
    line = next(line for line in out.splitlines() if line.startswith("weight sync: "))
    assert code == 0 and line.startswith("weight sync: object_store to rollout, inference (auto: ")
    assert "the slower object store carries the weights" in line
    code, out, _ = run_plan(capsys, "--config-name", "tiny-grpo-megatron-hybrid", "--json")
    weights = json.loads(out)["weight_sync"]
    assert weights["transport"] == "object_store" and weights["why"].startswith("auto: ")


def test_console_script_exits_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "rlinf_pipe.cli", "plan", "--no-files", "--config-path", CONFIGS,
         "--config-name", "qwen2.5-1.5b-grpo-megatron-pipeline", "cluster.component_placement.actor=20-31"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "rule: inference (20-23) and actor (20-31) share GPU(s) 20-23 but are not identical" in proc.stderr


def test_timeline_of_a_cut_short_timeline_json_is_one_clear_error(tmp_path, capsys):
    from rlinf_pipe.utils.timeline import write_chrome_trace
    from rlinf_pipe.utils.tracing import Span

    write_chrome_trace([Span("step", "driver", 1.0, 2.0, (), {"step": 0})], tmp_path / "timeline.json")
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.json"]  # written whole, no temporary left
    text = (tmp_path / "timeline.json").read_text()
    (tmp_path / "timeline.json").write_text(text[: len(text) // 2])  # what a full disk used to leave
    assert main(["timeline", str(tmp_path), "--no-png"]) == 2
    err = capsys.readouterr().err
    assert "timeline.json is not a readable timeline" in err and "Traceback" not in err


def test_plan_and_train_accept_a_config_file_path(capsys, tmp_path):
    """`rlinf-pipe plan my.yaml key=value`: a path instead of --config-path/--config-name, overrides after it."""
    file = tmp_path / "mine.yaml"
    file.write_text("cluster:\n  num_gpus_per_node: 4\n  component_placement:\n    actor,rollout: all\n")
    code = main(["plan", str(file), "actor.tensor_parallel_size=2", "rollout.tensor_parallel_size=2"])
    out, err = capsys.readouterr()
    assert code == 0 and err == "" and out.startswith("mode: collocated")
    actor_row = next(line.split() for line in out.splitlines() if line.startswith("actor "))
    assert actor_row[-3:] == ["2", "1", "2"]  # TP PP DP: the override applied on top of the file


@pytest.mark.parametrize(
    "args, expected",
    [
        (["missing.yaml"], "missing.yaml: no such config file"),
        (["runner.max_steps"], "runner.max_steps: no such config file; overrides look like key=value"),
        (["--config-name", "tiny-grpo-megatron", "EXAMPLE"], "either as a file or with --config-name"),
    ],
)
def test_config_file_argument_errors(capsys, args, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if "EXAMPLE" in args:
        (tmp_path / "EXAMPLE").write_text("{}\n")
    code, out, err = run_plan(capsys, *args)
    assert code == 2 and out == "" and expected in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model", "no-such-model"], "--model: unknown model 'no-such-model'"),
        (["--model", "tiny", "--limit", "0"], "--limit must be >= 1, got 0"),
    ],
)
def test_eval_user_errors_exit_2_with_message(capsys, tmp_path, args, expected):
    code = main(["eval", *args, "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 2 and expected in err and "Traceback" not in err


def test_plan_prints_the_step_s_stages_with_the_channels_each_reads_and_writes(capsys):
    """The hybrid example: the engines take turns with the actor, inference streams on a GPU of its own."""
    code, out, _ = run_plan(capsys, "--config-name", "tiny-grpo-megatron-hybrid")
    lines = out.splitlines()
    start = lines.index("step (stage, component, reads -> writes):")
    stages = [line.split()[:5] for line in lines[start + 1:start + 5]]
    assert code == 0 and stages == [["generate", "rollout", "prompts", "->", "[rollouts];"],
                                     ["score", "reward", "[rollouts]", "->", "[scored]"],
                                     ["logprob", "inference", "[scored]", "->", "[train]"],
                                     ["train", "actor", "[train]", "->", "weights;"]]
    # Collocated, and an algorithm that needs no log-prob pass: the reward workers feed the actor's train channels.
    code, out, _ = run_plan(capsys, "--config-name", "tiny-grpo-megatron", "--json")
    stages = json.loads(out)["stages"]
    assert [(s["stage"], s["component"], s["reads"], s["writes"], s["turns_with"]) for s in stages] == [
        ("generate", "rollout", None, "rollouts", ["actor"]), ("score", "reward", "rollouts", "train", []),
        ("train", "actor", "train", None, ["rollout"])]
    assert stages[1]["writes_item"] == "TrainBatch"
