"""A discrete-event simulation of a run's step, walking the stage graph the runner runs (`stage_graph(plan)`).

Each stage is simulated by the handler of its name, reading the arrival times of the groups in the channel it
reads and writing their departure times into the one it writes:

* **generate**: the prompts are split over the engines in order; each engine batches its requests as its backend
  does (`planning.batching`: SGLang continuously, the torch engine in static batches), every sample's length drawn
  (seeded) from the costs' response lengths, cut at `rollout.max_new_tokens`; a group leaves when its last sample
  is done. Started once the engines hold the step's version: after the weight sync (the plan's transport,
  `Costs.sync_s`, and the driver's calls on its way, `run_plan.sync_calls`) that follows the previous version's
  training. With `runner.max_staleness` N the
  generations of the next N steps run back to back on the engines while earlier steps train
  (`runner.generation.RolloutSchedule`): a step's sync waits until the engines finished those started on older
  versions, then the step after the last one started ahead is begun.
* **score**: each reward process scores a group's samples on its pool (`reward.num_workers` at once), in arrival order.
* **logprob** / **train**: replicas (`dp` of them) take the groups as they arrive, from the driver's call (a round
  trip after the engines finished the generations started on older versions, and their sync where the driver
  waits for it); the actor computes the log-probs of the whole step before it trains (the driver calls
  its training once they returned: a round trip); training follows the mini-batches: every replica trains its
  share of mini-batch m (groups by slot, or to the replica with the fewest tokens under `replica_routing:
  tokens`), then one optimizer step on all, then mini-batch m + 1; a replica trains in micro-batches as the
  actor's batcher forms them (`train_replica`), each pass at `Costs.train_pass_s` plus its tokens at the rate.
* **turns**: a stage that takes turns on its GPUs (`Stage.turns_with`) starts once the set is free and a driver
  call later, pays its component's switch (onload + offload, wake + sleep) around its phase, and holds the set until
  its last group; log-prob workers on a shared set hold it group by group, a round trip to the lock table each.
* **co-run**: with a co-run slowdown (`Costs.co_run_slowdown`, virtual GPUs sharing a CPU host) the step is
  simulated `CO_RUN_ROUNDS` times, each slowing every replica's work of a stage by the share of its time other GPUs
  of its host computed in the round before (`planning.co_run`).

The steady step time is the mean over the steps after the first N + 1 (N: staleness; without staleness every step
drains the pipeline, and the first is as steady as any), each of which starts its generation N steps ahead: N more
steps follow them, not measured. Not modelled: the channels'
bounds (producers never wait for a full channel), dynamic sampling's extra rounds, the driver's work inside a step
beyond its calls.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import defaultdict
from dataclasses import dataclass, field

from rlinf_pipe.config.schema import Config
from rlinf_pipe.planning.batching import Request, engine_batching, prefill_share, run_batched
from rlinf_pipe.planning.co_run import MIN_SLOWDOWN, Busy, alone_factor, overlap_fractions
from rlinf_pipe.planning.costs import (Costs, Parallel, cut_at, logprob_passes, pass_tokens, scale_rate,
                                       shares_prompts)
from rlinf_pipe.planning.gpu_ids import NodeLayout
from rlinf_pipe.planning.placement import ComponentPlacement, reward_placement
from rlinf_pipe.planning.run_plan import RunPlan, sync_calls
from rlinf_pipe.planning.stage_graph import Stage, StageGraph, stage_graph
from rlinf_pipe.planning.tp_comm import extra_tp_s, tp_shape

Arrivals = list[tuple[float, int]]  # (time, group) in a channel, for one step
WorkKey = tuple[int, str, int]  # (step, stage, replica): the work one co-run slowdown factor applies to


@dataclass(frozen=True)
class Prediction:
    """A predicted step: its seconds, the device bubble (1 - busy GPU-seconds / (GPUs x step)), response tokens/s,
    each stage's busy seconds per step (summed over its replicas' GPUs, divided by the stage's GPUs), and the costs'
    source."""

    step_s: float
    bubble: float
    tokens_per_s: float
    stage_busy_s: dict[str, float]
    source: str
    gpus: int

    def to_json(self) -> dict[str, object]:
        return {"predicted_step_s": self.step_s, "bubble": self.bubble, "tokens_per_s": self.tokens_per_s,
                "stage_busy_s": self.stage_busy_s, "source": self.source}


def _parallel(comp: ComponentPlacement) -> Parallel:
    return Parallel(comp.tp, comp.pp, comp.cp)


@dataclass
class _Pool:
    """Identical servers; each item goes to the first free one, in arrival order."""

    free: list[tuple[float, int]]  # (free from, server)
    busy: float = 0.0

    @classmethod
    def of(cls, servers: int, free: float = 0.0) -> _Pool:
        return cls([(free, i) for i in range(servers)])

    def next_server(self) -> int:
        return self.free[0][1]

    def serve(self, arrival: float, seconds: float) -> tuple[float, float]:
        """The item's (start, end) on the first free server (`next_server`)."""
        free, server = heapq.heappop(self.free)
        start = max(arrival, free)
        heapq.heappush(self.free, (start + seconds, server))
        self.busy += seconds
        return start, start + seconds


@dataclass
class _Sim:
    """The state of one simulation (see the module docstring)."""

    cfg: Config
    plan: RunPlan
    costs: Costs
    rng: random.Random
    steps: int
    lengths: dict[int, list[list[int]]] = field(default_factory=dict)  # per step, per group, its samples' lengths
    generated: dict[int, Arrivals] = field(default_factory=dict)
    step_start: float = 0.0
    calls_at: float = 0.0  # when the driver's calls of this step's log-prob and training stages reach the workers
    engines_free: float = 0.0
    next_generation: int = 0
    set_free: dict[tuple[int, ...], float] = field(default_factory=lambda: defaultdict(float))
    busy: dict[int, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    reward: _Pool | None = None
    logprob_pool: _Pool | None = None
    current: int = 0  # the step being simulated
    actor_phase_open: bool = False  # the actor's log-prob stage took its turn; training goes on in that phase
    slow: dict[WorkKey, float] = field(default_factory=dict)  # per piece of work, its co-run slowdown factor
    work: list[Busy[WorkKey]] = field(default_factory=list)  # the GPUs' work, as simulated (when `track`)
    track: bool = False  # record `work` (for the next co-run round)

    def __post_init__(self) -> None:
        self.prompts, self.group_size = self.cfg.data.rollout_batch_size, self.cfg.algorithm.group_size
        comps = self.plan.placement.components
        self.rollout, self.actor = comps["rollout"], comps["actor"]
        processes = len(reward_placement(self.plan.placement).processes)
        self.reward = _Pool.of(processes)
        logprob = self.plan.logprob_component
        self.logprob_comp = comps[logprob] if logprob else None
        if self.logprob_comp is not None and logprob == "inference":
            self.logprob_pool = _Pool.of(self.logprob_comp.dp)
        self.sync = self.costs.sync_s(self.plan.weight_transport) + sync_calls(self.plan) * self.costs.call_s
        self.shared, self.passes = shares_prompts(self.cfg), logprob_passes(self.cfg)
        self.receiver_gpus = sum(len(comps[n].gpus) for n in self.plan.weight_receivers if n in comps)
        self.tp_shape = tp_shape(self.cfg)

    def tp_s(self, kind: str, tokens: float, tp: int, measured: Parallel) -> float:
        """A pass's tensor-parallel all-reduces beyond those its profiled rate holds (`planning.tp_comm`)."""
        if tp == measured.tp:  # (most candidates: nothing to add, without a call)
            return 0.0
        return extra_tp_s(self.costs, self.tp_shape, kind, tokens, tp, measured.tp)

    # --- helpers ---------------------------------------------------------------------------------------------
    def factor(self, stage: str, replica: int) -> float:
        """How much longer this step's work of `stage`'s replica takes beside other GPUs' (`planning.co_run`)."""
        return self.slow.get((self.current, stage, replica), 1.0)

    def record(self, stage: str, replica: int, comp: ComponentPlacement, start: float, end: float,
               step: int | None = None) -> None:
        """Record a replica's work (its GPUs: the `replica`-th slice of `comp.gpus`) when tracking."""
        if not self.track:
            return
        size = len(comp.gpus) // max(comp.dp, 1)
        self.work.append(Busy((self.current if step is None else step, stage, replica), start, end,
                              tuple(comp.gpus[replica * size:(replica + 1) * size])))

    def group_tokens(self, step: int, group: int) -> float:
        """The tokens a pass runs for one group (`pass_tokens`)."""
        lengths = self.lengths[step][group]
        return pass_tokens(sum(lengths), len(lengths) * self.costs.prompt_tokens, len(lengths), self.shared)

    def take_turn(self, stage: Stage, comp: ComponentPlacement, ready: float) -> float:
        """When `stage`'s phase may start on its GPUs (after the set is free and its switch-in); `ready` for a
        stage whose GPUs are its own."""
        if not stage.turns_with:
            return ready
        switch = self.costs.switch_s.get(comp.name, 0.0) / 2
        self.busy[self.current]["switch"] += switch * 2 * len(comp.gpus)
        return max(ready, self.set_free[comp.gpus]) + self.costs.phase_call + switch

    def end_turn(self, stage: Stage, comp: ComponentPlacement, end: float) -> float:
        if not stage.turns_with:
            return end
        self.set_free[comp.gpus] = end + self.costs.switch_s.get(comp.name, 0.0) / 2
        return self.set_free[comp.gpus]

    # --- stages ------------------------------------------------------------------------------------------------
    def generate(self, stage: Stage, _: Arrivals) -> Arrivals:
        """Sync the step's version into the receivers, then run the generations due (this step's, and those
        started ahead up to the staleness)."""
        sync_at = max(self.step_start, self.engines_free)
        self.busy[self.current]["weight_sync"] += self.sync * self.receiver_gpus
        start = sync_at + self.sync
        # the driver's calls to the log-prob workers and the actor go out once the generation is asked for: at once
        # where the engines may take it while their sync loads, after the sync where inference workers load beside
        self.calls_at = (start if self.plan.inference_shares_rollout else sync_at) + self.costs.phase_call
        last = min(self.current + self.plan.staleness, self.steps - 1)
        while self.next_generation <= last:
            start = self.run_generation(stage, self.next_generation, start)
            self.next_generation += 1
        self.engines_free = start
        return self.generated[self.current]

    def run_generation(self, stage: Stage, step: int, ready: float) -> float:
        comp, costs, g = self.rollout, self.costs, self.group_size
        start = self.take_turn(stage, comp, ready)
        drawn = self.rng.choices(costs.response_lengths, k=self.prompts * g)
        self.lengths[step] = [drawn[i * g:(i + 1) * g] for i in range(self.prompts)]
        engines, par = comp.dp, _parallel(comp)
        factor = scale_rate(1.0, costs.rollout_parallel, par)
        batching = engine_batching(self.cfg, self.plan)
        arrivals: Arrivals = []
        end = start
        for e in range(engines):
            groups = range(e * self.prompts // engines, (e + 1) * self.prompts // engines)
            share = prefill_share(costs.prompt_tokens, g)
            requests = [Request(grp, share, n) for grp in groups for n in self.lengths[step][grp]]
            slow = self.slow.get((step, "generate", e), 1.0)
            rate = lambda n: costs.decode.at(n) * factor / slow  # noqa: E731
            # (each decode step's all-reduces: SGLang shards the model over its TP ranks; the torch engine runs it
            # whole in one process whatever its GPUs, and has none)
            if self.cfg.rollout.backend == "sglang" and self.tp_s("decode", 1, par.tp, costs.rollout_parallel):
                alone = rate
                rate = lambda n: n / max(  # noqa: E731
                    n / alone(n) + self.tp_s("decode", n, par.tp, costs.rollout_parallel), 1e-12)
            run = run_batched(requests, start, rate, costs.prefill_rate(par) / slow, batching, costs.decode_call_s)
            self.record("generate", e, comp, start, run.end, step)
            done: dict[int, float] = {}
            for r, t in zip(requests, run.finish):
                done[r.group] = max(done.get(r.group, 0.0), t)
            arrivals += [(t, grp) for grp, t in done.items()]
            self.busy[step]["generate"] += (run.end - start) * par.gpus
            end = max(end, run.end)
        self.end_turn(stage, comp, end)
        self.generated[step] = sorted(arrivals)
        return end

    def score(self, stage: Stage, arrivals: Arrivals) -> Arrivals:
        assert self.reward is not None
        per_group = math.ceil(self.group_size / self.cfg.reward.num_workers) * self.costs.reward_s_per_sample
        return sorted((self.reward.serve(t, per_group)[1], grp) for t, grp in arrivals)

    def logprob(self, stage: Stage, arrivals: Arrivals) -> Arrivals:
        comp = self.logprob_comp
        assert comp is not None
        par = _parallel(comp)
        rate = self.costs.logprob_rate(par)
        if self.logprob_pool is not None and not stage.turns_with:  # inference workers on GPUs of their own
            pool, start = self.logprob_pool, self.calls_at
        else:  # the actor before it trains, or inference between the engines' generations: a phase of its own
            ready = max(self.step_start, self.generated_end(arrivals) if stage.turns_with else self.calls_at)
            start = self.take_turn(stage, comp, ready)
            pool = _Pool.of(comp.dp, start)
        # log-prob workers on a shared set hold its GPUs group by group: each hold a round trip to the lock table
        hold = self.costs.call_s if stage.turns_with and comp.name != "actor" else 0.0
        hold += self.costs.logprob_handoff_s  # (and each pass reads its group first)
        hold += self.costs.share_s if par.gpus > 1 else 0.0  # (shared among the replica's ranks; an actor's training
        # reads its next micro-batch while one trains)
        before = pool.busy
        out = []
        for t, grp in sorted(arrivals):
            replica = pool.next_server()
            tokens = self.group_tokens(self.current, grp)
            seconds = self.passes * (self.costs.logprob_pass_s + tokens / rate) * self.factor("logprob", replica)
            seconds = max(seconds + self.passes * self.tp_s("logprob", tokens, par.tp, self.costs.logprob_parallel),
                          0.0)
            began, end = pool.serve(max(t, start), hold + seconds)
            self.record("logprob", replica, comp, began + hold, end)
            out.append((end, grp))
        out.sort()
        self.busy[self.current]["logprob"] += (pool.busy - before - hold * len(arrivals)) * par.gpus
        if comp.name == "actor":  # training starts once every log-prob is computed
            done = max((t for t, _ in out), default=start)
            self.actor_phase_open = True
            return [(done, grp) for _, grp in out]
        if stage.turns_with:
            self.end_turn(stage, comp, max((t for t, _ in out), default=start))
        return out

    def generated_end(self, arrivals: Arrivals) -> float:
        return max(self.engines_free, max((t for t, _ in arrivals), default=0.0))

    def train(self, stage: Stage, arrivals: Arrivals) -> Arrivals:
        comp, costs = self.actor, self.costs
        par = _parallel(comp)
        rate, opt = costs.train_rate(par), costs.optimizer_s(par, comp.dp * comp.cp)
        if self.actor_phase_open:  # (the log-prob stage took the turn; the driver calls training once it returned)
            start = min((t for t, _ in arrivals), default=self.step_start) + costs.phase_call
            self.actor_phase_open = False
        else:
            ready = self.generated_end([]) if stage.turns_with else self.calls_at
            start = self.take_turn(stage, comp, max(self.step_start, ready))
        dp, m = comp.dp, self.cfg.algorithm.n_minibatches
        per_mb = max(1, self.prompts // m)
        order = sorted(arrivals) if self.plan.arrival_slots else sorted(arrivals, key=lambda a: a[1])
        batches: list[list[list[tuple[float, int]]]] = [[[] for _ in range(dp)] for _ in range(m)]
        loads = [[0.0] * dp for _ in range(m)]
        for slot, (t, grp) in enumerate(order):
            mb = min(slot // per_mb, m - 1)
            r = min(range(dp), key=loads[mb].__getitem__) if self.plan.token_balance else slot % dp
            loads[mb][r] += self.group_tokens(self.current, grp)
            batches[mb][r].append((t, grp))
        t_mb, trained = start, 0.0
        for mb in range(m):
            ends = []
            for r in range(dp):
                end, busy = self.train_replica(sorted(batches[mb][r]), t_mb, r, rate)
                ends.append(end)
                trained += busy
            t_mb = max(ends) + opt
        self.busy[self.current]["train"] += (trained + m * opt * dp) * par.gpus
        return [(self.end_turn(stage, comp, t_mb), -1)]

    def train_replica(self, queue: Arrivals, t: float, replica: int, rate: float) -> tuple[float, float]:
        """One replica's passes over its groups of a mini-batch (`queue`, in arrival order) from `t`, in micro-batches
        as the actor's `MicroBatcher` forms them: a pass takes groups until it holds `actor.micro_batch_size` rows
        (waiting for them), and more that have already arrived up to `actor.max_micro_batch_size`, never past
        `actor.micro_batch_tokens` (where a number); the last takes what is left. Each pass costs
        `Costs.train_pass_s` and its tokens at `rate`. Returns (end, busy seconds)."""
        actor, slow = self.cfg.actor, self.factor("train", replica)
        least = actor.micro_batch_size
        most = max(actor.max_micro_batch_size or least, least)
        budget = actor.micro_batch_tokens if isinstance(actor.micro_batch_tokens, int) else math.inf
        busy, i = 0.0, 0
        while i < len(queue):
            t, rows, tokens = max(t, queue[i][0]), 0, 0.0
            while i < len(queue):
                arrival, grp = queue[i]
                more = self.group_tokens(self.current, grp)
                if rows and (rows + self.group_size > most or tokens + more > budget
                             or (rows >= least and arrival > t)):
                    break
                t, rows, tokens, i = max(t, arrival), rows + self.group_size, tokens + more, i + 1
            seconds = (self.costs.train_pass_s + tokens / rate) * slow
            began, t = t, t + max(seconds + self.tp_s("train", tokens, self.actor.tp, self.costs.train_parallel), 0.0)
            self.record("train", replica, self.actor, began, t)
            busy += t - began
        return t, busy

    # --- the run -----------------------------------------------------------------------------------------------
    def run(self, graph: StageGraph) -> list[float]:
        """Every step's end time."""
        handlers = {"generate": self.generate, "score": self.score, "logprob": self.logprob, "train": self.train}
        ends = []
        self.step_start = self.costs.step_gap_s  # (every step after the driver's work between steps)
        for step in range(self.steps):
            self.current = step
            channels: dict[str | None, Arrivals] = {None: []}
            for stage in graph.stages:
                if stage.name not in handlers:
                    raise ValueError(f"the simulator has no model of stage {stage.name!r}")
                channels[stage.writes] = handlers[stage.name](stage, channels[stage.reads])
            end = max(t for t, _ in channels[None])
            ends.append(end)
            self.step_start = end + self.costs.step_gap_s
        return ends


CO_RUN_ROUNDS = 3  # simulations with a co-run slowdown: each slows the work by the overlap of the one before


def simulate(cfg: Config, plan: RunPlan, costs: Costs, seed: int = 0, steps: int | None = None) -> Prediction:
    """The predicted steady step of `plan` (see the module docstring)."""
    warm = plan.staleness + 1 if plan.staleness else 0  # (without staleness every step drains: each is steady)
    steps = steps or warm + 2
    # the measured steps generate ahead as a long run's do: `staleness` more steps follow them, not measured (the
    # last steps of a run start no generation: counted, they would make a step whose engines lead look short)
    simulated = steps + plan.staleness
    cut = cut_at(costs, cfg.rollout.max_new_tokens)  # (a profile of a higher limit has its lengths cut at this one's)
    graph, host_of = stage_graph(plan), NodeLayout(plan.placement.gpus_per_node).node_of
    slow: dict[WorkKey, float] = {}
    rounds = CO_RUN_ROUNDS if costs.co_run_slowdown >= MIN_SLOWDOWN else 1
    for done in range(1, rounds + 1):
        sim = _Sim(cfg, plan, cut, random.Random(seed), simulated, slow=slow, track=done < rounds)
        ends = sim.run(graph)
        if done < rounds:
            slow = {k: alone_factor(costs.co_run_slowdown, f)
                    for k, f in overlap_fractions(sim.work, host_of).items()}
    measured = range(min(warm, steps - 1), steps)
    first = ends[measured[0] - 1] if measured[0] > 0 else 0.0
    step_s = (ends[measured[-1]] - first) / len(measured)
    comps = plan.placement.components
    used = {g for name in ("rollout", "inference", "actor") if name in comps
            and (name != "inference" or plan.inference_workers) for g in comps[name].gpus}
    gpus = max(len(used), 1)
    busy = {k: sum(sim.busy[s][k] for s in measured) / len(measured) for k in
            {k for s in measured for k in sim.busy[s]}}
    tokens = sum(sum(map(sum, sim.lengths[s])) for s in measured) / len(measured)
    bubble = max(0.0, 1.0 - sum(busy.values()) / (gpus * step_s)) if step_s > 0 else 0.0
    stage_gpus = {"generate": len(comps["rollout"].gpus), "train": len(comps["actor"].gpus),
                  "logprob": len(sim.logprob_comp.gpus) if sim.logprob_comp else 1,
                  "weight_sync": max(sim.receiver_gpus, 1), "switch": gpus}
    return Prediction(step_s, bubble, tokens / step_s if step_s > 0 else 0.0,
                      {k: v / stage_gpus.get(k, 1) for k, v in sorted(busy.items())}, costs.source, gpus)
