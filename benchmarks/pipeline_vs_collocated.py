"""Step time of the disaggregated pipeline against collocated mode on the same virtual GPUs; weight-sync bandwidth
against a raw torch.distributed gloo broadcast.

    python benchmarks/pipeline_vs_collocated.py [--gpus 2] [--cpus 2] [--steps 8] [--warmup 2] [--repeats 3]
        [--cores-per-gpu K] [--json]

Each repeat trains, in one process and one after the other (order alternating between repeats), with the same
warm-started tiny model, data, seed and batch, on `--gpus` N virtual GPUs:
- pipeline: examples/math/config/tiny-grpo-megatron-pipeline.yaml, the default (N = 2: rollout: 0, actor: 1;
  otherwise rollout: 0, actor: 1-(N-1));
- collocated: examples/math/config/tiny-grpo-megatron.yaml with `cluster.num_gpus_per_node=N` and
  `cluster.component_placement={"actor,rollout": all}` (actor DP=N, rollout DP=N, time-sharing the GPUs).
Both use `data.rollout_batch_size` (`--rollout-batch-size`, default the example's 16), whose samples must split over
each actor's data-parallel ranks.
Each run goes through `rlinf_pipe.runner.Runner.start(cfg)` (`.run()`, `.shutdown()`) in one local Ray session
(N virtual GPUs) that the script starts once, on `--cpus` cores (this process and every process it starts are
pinned to the first ones it may use: each worker's torch threads follow its share of them); its
`metrics.jsonl` and `timeline.json` are read back and the first `--warmup` steps are dropped.
With `--cores-per-gpu K` every repeat also trains both modes with `cluster.cores_per_gpu=K` (each virtual GPU's
workers pinned to K cores of their own, as stages on devices of their own: docs/placement.md#virtual-gpus-on-cores),
and the summary adds `pinned` (the same figures for those runs) and `pinned_pipeline_over_collocated_step_time`.

Reported (medians over steps, then over repeats; ratios paired within a repeat, then the median):
- step time of each mode and `pipeline_over_collocated_step_time` (< 1: the pipeline is faster);
- per-stage busy fractions (share of step time during which some worker ran the stage), the device bubble and the
  scheduler overhead (share of step time during which no worker ran any span) of each mode;
- bytes of data (tensors, arrays) through the driver per step (`driver_data_bytes_per_step`: the arguments of its
  worker-group calls and its channel ends; the training data streams from worker to worker, so this is 0), beside
  the bytes of training batches the actor replicas read from their train channels (`train_data_bytes_per_step`);
- weight sync per version: time = for a version pushed as soon as it is trained (the pipeline over a group
  transport), from the start of the actor's `publish_weights` span to the end of the last receiver's
  `weight_sync` span (which starts when the bytes arrive: the rollout engines, and inference workers if any run);
  otherwise the driver's `weight_sync` span (`timing/weight_sync`: from the calls going out until every receiver
  has loaded the version) united with the actor's `publish_weights` span of that version (the object store path
  publishes at the end of the previous step); bytes (`weight_sync/bytes`), bandwidth = bytes / time;
- the ideal step of each mode for its measured work: max(longest stage's busy time, the CPU time every process
  of the job used per measured step (driver, workers, the reward pool; from the first measured step's start to
  the last one's end) / the cores this process may use), and `fraction_of_ideal` = ideal / measured step time
  (1: as fast as the work allows on these cores);
- the baseline: Ray actors forming a gloo group broadcast a float32 tensor of the same number of bytes from one
  sender to as many receivers as the pipeline's sync has (timed from the sender's start to the last receiver's
  end on the machine-wide monotonic clock, median of `--gloo-iters`); `weight_sync_bw_ratio_vs_gloo` = pipeline
  sync bandwidth / that bandwidth. For reference the same against a broadcast to one receiver
  (`weight_sync_bw_ratio_vs_gloo_one_receiver`).
With --json the last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch

from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.utils.net import free_port

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "examples" / "math" / "config"
MODES = ("pipeline", "collocated")


def mode_config(mode: str, gpus: int) -> tuple[str, list[str]]:
    """The example config and placement overrides of `mode` on `gpus` virtual GPUs."""
    placement = '{"actor,rollout": all}' if mode == "collocated" else (
        "{rollout: 0, actor: 1}" if gpus == 2 else f"{{rollout: 0, actor: 1-{gpus - 1}}}")
    name = "tiny-grpo-megatron" if mode == "collocated" else "tiny-grpo-megatron-pipeline"
    return name, [f"cluster.num_gpus_per_node={gpus}", f"cluster.component_placement={placement}"]


def finite_or_none(value: Any) -> Any:
    """JSON has no NaN: a part that did not happen (no inference worker when collocated) becomes null."""
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def median(values: list[float]) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else float("nan")


def load(mode: str, args: argparse.Namespace, model: str | None, out: Path, cores_per_gpu: int | None = None) -> Any:
    from rlinf_pipe.config import load_config

    name, extra = mode_config(mode, args.gpus)
    overrides = [
        f"runner.max_steps={args.steps}", "runner.progress=false", "runner.tensorboard=false",
        f"runner.output_dir={out}", f"runner.experiment_name=bench-{label(mode, cores_per_gpu)}",
        "cluster.ray_address=local", f"data.rollout_batch_size={args.rollout_batch_size}", *extra,
        f"cluster.cores_per_gpu={'null' if cores_per_gpu is None else cores_per_gpu}",
    ]
    if model is not None:
        overrides.append(f"actor.model_path={model}")
    if mode == "pipeline" and args.staleness:  # (collocated mode cannot run rollout ahead)
        overrides.append(f"runner.max_staleness={args.staleness}")
    if args.weight_bucket_mb is not None:
        overrides.append(f"runner.weight_bucket_mb={args.weight_bucket_mb}")
    overrides.append(f"runner.weight_sync={args.weight_sync}")
    return load_config(CONFIGS, name, overrides)


def label(mode: str, cores_per_gpu: int | None) -> str:
    return mode if cores_per_gpu is None else f"{mode}-pinned"


def job_cpu_s(workers: list[int], driver: int | None = None) -> float:
    """CPU seconds (user + system) used so far by the `driver` process itself (its children are Ray's own
    processes, which run the workers) and by the `workers` with their live children (the reward pool)."""
    import psutil

    procs: dict[int, psutil.Process] = {}
    for pid in workers:
        try:
            proc = psutil.Process(pid)
            procs |= {p.pid: p for p in (proc, *proc.children(recursive=True))}
        except psutil.NoSuchProcess:
            continue
    if driver is not None:
        procs[driver] = psutil.Process(driver)
    total = 0.0
    for proc in procs.values():
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def run_mode(mode: str, args: argparse.Namespace, model: str, out: Path,
             cores_per_gpu: int | None = None) -> dict[str, Any]:
    """Train `mode` for `args.steps` steps in this process (`cluster.cores_per_gpu=cores_per_gpu`); the measured
    steps' figures, with the CPU time every process of the job (driver, workers, reward pool) used per step once
    launched."""
    from rlinf_pipe.runner import Runner

    cfg = load(mode, args, model, out, cores_per_gpu)
    start = time.perf_counter()
    runner = Runner.start(cfg)
    try:
        workers = [pid for group in runner.c.groups() for pid in group.all.call(Worker.ping).wait()]
        cpu: dict[str, float] = {}
        train_step = runner.step

        async def measured_step(step: int) -> dict[str, float]:  # CPU time over the measured steps only
            if step == args.warmup:
                cpu["start"] = job_cpu_s(workers, os.getpid())
            metrics = await train_step(step)
            if step == args.steps - 1:
                cpu["end"] = job_cpu_s(workers, os.getpid())
            return metrics

        runner.step = measured_step
        run_dir = runner.run()
        cpu_per_step = (cpu["end"] - cpu["start"]) / (args.steps - args.warmup)
        plan = runner.c.plan
        receivers = sum(len(plan.placement.components[name].processes) for name in plan.weight_receivers)
    finally:
        runner.shutdown()
    figures = mode_figures(run_dir, receivers, time.perf_counter() - start, args.warmup, args.steps)
    return {**figures, **ideal_step(figures, cpu_per_step, len(os.sched_getaffinity(0)))}


def ideal_step(figures: dict[str, Any], cpu_per_step_s: float, cores: int) -> dict[str, float]:
    """The step time the measured work allows on `cores`: no faster than its longest stage (a stage's busy time),
    nor than all its CPU time spread perfectly over the cores; `fraction_of_ideal` = ideal / measured step."""
    longest = max(figures["stage_busy"].values(), default=0.0) * figures["step_s"]
    ideal = max(longest, cpu_per_step_s / cores)
    return {"cpu_per_step_s": cpu_per_step_s, "cores": cores, "longest_stage_s": longest, "ideal_step_s": ideal,
            "fraction_of_ideal": ideal / figures["step_s"]}


def mode_figures(run_dir: Path, receivers: int, wall: float, warmup: int, steps: int) -> dict[str, Any]:
    """The figures of one finished run folder (its `metrics.jsonl` and `timeline.json`), steps >= `warmup`."""
    from rlinf_pipe.runner.outputs import training_rows
    from rlinf_pipe.utils.metrics import read_metrics
    from rlinf_pipe.utils.timeline import analyse, read_chrome_trace, summarise

    records = [r for r in training_rows(read_metrics(run_dir / "metrics.jsonl")) if r["step"] >= warmup]
    spans = read_chrome_trace(run_dir / "timeline.json")
    analyses = [a for a in analyse(spans) if a.step >= warmup]
    timeline = summarise(analyses)
    sync_s = median([sync_time(spans, v) for v in range(warmup, steps)])
    sync_bytes = median([r["weight_sync/bytes"] for r in records])

    def span_median(name: str, track_prefix: str) -> float:  # per-step time of one part of the sync
        return median([s.duration for s in spans if s.name == name and s.track.startswith(track_prefix)
                       and s.args.get("version", -1) >= warmup])

    return {
        "run_dir": str(run_dir),
        "wall_s": wall,
        "step_s": median([r["timing/step"] for r in records]),
        "steps_measured": len(records),
        "stage_busy": timeline["stage_busy"],
        "bubble_fraction": timeline["bubble_fraction"],
        "scheduler_overhead_fraction": timeline["scheduler_overhead_fraction"],
        "weight_sync_s": sync_s,
        "weight_sync_driver_span_s": median([r["timing/weight_sync"] for r in records]),
        "weight_sync_bytes": sync_bytes,
        "weight_sync_receivers": receivers,
        "weight_sync_bytes_per_s": sync_bytes / sync_s,
        "weight_sync_parts_s": {
            "publish": span_median("publish_weights", "actor"),
            "load_rollout": span_median("weight_sync", "rollout"),
            "load_inference": span_median("weight_sync", "inference"),
        },
        "tokens_per_s": median([r["throughput/tokens_per_s"] for r in records]),
        "reward_mean": median([r["reward/mean"] for r in records]),
        "driver_data_bytes_per_step": median([r["driver/data_bytes"] for r in records]),
        "train_data_bytes_per_step": median([r["actor/train_data_bytes"] for r in records]),
    }


def sync_time(spans: list, version: int) -> float:
    """Seconds version `version` took to reach every receiver (see the module docstring)."""
    mine = [s for s in spans if s.args.get("version") == version and s.name in ("weight_sync", "publish_weights")]
    if any(s.track == "driver" and s.args.get("pushed") for s in mine):  # moved by the actor's send, no call between
        moved = [s for s in mine if s.track != "driver"]
        return max(s.end for s in moved) - min(s.start for s in moved)
    # The driver's span (loading into every receiver) united with the actor's `publish_weights` span: the runner
    # may publish inside the sync span or at the end of the previous step (while the actor still holds its
    # devices); the union counts publishing once either way.
    return union_length([(s.start, s.end) for s in mine if s.track == "driver" or s.name == "publish_weights"]) or (
        float("nan"))


@ray.remote(num_cpus=0)
class GlooRank:
    """One rank of a gloo group (the raw-broadcast baseline)."""

    def init(self, rank: int, world: int, address: str) -> None:
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.rank = rank
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)

    def broadcast(self, num_bytes: int, iters: int) -> list[float]:
        """Per iteration: the sender returns its clock just before the broadcast, the receiver its clock after it."""
        import torch.distributed as dist

        tensor = torch.randn(max(1, num_bytes // 4)) if self.rank == 0 else torch.empty(max(1, num_bytes // 4))
        dist.broadcast(tensor, src=0)  # warm-up (connections, buffers)
        clocks = []
        for _ in range(iters):
            dist.barrier()
            before = time.perf_counter()
            dist.broadcast(tensor, src=0)
            clocks.append(before if self.rank == 0 else time.perf_counter())
        return clocks

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def gloo_bytes_per_s(num_bytes: int, iters: int, receivers: int) -> float:
    """Median bandwidth of a raw gloo broadcast of `num_bytes` (float32) from one Ray actor to `receivers` others
    (each broadcast timed from the sender's start to the last receiver's end)."""
    ranks = [GlooRank.remote() for _ in range(1 + receivers)]
    try:
        address = f"tcp://127.0.0.1:{free_port()}"
        ray.get([r.init.remote(i, len(ranks), address) for i, r in enumerate(ranks)])
        sent, *received = ray.get([r.broadcast.remote(num_bytes, iters) for r in ranks])
        ray.get([r.close.remote() for r in ranks])
    finally:
        for rank in ranks:
            ray.kill(rank)
    durations = [max(max(ends) - start, 1e-9) for start, *ends in zip(sent, *received, strict=True)]
    return (max(1, num_bytes // 4) * 4) / statistics.median(durations)


IDEAL_KEYS = ("cpu_per_step_s", "longest_stage_s", "ideal_step_s", "fraction_of_ideal")


def summarise_runs(runs: dict[str, list[dict[str, Any]]], gloo: list[float], gloo_one: list[float],
                   args: argparse.Namespace, started: float) -> dict[str, Any]:
    """The JSON summary: per mode, the medians over repeats; the ratios paired within a repeat."""

    def agg(mode: str, key: str) -> float:
        return median([r[key] for r in runs[mode]])

    def agg_stages(mode: str) -> dict[str, float]:
        names = sorted({k for r in runs[mode] for k in r["stage_busy"]})
        return {k: round(median([r["stage_busy"].get(k, 0.0) for r in runs[mode]]), 4) for k in names}

    pipe, coll = runs["pipeline"], runs["collocated"]
    step_ratio = median([p["step_s"] / c["step_s"] for p, c in zip(pipe, coll, strict=False)])
    bw_ratio = median([p["weight_sync_bytes_per_s"] / g for p, g in zip(pipe, gloo, strict=False)])
    bw_ratio_one = median([p["weight_sync_bytes_per_s"] / g for p, g in zip(pipe, gloo_one, strict=False)])
    per_mode = {
        mode: {
            "step_s": round(agg(mode, "step_s"), 4),
            "tokens_per_s": round(agg(mode, "tokens_per_s"), 1),
            "stage_busy": agg_stages(mode),
            "bubble_fraction": round(agg(mode, "bubble_fraction"), 4),
            "scheduler_overhead_fraction": round(agg(mode, "scheduler_overhead_fraction"), 4),
            "weight_sync_s": round(agg(mode, "weight_sync_s"), 5),
            "weight_sync_driver_span_s": round(agg(mode, "weight_sync_driver_span_s"), 5),
            "weight_sync_bytes": int(agg(mode, "weight_sync_bytes")),
            "weight_sync_receivers": runs[mode][0]["weight_sync_receivers"],
            "weight_sync_mib_per_s": round(agg(mode, "weight_sync_bytes_per_s") / 2**20, 2),
            "weight_sync_parts_s": finite_or_none({
                k: round(median([r["weight_sync_parts_s"][k] for r in runs[mode]]), 5)
                for k in runs[mode][0]["weight_sync_parts_s"]
            }),
            "reward_mean": round(agg(mode, "reward_mean"), 4),
            **{key: round(agg(mode, key), 4) for key in IDEAL_KEYS if key in runs[mode][0]},
            "driver_data_bytes_per_step": int(agg(mode, "driver_data_bytes_per_step")),
            "train_data_bytes_per_step": int(agg(mode, "train_data_bytes_per_step")),
        }
        for mode in MODES
    }
    summary = {
        "pipeline_over_collocated_step_time": round(step_ratio, 3),
        "pipeline_step_s": per_mode["pipeline"]["step_s"],
        "fraction_of_ideal": per_mode["pipeline"].get("fraction_of_ideal"),
        "ideal_step_s": per_mode["pipeline"].get("ideal_step_s"),
        "collocated_step_s": per_mode["collocated"]["step_s"],
        "bubble_fraction": per_mode["pipeline"]["bubble_fraction"],
        "scheduler_overhead_fraction": per_mode["pipeline"]["scheduler_overhead_fraction"],
        "driver_data_bytes_per_step": per_mode["pipeline"]["driver_data_bytes_per_step"],
        "train_data_bytes_per_step": per_mode["pipeline"]["train_data_bytes_per_step"],
        "weight_sync_s": per_mode["pipeline"]["weight_sync_s"],
        "weight_sync_bytes": per_mode["pipeline"]["weight_sync_bytes"],
        "weight_sync_mib_per_s": per_mode["pipeline"]["weight_sync_mib_per_s"],
        "gloo_broadcast_mib_per_s": round(median(gloo) / 2**20, 2),
        "gloo_broadcast_one_receiver_mib_per_s": round(median(gloo_one) / 2**20, 2),
        "weight_sync_bw_ratio_vs_gloo": round(bw_ratio, 4),
        "weight_sync_bw_ratio_vs_gloo_one_receiver": round(bw_ratio_one, 4),
        "weight_sync_note": (
            "our sync time = from the actor starting to gather the version until every receiver (the rollout "
            "engines, and inference workers if any run) has loaded it; gloo = a raw broadcast of the same bytes from "
            "one process to as many receivers (and, for reference, to one)"
        ),
        "modes": per_mode,
        "settings": {
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "gloo_iters": args.gloo_iters,
            "rollout_batch_size": args.rollout_batch_size, "virtual_gpus": args.gpus, "cpus": args.cpus,
            "pipeline_max_staleness": args.staleness,
            "collocated_overrides": mode_config("collocated", args.gpus)[1],
            "pipeline_overrides": mode_config("pipeline", args.gpus)[1],
        },
        "runtime_s": round(time.perf_counter() - started, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                   f"torch {torch.__version__}, Ray {ray.__version__}",
    }

    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="steps per run (runner.max_steps)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    parser.add_argument("--repeats", type=int, default=3, help="one pipeline and one collocated run per repeat")
    parser.add_argument("--gpus", type=int, default=2, help="virtual GPUs of both modes (>= 2)")
    parser.add_argument("--cpus", type=int, default=2,
                        help="cores of the job (pinned: the first of those this process may use; default 2, as on CI)")
    parser.add_argument("--rollout-batch-size", type=int, default=16,
                        help="prompts per step for BOTH modes (x group_size 8 must split over the actors' DP)")
    parser.add_argument("--gloo-iters", type=int, default=50, help="timed broadcasts per baseline measurement")
    parser.add_argument("--output-dir", default=None, help="keep the run folders here (default: a temp folder)")
    parser.add_argument("--model", default=None,
                        help="HF model folder (default: the warm-started tiny model); e.g. a larger "
                        "`python -m rlinf_pipe.models.tiny` folder to see weight sync where bandwidth dominates")
    parser.add_argument("--weight-sync", choices=["auto", "object_store", "broadcast", "ipc"], default="auto",
                        help="runner.weight_sync of both modes (auto: broadcast in the pipeline, ipc collocated; "
                        "ipc needs every receiver on an actor GPU: collocated only)")
    parser.add_argument("--weight-bucket-mb", type=int, default=None,
                        help="runner.weight_bucket_mb for both modes (default: the config's)")
    parser.add_argument("--staleness", type=int, default=0,
                        help="runner.max_staleness of the pipeline runs (rollout up to N steps ahead)")
    parser.add_argument("--cores-per-gpu", type=int, default=None,
                        help="also train both modes with each virtual GPU's workers pinned to this many cores of "
                        "their own (cluster.cores_per_gpu; --gpus x K <= --cpus) and report both")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.warmup = min(args.warmup, args.steps - 1)
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= args.cpus <= len(allowed):
        parser.error(f"--cpus {args.cpus}: this process may use {len(allowed)} cores")
    if args.cores_per_gpu is not None and not 1 <= args.cores_per_gpu * args.gpus <= args.cpus:
        parser.error(f"--cores-per-gpu {args.cores_per_gpu}: {args.gpus} GPUs need {args.cores_per_gpu * args.gpus} "
                     f"cores of the {args.cpus} (--cpus)")
    os.sched_setaffinity(0, allowed[: args.cpus])  # inherited by Ray's processes, read by the workers' thread counts
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")

    from rlinf_pipe.models.warmstart import ensure_warm_tiny_model

    # One model for both modes: the warm-started tiny model of the (shared) data config, built once and cached.
    model = args.model or str(
        ensure_warm_tiny_model(data=load("pipeline", args, None, Path(tempfile.gettempdir())).data)
    )
    tmp = tempfile.TemporaryDirectory(prefix="rlp-pvc-") if args.output_dir is None else None
    out = Path(args.output_dir or tmp.name)

    started = time.perf_counter()
    # one local Ray session for every run and baseline (each run's Cluster uses it and leaves it open)
    ray.init(address="local", num_cpus=args.cpus, num_gpus=args.gpus, include_dashboard=False, log_to_driver=False)
    pinnings = [None] if args.cores_per_gpu is None else [None, args.cores_per_gpu]
    all_runs: dict[int | None, dict[str, list[dict[str, Any]]]] = {k: {m: [] for m in MODES} for k in pinnings}
    runs = all_runs[None]
    gloo: list[float] = []  # raw broadcast to as many receivers as the pipeline's sync has
    gloo_one: list[float] = []  # raw broadcast to one receiver
    for repeat in range(args.repeats):
        order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
        for mode in order:
            for k in pinnings if repeat % 2 == 0 else reversed(pinnings):
                r = run_mode(mode, args, model, out, k)
                all_runs[k][mode].append(r)
                print(f"repeat {repeat} {label(mode, k):<17}: step {r['step_s']:.3f} s, sync "
                      f"{r['weight_sync_s'] * 1e3:.1f} ms ({r['weight_sync_bytes'] / 2**20:.2f} MiB), bubble "
                      f"{r['bubble_fraction']:.1%}, scheduler overhead {r['scheduler_overhead_fraction']:.1%}, run "
                      f"{r['wall_s']:.1f} s", flush=True)
        sync_bytes, receivers = int(runs["pipeline"][-1]["weight_sync_bytes"]), runs["pipeline"][-1]["weight_sync_receivers"]
        gloo.append(gloo_bytes_per_s(sync_bytes, args.gloo_iters, receivers))
        gloo_one.append(gloo_bytes_per_s(sync_bytes, args.gloo_iters, 1))
        print(f"repeat {repeat} gloo broadcast: {gloo[-1] / 2**20:.1f} MiB/s to {receivers} receivers, "
              f"{gloo_one[-1] / 2**20:.1f} MiB/s to one", flush=True)
    ray.shutdown()
    if tmp is not None:
        tmp.cleanup()

    summary = summarise_runs(runs, gloo, gloo_one, args, started)
    summary["settings"]["cores_per_gpu"] = args.cores_per_gpu
    per_mode, step_ratio = summary["modes"], summary["pipeline_over_collocated_step_time"]
    bw_ratio = summary["weight_sync_bw_ratio_vs_gloo"]
    bw_ratio_one = summary["weight_sync_bw_ratio_vs_gloo_one_receiver"]

    print()
    print_table(per_mode, "no pinning")
    if args.cores_per_gpu is not None:
        pinned = summarise_runs(all_runs[args.cores_per_gpu], gloo, gloo_one, args, started)
        summary["pinned_pipeline_over_collocated_step_time"] = pinned["pipeline_over_collocated_step_time"]
        summary["pinned"] = {key: value for key, value in pinned.items() if key not in ("settings", "runtime_s",
                                                                                       "machine")}
        print_table(pinned["modes"], f"cluster.cores_per_gpu={args.cores_per_gpu}")
        print(f"pinned ({args.cores_per_gpu} cores a virtual GPU): pipeline / collocated step time "
              f"{pinned['pipeline_over_collocated_step_time']:.3f}")
    print(f"pipeline / collocated step time: {step_ratio:.3f} (< 1: the pipeline is faster); the pipeline runs at "
          f"{summary['fraction_of_ideal']:.2f} of the ideal step its measured work allows on the cores "
          "(max(longest stage, CPU time / cores))")
    print(f"weight sync {summary['weight_sync_mib_per_s']:.1f} MiB/s vs raw gloo broadcast "
          f"{summary['gloo_broadcast_mib_per_s']:.1f} MiB/s of {summary['weight_sync_bytes']:,} bytes: ratio "
          f"{bw_ratio:.3f} ({bw_ratio_one:.3f} against a broadcast to one receiver). {summary['weight_sync_note']}")
    print(f"runtime {summary['runtime_s']:.0f} s")
    if args.json:
        print(json.dumps(summary))


def print_table(per_mode: dict[str, Any], title: str) -> None:
    """The figures of both modes side by side."""
    print(f"{title:<28}{'pipeline':>12}{'collocated':>12}")
    for name, key, fmt in [
        ("step time (s)", "step_s", "{:.3f}"), ("tokens/s", "tokens_per_s", "{:.0f}"),
        ("device bubble", "bubble_fraction", "{:.1%}"),
        ("scheduler overhead", "scheduler_overhead_fraction", "{:.1%}"),
        ("weight sync (ms)", "weight_sync_s", "{:.1f}"),
        ("  driver sync span (ms)", "weight_sync_driver_span_s", "{:.1f}"), ("weight sync receivers", "weight_sync_receivers", "{}"),
        ("weight sync MiB/s", "weight_sync_mib_per_s", "{:.1f}"),
        ("driver data bytes/step", "driver_data_bytes_per_step", "{:,}"),
        ("train data bytes/step", "train_data_bytes_per_step", "{:,}"),
        ("CPU time per step (s)", "cpu_per_step_s", "{:.3f}"), ("longest stage (s)", "longest_stage_s", "{:.3f}"),
        ("ideal step (s)", "ideal_step_s", "{:.3f}"), ("fraction of ideal", "fraction_of_ideal", "{:.2f}"),
    ]:
        vals = [per_mode[m][key] * (1e3 if key in ("weight_sync_s", "weight_sync_driver_span_s") else 1) for m in MODES]
        print(f"{name:<28}" + "".join(f"{fmt.format(v):>12}" for v in vals))
    for stage in sorted(set(per_mode["pipeline"]["stage_busy"]) | set(per_mode["collocated"]["stage_busy"])):
        vals = [per_mode[m]["stage_busy"].get(stage) for m in MODES]
        print(f"{'busy ' + stage:<28}" + "".join(f"{'-' if v is None else f'{v:.1%}':>12}" for v in vals))


if __name__ == "__main__":
    main()
