"""One profile from several runs (`plan --profile RUN_DIR RUN_DIR ...`): a single run's figures move with its
host's noise (on this 2-core machine one run fitted a co-run slowdown of 0.11 where four others of the same
placement fitted 0.21-0.26), and the median over runs does not; and one run rarely shows each stage both alone and
beside another GPU's work, where runs of several placements together do.

The co-run slowdown (`planning.co_run`) is fitted once, over every run's compute spans together, and each run's
rates are carried to work alone by that one figure. Then each figure is the median of the runs' that measured it
(`Costs.measured`: a pipeline run measures no phase switch, a collocated one no pushed broadcast; a figure no run
measured, the median of their stand-ins): a rate, a latency, each transport's sync seconds, each component's switch
seconds; the decode curve, the median of the runs' curves at every concurrency any of them measured; the response
lengths, every run's samples together; `missing`, what every run missed. The runs must share the replica sizes
their rates were measured on (the parallel sizes of rollout, log-prob and actor replicas), so that a median compares
like with like; their placements may differ.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

from rlinf_pipe.errors import ConfigError
from rlinf_pipe.planning.costs import Costs, Curve, Parallel, reduce_hops
from rlinf_pipe.planning.co_run import fit_slowdown
from rlinf_pipe.planning.profile import RunRecord, profile_of, read_profile, read_run, replica_sizes
from rlinf_pipe.planning.tp_hop import fit_input_share, fit_tp_hop

PARALLEL_FIELDS = ("rollout_parallel", "logprob_parallel", "train_parallel")


def _median_curve(curves: Sequence[Curve]) -> Curve:
    xs = sorted({x for c in curves for x, _ in c.points})
    return Curve(tuple((x, statistics.median(c.at(x) for c in curves)) for x in xs))


def _measuring(profiles: Sequence[Costs], name: str) -> list[Costs]:
    """The profiles that measured figure `name` (`Costs.measured`), or all where none did."""
    return [c for c in profiles if name in c.measured] or list(profiles)


def pool_costs(profiles: Sequence[Costs], sources: Sequence[str]) -> Costs:
    """The median profile of `profiles` (see the module docstring), named after `sources` (one per profile)."""
    if not profiles:
        raise ValueError("pool_costs needs at least one profile")
    if len(profiles) == 1:
        return profiles[0]
    first = profiles[0]
    for costs, source in zip(profiles[1:], sources[1:]):
        for name in PARALLEL_FIELDS:
            if getattr(costs, name) != getattr(first, name):
                raise ConfigError(
                    f"--profile {sources[0]} and {source} measured {name.split('_')[0]} replicas of different sizes "
                    f"({getattr(first, name)} and {getattr(costs, name)}); profile runs that share their parallel "
                    "sizes, or give one run")
    pooled: dict[str, object] = {}
    for f in fields(Costs):
        if f.name in PARALLEL_FIELDS:  # (alike in every run: checked above)
            continue
        values = [getattr(c, f.name) for c in _measuring(profiles, f.name)]
        if f.name == "decode":
            pooled[f.name] = _median_curve(values)
        elif f.name == "response_lengths":
            pooled[f.name] = tuple(n for v in values for n in v)
        elif f.name == "missing":  # (what every run missed: another's measurement stands in for the rest)
            pooled[f.name] = tuple(m for m in profiles[0].missing if all(m in c.missing for c in profiles))
        elif f.name == "measured":
            pooled[f.name] = tuple(sorted({m for c in profiles for m in c.measured}))
        elif f.name == "notes":
            pooled[f.name] = {k: n for v in values for k, n in v.items()}
        elif f.name == "source":
            pooled[f.name] = f"profile of {len(profiles)} runs (the median of each figure): {', '.join(sources)}"
        elif isinstance(values[0], dict):
            keys = dict.fromkeys(k for c in profiles for k in getattr(c, f.name))
            pooled[f.name] = {k: statistics.median(getattr(c, f.name)[k] for c in _measuring(
                [c for c in profiles if k in getattr(c, f.name)], f"{f.name}.{k}")) for k in keys}
        elif isinstance(values[0], (int, float)):
            pooled[f.name] = statistics.median(values)
    return replace(first, **pooled)  # type: ignore[arg-type]


def reduction_hop(profiles: Sequence[Costs], actors: Sequence[tuple[Parallel, int]]) -> float | None:
    """A collective's hop from the actor's data-parallel reduction: the optimizer step of the runs whose actor sums
    its gradients over several ranks (`actors`: per run its replica's sizes and its reducing ranks) and had no hop
    measured (their `optimizer_step_s` still holds the reduction: not in `Costs.measured`), less the step of the
    runs of one rank, over the hops `Costs.reduce_s` counts (its bytes' time taken off first); the median over the
    reducing runs. None without runs of both kinds."""
    alone = [c.optimizer_step_s for c, (_, ranks) in zip(profiles, actors)
             if ranks == 1 and "optimizer_step_s" in c.measured]
    reducing = [(c, par, ranks) for c, (par, ranks) in zip(profiles, actors)
                if ranks > 1 and "optimizer_step_s" not in c.measured]
    if not alone or not reducing:
        return None
    step_alone, hops = statistics.median(alone), []
    for costs, par, ranks in reducing:
        whole = costs.optimizer_step_s + costs.reduce_s(par, ranks)  # (the step as measured)
        data = replace(costs, collective_s=0.0).reduce_s(par, ranks)
        hops.append(max(whole - step_alone - data, 0.0) / reduce_hops(ranks))
    return statistics.median(hops)


def read_profiles(run_dirs: Sequence[str | Path], gpu: str | None = None, warmup: int = 1) -> Costs:
    """The profile of several runs: those of the smallest replicas (the first such run's sizes) pooled
    (`pool_same_sizes`); runs whose replicas differ from them only in tensor-parallel size give one hop of a TP
    all-reduce and a pass's wait for its input shared among a replica's ranks (`planning.tp_hop`, `Costs.tp_hop_s`,
    `Costs.share_s`). One run's profile as it is."""
    for run_dir in run_dirs:
        if Path(run_dir).is_file():  # (`--profile RUN CONFIG`: the list took the config too)
            raise ConfigError(f"--profile {run_dir}: a file, where run folders go; give the config before --profile "
                              "(rlinf-pipe plan --search CONFIG --profile RUN_DIR [RUN_DIR ...])")
    if len(run_dirs) == 1:
        return read_profile(run_dirs[0], gpu, warmup)
    runs = [read_run(d, warmup) for d in run_dirs]  # (each timeline parsed once: the fit and the profile read it)
    sizes = [replica_sizes(run.plan) for run in runs]
    reference = min(sizes, key=lambda s: sum(p.gpus for p in s))
    same = [run for run, s in zip(runs, sizes) if s == reference]
    other = [run for run, s in zip(runs, sizes) if s != reference]
    for run, s in zip(runs, sizes):
        if any((p.pp, p.cp) != (q.pp, q.cp) for p, q in zip(s, reference)):
            raise ConfigError(
                f"--profile {same[0].run_dir} and {run.run_dir} measured replicas of other pipeline or context-"
                f"parallel sizes (rollout, log-prob, actor: {_sizes(reference)} and {_sizes(s)}); profile runs that "
                "share them (runs that differ only in tensor-parallel size give its all-reduce's hop)")
    pooled = pool_same_sizes(same, gpu)
    if not other:
        return pooled
    figures: dict[str, float] = {}
    if (hop := fit_tp_hop(pooled, other)) is not None:
        figures["tp_hop_s"] = hop
    if (share := fit_input_share(pooled, other)) is not None:
        figures["share_s"] = share
    if not figures:
        return replace(pooled, missing=(*pooled.missing, "a tensor-parallel all-reduce's hop (the runs at other "
                                        "sizes ran no log-prob or training pass at another TP size)"))
    note = f"the log-prob and training passes of {len(other)} run(s) at another tensor-parallel size"
    return replace(pooled, **figures,  # type: ignore[arg-type]
                   notes={**pooled.notes, **{k: note for k in figures}},
                   measured=tuple(sorted({*pooled.measured, *figures})),
                   source=f"{pooled.source}; the TP figures from {', '.join(str(r.run_dir) for r in other)}")


def _sizes(sizes: tuple[Parallel, ...]) -> str:
    return ", ".join(f"TP {p.tp} PP {p.pp} CP {p.cp}" for p in sizes)


def pool_same_sizes(runs: Sequence[RunRecord], gpu: str | None = None) -> Costs:
    """Runs of the same replica sizes in one profile: each run's rates carried to work alone by one co-run fit over
    all their compute spans (`fit_slowdown`), pooled (`pool_costs`), and a collective's hop from the actor's
    data-parallel reduction where the runs show one with and one without it (`reduction_hop`: an all-reduce among
    the actor's ranks, where the pushed broadcast's hop is another kind of collective)."""
    if len(runs) == 1:
        return profile_of(runs[0], gpu)
    fit = fit_slowdown([sample for run in runs for sample in run.co_run_samples()])
    profiles = [profile_of(run, gpu, fit) for run in runs]
    pooled = pool_costs(profiles, [str(run.run_dir) for run in runs])
    actors = [run.plan.placement.components["actor"] for run in runs]
    hop = reduction_hop(profiles, [(Parallel(a.tp, a.pp, a.cp), a.dp * a.cp) for a in actors])
    if hop is None:
        return pooled
    note = "the actor's data-parallel reduction: the optimizer steps of runs with and without it"
    return replace(pooled, collective_s=hop, notes={**pooled.notes, "collective_s": note},
                   measured=tuple(sorted({*pooled.measured, "collective_s"})))
