"""What `rlinf-pipe plan --search` and `plan --validate` print: the ranked candidates as a table and as YAML to
paste, or as JSON; a run's prediction beside its measurement."""

from __future__ import annotations

import shlex
from typing import Any

from rlinf_pipe.planning.costs import Costs
from rlinf_pipe.planning.search import Ranked, SearchResult
from rlinf_pipe.planning.validate import Validation

# Candidates predicted this close to the best are ties: in this machine's checks (docs/planning.md, 4. Validate) real
# runs ordered 10 of 45 pairs of placements predicted within 10% of each other the other way, and 1 of 102 beyond.
TIE_WITHIN = 0.10


def _behind_best(ranked: list[Ranked]) -> list[float]:
    """Each candidate's predicted step time over the best's, less one."""
    best = ranked[0].prediction.step_s
    return [r.prediction.step_s / best - 1.0 if best > 0 else 0.0 for r in ranked]


def tie_note(behind_best: list[float]) -> str | None:
    """The line that names the candidates within `TIE_WITHIN` of the best (`behind_best`: each one's `_behind_best`),
    if any."""
    tied = [f"#{i}" for i, behind in enumerate(behind_best, 1) if 1 < i and behind <= TIE_WITHIN]
    if not tied:
        return None
    return (f"{', '.join(tied)} {'is' if len(tied) == 1 else 'are'} within {TIE_WITHIN:.0%} of #1: a tie within the "
            "prediction's accuracy (docs/planning.md, 4. Validate); a short run of each tells them apart")


def candidate_yaml(ranked: Ranked) -> list[str]:
    """The candidate's placement and parallel sizes as a YAML block to paste into the config."""
    lines = ["cluster:", "  component_placement:"]
    lines += [f"    {key}: {value}" for key, value in ranked.candidate.placement().items()]
    sections: dict[str, list[str]] = {}
    for key, value in ranked.candidate.sizes:
        section, name = key.split(".")
        sections.setdefault(section, []).append(f"  {name}: {value}")
    for section, entries in sections.items():
        lines += [f"{section}:", *entries]
    return lines


def _sizes(ranked: Ranked) -> str:
    values = dict(ranked.candidate.sizes)
    parts = []
    for name, short in (("rollout", "R"), ("inference", "I"), ("actor", "A")):
        tp = values.get(f"{name}.tensor_parallel_size")
        if tp is not None:
            pp = values.get(f"{name}.pipeline_parallel_size", 1)
            parts.append(f"{short} tp{tp}" + (f"pp{pp}" if pp > 1 else ""))
    return " ".join(parts)


def render_search(result: SearchResult, costs: Costs) -> str:
    """The best candidates as a table (best first), then each as YAML, then what the search did."""
    if not result.ranked:
        reasons = "".join(f"\n  {r}" for r in result.refusals)
        return (f"no candidate passed: {result.refused_rules} refused by the placement rules, "
                f"{result.refused_memory} by the memory estimate{reasons}")
    head = ("#", "mode", "placement", "parallel", "step s", "vs #1", "bubble", "tokens/s")
    rows = [head]
    behind_best = _behind_best(result.ranked)
    for i, (r, behind) in enumerate(zip(result.ranked, behind_best), 1):
        placement = ", ".join(f"{k}: {v}" for k, v in r.candidate.placement().items())
        rows.append((str(i), r.candidate.shape.mode, placement, _sizes(r), f"{r.prediction.step_s:.2f}",
                     "" if i == 1 else f"+{behind:.0%}", f"{r.prediction.bubble:.0%}",
                     f"{r.prediction.tokens_per_s:,.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [f"costs: {costs.source}"]
    lines += [f"  missing, taken from the default: {m}" for m in costs.missing]
    lines += ["", *("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)]
    if (note := tie_note(behind_best)) is not None:
        lines.append(note)
    for i, r in enumerate(result.ranked, 1):
        lines += ["", f"# {i}: predicted {r.prediction.step_s:.2f} s/step ({costs.source})",
                  *candidate_yaml(r), f"# overrides: {' '.join(shlex.quote(o) for o in r.candidate.overrides())}"]
    budget = "; stopped at the budget of simulated samples: a candidate left may beat the last shown" \
        if result.budget_hit else ""
    lines += ["", f"searched in {result.seconds:.1f} s: {result.enumerated} candidates, {result.simulated} simulated, "
                  f"{result.refused_rules} refused by the placement rules, {result.refused_memory} by the memory "
                  f"estimate, {result.pruned} pruned by their bound{budget}"]
    return "\n".join(lines)


def search_json(result: SearchResult, costs: Costs) -> dict[str, Any]:
    """`plan --search --json`: `candidates` best first, each with its placement, overrides and prediction."""
    return {
        "candidates": [{"component_placement": r.candidate.placement(), "mode": r.candidate.shape.mode,
                        "parallel": dict(r.candidate.sizes), "overrides": r.candidate.overrides(),
                        **r.prediction.to_json(), "behind_best": behind,
                        "tie_with_best": i > 0 and behind <= TIE_WITHIN}
                       for i, (r, behind) in enumerate(zip(result.ranked, _behind_best(result.ranked)))],
        "source": costs.source, "missing": list(costs.missing),
        "search": {"seconds": result.seconds, "enumerated": result.enumerated, "simulated": result.simulated,
                   "refused_rules": result.refused_rules, "refused_memory": result.refused_memory,
                   "pruned": result.pruned, "budget_hit": result.budget_hit},
    }


def render_validation(v: Validation, costs: Costs) -> str:
    """The run's prediction beside what it measured."""
    p = v.prediction
    rows = [("", "predicted", "measured"),
            ("step s", f"{p.step_s:.3f}", f"{v.measured_step_s:.3f}"),
            ("bubble", f"{p.bubble:.1%}", f"{v.measured_bubble:.1%}"),
            ("tokens/s", f"{p.tokens_per_s:,.0f}", f"{v.measured_tokens_per_s:,.0f}")]
    lines = [f"run: {v.run_dir} ({v.steps} steps measured, the first left out when there are more)",
             f"costs: {costs.source}", *(f"  missing, taken from the default: {m}" for m in costs.missing), ""]
    lines += [f"{a:<10}{b:>12}{c:>12}" for a, b, c in rows]
    lines += ["", f"step time error: {v.error:+.1%}",
              "predicted busy seconds per step (per GPU of the stage): "
              + ", ".join(f"{k} {s:.3f}" for k, s in p.stage_busy_s.items())]
    return "\n".join(lines)
