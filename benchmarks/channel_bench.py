"""Channel throughput between two processes on one node, against raw pyzmq and a Ray actor queue.

    python benchmarks/channel_bench.py [--repeats 5] [--aget] [--curve] [--json]

For each payload size, a producer process sends N items and a consumer process receives them and reads one byte
of every 4 KiB page (memory not yet mapped costs what it costs); throughput is counted on the consumer from the
first item to the last (setup excluded). The channel runs twice: as configured by default (on one node, buffers of
64 KiB or more go through the producer's shared memory) and with `shared_bytes=0` (every byte over the socket:
`channel_socket`, key `ratio_vs_zmq_socket`). Baselines, measured in the same run:
(a) raw pyzmq PUSH/PULL sending the same bytes (zero-copy for large payloads, default high-water marks,
which measured fastest), (b) `ray.util.queue.Queue`
(an actor-backed queue) for the small items. With --curve the channel also runs encrypted (`encrypt=True`, CURVE:
`channel_curve`, and `channel_curve_socket` with every byte over the socket), against the same channel in the clear
(keys `curve_vs_plain`, `curve_socket_vs_socket`). Each measurement is repeated; medians and ratios are reported.
With --json the last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_items import Payload  # noqa: E402  (importable by Ray workers through PYTHONPATH)

from rlinf_pipe.channels import Channel  # noqa: E402

PREFETCH = 32
SIZES = {"100B": (100, 20000), "64KiB": (64 * 1024, 4000), "4MiB": (4 * 1024 * 1024, 400)}


@ray.remote(num_cpus=0)
class Endpoint:
    """One benchmark process. Every transport first moves one warm-up item (connections made, buffers
    allocated); only then does the driver start the timed part: the sender returns the clock when it starts,
    the receiver the clock after the last item (both read the machine-wide monotonic clock)."""

    def setup(self, transport: str, size: int, target: Any = None) -> Any:
        self.transport, self.data = transport, np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        self.copy = size < 65536
        if transport.startswith("channel") or transport == "ray_queue":
            self.target = target
        elif target is None:  # zmq receiver
            self.sock = zmq.Context.instance().socket(zmq.PULL)  # default high-water marks: its fastest setting
            path = f"/tmp/rlp-bench-{os.getpid()}-{time.monotonic_ns()}.sock"
            self.sock.bind(f"ipc://{path}")
            return f"ipc://{path}"
        else:  # zmq sender
            self.sock = zmq.Context.instance().socket(zmq.PUSH)
            self.sock.connect(target)
        return None

    def send(self, i: int) -> None:
        if self.transport == "zmq":
            self.sock.send(self.data, copy=self.copy)
        else:
            self.target.put(Payload(i, self.data))

    def receive(self) -> None:
        if self.transport == "zmq":
            _touch(self.sock.recv(copy=False).buffer)
        else:
            _touch(self.target.get().data)

    def send_many(self, count: int) -> float:
        self.cpu_start = time.process_time()
        start = time.perf_counter()
        for i in range(count):
            self.send(i)
        return start

    def receive_many(self, count: int) -> float:
        self.cpu_start = time.process_time()
        if self.transport == "channel_aget":  # as the pipeline's workers take: from an event loop (its own thread)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:  # (Ray runs this method in a thread of its own)
                return pool.submit(asyncio.run, _areceive_many(self.target, count)).result()
        for _ in range(count):
            self.receive()
        return time.perf_counter()

    def cpu_seconds(self) -> float:
        """CPU time of this whole process (every thread) since its timed part began."""
        return time.process_time() - self.cpu_start


def _touch(buffer: Any) -> None:
    """Read one byte of every page, as a consumer that uses the bytes would."""
    np.frombuffer(buffer, dtype=np.uint8)[::4096].sum()


async def _areceive_many(channel: Channel, count: int) -> float:
    """(Not a method: a coroutine method would make `Endpoint` an async actor, whose methods share one loop.)"""
    for _ in range(count):
        _touch((await channel.aget()).data)
    return time.perf_counter()


def measure(transport: str, size: int, count: int, run: int) -> tuple[float, float]:
    """Items per second from `count` items sent after a warm-up item, and the CPU microseconds both processes
    (every thread) used per item from the start of their timed part until the consumer's last receive."""
    consumer, producer = Endpoint.remote(), Endpoint.remote()
    if transport.startswith("channel"):
        spec = {"shared_bytes": 0} if transport.endswith("_socket") else {}
        if "_curve" in transport:
            spec["encrypt"] = True
        target = Channel.create(f"bench-{transport}-{size}-{run}", Payload, maxsize=2 * PREFETCH, prefetch=PREFETCH,
                                **spec)
    elif transport == "ray_queue":
        from ray.util.queue import Queue

        target = Queue(maxsize=2 * PREFETCH)
    else:
        target = None
    address = ray.get(consumer.setup.remote(transport, size, target))
    ray.get(producer.setup.remote(transport, size, target if transport != "zmq" else address))
    ray.get([producer.send.remote(-1), consumer.receive_many.remote(1)])  # warm-up item
    if transport == "zmq":  # connected: the socket's file is no longer needed (nothing left behind in /tmp)
        os.unlink(address.removeprefix("ipc://"))
    end = consumer.receive_many.remote(count)
    start = ray.get(producer.send_many.remote(count))
    rate = count / (ray.get(end) - start)
    cpu = sum(ray.get([producer.cpu_seconds.remote(), consumer.cpu_seconds.remote()]))
    return rate, cpu / count * 1e6


@contextlib.contextmanager
def one_core_busy() -> Iterator[None]:
    """A background process that keeps one core busy while the block runs: real workers share their host's cores
    with tokenisation, the engine's scheduler, data loading."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply item counts (e.g. 0.1 for a smoke run)")
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--no-load", action="store_true", help="skip the runs with one core kept busy")
    parser.add_argument("--aget", action="store_true", help="also time a consumer taking with `aget` in an event "
                        "loop, as the pipeline's workers do (key `ratio_vs_zmq_aget`)")
    parser.add_argument("--curve", action="store_true", help="also time the channel encrypted (encrypt=True, CURVE), "
                        "keys `curve_vs_plain` and `curve_socket_vs_socket`")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", num_cpus=2, include_dashboard=False)

    results: dict[str, dict[str, float]] = {}
    spread: dict[str, dict[str, list[int]]] = {}  # items/s: the lowest and highest run of each median
    cpu_us: dict[str, dict[str, float]] = {}  # quiet runs: CPU microseconds per item, both processes together
    for name in args.sizes:
        size, count = SIZES[name]
        count = max(10, int(count * args.scale))
        runs: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}

        def timed(key: str, transport: str, run: int, items: int = count) -> None:
            rate, per_item_us = measure(transport, size, items, run)
            runs.setdefault(key, []).append(rate)
            cpu.setdefault(key, []).append(per_item_us)

        for run in range(args.repeats):  # quiet, then with one core kept busy, alternating
            timed("channel", "channel", run)
            timed("zmq", "zmq", run)
            if name != "100B":
                timed("channel_socket", "channel_socket", 4 * args.repeats + run)
            if args.aget:
                timed("channel_aget", "channel_aget", 2 * args.repeats + run)
            if args.curve:
                timed("channel_curve", "channel_curve", 6 * args.repeats + run)
                if name != "100B":
                    timed("channel_curve_socket", "channel_curve_socket", 7 * args.repeats + run)
            if name == "100B":
                timed("ray_queue", "ray_queue", run, max(10, count // 10))
            elif not args.no_load:
                with one_core_busy():
                    timed("channel_loaded", "channel", args.repeats + run)
                    timed("zmq_loaded", "zmq", args.repeats + run)
                    timed("channel_socket_loaded", "channel_socket", 5 * args.repeats + run)
                    if args.aget:
                        timed("channel_aget_loaded", "channel_aget", 3 * args.repeats + run)
        results[name] = {k: statistics.median(v) for k, v in runs.items() if v}
        spread[name] = {k: [round(min(v)), round(max(v))] for k, v in runs.items() if v}
        cpu_us[name] = {k: round(statistics.median(v), 1) for k, v in cpu.items() if not k.endswith("loaded")}
        line = ", ".join(f"{k} {v:,.0f} items/s ({v * size / 2**20:,.1f} MB/s)" for k, v in results[name].items())
        print(f"{name:>6}: {line}", flush=True)

    def ratio(name: str, baseline: str, channel: str = "channel") -> float | None:
        r = results.get(name, {})
        return round(r[channel] / r[baseline], 3) if baseline in r and channel in r else None

    def loaded_ratio(name: str, channel: str = "channel_loaded") -> float | None:
        r = results.get(name, {})
        return round(r[channel] / r["zmq_loaded"], 3) if channel in r and "zmq_loaded" in r else None

    summary = {
        "ratio_vs_zmq": {n: ratio(n, "zmq") for n in ("64KiB", "4MiB")},
        "ratio_vs_zmq_loaded": {n: loaded_ratio(n) for n in ("64KiB", "4MiB")},
        "ratio_vs_ray": {"100B": ratio("100B", "ray_queue")},
        "ratio_vs_zmq_socket": {n: ratio(n, "zmq", "channel_socket") for n in ("64KiB", "4MiB")},
        "ratio_vs_zmq_socket_loaded": {n: loaded_ratio(n, "channel_socket_loaded") for n in ("64KiB", "4MiB")},
        **({"ratio_vs_zmq_aget": {n: round(results[n]["channel_aget"] / results[n]["zmq"], 3)
                                  for n in ("64KiB", "4MiB") if "channel_aget" in results.get(n, {})},
            "ratio_vs_zmq_aget_loaded": {n: loaded_ratio(n, "channel_aget_loaded") for n in ("64KiB", "4MiB")}}
           if args.aget else {}),
        **({"curve_vs_plain": {n: ratio(n, "channel", "channel_curve") for n in results},
            "curve_socket_vs_socket": {n: ratio(n, "channel_socket", "channel_curve_socket")
                                       for n in ("64KiB", "4MiB")}}
           if args.curve else {}),
        "items_per_s": {n: round(r["channel"]) for n, r in results.items()},
        "items_per_s_loaded": {n: round(r["channel_loaded"]) for n, r in results.items() if "channel_loaded" in r},
        "mb_per_s": {n: round(r["channel"] * SIZES[n][0] / 2**20, 1) for n, r in results.items()},
        "baselines_items_per_s": {n: {k: round(v) for k, v in r.items() if not k.startswith("channel")}
                                  for n, r in results.items()},
        "cpu_us_per_item": cpu_us,
        "spread_items_per_s": spread,
        "repeats": args.repeats,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
    }
    print(f"ratio vs raw pyzmq: {summary['ratio_vs_zmq']} (one core busy: {summary['ratio_vs_zmq_loaded']}); "
          f"vs Ray queue: {summary['ratio_vs_ray']}; over the socket only: {summary['ratio_vs_zmq_socket']} "
          f"(one core busy: {summary['ratio_vs_zmq_socket_loaded']})")
    if args.json:
        print(json.dumps(summary))
    ray.shutdown()


if __name__ == "__main__":
    main()
