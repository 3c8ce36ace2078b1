"""The summaries of `planner_accuracy.py`: the ranking the runs measure (`told_apart_ranking`) and several
invocations pooled (`pooled`), and their tables. See that script's docstring."""

from __future__ import annotations

import itertools
import statistics
from typing import Any

TOLD_APART = 0.75  # pooled: two placements are told apart where a run of one beats a run of the other this often


def told_apart_ranking(measured: dict[str, float], predicted: dict[str, float], told: set[frozenset[str]]
                       ) -> dict[str, Any]:
    """The ranking the runs measure (see `planner_accuracy.py`'s docstring): of the largest sets of placements every
    two of which are `told` apart, one in measured order (`ranked_placements`), and whether the prediction orders
    every such set as measured (`ranked_alike`)."""
    names = sorted(measured, key=measured.__getitem__)
    for size in range(len(names), 0, -1):
        largest = [subset for subset in itertools.combinations(names, size)
                   if all(frozenset(pair) in told for pair in itertools.combinations(subset, 2))]
        if largest:
            alike = all(sorted(subset, key=predicted.__getitem__) == list(subset) for subset in largest)
            return {"ranked_placements": list(largest[0]), "ranked_alike": alike}
    return {"ranked_placements": [], "ranked_alike": True}


def pooled(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Several invocations' summaries together (see `planner_accuracy.py`'s docstring): each placement's runs pooled,
    its prediction the median of the invocations'; the errors over the placements not profiled; `same_ranking`; and of
    the pairs of placements, those whose runs one wins in at least `TOLD_APART` of their pairings (`win`: how often
    a run of the faster by median is faster than a run of the other), and how many of them the prediction orders
    alike."""
    names = [r["name"] for r in summaries[0]["placements"]]
    rows = {n: [r for s in summaries for r in s["placements"] if r["name"] == n] for n in names}
    runs = {n: [m for r in rs for m in r["measured_runs_s"]] for n, rs in rows.items()}
    measured = {n: statistics.median(v) for n, v in runs.items()}
    predicted = {n: statistics.median(r["predicted_step_s"] for r in rs) for n, rs in rows.items()}
    error = {n: (predicted[n] - measured[n]) / measured[n] for n in names}
    others = [abs(error[n]) for n in names if not rows[n][0]["profiled"]] or [abs(e) for e in error.values()]
    pairs = []
    for a, b in itertools.combinations(sorted(names, key=measured.__getitem__), 2):
        win = sum(x < y for x in runs[a] for y in runs[b]) / (len(runs[a]) * len(runs[b]))
        pairs.append({"faster": a, "slower": b, "gap": round((measured[b] - measured[a]) / measured[a], 4),
                      "win": round(win, 3), "told_apart": win >= TOLD_APART,
                      "predicted_alike": predicted[a] < predicted[b]})
    told = [p for p in pairs if p["told_apart"]]
    by_predicted, by_measured = sorted(names, key=predicted.__getitem__), sorted(names, key=measured.__getitem__)
    ranking = told_apart_ranking(measured, predicted, {frozenset((p["faster"], p["slower"])) for p in told})
    return {"invocations": len(summaries), "median_abs_error": round(statistics.median(others), 4),
            "max_abs_error": round(max(others), 4), "same_ranking": by_predicted == by_measured,
            "predicted_ranking": by_predicted, "measured_ranking": by_measured, "told_apart_pairs": len(told),
            "told_apart_pairs_ordered_alike": sum(p["predicted_alike"] for p in told), **ranking, "pairs": pairs,
            "placements": [{"name": n, "profiled": rows[n][0]["profiled"], "measured_step_s": round(measured[n], 4),
                            "runs": len(runs[n]), "predicted_step_s": round(predicted[n], 4),
                            "error": round(error[n], 4)} for n in names]}


def print_placements(summary: dict[str, Any], pooled_runs: bool) -> None:
    """One row a placement: measured and predicted seconds, the error, and the runs pooled or their spread."""
    header, cell = ("runs", "{:>8}") if pooled_runs else ("spread", "{:>8.0%}")
    print(f"{'placement':<26}{'measured s':>11}{header:>8}{'predicted':>11}{'error':>9}")
    for r in summary["placements"]:
        mark = " (profiled)" if r["profiled"] else ""
        extra = cell.format(r["runs"] if pooled_runs else r.get("spread", 0.0))
        print(f"{r['name']:<26}{r['measured_step_s']:>11.3f}{extra}{r['predicted_step_s']:>11.3f}"
              f"{r['error']:>+9.1%}{mark}")


def print_pooled(summary: dict[str, Any]) -> None:
    print(f"pooled over {summary['invocations']} invocations")
    print_placements(summary, pooled_runs=True)
    print(f"median |error| {summary['median_abs_error']:.1%}, worst {summary['max_abs_error']:.1%}; same ranking: "
          f"{summary['same_ranking']}")
    for p in summary["pairs"]:
        if not p["predicted_alike"]:
            print(f"  predicted in the other order: {p['faster']} < {p['slower']} ({p['gap']:+.1%}, a run of the "
                  f"first faster in {p['win']:.0%} of pairings)")
    print(f"pairs told apart (a run of one faster in at least {TOLD_APART:.0%} of pairings): "
          f"{summary['told_apart_pairs']}, of which predicted in the same order: "
          f"{summary['told_apart_pairs_ordered_alike']}")
    print_ranking(summary)


def print_ranking(summary: dict[str, Any]) -> None:
    ranked = summary["ranked_placements"]
    print(f"the ranking the runs measure (the most placements every two of which they tell apart): {len(ranked)}, "
          f"{' < '.join(ranked)}; predicted in that order: {'yes' if summary['ranked_alike'] else 'no'}")


def print_table(summary: dict[str, Any]) -> None:
    print_placements(summary, pooled_runs=False)
    print(f"median |error| {summary['median_abs_error']:.1%}, worst {summary['max_abs_error']:.1%} (the "
          f"{sum(not r['profiled'] for r in summary['placements'])} placements not profiled); same ranking: "
          f"{summary['same_ranking']}")
    if not summary["same_ranking"]:
        print(f"  predicted order: {', '.join(summary['predicted_ranking'])}")
        print(f"  measured order:  {', '.join(summary['measured_ranking'])}")
    print(f"pairs of placements the runs tell apart (every run of one faster than every run of the other): "
          f"{summary['distinguishable_pairs']}, of which predicted in the same order: "
          f"{summary['distinguishable_pairs_ordered_alike']}")
    print_ranking(summary)
