"""Channel stress: many small items from 2 producers to 2 consumers, one of them slow; nothing lost or repeated.

    python benchmarks/channel_stress.py [--items 1000000] [--repeats 3] [--json]

A local Ray cluster of two nodes (`ray.cluster_utils.Cluster`, one producer and one consumer on each) moves
`--items` small items (`(producer, seq)` tuples) (half from each producer) through one channel (maxsize 512, prefetch 256). The slow
consumer pauses 2 ms every 100 items. Each repeat checks that every item arrived exactly once and that each
producer's items arrived in order at each consumer, and reports items/s (the wall time from the first put to the
last item taken) and the slow consumer's share. The baseline, measured in the same run, is the same number of items
through one producer and one fast consumer on the driver's node (`over_single_pair` < 1: the 2x2 shape is slower).
With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlinf_pipe.errors import ChannelClosed
from rlinf_pipe.channels import Channel, StepEnd


Item = tuple[int, int]  # (producer, seq): a small item (plain types, so the workers need no class of this script)


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, channel: Channel, producer: int):
        self.channel, self.producer = channel, producer

    def put(self, count: int) -> float:
        start = time.time()
        for seq in range(count):
            self.channel.put((self.producer, seq))
        self.channel.end_step()
        self.channel.close()
        return start


@ray.remote(num_cpus=0)
class Consumer:
    def __init__(self, channel: Channel, pause_s: float, every: int):
        self.channel, self.pause_s, self.every = channel, pause_s, every

    def drain(self) -> tuple[list[tuple[int, int]], float]:
        seen: list[tuple[int, int]] = []
        while True:
            try:
                item = self.channel.get(timeout=120)
            except ChannelClosed:
                return seen, time.time()
            if isinstance(item, StepEnd):
                continue
            seen.append((item[0], item[1]))
            if self.pause_s and len(seen) % self.every == 0:
                time.sleep(self.pause_s)


def on(cls, node_id: str):
    return cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


def run_once(name: str, items: int, nodes: list[str], pairs: int) -> dict[str, float]:
    """`pairs` producers (and consumers; the first consumer slow when there are two) spread over `nodes`."""
    channel = Channel.create(name, Item, maxsize=512, prefetch=256, num_producers=pairs)
    consumers = [on(Consumer, nodes[c % len(nodes)]).remote(channel, 0.002 if pairs > 1 and c == 0 else 0.0, 100)
                 for c in range(pairs)]
    drains = [c.drain.remote() for c in consumers]
    producers = [on(Producer, nodes[p % len(nodes)]).remote(channel, p) for p in range(pairs)]
    starts = ray.get([p.put.remote(items // pairs) for p in producers])
    results = ray.get(drains)
    received = [r for r, _ in results]
    wall = max(end for _, end in results) - min(starts)
    everything = sorted(x for r in received for x in r)
    expected = [(p, s) for p in range(pairs) for s in range(items // pairs)]
    lost = len(set(expected) - set(everything))
    duplicated = len(everything) - len(set(everything))
    in_order = all([s for p2, s in r if p2 == p] == sorted(s for p2, s in r if p2 == p) for r in received
                   for p in range(pairs))
    for actor in (*consumers, *producers):
        ray.kill(actor)
    return {"items_per_s": len(everything) / wall, "lost": lost, "duplicated": duplicated, "in_order": in_order,
            "slow_share": len(received[0]) / max(1, len(everything)) if pairs > 1 else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    here = ray.get_runtime_context().get_node_id()
    nodes = [here] + [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
    runs, singles = [], []
    try:
        for repeat in range(args.repeats):
            runs.append(run_once(f"stress-{repeat}", args.items, nodes, pairs=2))
            singles.append(run_once(f"single-{repeat}", args.items, nodes[:1], pairs=1))
            print(f"repeat {repeat}: 2x2 {runs[-1]['items_per_s']:,.0f} items/s (lost {runs[-1]['lost']}, "
                  f"duplicated {runs[-1]['duplicated']}, slow consumer took {runs[-1]['slow_share']:.1%}); "
                  f"1x1 {singles[-1]['items_per_s']:,.0f} items/s", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    rates = [r["items_per_s"] for r in runs]
    summary = {
        "items": args.items, "repeats": args.repeats,
        "lost": sum(r["lost"] for r in runs), "duplicated": sum(r["duplicated"] for r in runs),
        "in_order": all(r["in_order"] for r in runs),
        "items_per_s_median": round(statistics.median(rates)),
        "items_per_s_range": [round(min(rates)), round(max(rates))],
        "slow_consumer_share_median": round(statistics.median(r["slow_share"] for r in runs), 4),
        "over_single_pair": round(statistics.median(r["items_per_s"] / s["items_per_s"]
                                                    for r, s in zip(runs, singles, strict=True)), 3),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                   f"Ray {ray.__version__}",
    }
    print(f"{args.items:,} items x {args.repeats}: lost {summary['lost']}, duplicated {summary['duplicated']}, "
          f"in order {summary['in_order']}; median {summary['items_per_s_median']:,} items/s "
          f"({summary['over_single_pair']}x one producer to one consumer)")
    if args.json:
        print(json.dumps(summary))
    if summary["lost"] or summary["duplicated"] or not summary["in_order"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
