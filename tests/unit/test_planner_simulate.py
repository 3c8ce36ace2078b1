"""The step simulator on small cases whose answer is worked out by hand: a flat decode curve of 100 tokens/s per
engine (shared by its running requests), every response 100 tokens, prompts free, training 100 sequence tokens/s."""

from __future__ import annotations

import dataclasses

import pytest

from rlinf_pipe.config import load_config
from rlinf_pipe.planning.batching import Batching, Request, engine_batching, run_batched, run_engine
from rlinf_pipe.planning.costs import Costs, Curve
from rlinf_pipe.planning.run_plan import plan_run
from rlinf_pipe.planning.simulate import simulate
from rlinf_pipe.planning.stage_graph import Stage, StageGraph

BASE = ["data.rollout_batch_size=2", "algorithm.group_size=2", "rollout.max_running_requests=2",
        "rollout.max_new_tokens=1000",  # (responses are cut at the limit: 100 tokens need one above it)
        "actor.micro_batch_size=2"]  # (a group a training pass: the actor trains each as it arrives)


def costs(**changes: object) -> Costs:
    flat = Costs(decode=Curve(((1.0, 100.0), (64.0, 100.0))), prefill_tokens_per_s=1e12, response_lengths=(100,),
                 prompt_tokens=0.0, logprob_tokens_per_s=400.0, train_tokens_per_s=100.0, optimizer_step_s=0.0,
                 weight_sync_s={"broadcast": 0.0, "ipc": 0.0, "object_store": 0.0}, reward_s_per_sample=0.0,
                 switch_s={"actor": 0.0, "rollout": 0.0, "inference": 0.0}, launch_s=0.0, source="by hand")
    return dataclasses.replace(flat, **changes)  # type: ignore[arg-type]


def predict(c: Costs, *overrides: str):
    cfg = load_config(overrides=[*BASE, *overrides])
    return simulate(cfg, plan_run(cfg), c)


def test_an_engine_shares_its_rate_among_its_requests_and_the_long_tail_runs_alone():
    # 4 requests at 400 tokens/s in all: 100 each a second; three finish after their 100 tokens (1 s), the
    # 1,000-token one then runs alone at 400 tokens/s: 900 more tokens take 2.25 s.
    requests = [Request(0, 0.0, 100), Request(0, 0.0, 100), Request(1, 0.0, 100), Request(1, 0.0, 1000)]
    run = run_engine(requests, 0.0, lambda n: 400.0, 1e12, max_running=8)
    assert run.finish == pytest.approx((1.0, 1.0, 1.0, 3.25))
    capped = run_engine(requests[:3], 0.0, lambda n: 100.0 * n, 1e12, max_running=1)  # one at a time, 1 s each
    assert capped.finish == pytest.approx((1.0, 2.0, 3.0))


def test_the_torch_engines_static_batches_run_one_after_the_other():
    # Each request decodes at 10 tokens/s, 10-token prompts prefill at 100 tokens/s. Static batches of 1, then 2:
    # request 0 alone (0.1 s prefill + 1 s) ends at 1.1; requests 1 and 2 prefill (0.2 s) and decode together: the
    # 10-token one ends at 2.3, the 20-token one goes on alone to 3.3. Continuously (2 at once) request 2 takes
    # request 0's place at 1.2 (after its own 0.1 s prefill) and both end at 2.3.
    requests = [Request(0, 10.0, 10), Request(0, 10.0, 20), Request(1, 10.0, 10)]
    static = run_batched(requests, 0.0, lambda n: 10.0 * n, 100.0, Batching(2, static=True, first=1))
    assert static.finish == pytest.approx((1.1, 3.3, 2.3)) and static.end == pytest.approx(3.3)
    continuous = run_batched(requests, 0.0, lambda n: 10.0 * n, 100.0, Batching(2))
    assert continuous.finish == pytest.approx((1.2, 2.3, 2.3)) and continuous.end == pytest.approx(2.3)


def test_each_backend_batches_as_its_engine_does():
    def batching(*overrides: str) -> Batching:
        cfg = load_config(overrides=list(overrides))
        return engine_batching(cfg, plan_run(cfg))

    # the torch engine streaming to an actor of its own: a first batch of one micro-batch, then 64 at a time
    assert batching("actor.micro_batch_size=32") == Batching(64, static=True, first=32)
    assert batching("rollout.first_batch_size=8", "rollout.max_running_requests=16") == Batching(16, True, 8)
    # taking turns with the actor: every batch full; SGLang: continuous
    assert batching('cluster.component_placement={"actor,rollout": all}') == Batching(64, static=True, first=64)
    assert not batching("rollout.backend=sglang", "rollout.max_running_requests=16").static


def test_a_pure_chain_adds_up_by_hand():
    # One group per step on one engine (max_running 2 holds both samples): 2 x 100 tokens at 100 tokens/s = 2 s;
    # then its 200 sequence tokens train at 100/s = 2 s, then the optimizer step 0.5 s: 4.5 s.
    p = predict(costs(optimizer_step_s=0.5), "data.rollout_batch_size=1")
    assert p.step_s == pytest.approx(4.5)
    assert p.tokens_per_s == pytest.approx(200 / 4.5)
    # busy GPU-seconds: the engine 2, the actor 2.5, of 2 GPUs x 4.5 s
    assert p.bubble == pytest.approx(1 - 4.5 / 9.0)
    assert p.stage_busy_s["generate"] == pytest.approx(2.0) and p.stage_busy_s["train"] == pytest.approx(2.5)


def test_groups_stream_so_the_pipeline_beats_the_sum_of_its_stages():
    # Two groups, one after the other on the engine (2 s each: done at 2 and 4); the first trains from 2 to 4 while
    # the second generates, the second from 4 to 6: 6 s, where the stages one after the other take 4 + 4 = 8 s.
    p = predict(costs())
    assert p.step_s == pytest.approx(6.0)
    assert p.stage_busy_s["generate"] + p.stage_busy_s["train"] == pytest.approx(8.0)


def test_the_weight_sync_on_the_plans_transport_precedes_the_generation():
    p = predict(costs(weight_sync_s={"broadcast": 0.75, "ipc": 9.0, "object_store": 9.0}))
    assert p.step_s == pytest.approx(6.75)


def test_staleness_one_hides_the_generation_behind_training():
    # One group a step: generation 2 s, training 3 s (200 tokens at 200/3 tokens/s). Without staleness
    # each step is 2 + 3 = 5 s; with max_staleness 1 the next step's group generates while this one trains: 3 s.
    c = costs(train_tokens_per_s=200 / 3)
    assert predict(c, "data.rollout_batch_size=1").step_s == pytest.approx(5.0)
    assert predict(c, "data.rollout_batch_size=1", "runner.max_staleness=1").step_s == pytest.approx(3.0)


def test_a_steady_step_with_staleness_counts_the_generation_it_starts_ahead():
    # Rollout and reference log-probs taking turns on GPU 0, the actor on GPU 1, one group a step: generation 2 s,
    # log-probs 0.5 s (200 tokens at 400/s), training 2 s. With staleness 1 a step generates the next step's group
    # first (the engines hold GPU 0 until it is done), then its log-probs, then training: 4.5 s. A run's last step
    # generates nothing ahead (2.5 s): counted in, it made the steady step look 3.5 s.
    hybrid = ["cluster.num_gpus_per_node=2", 'cluster.component_placement={"rollout,inference": 0, actor: 1}',
              "algorithm.compute_ref_logprobs=true", "data.rollout_batch_size=1"]
    assert predict(costs(), *hybrid, "runner.max_staleness=1").step_s == pytest.approx(4.5)


def test_collocated_phases_pay_their_switches_and_do_not_overlap():
    # One GPU taken in turns: the engines wake (0.2) and generate both groups (4 s), sleep (0.2); the actor onloads
    # (0.5), trains 4 s, offloads (0.5): 9.4 s.
    c = costs(switch_s={"actor": 1.0, "rollout": 0.4, "inference": 0.0})
    p = predict(c, "cluster.num_gpus_per_node=1", 'cluster.component_placement={"actor,rollout": 0}')
    assert p.step_s == pytest.approx(9.4)
    disaggregated = predict(c)  # the same work streaming on two GPUs
    assert disaggregated.step_s == pytest.approx(6.0)


def test_the_actor_computing_the_log_probs_trains_only_after_all_of_them():
    # n_minibatches 2 needs old log-probs; no inference workers: the actor computes them (400 tokens/s: 0.5 s a
    # group) as the groups arrive (at 2 and 4), the last done at 4.5; then both groups train (2 s each) in two
    # mini-batches: 8.5 s.
    p = predict(costs(), "algorithm.n_minibatches=2")
    assert p.step_s == pytest.approx(8.5)


def test_a_stage_the_simulator_does_not_know_is_an_error():
    cfg = load_config(overrides=BASE)
    from rlinf_pipe.planning.simulate import _Sim
    import random

    sim = _Sim(cfg, plan_run(cfg), costs(), random.Random(0), 1)
    with pytest.raises(ValueError, match="no model of stage 'distill'"):
        sim.run(StageGraph((Stage("distill", "actor", None, None),), ()))


def test_each_phase_the_driver_starts_pays_a_call_and_each_step_the_drivers_work_between_steps():
    # The collocated step above (9.4 s) with a 0.3 s call before each of its two phases and before its weight sync
    # (ipc, at the end of the actor's phase), and 0.5 s between steps: 9.4 + 3 x 0.3 + 0.5 = 10.8 s. Streaming on
    # two GPUs, no phase starts by a call and the version is pushed: 6 + 0.5 s.
    c = costs(switch_s={"actor": 1.0, "rollout": 0.4, "inference": 0.0}, call_s=0.3, step_gap_s=0.5)
    p = predict(c, "cluster.num_gpus_per_node=1", 'cluster.component_placement={"actor,rollout": 0}')
    assert p.step_s == pytest.approx(10.8)
    assert predict(c).step_s == pytest.approx(6.5)


def test_a_data_parallel_actor_pays_its_gradient_reduction_at_every_optimizer_step():
    # One group a step per replica: the two groups generate one after the other on the engine (done at 2 and 4);
    # the actor's 2 replicas train one each (2 s), the second ending at 6; then the optimizer step: 0.5 s of its
    # own, plus 4 collectives of 2 hops of 0.1 s, plus 2 x 1/2 x 400 bytes at 1,000 bytes/s: 6 + 0.5 + 0.8 + 0.4.
    c = costs(optimizer_step_s=0.5, collective_s=0.1, grad_bytes=400.0, collective_bytes_per_s=1000.0)
    dp2 = ["cluster.num_gpus_per_node=3", "cluster.component_placement={rollout: 0, actor: 1-2}"]
    assert predict(c, *dp2).step_s == pytest.approx(7.7)
    assert predict(c).step_s == pytest.approx(6.5)  # one replica: no reduction


def test_responses_are_cut_at_the_configs_limit():
    # The profile's 100-token responses at max_new_tokens 50: each group 2 x 50 tokens (1 s), trained in 1 s: the
    # first group generates 0-1 and trains 1-2 while the second generates 1-2, then trains 2-3.
    assert predict(costs(), "rollout.max_new_tokens=50").step_s == pytest.approx(3.0)


def test_a_groups_rows_sharing_their_prompt_train_it_once():
    # One group of 2 rows with 50-token prompts (prefill free): 2 s of generation, then 200 response tokens and the
    # prompt once (250 at 100/s: 2.5 s) where the rows share it, twice (300: 3 s) where they do not.
    c = costs(prompt_tokens=50.0)
    assert predict(c, "data.rollout_batch_size=1").step_s == pytest.approx(4.5)
    assert predict(c, "data.rollout_batch_size=1", "actor.share_prompts=false").step_s == pytest.approx(5.0)


def test_log_prob_workers_sharing_the_engines_gpus_hold_them_group_by_group():
    # Reference log-probs (400 tokens/s: 0.5 s a group) on the engines' GPU, the actor on its own. With no call cost:
    # generation ends at 4 (groups at 2 and 4), log-probs 4-4.5 and 4.5-5, training 4.5-6.5 and 6.5-8.5. With a
    # 0.25 s round trip: the engines' turn starts 0.25 later (their groups at 2.25, 4.25), the log-prob turn 0.25
    # after that (4.5) and every group holds the GPU a round trip first (done at 5.25 and 6.0); training 5.25-7.25,
    # 7.25-9.25; and the version's way through the object store (two receivers on one GPU) two round trips: 9.75.
    hybrid = ["cluster.num_gpus_per_node=2", 'cluster.component_placement={"rollout,inference": 0, actor: 1}',
              "algorithm.compute_ref_logprobs=true"]
    assert predict(costs(), *hybrid).step_s == pytest.approx(8.5)
    assert predict(costs(call_s=0.25), *hybrid).step_s == pytest.approx(9.75)


def test_the_driver_calls_on_a_weight_versions_way_are_counted_by_route():
    from rlinf_pipe.planning.run_plan import sync_calls

    def calls(*overrides: str) -> int:
        cfg = load_config(overrides=[*BASE, *overrides])
        return sync_calls(plan_run(cfg))

    assert calls() == 0  # pushed to engines on a GPU of their own
    assert calls("cluster.num_gpus_per_node=1", 'cluster.component_placement={"actor,rollout": 0}') == 1
    assert calls("runner.weight_sync=object_store") == 2
    # the chain above with a 0.75 s sync of which 0.25 s is the driver's call at the end of a collocated actor phase
    c = costs(weight_sync_s={"broadcast": 0.5, "ipc": 0.5, "object_store": 0.5}, call_s=0.25)
    collocated = predict(c, "cluster.num_gpus_per_node=1", 'cluster.component_placement={"actor,rollout": 0}')
    no_call = predict(dataclasses.replace(c, call_s=0.0), "cluster.num_gpus_per_node=1",
                      'cluster.component_placement={"actor,rollout": 0}')
    assert collocated.step_s - no_call.step_s == pytest.approx(3 * 0.25)  # the sync's call and both phases' turns


def test_the_torch_engine_pays_a_hand_off_each_time_rows_finish():
    # Static batches of 2 rows; requests of 10, 10 and 20 tokens at 10 tokens/s a row: the first batch's two rows
    # finish together at 1 s (one hand-off), the second's one row at 3 s: with 0.25 s a hand-off, 1.25 and 3.5.
    requests = [Request(0, 0.0, 10), Request(0, 0.0, 10), Request(1, 0.0, 20)]
    run = run_batched(requests, 0.0, lambda n: 10.0 * n, 1e12, Batching(2, static=True, first=2), finish_s=0.25)
    assert run.finish == pytest.approx((1.25, 1.25, 3.5))


def test_work_beside_another_gpus_work_is_slowed_by_the_co_run_slowdown():
    # Disaggregated (rollout 0, actor 1): the engine runs 2 requests at a time, group 0 done at 2 s, group 1 at 4 s;
    # training takes 2 s a group: group 0 over [2, 4] beside the generation, group 1 over [4, 6] alone. With a
    # slowdown of 0.5 both stages spend half their time beside the other: 1.25 x as long. Generation then ends at 5
    # (group 0 at 2.5), training runs [2.5, 5] and [5, 7.5]; the overlaps stay half: 7.5 s a step.
    assert predict(costs()).step_s == pytest.approx(6.0)
    slowed = predict(costs(co_run_slowdown=0.5))
    assert slowed.step_s == pytest.approx(7.5)
    assert slowed.stage_busy_s["generate"] == pytest.approx(5.0) and slowed.stage_busy_s["train"] == pytest.approx(5.0)
    # one GPU taking turns: nothing runs beside anything
    one = ("cluster.num_gpus_per_node=1", 'cluster.component_placement={"actor,rollout": all}')
    assert predict(costs(co_run_slowdown=0.5), *one).step_s == pytest.approx(predict(costs(), *one).step_s)


def test_the_actor_starts_on_the_drivers_call_and_trains_on_another_after_its_log_probs():
    # Staleness 1 (the step above, 3 s): the group generated ahead waits for the driver's call, which goes out once
    # the step began (the engines already finished it): 0.25 + 3 s. Without staleness the group arrives at 2 s,
    # long after the call: 5 s still. The actor computing the log-probs (8.5 s above) is called again to train once
    # they returned: 0.25 s more.
    c = costs(train_tokens_per_s=200 / 3, call_s=0.25)
    assert predict(c, "data.rollout_batch_size=1", "runner.max_staleness=1").step_s == pytest.approx(3.25)
    assert predict(c, "data.rollout_batch_size=1").step_s == pytest.approx(5.0)
    assert predict(costs(call_s=0.25), "algorithm.n_minibatches=2").step_s == pytest.approx(8.75)


def test_a_log_prob_pass_reads_its_group_first_and_a_stage_call_costs_its_measured_latency():
    # The actor computing the log-probs (8.5 s above): reading a group takes 0.1 s before its 0.5 s pass (the
    # groups arrive at 2 and 4: passes over [2.1, 2.6] and [4.1, 4.6]): 8.6 s; the call that starts its training
    # 0.25 s where measured (`phase_call_s`), at least a round trip (`call_s`).
    assert predict(costs(logprob_handoff_s=0.1), "algorithm.n_minibatches=2").step_s == pytest.approx(8.6)
    assert predict(costs(logprob_handoff_s=0.1, phase_call_s=0.25),
                   "algorithm.n_minibatches=2").step_s == pytest.approx(8.85)
    assert predict(costs(phase_call_s=0.25, call_s=0.3), "algorithm.n_minibatches=2").step_s == pytest.approx(8.8)


def test_the_actor_trains_in_micro_batches_as_its_batcher_forms_them_each_pass_at_its_fixed_cost():
    # 4 groups done at 2, 4, 6, 8 s. Passes of 4 rows (2 groups): the first waits for group 1 and trains both over
    # [4, 8], the second [8, 12]; at 0.5 s a pass, 13 s.
    four = ("data.rollout_batch_size=4",)
    assert predict(costs(), *four, "actor.micro_batch_size=4").step_s == pytest.approx(12.0)
    assert predict(costs(train_pass_s=0.5), *four, "actor.micro_batch_size=4").step_s == pytest.approx(13.0)
    # a token budget of one group's 200 tokens: a group a pass, each trained as it arrives (the last over [8, 10])
    assert predict(costs(), *four, "actor.micro_batch_size=4", "actor.pack_sequences=true",
                   "actor.micro_batch_tokens=200").step_s == pytest.approx(10.0)
    # Training at 50 tokens/s (4 s a group) and 1 s a pass: group 0 alone over [2, 7]; groups 1 and 2 have arrived
    # by then and train together (up to 8 rows) over [7, 16]; group 3 over [16, 21]. One group a pass: 22 s.
    slow = costs(train_tokens_per_s=50.0, train_pass_s=1.0)
    assert predict(slow, *four, "actor.max_micro_batch_size=8").step_s == pytest.approx(21.0)
    assert predict(slow, *four).step_s == pytest.approx(22.0)
    # a log-prob pass's fixed cost: the actor's passes (8.5 s above) each 0.25 s longer, the last one's counted
    assert predict(costs(logprob_pass_s=0.25), "algorithm.n_minibatches=2").step_s == pytest.approx(8.75)
