"""Text view of a `Placement`: node x GPU grid, per-component parallelism, the per-GPU memory estimate,
warnings."""

from __future__ import annotations

from rlinf_pipe.planning.memory import GIB, KINDS, MemoryReport
from rlinf_pipe.planning.gpu_ids import format_ids
from rlinf_pipe.planning.placement import Placement

ABBREVIATIONS = {"rollout": "R", "inference": "I", "actor": "A", "reward": "W"}
MODE_REASONS = {
    "collocated": "actor and rollout share the same GPUs and take turns on them",
    "disaggregated": "components on disjoint GPUs stream to each other, stages overlap",
    "hybrid": "some components share a GPU set and take turns on it, the others stream on GPUs of their own",
}


def render_plan(placement: Placement, memory: MemoryReport | None = None,
                warnings: tuple[str, ...] | None = None, notes: list[str] | None = None) -> str:
    """The screen `rlinf-pipe plan` prints (`warnings`: the run's, default the placement's; `notes`: lines after the
    memory estimate)."""
    lines = [
        f"mode: {placement.mode} ({MODE_REASONS[placement.mode]})",
        f"cluster: {len(placement.gpus_per_node)} node(s), {placement.world_size} GPU(s)",
        "",
        *_grid(placement),
        "",
        "legend: " + ", ".join(f"{a}n = {name} process n" for name, a in ABBREVIATIONS.items()
                               if name in placement.components) + ", . = unused",
        "",
        *_table(placement),
        "",
        *_gpu_sets(placement),
    ]
    if memory is not None:
        lines += ["", *_memory(memory)]
    if notes:
        lines += ["", *notes]
    shown = [*(placement.warnings if warnings is None else warnings),
             *(memory.warnings() if memory is not None else [])]
    if shown:
        lines += ["", *(f"warning: {w}" for w in shown)]
    return "\n".join(lines)


def _memory(memory: MemoryReport) -> list[str]:
    """The estimate as a table of GiB per GPU (docs/memory.md), or why there is none."""
    if not memory.components:
        return [f"memory: no estimate ({memory.note})"]
    head = ("memory/GPU (GiB)", *KINDS, "total", f"of {memory.capacity_bytes / GIB:.1f}")
    rows: list[tuple[str, ...]] = [head]
    for name, m in memory.components.items():
        rows.append((name, *(f"{m.per_gpu_bytes[k] / GIB:.1f}" for k in KINDS), f"{m.total / GIB:.1f}",
                     "fits" if m.fits else "DOES NOT FIT"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return [f"memory estimate (model: {memory.model}):", *table]


def _grid(placement: Placement) -> list[str]:
    owners: dict[int, list[str]] = {}
    for name, comp in placement.components.items():
        for proc in comp.processes:
            for gpu in proc.global_gpus:
                owners.setdefault(gpu, []).append(f"{ABBREVIATIONS[name]}{proc.rank}")
    cells: list[list[str]] = []
    start = 0
    for count in placement.gpus_per_node:
        cells.append(["+".join(owners.get(start + i, ["."])) for i in range(count)])
        start += count
    widest_node = max(placement.gpus_per_node)
    width = max([len(c) for row in cells for c in row] + [len(f"gpu{widest_node - 1}")])
    header = " " * 8 + " ".join(f"gpu{i}".ljust(width) for i in range(widest_node))
    rows = [header.rstrip()]
    offset = 0
    for node, row in enumerate(cells):
        ids = f"[{offset}-{offset + len(row) - 1}]" if row else "[]"
        padded = row + [""] * (widest_node - len(row))
        rows.append(f"node {node}".ljust(8) + " ".join(c.ljust(width) for c in padded) + f"  global {ids}")
        offset += len(row)
    return rows


def _gpu_sets(placement: Placement) -> list[str]:
    """How each GPU set is used: by one component that streams, or in turns by several."""
    sets = placement.gpu_sets()
    width = max(len(format_ids(s.gpus)) for s in sets)
    return ["GPU sets:", *(f"  {format_ids(s.gpus).ljust(width)}  {s.sharing}" for s in sets)]


def _table(placement: Placement) -> list[str]:
    """The components' table; a CP column where some component runs context parallelism."""
    with_cp = any(comp.cp > 1 for comp in placement.components.values())
    head = ("component", "yaml key", "global gpus", "procs", "gpus/proc", "TP", "PP", *(("CP",) if with_cp else ()),
            "DP")
    rows = [head]
    for name, comp in placement.components.items():
        per_proc = len(comp.processes[0].global_gpus) if comp.processes else 0
        gpus = format_ids(comp.gpus) if comp.gpus else "cpu"
        rows.append((name, comp.key, gpus, str(len(comp.processes)), str(per_proc), str(comp.tp), str(comp.pp),
                     *((str(comp.cp),) if with_cp else ()), str(comp.dp)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
