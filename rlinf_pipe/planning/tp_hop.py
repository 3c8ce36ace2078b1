"""One hop of a tensor-parallel all-reduce, measured by runs whose actor or log-prob replicas have another TP size
than the profile's (`plan --profile RUN RUN ...`).

A profile of TP-1 runs cannot time a TP all-reduce: its hop is otherwise a pushed broadcast's or the actor's
data-parallel reduction's, other collectives (on the 2-core machine a collocated TP-2 step was predicted 24% fast
from the reduction's hop). A run at TP 2 holds them: each of its log-prob and training passes takes the profile's
computing for its tokens, carried to its size and slowed by the co-run factor of its overlap (its ranks compute
beside each other), plus the all-reduces it waits on beyond the profile's (`tp_comm.extra_tp_hops`), each a hop and
its bytes. The hop is the median over the run's passes of what is left, over their hops.

Such a run also shows what each pass of a replica over several GPUs waits for before it starts: its input, read on the
replica's input rank and shared with the others (`workers/replica_input.py`, a broadcast between the ranks'
processes): its log-prob worker's time between passes less the profile's (`fit_input_share`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rlinf_pipe.planning.co_run import COMPUTE_WORK, Busy, alone_factor, overlap_fractions
from rlinf_pipe.planning.costs import Costs, Parallel
from rlinf_pipe.planning.gpu_ids import NodeLayout
from rlinf_pipe.planning.profile import RunRecord, SpanTokens, logprob_handoff_s, replica_sizes
from rlinf_pipe.planning.tp_comm import extra_tp_hops, extra_tp_s, tp_shape

PASS_SPANS = ("logprob", "train")


def pass_hop(costs: Costs, run: RunRecord) -> list[float]:
    """Per log-prob or training span of `run` whose replica's TP differs from the one `costs` measured it at, the
    hop its all-reduces imply (see the module docstring)."""
    shape = tp_shape(run.cfg)
    if not shape.layers:
        return []
    counts = SpanTokens.of(run.cfg, costs)
    _, logprob_par, train_par = replica_sizes(run.plan)
    # (each pass's overlap with every compute span of other GPUs, generation included, as the co-run fit counts it)
    spans = [s for s in run.work if s.name in COMPUTE_WORK and s.devices and s.duration > 0]
    host_of = NodeLayout(run.plan.placement.gpus_per_node).node_of
    shares = overlap_fractions([Busy(i, s.start, s.end, s.devices) for i, s in enumerate(spans)], host_of)
    hops_left = []
    for i, s in enumerate(spans):
        if s.name not in PASS_SPANS:
            continue
        par: Parallel
        if s.name == "train":
            kind, par, passes, tokens = "train", train_par, 1, counts.train(s)
            compute = costs.train_pass_s + tokens / costs.train_rate(par)
            measured_tp = costs.train_parallel.tp
        else:
            kind, par, passes = "logprob", logprob_par, counts.passes
            tokens = counts.logprob(s) / passes
            compute = passes * (costs.logprob_pass_s + tokens / costs.logprob_rate(par))
            measured_tp = costs.logprob_parallel.tp
        hops = passes * extra_tp_hops(shape, kind, par.tp, measured_tp)
        if hops <= 0 or tokens <= 0:
            continue
        data = passes * extra_tp_s(costs, shape, kind, tokens, par.tp, measured_tp, hop=0.0)
        left = s.duration - compute * alone_factor(costs.co_run_slowdown, shares[i]) - data
        hops_left.append(left / hops)
    return hops_left


def fit_tp_hop(costs: Costs, runs: Sequence[RunRecord]) -> float | None:
    """The hop of a TP all-reduce from `runs` (at other TP sizes than `costs` measured): the median over their
    passes (`pass_hop`), at least 0; None where none has all-reduces to count."""
    hops = [h for run in runs for h in pass_hop(costs, run)]
    return max(0.0, statistics.median(hops)) if hops else None


def fit_input_share(costs: Costs, runs: Sequence[RunRecord]) -> float | None:
    """The seconds a pass of a replica over several GPUs waits for its input to be shared among its ranks: the
    median over `runs` whose log-prob replicas are such of their log-prob workers' time between passes
    (`profile.logprob_handoff_s`) less `costs.logprob_handoff_s`, at least 0; None where no such run has passes."""
    shares = []
    for run in runs:
        if replica_sizes(run.plan)[1].gpus > 1:
            handoff = logprob_handoff_s(run.work)
            if handoff is not None:
                shares.append(max(0.0, handoff - costs.logprob_handoff_s))
    return statistics.median(shares) if shares else None
