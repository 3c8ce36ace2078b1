"""Fuzzing `rlinf-pipe plan` with a generated table of bad and good input (over 1,000 cases): every config key with
values of the wrong kind, broken YAML, non-finite and huge numbers, YAML tags; placement strings of every shape;
values of the right type that no run can take (`MUST_REFUSE`: each family once let through) and files that `train`
would refuse; config files of any encoding and top-level type. Each case either plans (exit 0) or is refused with
exit 2 and a short `error: ...` message; never a traceback, never another exit. Values that can never be valid must
be refused, and known-good ones must still plan."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import typing

import pytest

from rlinf_pipe.cli import main
from rlinf_pipe.config.schema import Config

BAD_VALUES = [
    "abc", "[1,", "'5", ".nan", "-.inf", "1e999", "-1", "", "null", "{a: 1}", "[1, 2]",
    "!!python/object/apply:os.system ['true']", "99999999999999999999", "${nope}", "1:0",
]
NEVER_VALID = ["[1,", "'5", "!!python/object/apply:os.system ['true']", "${nope}"]
NON_FINITE = [".nan", "-.inf", "1e999"]
PLACEMENT_VALUES = [
    "0-3", "0-3,", ",0-3", "", "all", "-1", "3-0", "0-99999", "1:0", "a-b", "0,,1", "0-1-2", "null", "[0, 1]",
    "{x: 1}", "0-3,2", "' 0 - 3 '", "0-3:2", "2", "0", "1-2", "0-0", "4", "0-4", "all,0", "*", "0;1", "1.5", "0-3:0",
]
PLACEMENT_KEYS = ["actor", "rollout", "inference", "reward", "actor,rollout", "actor,inference", "critic", "actor,"]
GPU_COUNTS = ["cluster.num_gpus_per_node=4", "cluster.num_gpus_per_node=2", "cluster.num_gpus_per_node=[4,4]",
              "cluster.num_gpus_per_node=1000000000", "cluster.num_nodes=3"]
VALID = [
    [], ["runner.max_steps=5"], ["cluster.component_placement.actor=1"], ["runner.experiment_name=exp-${runner.seed}"],
    ["rollout.top_p=0.9"], ["algorithm.kl_coef=0.01"], ["reward.timeout_s=2.5"], ["runner.max_restarts=3"],
    ['cluster.component_placement={"actor,rollout": all}', "cluster.num_gpus_per_node=2"],
    ["data.arithmetic.operators=[+]"], ["runner.stop_grace_s=0"], ["runner.save_on_signal=true"],
    ["rollout.top_k=5"], ["cluster.ray_address=10.0.0.1:6379"], ["cluster.ray_address=ray://head:10001"],
    ["data.template='Q: {prompt} A:'"], ["runner.seed=9223372036854775807"], ["runner.wandb_tags=[a, b]"],
]
# Values of the right type that no run can take (each family once planned with exit 0), and what `train` refuses
# before Ray starts (missing model folders, datasets, checkpoints): `plan` refuses them all.
MUST_REFUSE = [
    ["data.arithmetic.operators=[]"], ["data.arithmetic.operators=['^']"], ["data.arithmetic.operators=['+', '']"],
    ["data.arithmetic.min_value=11"], ["rollout.top_k=-5"], ["rollout.top_k=0"], ["data.template=Q"],
    ["data.template='{prompt'"], ["data.template='{prompt} {x}'"], ["cluster.ray_address=not-an-address"],
    ["cluster.ray_address=10.0.0.1:65536"], ["cluster.ray_address=10.0.0.1:0"], ["runner.weight_bucket_mb=99999999999"],
    ["runner.seed=18446744073709551616"], ["runner.seed=-1"], ['runner.experiment_name="a\x00b"'],
    ['runner.output_dir="out\x00"'], ["actor.model_path=/nowhere/model"], ["rollout.model_path=/nowhere/model"],
    ["data.dataset=/nowhere/train.jsonl"], ["runner.resume_dir=/nowhere/checkpoints/step_3"],
    ["runner.val_interval=1", "data.val_dataset=/nowhere/val.jsonl"],
]
# Config files: (name, bytes). Every one is refused in one line naming the file.
BAD_FILES = [
    ("scalar", b"42\n"), ("string", b"just text\n"), ("list", b"- runner\n- cluster\n"),
    ("latin1", "runner:\n  experiment_name: caf\u00e9\n".encode("latin-1")),
    ("utf16", "runner:\n  max_steps: 3\n".encode("utf-16")), ("nul", b"runner:\n  max_steps: 3\x00\n"),
    ("binary", bytes(range(256))), ("tabs", b"runner:\n\tmax_steps: 3\n"), ("unknown", b"runner:\n  max_stepz: 3\n"),
    ("section-scalar", b"runner: 5\n"), ("yaml-tag", b"runner: !!python/object/apply:os.system ['true']\n"),
]


def _leaf_keys(tp: type, prefix: str = "") -> list[tuple[str, typing.Any]]:
    keys = []
    for name, hint in typing.get_type_hints(tp).items():
        if dataclasses.is_dataclass(hint):
            keys += _leaf_keys(hint, f"{prefix}{name}.")
        else:
            keys.append((f"{prefix}{name}", hint))
    return keys


KEYS = _leaf_keys(Config)


def _is_float(hint: typing.Any) -> bool:
    return hint is float or float in typing.get_args(hint)


def _plan(overrides: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *overrides])
    return code, err.getvalue()


def _cases() -> list[tuple[list[str], str]]:
    """(overrides, expectation): `refused`, `planned`, or `either` (valid for some keys, not others)."""
    cases = []
    for key, hint in KEYS:
        for value in BAD_VALUES:
            must_refuse = value in NEVER_VALID or (value in NON_FINITE and _is_float(hint))
            cases.append(([f"{key}={value}"], "refused" if must_refuse else "either"))
    for key in PLACEMENT_KEYS:
        for value in PLACEMENT_VALUES:
            cases.append(([f"cluster.component_placement.{key}={value}"], "either"))
    for gpus in GPU_COUNTS:
        cases.append(([gpus], "either"))
    cases += [(overrides, "planned") for overrides in VALID]
    cases += [(overrides, "refused") for overrides in MUST_REFUSE]
    return cases


CASES = _cases()


def test_the_table_is_large():
    assert len(CASES) >= 1000, len(CASES)


def test_every_case_plans_or_is_refused_with_one_clear_error():
    problems = []
    for overrides, expected in CASES:
        try:
            code, err = _plan(overrides)
        except BaseException as exc:  # noqa: BLE001 - what escapes main() is the finding
            problems.append(f"{overrides}: raised {type(exc).__name__}: {exc}")
            continue
        lines = err.strip().splitlines()
        if code not in (0, 2) or "Traceback" in err:
            problems.append(f"{overrides}: exit {code}, {err[-300:]!r}")
        elif code == 2 and (not lines or not lines[0].startswith("error: ") or len(lines) > 4):
            problems.append(f"{overrides}: unclear message {err!r}")
        elif code == 0 and expected == "refused":
            problems.append(f"{overrides}: accepted, must be refused")
        elif code == 2 and expected == "planned":
            problems.append(f"{overrides}: refused a valid config: {err.strip()}")
    assert not problems, f"{len(problems)} of {len(CASES)} cases:\n" + "\n".join(problems[:40])


@pytest.mark.parametrize("value", NON_FINITE)
def test_non_finite_numbers_are_refused_naming_the_key(value):
    code, err = _plan([f"algorithm.clip_ratio_high={value}"])
    assert code == 2 and "algorithm.clip_ratio_high: expected a finite number" in err


@pytest.mark.parametrize("name, content", BAD_FILES, ids=[n for n, _ in BAD_FILES])
def test_a_config_file_of_any_encoding_or_shape_is_one_clear_error(tmp_path, name, content):
    file = tmp_path / f"{name}.yaml"
    file.write_bytes(content)
    code, err = _plan([str(file)])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert str(file) in err or "runner" in err, err


def test_an_empty_config_file_is_the_defaults(tmp_path):
    (tmp_path / "empty.yaml").write_bytes(b"")
    assert _plan([str(tmp_path / "empty.yaml")])[0] == 0
