"""Virtual GPUs pinned to cores (`cluster.cores_per_gpu`, `rlinf_pipe.runtime.cores`): the cores each worker gets,
hand-checked, and the errors when a host has too few."""

from __future__ import annotations

import pytest

from rlinf_pipe.config import Config, load_config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.planning.placement import plan_placement
from rlinf_pipe.runner.cpu_shares import lends_cpus
from rlinf_pipe.runtime import cores as cores_module
from rlinf_pipe.runtime.cores import (
    HostSlots,
    check_driver_host,
    check_host_cores,
    host_slots,
    pinning_env,
    read_pinning,
    worker_cores,
)


def test_host_slots_number_gpus_across_the_nodes_of_one_host():
    # one node per host: each node's GPUs start at slot 0 of their own host's cores
    assert host_slots(["10.0.0.1", "10.0.0.2"], [4, 4]) == [HostSlots(0, 4), HostSlots(0, 4)]
    # three Ray nodes on one machine (a rehearsal): one after another
    assert host_slots(["h", "h", "h"], [2, 2, 2]) == [HostSlots(0, 6), HostSlots(2, 6), HostSlots(4, 6)]
    # two hosts, the first running nodes 0 and 2
    assert host_slots(["h", "g", "h"], [2, 3, 1]) == [HostSlots(0, 3), HostSlots(0, 3), HostSlots(2, 3)]


def test_each_gpu_owns_k_cores_and_gpuless_processes_take_the_rest():
    eight = range(8)
    assert worker_cores(eight, [0], HostSlots(0, 3), 2) == (0, 1)
    assert worker_cores(eight, [2], HostSlots(0, 3), 2) == (4, 5)
    assert worker_cores(eight, [1, 2], HostSlots(0, 3), 2) == (2, 3, 4, 5)  # a process on two GPUs: both their cores
    assert worker_cores(eight, [], HostSlots(0, 3), 2) == (6, 7)  # the cores no GPU owns
    assert worker_cores(eight, [], HostSlots(0, 4), 2) == tuple(eight)  # none left: every core
    assert worker_cores(eight, [3], HostSlots(0, 4), 2) == (6, 7)


def test_cores_index_the_allowed_ones_not_the_machine_numbers():
    # a process started on cores 2, 3, 8, 9 (taskset, a cpuset): GPU g takes the g-th of those
    allowed = [9, 3, 8, 2]
    assert worker_cores(allowed, [0], HostSlots(0, 2), 1) == (2,)
    assert worker_cores(allowed, [1], HostSlots(0, 2), 1) == (3,)
    assert worker_cores(allowed, [], HostSlots(0, 2), 1) == (8, 9)


def test_nodes_on_one_host_never_share_a_core():
    # three Ray nodes of two GPUs on one 6-core machine, k = 1: every GPU of the host a core of its own
    slots = host_slots(["h"] * 3, [2, 2, 2])
    got = {(node, g): worker_cores(range(6), [g], slots[node], 1) for node in range(3) for g in range(2)}
    assert got == {(0, 0): (0,), (0, 1): (1,), (1, 0): (2,), (1, 1): (3,), (2, 0): (4,), (2, 1): (5,)}
    # on two hosts of their own, node 1's local GPU 0 takes core 0 of its own host
    assert worker_cores(range(6), [0], host_slots(["a", "b"], [2, 2])[1], 1) == (0,)


def placed_cores(placement: dict, gpus: int, k: int, cores: int) -> dict[str, list[tuple[int, ...]]]:
    """Each placed process's cores, by component, on one node of `gpus` GPUs and `cores` cores."""
    cfg = Config()
    cfg.cluster.num_nodes, cfg.cluster.num_gpus_per_node = 1, gpus
    cfg.cluster.component_placement = placement
    slots = host_slots(["h"], [gpus])[0]
    return {name: [worker_cores(range(cores), p.local_gpus, slots, k) for p in comp.processes]
            for name, comp in plan_placement(cfg).components.items()}


def test_collocated_components_share_their_gpus_cores():
    # actor DP 2 and two engines on GPUs 0-1, 2 cores a GPU: rank r of each takes GPU r's two cores in its phase
    got = placed_cores({"actor,rollout": "all"}, gpus=2, k=2, cores=4)
    assert got["actor"] == [(0, 1), (2, 3)]
    assert got["rollout"] == [(0, 1), (2, 3)]


def test_disaggregated_stages_never_share_a_core():
    got = placed_cores({"rollout": "0-1", "actor": "2-3"}, gpus=4, k=1, cores=6)
    assert got["rollout"] == [(0,), (1,)]
    assert got["actor"] == [(2,), (3,)]
    rollout, actor = set().union(*got["rollout"]), set().union(*got["actor"])
    assert not rollout & actor


def test_too_few_cores_name_the_numbers_and_the_fix():
    with pytest.raises(ConfigError) as info:
        worker_cores(range(6), [0], HostSlots(0, 4), 2, host="host n1")
    message = str(info.value)
    assert "cluster.cores_per_gpu=2" in message and "4 GPU(s) on host n1" in message
    assert "4 x 2 = 8 cores" in message and "may use 6" in message
    assert "set cluster.cores_per_gpu to 1 or less" in message and "cluster.cores_per_gpu=null" in message
    with pytest.raises(ConfigError, match="use at most 2 GPUs on this host"):
        check_host_cores(1, 8, 2)
    check_host_cores(2, 4, 8)  # exactly enough


def test_the_driver_checks_the_gpus_of_its_own_host(monkeypatch):
    monkeypatch.setattr(cores_module.os, "sched_getaffinity", lambda pid: {0, 1})
    check_driver_host(1, ["h", "g"], [2, 2], "h")  # 2 GPUs here, 2 cores: fits
    check_driver_host(1, ["h", "g"], [2, 2], None)  # the driver on none of the nodes: the workers check
    check_driver_host(None, ["h", "h"], [2, 2], "h")  # no pinning
    with pytest.raises(ConfigError, match=r"4 GPU\(s\) on host h need 4 x 1 = 4 cores"):
        check_driver_host(1, ["h", "h"], [2, 2], "h")  # two Ray nodes on this machine


def test_pinning_env_reads_back_per_node(monkeypatch):
    assert pinning_env(None, [HostSlots(0, 2)]) == {}
    env = pinning_env(2, host_slots(["h", "h", "g"], [2, 1, 4]))
    assert env == {"RLINF_PIPE_CORES_PER_GPU": "2", "RLINF_PIPE_HOST_SLOTS": "0:0:3,1:2:3,2:0:4"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert read_pinning(1) == (2, HostSlots(2, 3))
    assert read_pinning(2) == (2, HostSlots(0, 4))
    monkeypatch.delenv("RLINF_PIPE_CORES_PER_GPU")
    assert read_pinning(1) is None


def test_the_option_defaults_to_no_pinning_and_turns_lending_off():
    cfg = load_config()
    assert cfg.cluster.cores_per_gpu is None
    assert lends_cpus(cfg, staleness=0, engines_share_actor=False)
    pinned = load_config(overrides=["cluster.cores_per_gpu=1"])
    assert pinned.cluster.cores_per_gpu == 1
    assert not lends_cpus(pinned, staleness=0, engines_share_actor=False)
    with pytest.raises(ConfigError, match="cores_per_gpu"):
        load_config(overrides=["cluster.cores_per_gpu=0"])


def test_a_pinned_worker_takes_all_its_gpus_cores_as_torch_threads(monkeypatch):
    from rlinf_pipe.runtime import worker as worker_module
    from rlinf_pipe.runtime.worker import Worker, WorkerInfo

    monkeypatch.setattr(worker_module.os, "sched_getaffinity", lambda pid: set(range(8)))
    shell = Worker.__new__(Worker)  # (the share alone: no Ray actor around it)

    def share(local_gpus: tuple[int, ...], cores: tuple[int, ...] | None, node_procs: dict[int, int]) -> int:
        shell.info = WorkerInfo("actor", 0, 1, 0, local_gpus, local_gpus, "h", "ip", 1, "node", None)
        shell.cores = cores
        return shell._cpu_share(node_procs)

    assert share((0,), (2, 3, 4), {0: 4}) == 3  # pinned: its GPU's cores, whatever shares the node
    assert share((0,), None, {0: 4}) == 2  # not pinned: 8 cores over 4 processes
    assert share((), (6, 7), {0: 4}) == 2  # no GPUs: the share rule on the cores it may use
