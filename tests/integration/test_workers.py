"""Workers and worker groups on a real multi-node Ray cluster with fake GPUs (4 nodes x 8 GPUs, one machine)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import sys

import pytest
import ray
import torch
from ray.cluster_utils import Cluster as RayTestCluster

from rlinf_pipe.config import Config
from rlinf_pipe.errors import ClusterError, ConfigError, UserCodeError, WorkerError
from rlinf_pipe.runtime import worker_group
from rlinf_pipe.runtime.cluster import NODE_RANK_LABEL, Cluster
from rlinf_pipe.runtime.node_paths import NodePath, check_node_paths
from rlinf_pipe.planning.placement import plan_placement
from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.runtime.worker_group import WorkerGroup
from rlinf_pipe.utils.net import GLOO_IFNAME_ENV, NCCL_IFNAME_ENV, socket_interface_env

# Worker classes below are shipped to Ray workers by value (the tests folder is not importable there).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Probe(Worker):
    def __init__(self, tag: str = ""):
        super().__init__()
        if tag == "dies while it builds":  # (as an SGLang engine that finds too little memory, then SIGQUIT)
            sys.stderr.write("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.\n")
            sys.stderr.flush()
            os._exit(3)
        self.tag = tag

    def tagged(self) -> tuple[str, int]:
        return self.tag, self.rank

    def all_reduce_rank(self) -> tuple[float, str]:
        import torch
        import torch.distributed as dist

        value = torch.tensor([float(self.rank)])
        dist.all_reduce(value)
        return value.item(), dist.get_backend()

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"rank {rank} refuses on purpose")
        return self.rank

    def user_code_fails_on(self, rank: int) -> int:
        if self.rank == rank:
            raise UserCodeError(f"my_reward.py:7 in compute_score: KeyError: 'x' (on rank {rank})")
        return self.rank

    def shard_sum(self, shard: list[int], offset: int = 0) -> tuple[int, list[int]]:
        return self.rank, [x + offset for x in shard]

    def total(self, values: torch.Tensor) -> float:
        return float(values.sum())

    def crash(self) -> None:
        """Die without an exception of its own, after a last word (as SGLang's scheduler writes its traceback to
        the output the worker shares with it before it ends the worker)."""
        sys.stderr.write("Scheduler hit an exception: torch.OutOfMemoryError: CUDA out of memory\n")
        sys.stderr.flush()
        os._exit(3)

    def hold(self, seconds: float) -> int:
        import time

        time.sleep(seconds)
        return self.rank


SKEW_S = 3.0


class SkewedClock(Worker):
    """A worker on a host whose clock is `SKEW_S` ahead (the clock its spans and `clock()` read)."""

    def __init__(self):
        super().__init__()
        import time

        from rlinf_pipe.utils import tracing

        tracing.now = lambda: time.time() + SKEW_S

    def mark(self) -> None:
        with self.tracer.span("mark"):
            pass


class BrokenInit(Worker):
    def __init__(self):
        super().__init__()
        raise RuntimeError("constructor failed on purpose")


class BrokenOnRankOne(Worker):
    """Rank 1 fails before joining the group's world; rank 0 is left waiting in the rendezvous."""

    def __init__(self):
        if os.environ["RLINF_PIPE_RANK"] == "1":
            raise RuntimeError("rank 1 fails before the rendezvous")
        super().__init__()


def make_config(placement: dict, **parallel: int) -> Config:
    cfg = Config()
    cfg.cluster.num_nodes, cfg.cluster.num_gpus_per_node = 4, 8
    cfg.cluster.component_placement = placement
    cfg.actor.tensor_parallel_size = parallel.get("actor_tp", 1)
    cfg.rollout.tensor_parallel_size = parallel.get("rollout_tp", 1)
    return cfg


@pytest.fixture(scope="module")
def cluster():
    """4 nodes x 8 fake GPUs. Nodes join out of RANK order; the head carries no label."""
    test_cluster = RayTestCluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 8})
    for rank in ("3", "1", "2"):
        test_cluster.add_node(num_cpus=1, num_gpus=8, labels={NODE_RANK_LABEL: rank})
    ray.init(address=test_cluster.address)
    try:
        yield Cluster(make_config({"actor,rollout": "all"}))
    finally:
        ray.shutdown()
        test_cluster.shutdown()


@pytest.fixture(scope="module")
def actor_group(cluster):
    """4 actor processes on GPUs 6-9 (nodes 0 and 1), TP 2 -> 2 data-parallel replicas, gloo initialised."""
    cfg = make_config({"rollout": "0-5", "actor": "6-9"}, actor_tp=2)
    group = WorkerGroup.launch(Probe, "actor", plan_placement(cfg).components["actor"], cluster, "shared")
    yield group
    group.shutdown()


def test_nodes_follow_head_then_rank_label(cluster):
    node_ids = {n["NodeID"]: (n.get("Labels") or {}).get(NODE_RANK_LABEL) for n in ray.nodes()}
    assert [node_ids[n.node_id] for n in cluster.nodes] == [None, "1", "2", "3"]
    assert cluster.nodes[0].is_head
    assert (cluster.num_nodes, cluster.gpus_per_node, cluster.world_size) == (4, [8] * 4, 32)
    assert cluster.node_of(17).node_rank == 2


def test_a_run_using_fewer_gpus_than_a_node_has_holds_them_all(cluster):
    """Our processes choose their GPU ids themselves (0..k-1): holding only k GPUs would let Ray hand another job
    GPUs among them. (Runs before the module's other tests reserve the nodes.)"""
    from ray.util.placement_group import placement_group_table

    cfg = make_config({"rollout": "0-1", "actor": "2-3"})
    cfg.cluster.num_gpus_per_node = 6
    fewer = Cluster(cfg)
    try:
        assert fewer.gpus_per_node == [6] * 4 and fewer.nodes[3].ray_gpus == 8
        (held,) = fewer.reserve_nodes([3]).values()
        assert placement_group_table(held)["bundles"] == {0: {"GPU": 8.0}}
    finally:
        fewer.release()


def test_workers_land_on_their_nodes_with_their_gpus(cluster):
    cfg = make_config({"rollout": "0-3,12-15,16-19,28-31", "actor": "4-11"}, rollout_tp=4)
    placement = plan_placement(cfg).components["rollout"]
    group = WorkerGroup.launch(Probe, "rollout", placement, cluster, distributed=False)
    try:
        infos = group.infos()
        assert [i.rank for i in infos] == [0, 1, 2, 3]
        for info, proc in zip(infos, placement.processes, strict=True):
            assert info.node_id == cluster.nodes[proc.node_rank].node_id
            assert info.node_rank == proc.node_rank
            assert info.cuda_visible_devices == ",".join(map(str, proc.local_gpus))
            assert info.global_gpus == proc.global_gpus and info.world_size == 4 and info.pid > 0
        assert [i.node_rank for i in infos] == [0, 1, 2, 3]
        assert [i.cuda_visible_devices for i in infos] == ["0,1,2,3", "4,5,6,7", "0,1,2,3", "4,5,6,7"]
        assert group.dp_size == 4 and all(group.is_output_rank(r) for r in range(4))
    finally:
        group.shutdown()


def test_gloo_all_reduce_across_nodes(actor_group):
    """... with gloo on the interface of each node's Ray IP (GLOO_SOCKET_IFNAME, unless that IP is loopback)."""
    assert actor_group.all.call(Probe.all_reduce_rank).wait() == [(6.0, "gloo")] * 4
    infos = actor_group.infos()
    assert [i.node_rank for i in infos] == [0, 0, 1, 1]
    assert [i.cuda_visible_devices for i in infos] == ["6", "7", "0", "1"]
    expected = [socket_interface_env(i.ip, {}).get(GLOO_IFNAME_ENV) for i in infos]
    assert actor_group.all.call(Probe.env, GLOO_IFNAME_ENV).wait() == expected
    nccl = [socket_interface_env(i.ip, {}).get(NCCL_IFNAME_ENV) for i in infos]
    assert actor_group.all.call(Probe.env, NCCL_IFNAME_ENV).wait() == nccl  # NCCL's bootstrap on the same interface
    assert [n and n.removeprefix("=") for n in nccl] == expected
    assert all(expected) or ipaddress.ip_address(infos[0].ip).is_loopback


def test_constructor_args_reach_every_rank(actor_group):
    assert actor_group.all.call(Probe.tagged).wait() == [("shared", r) for r in range(4)]


def test_remote_exception_names_group_rank_node_gpus_and_traceback(actor_group):
    with pytest.raises(WorkerError) as info:
        actor_group.all.call(Probe.fail_on, 2).wait()
    message = str(info.value)
    assert message.startswith("actor rank 2 (node 1, GPUs 8) in fail_on() raised ValueError: rank 2 refuses")
    assert "--- remote traceback ---" in message and "\x1b[" not in message
    assert 'test_workers.py", line' in message and "in fail_on" in message
    assert actor_group.all.call(Probe.fail_on, -1).wait() == [0, 1, 2, 3]  # the group keeps working


def test_a_user_code_error_in_a_worker_is_its_message_without_a_traceback(actor_group):
    with pytest.raises(WorkerError) as info:
        actor_group.all.call(Probe.user_code_fails_on, 1).wait()
    assert str(info.value) == ("actor rank 1 (node 0, GPUs 7) in user_code_fails_on(): my_reward.py:7 in "
                               "compute_score: KeyError: 'x' (on rank 1)")


async def test_await_a_group_call(actor_group):
    assert await actor_group.all.call(Probe.tagged) == [("shared", r) for r in range(4)]
    with pytest.raises(WorkerError, match="rank 1"):
        await actor_group.all.call(Probe.fail_on, 1)


def test_verbs_pick_their_results(actor_group):
    assert actor_group.rank(3).call(Probe.tagged).wait() == ("shared", 3)  # one rank
    assert actor_group.leader(2).call(Probe.all_reduce_rank).wait() == (6.0, "gloo")  # a collective, rank 2's result
    # TP 2: ranks 0 and 2 answer
    assert actor_group.replicas.call(Probe.tagged).wait() == [("shared", 0), ("shared", 2)]
    with pytest.raises(ValueError, match="no rank 4"):
        actor_group.rank(4)


def test_sharded_call_splits_along_data_parallel_ranks(actor_group):
    assert actor_group.dp_size == 2
    assert [actor_group.dp_rank_of(r) for r in range(4)] == [0, 0, 1, 1]
    results = actor_group.sharded.call(Probe.shard_sum, list(range(7)), offset=100).wait()
    assert results == [(0, [100, 101, 102]), (2, [103, 104, 105, 106])]


def test_a_large_argument_goes_into_the_object_store_once(actor_group, monkeypatch):
    puts = []
    real_put = worker_group.ray.put
    monkeypatch.setattr(worker_group.ray, "put", lambda value: puts.append(value) or real_put(value))
    values = torch.arange(1000.0)
    assert actor_group.all.call(Probe.total, values).wait() == [float(values.sum())] * 4
    assert len(puts) == 1 and puts[0] is values  # shared by the 4 ranks
    # one rank: inline
    assert actor_group.rank(0).call(Probe.total, values).wait() == float(values.sum()) and len(puts) == 1


def test_wait_timeout_names_running_ranks(cluster):
    cfg = make_config({"rollout": "0-1", "actor": "2-3"})
    group = WorkerGroup.launch(Probe, "slow", plan_placement(cfg).components["actor"], cluster,
                               distributed=False)
    try:
        blocker = group.rank(1).call(Probe.run, lambda w: __import__("time").sleep(30))
        call = group.all.call(Probe.run, lambda w: w.rank)
        ray.get(call.refs[0], timeout=60)  # (rank 0's part is over, however busy the machine)
        with pytest.raises(WorkerError, match=r"ranks \[1\] still running after 0.5 s"):
            call.wait(timeout_s=0.5)
        assert group.alive() == [True, True]  # pings are answered while rank 1 is busy
        del blocker
    finally:
        group.shutdown()


def test_dead_worker_is_reported_by_name(cluster):
    cfg = make_config({"rollout": "0-1", "actor": "2-3"})
    group = WorkerGroup.launch(Probe, "fragile", plan_placement(cfg).components["actor"], cluster,
                               distributed=False)
    try:
        with pytest.raises(WorkerError) as info:
            group.rank(1).call(Probe.crash).wait()
        assert "worker rlinf_pipe:fragile:1 died" in str(info.value) and "node 0, GPUs 3" in str(info.value)
        # why, in Ray's words (its sentence on the death, not its first line, which only says the actor died)
        why = "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR"
        assert why in str(info.value) and "died unexpectedly" not in str(info.value)
        # the last lines it printed (its Ray log file, readable here: the same machine)
        said = str(info.value).split("--- the last lines of its output (", 1)[1]
        assert said.splitlines()[-1] == "Scheduler hit an exception: torch.OutOfMemoryError: CUDA out of memory"
        assert group.alive() == [True, False]
        # the heartbeat's report of the same loss says it too
        (lost,) = asyncio.run(group.unhealthy(timeout_s=10))
        assert lost.how == "died" and str(lost).endswith("CUDA out of memory") and why in str(lost)
    finally:
        group.shutdown()


def test_a_worker_that_dies_while_it_builds_is_reported_with_its_last_output(cluster):
    cfg = make_config({"rollout": "0-1", "actor": "2-3"})
    with pytest.raises(WorkerError) as info:
        WorkerGroup.launch(Probe, "doomed", plan_placement(cfg).components["actor"], cluster, "dies while it builds",
                           distributed=False)
    assert "died" in str(info.value)
    assert str(info.value).splitlines()[-1] == ("RuntimeError: Not enough memory. Please try to increase "
                                                "--mem-fraction-static.")


def test_the_heartbeat_names_a_hung_worker_and_a_peer_failure_is_blamed_on_the_lost_one(cluster):
    """A stopped (SIGSTOP) rank is reported as hung by `Health` within its timeout, with its group, rank, node and
    GPUs; a stage that fails because of it (here: a rank of another group that raises) is blamed on the hung one."""
    import asyncio
    import signal

    from rlinf_pipe.errors import WorkerLost
    from rlinf_pipe.runner.health import Health

    cfg = make_config({"rollout": "0-1", "actor": "2-3"})
    comps = plan_placement(cfg).components
    stuck = WorkerGroup.launch(Probe, "stuck", comps["actor"], cluster, distributed=False)
    noticing = WorkerGroup.launch(Probe, "noticing", comps["rollout"], cluster, distributed=False)
    pid = stuck.rank(1).call(Probe.run, lambda w: os.getpid()).wait()
    health = Health(lambda: [stuck, noticing], timeout_s=3.0)  # (a healthy rank's ping: well within, on any load)
    try:
        assert asyncio.run(health.find_lost()) == []
        os.kill(pid, signal.SIGSTOP)

        async def long_stage() -> None:
            await stuck.rank(1).call(Probe.run, lambda w: w.rank)  # never answers: its process is stopped

        with pytest.raises(WorkerLost) as hung:
            asyncio.run(health.guard(long_stage()))
        assert (hung.value.worker, hung.value.how) == ("rlinf_pipe:stuck:1", "hung")
        assert "stuck rank 1 (node 0, GPUs 3)" in str(hung.value) and "within 3 s" in str(hung.value)

        async def failing_peer() -> None:
            await noticing.rank(0).call(Probe.fail_on, 0)

        with pytest.raises(WorkerLost) as blamed:  # the raise of `noticing` is not what went wrong
            asyncio.run(health.guard(failing_peer()))
        assert blamed.value.worker == "rlinf_pipe:stuck:1" and isinstance(blamed.value.__cause__, WorkerError)
    finally:
        os.kill(pid, signal.SIGCONT)
        stuck.shutdown(wait_s=10)
        noticing.shutdown(wait_s=10)


def test_a_relaunched_rank_returns_on_its_gpus_and_settle_waits_for_the_calls(cluster):
    """What a recovery does with a group: wait until the calls of the abandoned step are over (`settle`: finished,
    failed or killed), then start the lost rank again on the same node and GPUs, with new constructor arguments,
    the other rank untouched. A group with a torch.distributed world is only relaunched whole."""
    import asyncio

    cfg = make_config({"rollout": "0-1", "actor": "2-3"})
    group = WorkerGroup.launch(Probe, "relaunched", plan_placement(cfg).components["actor"], cluster, "old",
                               distributed=False)
    distributed = WorkerGroup.launch(Probe, "whole", plan_placement(cfg).components["rollout"], cluster)
    try:
        before = group.infos()
        group.rank(0).call(Probe.hold, 3.0)
        group.rank(1).call(Probe.hold, 60.0)
        assert asyncio.run(group.settle(0.2)) == [0, 1]  # both still in their calls
        group.kill([1])  # its call fails: finished, as far as `settle` is concerned
        assert asyncio.run(group.settle(30)) == []
        group.relaunch([1], "new")
        after = group.infos()
        assert after[0].pid == before[0].pid and after[1].pid != before[1].pid
        assert (after[1].node_rank, after[1].global_gpus) == (before[1].node_rank, before[1].global_gpus) == (0, (3,))
        assert group.all.call(Probe.tagged).wait() == [("old", 0), ("new", 1)]
        with pytest.raises(ValueError, match="relaunched whole"):
            distributed.relaunch([0])
        distributed.relaunch([0, 1])
        # a new world, both ranks in it
        assert distributed.all.call(Probe.all_reduce_rank).wait() == [(1.0, "gloo")] * 2
    finally:
        group.shutdown(wait_s=10)
        distributed.shutdown(wait_s=10)


def test_constructor_failure_surfaces_with_rank(cluster):
    cfg = make_config({"rollout": "0", "actor": "1"})
    with pytest.raises(WorkerError, match=r"broken rank 0 \(node 0, GPUs 1\) failed in its constructor: "
                                          "RuntimeError: constructor failed on purpose"):
        WorkerGroup.launch(BrokenInit, "broken", plan_placement(cfg).components["actor"], cluster)


def test_a_failing_rank_does_not_leave_the_others_waiting_in_the_rendezvous(cluster):
    cfg = make_config({"rollout": "0-1", "actor": "2-3"})
    with pytest.raises(WorkerError, match=r"halfbroken rank 1 .* failed in its constructor"):
        WorkerGroup.launch(BrokenOnRankOne, "halfbroken", plan_placement(cfg).components["actor"], cluster)
    assert not [a for a in ray.util.list_named_actors() if a.startswith("rlinf_pipe:halfbroken")]


def test_collocated_components_share_gpus(cluster):
    placement = plan_placement(make_config({"actor,rollout": "24-25"}))
    actor = WorkerGroup.launch(Probe, "colo-actor", placement.components["actor"], cluster, distributed=False)
    rollout = WorkerGroup.launch(Probe, "colo-rollout", placement.components["rollout"], cluster,
                                 distributed=False)
    try:
        a, r = actor.infos(), rollout.infos()
        assert [i.cuda_visible_devices for i in a] == [i.cuda_visible_devices for i in r] == ["0", "1"]
        assert {i.node_rank for i in a + r} == {3}
    finally:
        actor.shutdown()
        rollout.shutdown()


def test_reservation_holds_every_gpu_of_used_nodes(cluster, actor_group):
    per_node = ray._private.state.available_resources_per_node()
    free = {node.node_rank: per_node[node.node_id].get("GPU", 0.0) for node in cluster.nodes}
    assert free[0] == 0.0 and free[1] == 0.0  # actor_group's nodes are held whole


def test_duplicate_group_name_is_a_clear_error(cluster, actor_group):
    with pytest.raises(ClusterError, match="is a group named 'actor' running"):
        WorkerGroup.launch(Probe, "actor", actor_group.placement, cluster)


def test_waiting_for_missing_nodes_times_out_with_message(cluster):
    cfg = make_config({"actor,rollout": "all"})
    cfg.cluster.num_nodes, cfg.cluster.join_timeout_s = 5, 0.2
    with pytest.raises(ClusterError) as info:
        Cluster(cfg, poll_interval_s=0.05)
    assert "only 4 of cluster.num_nodes=5 Ray nodes joined" in str(info.value)
    assert "start_ray.sh" in str(info.value)


def test_gpu_count_mismatch_names_the_node(cluster):
    cfg = make_config({"actor,rollout": "all"})
    cfg.cluster.num_gpus_per_node = [8, 8, 16, 8]
    with pytest.raises(ClusterError, match="node 2 .* has 8 GPU\\(s\\) but the config expects 16"):
        Cluster(cfg)


def test_every_node_must_see_the_model_and_the_run_folder_as_the_driver_does(cluster, tmp_path):
    """One probe task per node but the driver's: a model folder missing there, or a run folder that is another
    one there (a token the driver did not write), is one ConfigError naming each node and path."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    probe = tmp_path / ".node-probe"
    probe.write_text("driver-token")
    good = [NodePath("actor.model_path", str(model), "model", "the actor workers"),
            NodePath("runner.output_dir", str(probe), "shared", "the actor's ranks", "driver-token")]
    check_node_paths(cluster, {0: good, 1: good, 3: good})  # this machine's nodes share its disk
    missing = NodePath("rollout.model_path", str(tmp_path / "absent"), "model", "the rollout workers")
    elsewhere = NodePath("runner.output_dir", str(probe), "shared", "the actor's ranks", "another-token")
    with pytest.raises(ConfigError) as info:
        check_node_paths(cluster, {0: [missing], 1: [missing], 2: good, 3: [elsewhere]})
    lines = str(info.value).splitlines()
    assert not any(line.startswith("  node 0 ") for line in lines)  # the driver's node checked its own
    assert f"  node 1 ({cluster.nodes[1].ip}): rollout.model_path: no model folder with config.json at " \
           f"{tmp_path / 'absent'} (needed by the rollout workers)" in lines
    assert any(line.startswith("  node 3 ") and f"the run folder {tmp_path} is not the driver's here" in line
               for line in lines)
    assert len([line for line in lines if line.startswith("  node ")]) == 2


def test_a_node_clock_ahead_of_the_drivers_is_measured_and_its_spans_go_on_the_drivers_clock(cluster):
    """The driver (node 0) measures node 1's clock through a worker there and shifts that worker's spans by the
    offset: a span recorded during a call lies within the driver's own times of the call."""
    import time

    from rlinf_pipe.runner.clocks import NodeClocks

    cfg = make_config({"rollout": "0", "actor": "8"})  # the actor's one rank on node 1
    group = WorkerGroup.launch(SkewedClock, "skewed", plan_placement(cfg).components["actor"], cluster,
                               distributed=False)
    try:
        clocks = NodeClocks(cluster.driver_node())
        warnings = asyncio.run(clocks.measure([group]))
        assert clocks.driver_node == 0 and set(clocks.offsets) == {1}
        assert clocks.offsets[1] == pytest.approx(SKEW_S, abs=0.5)
        (warning,) = warnings
        said = re.fullmatch(r"node 1's clock is ([0-9.]+) s ahead of .*", warning, re.S)
        assert said and float(said[1]) == pytest.approx(SKEW_S, abs=0.5)  # (the text rounds what it measured)
        assert asyncio.run(clocks.measure([group])) == []  # said once
        before = time.time()
        group.rank(0).call(SkewedClock.mark).wait()
        after = time.time()
        # (and its launch span)
        (span,) = [s for s in group.rank(0).call(SkewedClock.drain_spans).wait() if s.name == "mark"]
        assert span.start > after + SKEW_S / 2  # on its own clock
        (aligned,) = clocks.align([span], 1)
        assert before - 0.5 <= aligned.start <= aligned.end <= after + 0.5
        assert clocks.align([span], 0) == [span]  # the driver's node: as recorded
    finally:
        group.shutdown()
