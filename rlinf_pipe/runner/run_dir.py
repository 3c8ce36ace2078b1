"""A run's folder: `<output_dir>/<experiment_name>/<timestamp>/`, and finding checkpoints to resume from.

Layout: `config.yaml` (the resolved config), `metrics.jsonl`, `tensorboard/`, `timeline.json`, `timeline.png`,
`reward.png`, `summary.json`, `events.jsonl` (restarts, resumes and stops, one JSON object each) and
`checkpoints/step_NNNNNN/` (each with a `COMPLETE` marker written last, so a checkpoint interrupted half-way is
never resumed from). A resumed run continues in the folder of its checkpoint (`runner.resume_new_run_dir`: a new
one).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.utils.folders import COMPLETE, absolute, is_complete


MIN_FREE_BYTES = 256 << 20  # below this much free space a run cannot save even the tiny model's checkpoint


def create_run_dir(cfg: Config) -> Path:
    """A fresh, empty run folder (a numeric suffix is added if two runs start in the same second). A folder that
    cannot be created or written, or a disk that is (nearly) full, is a `ConfigError` naming runner.output_dir."""
    root = absolute(Path(cfg.runner.output_dir).expanduser()) / cfg.runner.experiment_name  # (for workers)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        path = root / (stamp if i == 0 else f"{stamp}-{i}")
        try:
            path.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            if not path.parent.is_dir():  # a file where a folder of the path must be
                raise _unusable(cfg, path, "a file stands where a folder of this path must be") from None
            continue
        except OSError as exc:
            raise _unusable(cfg, path, exc.strerror or str(exc)) from None
        check_writable(cfg, path)
        return path
    raise ConfigError(f"runner.output_dir: cannot find a new run folder name under {root} (1000 taken)")


def check_writable(cfg: Config, run_dir: Path) -> None:
    """Fail now, not at the first checkpoint, when the run folder cannot be written or its disk is full."""
    probe = run_dir / ".write-test"
    try:
        probe.write_text("x")
        probe.unlink()
        free = shutil.disk_usage(run_dir).free
    except OSError as exc:
        raise _unusable(cfg, run_dir, exc.strerror or str(exc)) from None
    if free < MIN_FREE_BYTES:
        raise _unusable(cfg, run_dir, f"its disk has only {free / 2**20:.0f} MiB free (at least "
                                      f"{MIN_FREE_BYTES >> 20} MiB needed for checkpoints and metrics)")


def _unusable(cfg: Config, path: Path, why: str) -> ConfigError:
    return ConfigError(f"runner.output_dir: the run folder {path} cannot be used: {why}; give runner.output_dir a "
                       f"writable folder with free space (now {cfg.runner.output_dir!r})")


def run_dir_of(ckpt: Path) -> Path | None:
    """The run folder a `checkpoints/step_N` folder belongs to (None for a checkpoint elsewhere)."""
    ckpt = absolute(ckpt)
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None


def open_run_dir(cfg: Config, resume_from: Path | None) -> Path:
    """The run's folder: the resumed checkpoint's run folder, else (or with `runner.resume_new_run_dir`) a new
    one."""
    if resume_from is not None and not cfg.runner.resume_new_run_dir:
        existing = run_dir_of(resume_from)
        if existing is not None:
            check_writable(cfg, existing)
            return existing
    return create_run_dir(cfg)


def record_event(run_dir: Path, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event (`restart`, `resume`, `stop`) to `<run_dir>/events.jsonl`; returns it."""
    event = {"event": kind, "time": time.time(), **fields}
    with (run_dir / "events.jsonl").open("a") as f:
        f.write(json.dumps(event) + "\n")
    return event


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_config(cfg: Config, run_dir: Path) -> None:
    (run_dir / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def complete_checkpoints(folder: Path) -> list[Path]:
    """The complete checkpoints of run folder `folder`, lowest step first."""
    return sorted((p for p in folder.glob("checkpoints/step_*") if is_complete(p)), key=lambda p: p.name)


def find_resume_checkpoint(cfg: Config) -> Path | None:
    """The checkpoint `runner.resume_dir` names: `auto` (the complete one with the highest step among this
    experiment's runs, the most recently finished of equal steps; or None), a run folder (its highest complete
    one), or a checkpoint folder (which must be complete)."""
    spec = cfg.runner.resume_dir
    if not spec:
        return None
    if spec == "auto":
        root = Path(cfg.runner.output_dir) / cfg.runner.experiment_name
        candidates = [c for run in root.glob("*") if run.is_dir() for c in complete_checkpoints(run)]
        return max(candidates, key=lambda p: (p.name, (p / COMPLETE).stat().st_mtime), default=None)
    path = Path(spec)
    if is_complete(path):
        return path
    found = complete_checkpoints(path) if path.is_dir() else []
    if found:
        return found[-1]
    raise ConfigError(
        f"runner.resume_dir: {spec!r} is not a complete checkpoint (no {COMPLETE} marker) nor a run folder with "
        "one; give a `checkpoints/step_N` folder written by a finished save, a run folder, or `auto`"
    )
