"""Running a rehearsal (`rlinf_pipe.runner.rehearsal`) and its report: the config's own checks, the scaled-down run
on a local cluster of the config's nodes, then what a user wants to know before booking the cluster."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import ClusterError
from rlinf_pipe.runner.rehearsal import Change, check_placed, crossings, local_nodes, scale_down, tiny_knobs_for
from rlinf_pipe.runner.workers_record import WorkerRecord, read_workers
from rlinf_pipe.planning.placement import reward_placement
from rlinf_pipe.planning.run_plan import RunPlan
from rlinf_pipe.utils.proc_memory import MemorySampler

GIB = 1 << 30
DATASETS = ("arithmetic", "gsm8k")


@dataclass(frozen=True)
class Rehearsal:
    """A finished rehearsal: its run folder, what it changed, the placement problems found, and the report."""

    run_dir: Path
    changes: tuple[Change, ...]
    problems: tuple[str, ...]
    report: str


def rehearse(cfg: Config, load: Callable[[Sequence[str]], Config], steps: int = 2, model: str | None = None,
             output_dir: str = "outputs/rehearsals") -> Rehearsal:
    """Check `cfg` as a real run would, then train `steps` steps of it scaled down (`load(overrides)`: the same
    config with more overrides) on local nodes; `model` replaces the tiny model."""
    from rlinf_pipe.runner import run
    from rlinf_pipe.runner.preflight import preflight

    checked = preflight(cfg, files=False)  # (the errors a real run would hit first: placement, sizes, values)
    placement = checked.plan.placement
    model = model or _tiny_model(cfg)
    dataset_found = cfg.data.dataset in DATASETS or Path(cfg.data.dataset).is_file()
    others = [c for name, c in placement.components.items() if name != "reward"]  # (the reward's, placed or not,
    processes = sum(len(c.processes) for c in others) + len(reward_placement(placement).processes) + 1  # and driver)
    changes = scale_down(cfg, placement.components["actor"].dp, steps, model, output_dir, dataset_found, processes,
                         len(os.sched_getaffinity(0)))
    # every process of the rehearsal runs under this one (the local nodes' daemons, their workers)
    with MemorySampler(os.getpid()) as memory, local_nodes(cfg.gpus_per_node()) as (address, node_ids):
        scaled = load([*(c.override for c in changes), f"cluster.ray_address={address}"])
        run_dir = run(scaled)
    records = read_workers(run_dir)
    started = sorted({r.group for r in records})
    problems = tuple(check_placed(placement, records, node_ids, started))
    report = render(cfg, run_dir, changes, problems, records, checked.plan,
                    [s for s in ("rollout", "reward", "inference", "actor") if s in started], memory)
    return Rehearsal(run_dir, tuple(changes), problems, report)


def _tiny_model(cfg: Config) -> str:
    knobs = tiny_knobs_for(cfg)
    if knobs is None:
        return "tiny"
    from rlinf_pipe.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(None, "qwen2", **knobs))  # (the warm-started tiny model's family)


def render(cfg: Config, run_dir: Path, changes: Sequence[Change], problems: Sequence[str],
           records: Sequence[WorkerRecord], plan: RunPlan, stages: Sequence[str], memory: MemorySampler) -> str:
    """The rehearsal's report (see the module docstring); `memory` sampled every process of the rehearsal."""
    summary = json.loads((run_dir / "summary.json").read_text())
    nodes = sorted({r.node_id for r in records})
    lines = [f"rehearsal of {cfg.runner.experiment_name}: {len(records)} processes on {len(nodes)} Ray node(s), "
             f"{summary['steps']} step(s) trained ({run_dir})", "", "changed for this machine:"]
    lines += [f"  {c.override}" + (f"  ({c.why})" if c.why else "") for c in changes if "output_dir" not in c.override]
    lines += ["", "placement: " + ("every process started on the node and GPUs the placement gave it" if not problems
                                   else f"{len(problems)} process(es) not where the placement said:")]
    lines += [f"  {p}" for p in problems]
    launch = summary.get("launch") or {}
    lines += ["", *memory_lines(records, stages, memory, launch)]
    timeline = summary.get("timeline") or {}
    busy = {k: v for k, v in (timeline.get("stage_busy") or {}).items() if v}
    lines += ["", f"stages (busy fraction of {timeline.get('total_step_time_s', 0):.1f} s of steps): "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(busy.items(), key=lambda kv: -kv[1]))]
    streams = crossings(plan.placement, plan.weight_transport, stages, plan.weight_routes)
    lines += ["", "streams between nodes:", *(f"  {line}" for line in streams)]
    if problems:
        raise ClusterError("\n".join(lines))
    return "\n".join(lines)


def memory_lines(records: Sequence[WorkerRecord], stages: Sequence[str], memory: MemorySampler,
                 launch: dict) -> list[str]:
    """The report's memory: each component's processes, nodes, peak PSS per process (max / mean; USS and RSS of the
    largest), launch time; then the peak of every process of the rehearsal together (PSS, which adds up: RSS counts
    the libraries every process shares again in each), split into the workers, the driver and the rest (Ray's
    daemons, helper actors, the reward pool's processes)."""
    lines = ["per component: processes, nodes, peak PSS per process (max / mean; USS, RSS of the max), launch (s)"]
    workers = {r.pid for r in records}
    for group in stages:
        mine = [r for r in records if r.group == group]
        peaks = [p for p in memory.peak_of(r.pid for r in mine) if p is not None]
        top = max(peaks, key=lambda p: p.pss) if peaks else None
        figures = ("not sampled" if top is None else
                   f"{top.pss / GIB:.2f} / {sum(p.pss for p in peaks) / len(peaks) / GIB:.2f} GiB "
                   f"(USS {top.uss / GIB:.2f}, RSS {top.rss / GIB:.2f})")
        lines.append(f"  {group:<10} {len(mine):>3}  nodes {','.join(map(str, sorted({r.node_rank for r in mine})))}"
                     f"  {figures}  {launch.get('workers_s', {}).get(group, float('nan')):.1f}")
    parts = Counter({"workers": 0, "driver": 0, "rest": 0})
    rest: Counter[str] = Counter()
    for pid, peak in memory.peaks.items():
        part = "workers" if pid in workers else "driver" if pid == memory.root else "rest"
        parts[part] += peak.memory.pss
        if part == "rest":
            rest[peak.name] += peak.memory.pss
    named = ", ".join(f"{name} {pss / GIB:.2f}" for name, pss in rest.most_common(4))
    lines.append(f"  every process together: {memory.peak_total / GIB:.1f} GiB PSS at the peak (each one's peak: "
                 f"workers {parts['workers'] / GIB:.1f}, driver {parts['driver'] / GIB:.1f}, the rest "
                 f"{parts['rest'] / GIB:.1f}: {named})")
    lines.append(f"  launch to the first step {launch.get('to_first_step_s', float('nan')):.1f} s")
    return lines
