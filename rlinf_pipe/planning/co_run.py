"""Work slowed by other GPUs' work on the same host: the co-run slowdown, measured from a run and simulated.

Virtual GPUs pinned to the cores of one CPU machine (`cluster.cores_per_gpu`) are not independent devices: a core
computes more slowly while the host's other cores compute too (shared caches and memory bandwidth; on a cloud VM
its vCPUs may be hyperthreads of the same physical cores). On the 2-core test machine a decode step took 1.2-1.4x
as long while the other core decoded too (docs/planning.md). Real GPUs barely slow each other; a GPU run measures a
slowdown near 0.

The model: work that runs while another GPU of its host computes for a fraction `f` of its time takes `1 + c x f`
times its time alone. `c` (`Costs.co_run_slowdown`) is fitted from a run's compute spans (`fit_slowdown`: each span's
seconds against its work and its `f`, per stage); the profile's rates are carried to work alone (`measured_slowdown`,
`alone_figures`: where enough of a stage's spans ran alone, their own speed; partial overlaps, where the other GPU's
work starts or ends, slow a span more than the line says), and the simulator (`planning.simulate`) slows each stage's
work by the `f` its own simulated timeline gives (`overlap_fractions`, the same function the profile uses).
Several runs (`plan --profile RUN RUN ...`, `planning.profile_pool`) are fitted together: one `c` over all their
spans, which runs of several placements make vary more than any one run does.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from rlinf_pipe.planning.costs import Curve
from rlinf_pipe.utils.intervals import IntervalUnion
from rlinf_pipe.utils.tracing import Span

K = TypeVar("K", bound=Hashable)

COMPUTE_WORK = {"generate": "tokens", "logprob": "tokens", "train": "sequence_tokens"}  # span -> its work's arg
Sample = tuple[str, float, float, float]  # one compute span: (stage, its work, its seconds, its overlap `f`)

MIN_SLOWDOWN = 0.02  # a fitted slowdown below this is noise: the simulation runs once, without it
MIN_SPREAD = 0.05  # the spans' overlap must vary this much (summed squared deviation per span) to fit a slowdown
ALONE_SHARE = 0.05  # a span that another GPU of its host computed beside for less of its time than this ran alone
ALONE_SPANS = 0.2  # the share of a stage's spans that must have run alone to measure its speed alone directly


@dataclass(frozen=True)
class Busy(Generic[K]):
    """One piece of work: its key, its interval and the global GPU ids it computes on."""

    key: K
    start: float
    end: float
    gpus: tuple[int, ...]


def overlap_fractions(work: Sequence[Busy[K]], host_of: Callable[[int], int]) -> dict[K, float]:
    """Per key, the share of its work's time during which another GPU of its host computes, over all its intervals
    and, for work on several GPUs, averaged over them: each of its GPUs computes beside the others, so a replica
    over several GPUs of one host (tensor parallel) runs beside itself (a share of 1 where it is all the host's
    work, as each of its ranks' spans measures). Keys whose work has no GPU or no duration get 0."""
    per_gpu: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for w in work:
        for g in w.gpus:
            per_gpu[g].append((w.start, w.end))
    others_of: dict[int, IntervalUnion] = {}  # per GPU, the other GPUs' of its host
    covered: dict[K, float] = defaultdict(float)
    total: dict[K, float] = defaultdict(float)
    for w in work:
        total[w.key] += max(w.end - w.start, 0.0)
        if not w.gpus or w.end <= w.start:
            continue
        for gpu in w.gpus:
            if gpu not in others_of:
                others_of[gpu] = IntervalUnion(iv for g, ivs in per_gpu.items()
                                               if g != gpu and host_of(g) == host_of(gpu) for iv in ivs)
            covered[w.key] += others_of[gpu].covered(w.start, w.end) / len(w.gpus)
    return {k: covered[k] / t if t > 0 else 0.0 for k, t in total.items()}


def fit_slowdown(samples: Sequence[Sample]) -> float | None:
    """`c` of the model above from compute spans, each `(stage, work, seconds, f)` (`work`: its tokens): a least-
    squares fit of `log(seconds) = a[stage] + b[stage] x log(work) + s x f` (each stage its own rate and its own
    dependence on the pass's size; one slowdown for all), `c = exp(s) - 1`; 0 below `MIN_SLOWDOWN`. None where the
    spans' overlap does not vary enough within a stage to tell (`MIN_SPREAD`)."""
    import numpy as np

    kept = [(st, math.log(w), math.log(sec), f) for st, w, sec, f in samples if w > 0 and sec > 0]
    stages = sorted({st for st, *_ in kept})
    spread = 0.0
    for st in stages:
        fs = [f for s, _, _, f in kept if s == st]
        mean = sum(fs) / len(fs)
        spread += sum((f - mean) ** 2 for f in fs)
    if not kept or spread < MIN_SPREAD:
        return None
    columns = 2 * len(stages) + 1
    x = np.zeros((len(kept), columns))
    y = np.array([sec for _, _, sec, _ in kept])
    for row, (st, work, _, f) in enumerate(kept):
        i = stages.index(st)
        x[row, 2 * i], x[row, 2 * i + 1], x[row, -1] = 1.0, work, f
    solution, *_ = np.linalg.lstsq(x, y, rcond=None)
    slowdown = math.exp(float(solution[-1])) - 1.0
    return slowdown if slowdown >= MIN_SLOWDOWN else 0.0


def alone_factor(slowdown: float, fraction: float) -> float:
    """How much longer work takes with other GPUs of its host computing `fraction` of its time: `1 + c x f`."""
    return 1.0 + slowdown * fraction


def compute_samples(work: Sequence[Span], host_of: Callable[[int], int]) -> list[Sample]:
    """A run's compute spans on GPUs (`COMPUTE_WORK`), each as a `Sample` with its overlap (`overlap_fractions`)."""
    spans = [s for s in work if s.name in COMPUTE_WORK and s.devices and s.duration > 0
             and float(s.args.get(COMPUTE_WORK[s.name], 0)) > 0]
    shares = overlap_fractions([Busy(i, s.start, s.end, s.devices) for i, s in enumerate(spans)], host_of)
    return [(s.name, float(s.args[COMPUTE_WORK[s.name]]), s.duration, shares[i]) for i, s in enumerate(spans)]


def measured_slowdown(work: Sequence[Span], host_of: Callable[[int], int], slowdown: float | None = None
                      ) -> tuple[float | None, dict[str, float]]:
    """A run's co-run slowdown (`fit_slowdown` over its compute spans, or `slowdown` where given: one fitted over
    several runs' spans) and, per stage, by how much its work alone runs faster than its spans did on average (per
    unit of work): measured directly where at least `ALONE_SPANS` of the stage's spans ran alone (overlap under
    `ALONE_SHARE`), otherwise their seconds over their seconds each divided by `alone_factor` of its overlap (1
    where no slowdown was fitted). Never below 1."""
    samples = compute_samples(work, host_of)
    if slowdown is None:
        slowdown = fit_slowdown(samples)
    faster = {}
    for name in {st for st, *_ in samples}:
        mine = [(sec, w, f) for st, w, sec, f in samples if st == name]
        alone = [(sec, w) for sec, w, f in mine if f < ALONE_SHARE]
        per_work = sum(sec for sec, _, _ in mine) / sum(w for _, w, _ in mine)
        if len(alone) >= max(3, ALONE_SPANS * len(mine)):
            factor = per_work / (sum(sec for sec, _ in alone) / sum(w for _, w in alone))
        else:
            factor = sum(sec for sec, _, _ in mine) / sum(sec / alone_factor(slowdown or 0.0, f) for sec, _, f in mine)
        faster[name] = max(1.0, factor)
    return slowdown, faster


def alone_figures(figures: dict[str, object], slowdown: float, faster: dict[str, float], logprob_from: str
                  ) -> dict[str, object]:
    """A profile's measured rates carried to work alone on its host, each times its stage's factor
    (`measured_slowdown`): the decode curve and the prefill rate the generation's, the training rate the
    training's, the log-prob rate that of `logprob_from` (the stage it was measured on); a pass's fixed seconds
    divided likewise; with `co_run_slowdown`."""
    out: dict[str, object] = {"co_run_slowdown": slowdown}
    if isinstance(decode := figures.get("decode"), Curve):
        out["decode"] = decode.scaled(faster.get("generate", 1.0))
    for key, stage in (("prefill_tokens_per_s", "generate"), ("train_tokens_per_s", "train"),
                       ("logprob_tokens_per_s", logprob_from)):
        if isinstance(rate := figures.get(key), float):
            out[key] = rate * faster.get(stage, 1.0)
    for key, stage in (("train_pass_s", "train"), ("logprob_pass_s", logprob_from)):  # (a pass's fixed seconds)
        if isinstance(seconds := figures.get(key), float):
            out[key] = seconds / faster.get(stage, 1.0)
    return out
