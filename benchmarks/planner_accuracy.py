"""How well `plan --validate`'s prediction of the step time holds across placements: one placement is trained and
profiled, every other one is predicted from that profile and trained for real, on virtual GPUs pinned to cores.

    python benchmarks/planner_accuracy.py [--json] [--steps 6] [--warmup 2] [--repeats 1] [--no-ref]
        [--profile-placement disaggregated [NAME ...]] [--only NAME ...] [--cores-per-gpu 1] [--output-dir DIR]
        [--set KEY=VALUE ...] [--pool-profile] [--predict-only DIR [DIR ...]]

Every run trains examples/math/config/tiny-grpo-megatron-pipeline.yaml (the tiny model warm-started once, its data,
seed and batch) with `cluster.cores_per_gpu=K` (each virtual GPU's workers on K cores of their own, 2 virtual GPUs
unless the placement needs 1), the `--set` overrides and the placement's overrides (`PLACEMENTS`), through
`Runner.start(cfg).run()` in one local Ray session that this script starts once. Only the placement differs between
runs (one config, so the actor's micro-batches are the same in every run; the collocated example's smaller ones are
not measured here).
Every run computes reference log-probs (`algorithm.compute_ref_logprobs=true`, `--no-ref` leaves them out): where no
inference workers are placed the actor computes them, so the profiled run measures the log-prob stage that the
hybrid placements move to GPUs of their own (without it, the log-prob rate comes from the training passes'
forwards, whose larger batches run faster per token than a log-prob pass of one group).

Each placement is trained `--repeats` times, interleaved (a round trains every placement once, each round's order
rotated), so that a busy minute of the host falls on every placement alike. The profiled placement's run whose mean
step is its median gives the costs (`planning.profile.read_profile`, its first `--warmup` steps left out); every
placement, the profiled one included, is then predicted from them exactly as
`rlinf-pipe plan --validate RUN_DIR --profile PROFILE_RUN` does (`planning.validate.validate_run`) and compared with
the median over its runs of their mean step time (the timeline's step spans after the first `--warmup`); `spread`
is (slowest - fastest) / median of those runs. `--profile-placement A B` profiles two placements together (each
one's median run, or with `--pool-profile` every run: one profile, as `plan --profile RUN RUN ...` makes it); the
errors are then over the placements neither is.

Reported: per placement its name, overrides, predicted and measured seconds per step, the spread and the error
((predicted - measured) / measured); over the placements other than the profiled one, `median_abs_error` and
`max_abs_error`; over all of them, `same_ranking` (the placements sorted by predicted step time == sorted by
measured step time), and over the pairs of placements whose runs do not overlap (every run of one faster than every
run of the other: those the measurement can tell apart on a noisy host) how many the prediction orders alike
(`distinguishable_pairs`, `distinguishable_pairs_ordered_alike`), and the ranking the runs measure: the largest
set of placements every two of which they tell apart, in measured order (`ranked_placements`; where the runs of
two placements overlap, the next invocation may measure them in either order), and whether every such set is
predicted in that order (`ranked_alike`). `--predict-only DIR` re-predicts the runs a
previous `--output-dir DIR` kept (its `runs.json`) without training. Given several DIRs (invocations, each with its
own profile) it pools them (`pooled`): per placement the median of all their runs against the median of the
invocations' predictions, and the pairs of placements their runs tell apart by how often a run of one is faster
than a run of the other, over every pairing of their runs (`told_apart`: at least `accuracy_summary.TOLD_APART`).
With --json the last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_summary import pooled, print_pooled, print_table, told_apart_ranking  # noqa: E402

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
    Placement("hybrid-rollout-inference", ('cluster.component_placement={"rollout,inference": 0, actor: 1}',)),
    Placement("hybrid-actor-rollout", ('cluster.component_placement={"actor,rollout": 0, inference: 1}',)),
    Placement("staleness-1", (PIPELINE, "runner.max_staleness=1")),
    Placement("short-responses", (PIPELINE, "rollout.max_new_tokens=10")),  # (the tiny model's run to ~14)
    Placement("collocated-2-tp2", ('cluster.component_placement={"actor,rollout": all}',
                                   "rollout.tensor_parallel_size=2", "actor.tensor_parallel_size=2")),
)
BY_NAME = {p.name: p for p in PLACEMENTS}


def load(placement: Placement, args: argparse.Namespace, model: str | None, out: Path) -> Any:
    """The config of one placement's run."""
    from rlinf_pipe.config import load_config

    overrides = [
        f"runner.max_steps={args.steps}", "runner.progress=false", "runner.tensorboard=false",
        f"runner.output_dir={out}", f"runner.experiment_name=accuracy-{placement.name}", "cluster.ray_address=local",
        f"cluster.cores_per_gpu={args.cores_per_gpu}", *args.extra, *placement.overrides,
    ]
    if args.ref:
        overrides.append("algorithm.compute_ref_logprobs=true")
    if model is not None:
        overrides.append(f"actor.model_path={model}")
    return load_config(CONFIGS, CONFIG, overrides)


def train(placement: Placement, args: argparse.Namespace, model: str, out: Path) -> Path:
    """Train one placement for `args.steps` steps in this process, once the host is quiet; its run folder."""
    from rlinf_pipe.runner import Runner

    wait_until_quiet()
    runner = Runner.start(load(placement, args, model, out))
    try:
        return Path(runner.run())
    finally:
        runner.shutdown()


def busy_cores(window_s: float = 0.5) -> float:
    """The host's cores busy over the next `window_s` (from /proc/stat)."""
    def ticks() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields) - fields[3] - fields[4], sum(fields)  # (busy: all but idle and iowait)

    (busy0, all0), _ = ticks(), time.sleep(window_s)
    busy1, all1 = ticks()
    return (busy1 - busy0) / max(all1 - all0, 1) * (os.cpu_count() or 1)


def wait_until_quiet(limit_s: float = 30.0, busy: float = 0.25) -> None:
    """Until the previous run's processes are gone (the host's busy cores under `busy`), at most `limit_s`: each
    run starts on a quiet host, not beside the last one's exit."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and busy_cores() > busy:
        pass


def compare(runs: dict[str, list[Path]], profiled: list[str], warmup: int, pool: bool = False) -> dict[str, Any]:
    """Every placement predicted from the profiled placements' costs (as `plan --validate RUN --profile PROFILED
    ...` does; of each one's repeats, the run whose step time is the median, or with `pool` all of them; several
    runs make one profile, `planning.profile_pool`) beside its measurement (the median over its repeats of each
    run's mean step, with their range); the summary figures (see the module docstring)."""
    from rlinf_pipe.planning.profile_pool import read_profiles
    from rlinf_pipe.planning.validate import validate_run

    profile_dirs = []
    for name in profiled:
        ranked = sorted(runs[name], key=lambda d: mean_step_s(d, warmup))
        profile_dirs += ranked if pool else [ranked[(len(ranked) - 1) // 2]]
    costs = read_profiles(profile_dirs, warmup=warmup)
    rows = []
    for name, dirs in runs.items():
        checks = [validate_run(d, costs, warmup=warmup) for d in dirs]
        measured = [v.measured_step_s for v in checks]
        median = statistics.median(measured)
        v = checks[0]
        rows.append({"name": name, "overrides": list(BY_NAME[name].overrides), "profiled": name in profiled,
                     "predicted_step_s": round(v.prediction.step_s, 4), "measured_step_s": round(median, 4),
                     "measured_runs_s": [round(m, 4) for m in measured],
                     "spread": round((max(measured) - min(measured)) / median, 4),
                     "error": round((v.prediction.step_s - median) / median, 4),
                     "predicted_bubble": round(v.prediction.bubble, 3),
                     "measured_bubble": round(statistics.median(c.measured_bubble for c in checks), 3),
                     "steps_measured": v.steps,
                     "predicted_stage_busy_s": {k: round(b, 4) for k, b in v.prediction.stage_busy_s.items()},
                     "run_dirs": [str(d) for d in dirs]})
    others = [abs(r["error"]) for r in rows if not r["profiled"]] or [abs(r["error"]) for r in rows]
    by_predicted = [r["name"] for r in sorted(rows, key=lambda r: r["predicted_step_s"])]
    by_measured = [r["name"] for r in sorted(rows, key=lambda r: r["measured_step_s"])]
    told_apart = [(a, b) for a, b in itertools.combinations(rows, 2) if max(a["measured_runs_s"]) < min(
        b["measured_runs_s"]) or max(b["measured_runs_s"]) < min(a["measured_runs_s"])]
    alike = [(a, b) for a, b in told_apart if (a["measured_step_s"] < b["measured_step_s"]) == (
        a["predicted_step_s"] < b["predicted_step_s"])]
    ranking = told_apart_ranking({r["name"]: r["measured_step_s"] for r in rows},
                                 {r["name"]: r["predicted_step_s"] for r in rows},
                                 {frozenset((a["name"], b["name"])) for a, b in told_apart})
    return {"profiled": profiled, "profile_runs": [str(d) for d in profile_dirs], "costs": costs.to_json(),
            "median_abs_error": round(statistics.median(others), 4), "max_abs_error": round(max(others), 4),
            "same_ranking": by_predicted == by_measured, "predicted_ranking": by_predicted,
            "measured_ranking": by_measured, "distinguishable_pairs": len(told_apart),
            "distinguishable_pairs_ordered_alike": len(alike), **ranking, "placements": rows}


def repredict(folder: str, pool: bool = False, profiled: list[str] | None = None) -> dict[str, Any]:
    """An earlier invocation's kept runs (`--output-dir`'s `runs.json`) compared again, profiled from `profiled`
    (default: the placement the invocation profiled)."""
    if not (Path(folder) / "runs.json").is_file():
        raise SystemExit(f"--predict-only {folder}: no runs.json there; give a folder an earlier --output-dir kept")
    kept = json.loads((Path(folder) / "runs.json").read_text())
    runs = {name: [Path(d) for d in ([dirs] if isinstance(dirs, str) else dirs)]
            for name, dirs in kept["runs"].items()}
    if profiled is None:
        profiled = [kept["profiled"]] if isinstance(kept["profiled"], str) else kept["profiled"]
    if missing := [name for name in profiled if name not in runs]:
        raise SystemExit(f"--profile-placement {' '.join(missing)}: not among the runs {folder} kept "
                         f"({', '.join(runs)})")
    summary = compare(runs, profiled, kept["warmup"], pool)
    summary["settings"] = kept["settings"]
    return summary


def mean_step_s(run_dir: Path, warmup: int) -> float:
    """A run's step time over its steps after the first `warmup`, as `validate_run` measures it."""
    from rlinf_pipe.planning.profile import step_cadence
    from rlinf_pipe.utils.timeline import read_chrome_trace

    return step_cadence(read_chrome_trace(run_dir / "timeline.json"), warmup)


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    return proc.stdout.strip() or "unknown"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per run (runner.max_steps)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    parser.add_argument("--profile-placement", nargs="+", default=None, choices=list(BY_NAME),
                        help="the placements whose runs give the costs (default: disaggregated; with "
                             "--predict-only, the one the invocation profiled); several make one profile, their "
                             "co-run slowdowns fitted together (`plan --profile RUN RUN ...`)")
    parser.add_argument("--only", nargs="+", choices=list(BY_NAME), default=None,
                        help="train only these placements besides the profiled one (a quick check)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per placement, interleaved (every placement once per round); the measured step "
                             "is the median of the runs' means")
    parser.add_argument("--cores-per-gpu", type=int, default=1, help="cluster.cores_per_gpu of every run")
    parser.add_argument("--output-dir", default=None, help="keep the run folders here (default: a temp folder)")
    parser.add_argument("--predict-only", metavar="DIR", nargs="+", default=None,
                        help="no training: re-predict the runs an earlier --output-dir DIR kept (several: pooled)")
    parser.add_argument("--no-ref", dest="ref", action="store_false",
                        help="no reference log-probs (the profile then has no log-prob stage)")
    parser.add_argument("--set", dest="extra", metavar="KEY=VALUE", action="append", default=[],
                        help="a config override for every run (repeatable), e.g. data.rollout_batch_size=64")
    parser.add_argument("--pool-profile", action="store_true", help="profile every run of the profiled placement "
                        "(the median of each figure, as `plan --profile RUN RUN ...`), not only its median run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.warmup = min(args.warmup, args.steps - 1)
    return args


def main() -> None:
    args = parse_args()
    if args.predict_only and len(args.predict_only) > 1:
        summaries = [repredict(folder, args.pool_profile, args.profile_placement) for folder in args.predict_only]
        for folder, one in zip(args.predict_only, summaries):
            print(f"\n{folder}:")
            print_table(one)
        summary = pooled(summaries) | {"commit": commit(), "folders": args.predict_only}
        print()
        print_pooled(summary)
        if args.json:
            print(json.dumps(summary))
        return
    if args.predict_only:
        summary = repredict(args.predict_only[0], args.pool_profile, args.profile_placement)
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

    profiled = args.profile_placement or ["disaggregated"]
    names = profiled + [p.name for p in PLACEMENTS if p.name not in profiled
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
    runs: dict[str, list[Path]] = {}
    failed: dict[str, str] = {}
    settings: dict[str, Any] = {"steps": args.steps, "warmup": args.warmup, "cores_per_gpu": args.cores_per_gpu,
                                "repeats": args.repeats, "ref_logprobs": args.ref, "cores": len(cores),
                                "overrides": args.extra,
                                "config": f"examples/math/config/{CONFIG}.yaml"}
    try:
        for repeat in range(args.repeats):  # (interleaved: every placement once per round, the order rotated)
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                if name in failed:
                    continue
                t0 = time.perf_counter()
                try:
                    run_dir = train(BY_NAME[name], args, model, out / f"r{repeat}")
                except Exception as exc:  # (one placement's failure is reported; the others still compare)
                    if name in profiled:
                        raise
                    failed[name] = f"{type(exc).__name__}: {exc}"[:500]
                    runs.pop(name, None)
                    print(f"{name:<26} FAILED: {failed[name]}", flush=True)
                    continue
                runs.setdefault(name, []).append(run_dir)
                print(f"round {repeat + 1}/{args.repeats} {name:<26} trained {args.steps} steps in "
                      f"{time.perf_counter() - t0:.0f} s: {run_dir}", flush=True)
                settings |= {"runtime_s": round(time.perf_counter() - started), "failed": failed,
                             "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average "
                                        f"{os.getloadavg()[0]:.2f} at the end"}
                (out / "runs.json").write_text(json.dumps({  # (kept as it goes: --predict-only reads a partial one)
                    "runs": {k: [str(d) for d in v] for k, v in runs.items()}, "settings": settings,
                    "profiled": profiled, "warmup": args.warmup}))
    finally:
        ray.shutdown()
    summary = compare(runs, profiled, args.warmup, args.pool_profile)
    summary["settings"] = settings
    if tmp is not None:
        tmp.cleanup()
    return summary


if __name__ == "__main__":
    main()
