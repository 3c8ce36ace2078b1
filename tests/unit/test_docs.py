"""Docs that match the code: the generated config reference, every command the docs show (it parses, and its
config loads and passes the checks `plan --no-files` runs; nothing is started), and every `plan` output they quote
(what `plan` prints for that command)."""

from __future__ import annotations

import contextlib
import difflib
import io
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from rlinf_pipe.config.reference import END, START, render_reference
from support.doc_commands import (
    ELISION,
    DocCommand,
    OutputBlock,
    doc_commands,
    fenced_blocks,
    inline_spans,
    matches,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DOC_FILES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
SHIPPED = "examples/math/config/tiny-grpo-megatron-pipeline.yaml"
A_RUN_DIR = "outputs/tiny-grpo-pipeline/20250101-120000"

PLACEHOLDERS = {
    # A run's folder where the command only names it (`timeline`: parsed, not read).
    "<run folder>": A_RUN_DIR,
    "RUN_DIR": A_RUN_DIR,
    "<time>": "20250101-120000",
    # A run's folder whose `config.yaml` the command reads (`eval RUN/config.yaml`): the test writes one as a run
    # does (`run_dir.write_config`).
    "RUN/": "{run}/",
    # "Any config": a shipped one stands in.
    "--config-name <config>": "--config-name tiny-grpo-megatron-pipeline",
    "--config-name NAME": "--config-name tiny-grpo-megatron-pipeline",
    "train CONFIG ": f"train {SHIPPED} ",
    "rehearse CONFIG [key=value ...]": f"rehearse {SHIPPED} runner.max_steps=3",
    "my.yaml key=value ...": SHIPPED,
    "my.yaml ...": SHIPPED,
    "my-placement.yaml": SHIPPED,
    "my-run.yaml": SHIPPED,
    # The run scripts' usage line: a shipped config's name and an override stand in.
    "[CONFIG] [key=value ...]": "tiny-grpo-megatron-pipeline runner.max_steps=5",
    "<nodes>": "1",
    " [your overrides]": "",
    # A model folder of an unsupported family (models.md): the test writes a GPT-2 config.json.
    "/models/gpt2": "{gpt2}",
}
"""The placeholders the docs' commands may hold, each with what the test puts in its place. Any other `<...>` left in
a command fails the test; an entry no command uses fails too."""

EXPECTED_ERRORS = {
    ("docs/benchmarks.md", 'rlinf-pipe train "cluster.component_placement={rollout: 0, actor: 9}"'):
        "shows how fast a placement error stops a run: GPU 9 is beyond the default cluster",
}
"""Commands shown to demonstrate an error, outside an output block (those compare the error itself): each must
fail with a user error (`RlinfPipeError`) when its config is loaded and checked."""

GPT2_CONFIG = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
               "vocab_size": 50257}


def test_configuration_reference_matches_schema():
    text = (DOCS / "configuration.md").read_text()
    embedded = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert embedded == render_reference().strip(), (
        "docs/configuration.md is out of date: regenerate the block with `python -m rlinf_pipe.config.reference --write`"
    )


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory) -> dict[str, str]:
    from rlinf_pipe.config import load_config
    from rlinf_pipe.runner.run_dir import write_config

    run = tmp_path_factory.mktemp("run")
    write_config(load_config(), run)
    gpt2 = tmp_path_factory.mktemp("gpt2")
    (gpt2 / "config.json").write_text(json.dumps(GPT2_CONFIG))
    return {key: value.format(run=run, gpt2=gpt2) for key, value in PLACEHOLDERS.items()}


@pytest.fixture(scope="module")
def shown(placeholders) -> tuple[list[DocCommand], list[OutputBlock]]:
    commands, outputs = [], []
    for path in DOC_FILES:
        found, blocks = doc_commands(path, ROOT, placeholders)
        commands += found
        outputs += blocks
    return commands, outputs


# -- the extraction itself ---------------------------------------------------------------------------------------


def test_the_extraction_finds_commands_in_blocks_and_spans(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Run `rlinf-pipe plan --config-name a\n  x=1` or `rlinf-pipe plan` (a name).\n\n"
        "```bash\n"
        "$ RANK=0 bash examples/a.sh \\\n    k=v   # a comment\n"
        "bash scripts/setup.sh && .venv/bin/rlinf-pipe timeline <run folder>\n"
        "  note: rlinf-pipe's message, quoted\n"
        "```\n\n"
        "```\n$ rlinf-pipe plan y=2\nmode: ...\n...\n\n```\n")
    commands, outputs = doc_commands(doc, tmp_path, {"<run folder>": "runs/r"})
    assert [(c.line, c.words) for c in commands] == [
        (5, ("bash", "examples/a.sh", "k=v")),
        (7, (".venv/bin/rlinf-pipe", "timeline", "runs/r")),
        (1, ("rlinf-pipe", "plan", "--config-name", "a", "x=1")),
        (12, ("rlinf-pipe", "plan", "y=2")),
    ]
    assert commands[1].placeholders == ("<run folder>",)
    assert [(o.command.line, o.expected) for o in outputs] == [(12, ["mode: ...", ELISION])]
    assert matches(["a", ELISION, "d"], ["a", "b", "c", "d"]) and matches(["a", ELISION], ["a"])
    assert not matches(["a", ELISION, "d"], ["a", "b"]) and not matches(["a"], ["a", "b"])


def test_every_placeholder_is_used(shown):
    commands, _ = shown
    used = {p for command in commands for p in command.placeholders}
    assert set(PLACEHOLDERS) - used == set(), "placeholders no command uses any more: drop them from PLACEHOLDERS"


# -- every command parses and its config loads -------------------------------------------------------------------


class _Loaded(Exception):
    """Raised in place of running a training or an evaluation once its config is loaded."""


def _check_cli(argv: list[str]) -> str | None:
    """`rlinf-pipe ARGV` up to its run: argument parsing; `plan`: the config loaded and checked as `plan --no-files`
    checks it (placement, algorithm, the model's sizes and context: no file read; `rehearse` the same, which is
    what it checks before it trains); `train`: the command itself,
    stopped where it would start the run, after the same checks; `eval`: the command, stopped once its config is
    loaded, where the evaluation would start; `convert` and `timeline`: parsing only. The error, or None."""
    from rlinf_pipe.cli import build_parser, load_cli_config
    from rlinf_pipe.errors import RlinfPipeError
    from rlinf_pipe.runner.preflight import preflight

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return f"argument parsing failed (exit {exc.code}): {err.getvalue().strip()}"
    try:
        if args.command in ("plan", "rehearse"):  # (a rehearsal runs these checks first, then trains)
            preflight(load_cli_config(args), files=False)
        elif args.command in ("train", "eval"):
            args.run(args)
            return f"`{args.command}` returned without loading its config"
    except _Loaded:
        return None
    except RlinfPipeError as exc:
        return f"error: {exc}"
    return None


def _stop_before_running(monkeypatch) -> None:
    import rlinf_pipe.engines.offline_eval as offline_eval
    import rlinf_pipe.runner as runner
    from rlinf_pipe.runner.preflight import preflight

    def checked(cfg, *args, **kwargs):
        preflight(cfg, files=False)
        raise _Loaded

    def loaded(*args, **kwargs):
        raise _Loaded

    monkeypatch.setattr(runner, "run", checked)
    monkeypatch.setattr(offline_eval, "evaluate_model", loaded)


STUB_PYTHON = """#!/bin/sh
# Stands in for python: records its arguments (NUL-separated, one invocation a record) and does nothing.
{ printf '%s\\0' "$@"; printf '%s\\0' "{end}"; } >> "$DOCS_STUB_LOG"
"""
_END = "--end-of-invocation--"


def _script_invocations(command: DocCommand, stub: Path, log: Path) -> tuple[int, str, list[list[str]]]:
    """Run `bash examples/...` as shown, with `$PYTHON` a stub that records how the script calls Python (and does
    nothing): its exit status, output and the recorded argument lists."""
    log.write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if k not in ("RLINF_PIPE_DEFAULT_CONFIG", "RLINF_PIPE_SCRIPT")}
    env.update(PYTHON=str(stub), DOCS_STUB_LOG=str(log))
    done = subprocess.run(list(command.words), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    records, current = [], []
    for word in log.read_bytes().decode().split("\0")[:-1]:
        if word == _END:
            records.append(current)
            current = []
        else:
            current.append(word)
    return done.returncode, done.stdout + done.stderr, records


def _cli_argv_of(python_args: list[str]) -> list[str] | None:
    """The `rlinf-pipe` arguments a Python invocation of a script amounts to: `main_math.py ARGS` (run here with
    `rlinf_pipe.cli.main` replaced, to see what it passes) or `-m rlinf_pipe.cli ARGS`; None for other Python (the
    scripts' helpers reading a run's outputs)."""
    import rlinf_pipe.cli as cli

    if python_args[:2] == ["-m", "rlinf_pipe.cli"]:
        return python_args[2:]
    if not python_args or not python_args[0].endswith("main_math.py"):
        return None
    seen: list[list[str]] = []
    real_main, real_argv = cli.main, sys.argv
    cli.main = lambda argv=None: seen.append(list(argv)) or 0
    sys.argv = list(python_args)
    try:
        runpy.run_path(python_args[0], run_name="__main__")
    except SystemExit:
        pass
    finally:
        cli.main, sys.argv = real_main, real_argv
    assert len(seen) == 1, f"{python_args[0]} called rlinf_pipe.cli.main {len(seen)} times"
    return seen[0]


def _check_script(command: DocCommand, stub: Path, log: Path) -> str | None:
    if command.args in (["--help"], ["-h"]):
        code, output, records = _script_invocations(command, stub, log)
        if code != 0 or "Shipped configs:" not in output or records:
            return f"--help exited {code} after {len(records)} Python call(s): {output[-500:]}"
        return None
    code, output, records = _script_invocations(command, stub, log)
    calls = [argv for argv in map(_cli_argv_of, records) if argv is not None]
    if not calls:
        return f"the script called no rlinf-pipe command (exit {code}): {output[-500:]}"
    for argv in calls:  # (a script whose later steps read the run's outputs stops after its first call here)
        error = _check_cli(argv)
        if error:
            return f"{error} (the script ran `rlinf-pipe {' '.join(argv)}`)"
    return None


def test_every_command_in_the_docs_parses_and_loads_its_config(shown, tmp_path, monkeypatch):
    """Every `rlinf-pipe ...` and `bash examples/...` command of README.md and docs/*.md, in fenced blocks and inline
    spans, up to the point where it would start something (see `_check_cli`); a script is run with a stub Python
    (see `_script_invocations`). The commands of output blocks are run whole by
    `test_every_plan_output_in_the_docs_is_what_plan_prints`. Failures name the file, line and command."""
    commands, _ = shown
    monkeypatch.chdir(ROOT)  # (the docs' commands run from the checkout's root)
    _stop_before_running(monkeypatch)
    stub = tmp_path / "python"
    stub.write_text(STUB_PYTHON.replace("{end}", _END))
    stub.chmod(0o755)
    log = tmp_path / "calls"
    failures, checked, expected_seen = [], 0, set()
    for command in commands:
        if command.in_output_block:
            continue
        leftover = [w for w in command.words if "<" in w and ">" in w]
        if leftover:
            failures.append(f"{command}: placeholder {leftover} is not in PLACEHOLDERS")
            continue
        checked += 1
        if command.kind == "bash":
            error = _check_script(command, stub, log)
        else:
            error = _check_cli(command.args)
        key = (command.file, command.text)
        if key in EXPECTED_ERRORS:
            expected_seen.add(key)
            if error is None or not error.startswith("error: "):
                failures.append(f"{command}: shown as an error ({EXPECTED_ERRORS[key]}), got {error or 'no error'}")
        elif error:
            failures.append(f"{command}: {error}")
    assert not failures, "commands in the docs that do not parse or load:\n" + "\n".join(failures)
    assert set(EXPECTED_ERRORS) == expected_seen, "EXPECTED_ERRORS entries no doc shows any more"
    assert checked >= 40, f"only {checked} commands found: the extraction lost some"


# -- every quoted `plan` output is what `plan` prints ------------------------------------------------------------


PLAN_OUTPUT_MARKS = ("mode: collocated", "mode: disaggregated", "mode: hybrid", "memory/GPU (GiB)", "checks passed: ",
                     "weight sync: ", "component  yaml key")


def test_every_plan_output_in_the_docs_names_its_command():
    """A fenced block that shows `plan`'s output starts with the command that printed it (`$ rlinf-pipe plan ...`),
    so that the next test can compare it."""
    unnamed = []
    for path in DOC_FILES:
        blocks, _ = fenced_blocks(path.read_text())
        for block in blocks:
            if block.lines and block.lines[0].startswith("$ rlinf-pipe "):
                continue
            if any(line.startswith(PLAN_OUTPUT_MARKS) for line in block.lines):
                unnamed.append(f"{path.relative_to(ROOT)}:{block.line}")
    assert not unnamed, "plan output without its `$ rlinf-pipe plan ...` line: " + ", ".join(unnamed)


def test_every_plan_output_in_the_docs_is_what_plan_prints(shown, placeholders, capsys, monkeypatch):
    """Each `$ rlinf-pipe plan ...` block, run in this process (stdout and stderr, on a machine without a GPU as the
    docs assume: 80 GB), against the lines the block shows; `...` lines stand for any lines, and the checkout's
    folder is written `...`."""
    import torch

    from rlinf_pipe.cli import main

    _, outputs = shown
    assert outputs, "no plan output blocks found"
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    normalise = [(str(ROOT), "..."), (placeholders["/models/gpt2"], "/models/gpt2")]
    failures = []
    for block in outputs:
        command = block.command
        if command.args[:1] != ["plan"]:
            failures.append(f"{command}: output blocks may only show `rlinf-pipe plan`")
            continue
        try:
            main(command.args)
        except SystemExit:  # (argparse's errors)
            pass
        out, err = capsys.readouterr()
        text = out + err
        for real, shown_as in normalise:
            text = text.replace(real, shown_as)
        actual = [line.rstrip() for line in text.rstrip("\n").split("\n")]
        if not matches(block.expected, actual):
            failures.append(f"{command}: the block differs from plan's output\n{_explain(block.expected, actual)}")
    assert not failures, "\n\n".join(failures)


def _explain(expected: list[str], actual: list[str]) -> str:
    """The lines a block shows that plan does not print, each with the closest line it does print; else (the
    lines are all there, in another order or with others between them) a diff against the whole output."""
    missing = [line for line in expected if line != ELISION and line not in actual]
    if not missing:
        return "\n".join(difflib.unified_diff(expected, actual, "docs", "plan", lineterm="", n=1))
    out = []
    for line in missing:
        close = difflib.get_close_matches(line, actual, n=1, cutoff=0.3)
        out += [f"  shown:   {line}", f"  printed: {close[0] if close else '(nothing like it)'}"]
    return "\n".join(out)


def test_inline_spans_ignore_fenced_blocks():
    blocks, prose = fenced_blocks("a `x`\n```\n`y`\n```\nb `z\nw`")
    assert [b.lines for b in blocks] == [("`y`",)]
    assert inline_spans(prose) == [(1, "x"), (5, "z w")]
