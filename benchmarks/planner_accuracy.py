"""How well `plan --validate`'s prediction of the step time holds across placements: one placement is trained and
profiled, every other one is predicted from that profile and trained for real, on virtual GPUs pinned to cores.

    python benchmarks/planner_accuracy.py [--json] [--steps 6] [--warmup 2] [--profile-placement disaggregated]
        [--only NAME ...] [--cores-per-gpu 1] [--output-dir DIR] [--predict-only DIR]

Every run trains examples/math/config/tiny-grpo-megatron-pipeline.yaml (the tiny model warm-started once, its data,
seed and batch) with `cluster.cores_per_gpu=K` (each virtual GPU's workers on K cores of their own, 2 virtual GPUs
unless the placement needs 1) and the placement's overrides (`PLACEMENTS`), through `Runner.start(cfg).run()` in one
local Ray session that this script starts once. Only the placement differs between runs (one config, so the
actor's micro-batches are the same in every run; the collocated example's smaller ones are not measured here).

The profiled placement's run gives the costs (`planning.profile.read_profile`, its first `--warmup` steps left
out); every run, the profiled one included, is then predicted from them exactly as
`rlinf-pipe plan --validate RUN_DIR --profile PROFILE_RUN` does (`planning.validate.validate_run`) and compared with
its measured mean step time (the timeline's step spans after the first `--warmup`).

Reported: per placement its name, overrides, predicted and measured seconds per step and the error
((predicted - measured) / measured); over the placements other than the profiled one, `median_abs_error` and
`max_abs_error`; over all of them, `same_ranking` (the placements sorted by predicted step time == sorted by
measured step time). `--predict-only DIR` re-predicts the runs a previous `--output-dir DIR` kept (its
`runs.json`) without training. With --json the last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "examples" / "math" / "config"
CONFIG = "tiny-grpo-megatron-pipeline"
PIPELINE = "cluster.component_placement={rollout: 0, actor: 1}"


@dataclass(frozen=True)
class Placement:
    """One placement measured: its name and the overrides that turn the tiny pipeline config into it."""

    name: str
    overrides: tuple[str, ...]

    @property
    def gpus(self) -> int:
        return 1 if "cluster.num_gpus_per_node=1" in self.overrides else 2


PLACEMENTS = (
    Placement("disaggregated", (PIPELINE,)),
    Placement("collocated-2", ('cluster.component_placement={"actor,rollout": all}',)),
    Placement("collocated-1", ("cluster.num_gpus_per_node=1", 'cluster.component_placement={"actor,rollout": all}')),
    Placement("hybrid-rollout-inference", ("algorithm.compute_ref_logprobs=true",
                                           'cluster.component_placement={"rollout,inference": 0, actor: 1}')),
    Placement("hybrid-actor-rollout", ("algorithm.compute_ref_logprobs=true",
                                       'cluster.component_placement={"actor,rollout": 0, inference: 1}')),
    Placement("staleness-1", (PIPELINE, "runner.max_staleness=1")),
    Placement("long-responses", (PIPELINE, "rollout.max_new_tokens=64")),
)
BY_NAME = {p.name: p for p in PLACEMENTS}


def load(placement: Placement, args: argparse.Namespace, model: str | None, out: Path) -> Any:
    """The config of one placement's run."""
    from rlinf_pipe.config import load_config

    overrides = [
        f"runner.max_steps={args.steps}", "runner.progress=false", "runner.tensorboard=false",
        f"runner.output_dir={out}", f"runner.experiment_name=accuracy-{placement.name}", "cluster.ray_address=local",
        f"cluster.cores_per_gpu={args.cores_per_gpu}", *placement.overrides,
    ]
    if model is not None:
        overrides.append(f"actor.model_path={model}")
    return load_config(CONFIGS, CONFIG, overrides)


def train(placement: Placement, args: argparse.Namespace, model: str, out: Path) -> Path:
    """Train one placement for `args.steps` steps in this process; its run folder."""
    from rlinf_pipe.runner import Runner

    runner = Runner.start(load(placement, args, model, out))
    try:
        return Path(runner.run())
    finally:
        runner.shutdown()


def compare(runs: dict[str, Path], profiled: str, warmup: int) -> dict[str, Any]:
    """Every run predicted from the profiled run's costs (as `plan --validate RUN --profile PROFILED` does) beside
    its measurement; the summary figures (see the module docstring)."""
    from rlinf_pipe.planning.profile import read_profile
    from rlinf_pipe.planning.validate import validate_run

    costs = read_profile(runs[profiled], warmup=warmup)
    rows = []
    for name, run_dir in runs.items():
        v = validate_run(run_dir, costs, warmup=warmup)
        rows.append({"name": name, "overrides": list(BY_NAME[name].overrides), "profiled": name == profiled,
                     "predicted_step_s": round(v.prediction.step_s, 4), "measured_step_s": round(v.measured_step_s, 4),
                     "error": round(v.error, 4), "predicted_bubble": round(v.prediction.bubble, 3),
                     "measured_bubble": round(v.measured_bubble, 3), "steps_measured": v.steps,
                     "predicted_stage_busy_s": {k: round(b, 4) for k, b in v.prediction.stage_busy_s.items()},
                     "run_dir": str(run_dir)})
    others = [abs(r["error"]) for r in rows if not r["profiled"]] or [abs(r["error"]) for r in rows]
    by_predicted = [r["name"] for r in sorted(rows, key=lambda r: r["predicted_step_s"])]
    by_measured = [r["name"] for r in sorted(rows, key=lambda r: r["measured_step_s"])]
    return {"profiled": profiled, "costs": costs.to_json(),
            "median_abs_error": round(statistics.median(others), 4), "max_abs_error": round(max(others), 4),
            "same_ranking": by_predicted == by_measured, "predicted_ranking": by_predicted,
            "measured_ranking": by_measured, "placements": rows}


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'placement':<26}{'measured s':>11}{'predicted':>11}{'error':>9}")
    for r in summary["placements"]:
        mark = " (profiled)" if r["profiled"] else ""
        print(f"{r['name']:<26}{r['measured_step_s']:>11.3f}{r['predicted_step_s']:>11.3f}{r['error']:>+9.1%}{mark}")
    print(f"median |error| {summary['median_abs_error']:.1%}, worst {summary['max_abs_error']:.1%} (the "
          f"{len(summary['placements']) - 1} placements not profiled); same ranking: {summary['same_ranking']}")
    if not summary["same_ranking"]:
        print(f"  predicted order: {', '.join(summary['predicted_ranking'])}")
        print(f"  measured order:  {', '.join(summary['measured_ranking'])}")


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    return proc.stdout.strip() or "unknown"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per run (runner.max_steps)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    parser.add_argument("--profile-placement", default="disaggregated", choices=list(BY_NAME),
                        help="the placement whose run gives the costs")
    parser.add_argument("--only", nargs="+", choices=list(BY_NAME), default=None,
                        help="train only these placements besides the profiled one (a quick check)")
    parser.add_argument("--cores-per-gpu", type=int, default=1, help="cluster.cores_per_gpu of every run")
    parser.add_argument("--output-dir", default=None, help="keep the run folders here (default: a temp folder)")
    parser.add_argument("--predict-only", metavar="DIR", default=None,
                        help="no training: re-predict the runs an earlier --output-dir DIR kept")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.warmup = min(args.warmup, args.steps - 1)
    return args


def main() -> None:
    args = parse_args()
    if args.predict_only:
        kept = json.loads((Path(args.predict_only) / "runs.json").read_text())
        runs = {name: Path(path) for name, path in kept["runs"].items()}
        summary = compare(runs, kept["profiled"], kept["warmup"])
        summary["settings"] = kept["settings"]
    else:
        summary = measure(args)
    summary["commit"] = commit()
    print()
    print_table(summary)
    if args.json:
        print(json.dumps(summary))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Train the profiled placement and the others, then `compare`."""
    import ray

    from rlinf_pipe.models.warmstart import ensure_warm_tiny_model

    names = [args.profile_placement] + [p.name for p in PLACEMENTS if p.name != args.profile_placement
                                        and (args.only is None or p.name in args.only)]
    gpus = max(BY_NAME[n].gpus for n in names)
    cores = sorted(os.sched_getaffinity(0))
    if gpus * args.cores_per_gpu > len(cores):
        raise SystemExit(f"--cores-per-gpu {args.cores_per_gpu}: {gpus} virtual GPUs need "
                         f"{gpus * args.cores_per_gpu} cores; this process may use {len(cores)}")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    model = str(ensure_warm_tiny_model(data=load(PLACEMENTS[0], args, None, Path(tempfile.gettempdir())).data))
    tmp = tempfile.TemporaryDirectory(prefix="rlp-accuracy-") if args.output_dir is None else None
    out = Path(args.output_dir or tmp.name)  # type: ignore[union-attr]
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    ray.init(address="local", num_cpus=len(cores), num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    runs: dict[str, Path] = {}
    failed: dict[str, str] = {}
    settings: dict[str, Any] = {"steps": args.steps, "warmup": args.warmup, "cores_per_gpu": args.cores_per_gpu,
                                "cores": len(cores), "config": f"examples/math/config/{CONFIG}.yaml"}
    try:
        for name in names:
            t0 = time.perf_counter()
            try:
                runs[name] = train(BY_NAME[name], args, model, out)
            except Exception as exc:  # (one placement's failure is reported; the others still compare)
                if name == args.profile_placement:
                    raise
                failed[name] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"{name:<26} FAILED: {failed[name]}", flush=True)
                continue
            print(f"{name:<26} trained {args.steps} steps in {time.perf_counter() - t0:.0f} s: {runs[name]}",
                  flush=True)
            settings |= {"runtime_s": round(time.perf_counter() - started), "failed": failed,
                         "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average "
                                    f"{os.getloadavg()[0]:.2f} at the end"}
            (out / "runs.json").write_text(json.dumps({  # (kept as it goes: --predict-only reads a partial one)
                "runs": {k: str(v) for k, v in runs.items()}, "settings": settings,
                "profiled": args.profile_placement, "warmup": args.warmup}))
    finally:
        ray.shutdown()
    summary = compare(runs, args.profile_placement, args.warmup)
    summary["settings"] = settings
    if tmp is not None:
        tmp.cleanup()
    return summary


if __name__ == "__main__":
    main()
