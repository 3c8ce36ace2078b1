"""Running a rehearsal (`rlinf_pipe.runner.rehearsal`) and its report: the config's own checks, the scaled-down run
on a local cluster of the config's nodes, then what a user wants to know before booking the cluster."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import ClusterError
from rlinf_pipe.runner.rehearsal import Change, check_placed, crossings, local_nodes, scale_down, tiny_knobs_for
from rlinf_pipe.runner.workers_record import WorkerRecord, read_workers
from rlinf_pipe.planning.placement import Placement

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
    changes = scale_down(cfg, placement.components["actor"].dp, steps, model, output_dir, dataset_found)
    with local_nodes(cfg.gpus_per_node()) as (address, node_ids):
        scaled = load([*(c.override for c in changes), f"cluster.ray_address={address}"])
        run_dir = run(scaled)
    records = read_workers(run_dir)
    started = sorted({r.group for r in records})
    problems = tuple(check_placed(placement, records, node_ids, started))
    report = render(cfg, run_dir, changes, problems, records, placement, checked.plan.weight_transport,
                    [s for s in ("rollout", "reward", "inference", "actor") if s in started])
    return Rehearsal(run_dir, tuple(changes), problems, report)


def _tiny_model(cfg: Config) -> str:
    knobs = tiny_knobs_for(cfg)
    if knobs is None:
        return "tiny"
    from rlinf_pipe.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(None, "qwen2", **knobs))  # (the warm-started tiny model's family)


def render(cfg: Config, run_dir: Path, changes: Sequence[Change], problems: Sequence[str],
           records: Sequence[WorkerRecord], placement: Placement, transport: str, stages: Sequence[str]) -> str:
    """The rehearsal's report (see the module docstring)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    nodes = sorted({r.node_id for r in records})
    lines = [f"rehearsal of {cfg.runner.experiment_name}: {len(records)} processes on {len(nodes)} Ray node(s), "
             f"{summary['steps']} step(s) trained ({run_dir})", "", "changed for this machine:"]
    lines += [f"  {c.override}" + (f"  ({c.why})" if c.why else "") for c in changes if "output_dir" not in c.override]
    lines += ["", "placement: " + ("every process started on the node and GPUs the placement gave it" if not problems
                                   else f"{len(problems)} process(es) not where the placement said:")]
    lines += [f"  {p}" for p in problems]
    launch = summary.get("launch") or {}
    lines += ["", "per component: processes, nodes, peak memory per process (max / mean), launch (s)"]
    for group in stages:
        mine = [r for r in records if r.group == group]
        peaks = [r.peak_rss_bytes / GIB for r in mine]
        lines.append(f"  {group:<10} {len(mine):>3}  nodes {','.join(map(str, sorted({r.node_rank for r in mine})))}"
                     f"  {max(peaks):.2f} / {sum(peaks) / len(peaks):.2f} GiB"
                     f"  {launch.get('workers_s', {}).get(group, float('nan')):.1f}")
    total = sum(r.peak_rss_bytes for r in records) / GIB
    lines.append(f"  all workers: {total:.1f} GiB of peak memory together; launch to the first step "
                 f"{launch.get('to_first_step_s', float('nan')):.1f} s")
    timeline = summary.get("timeline") or {}
    busy = {k: v for k, v in (timeline.get("stage_busy") or {}).items() if v}
    lines += ["", f"stages (busy fraction of {timeline.get('total_step_time_s', 0):.1f} s of steps): "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(busy.items(), key=lambda kv: -kv[1]))]
    lines += ["", "streams between nodes:", *(f"  {line}" for line in crossings(placement, transport, stages))]
    if problems:
        raise ClusterError("\n".join(lines))
    return "\n".join(lines)
