"""Large tensors through a channel on one node: through the producer's shared memory, then over the socket only.

    python examples/channels/large_tensors.py [--items 32] [--mib 1]

A producer worker puts `--items` tensors of `--mib` MiB; the driver takes them all, keeps them, checks every byte,
and reads the producer's `stats()`: with the default `shared_bytes` (64 MiB) its arena holds the tensors while the
driver keeps them, and gets them back once the driver lets go. Past 64 MiB in all, the rest goes over the socket
(the producer logs a warning, and the overflow is printed). The same run with `shared_bytes=0` sends every byte
over the socket (the path across nodes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])

import ray  # noqa: E402
import torch  # noqa: E402
from stream_items import Block  # noqa: E402

from rlinf_pipe.channels import Channel  # noqa: E402


def block(index: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.int32) * 7 + index  # (a different tensor for each index)


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, channel: Channel):
        self.channel = channel

    def put(self, items: int, numel: int) -> None:
        for index in range(items):
            self.channel.put(Block(index, block(index, numel)))
        self.channel.end_step()

    def stats(self) -> dict[str, float]:
        return self.channel.stats()


def run(name: str, items: int, numel: int, **spec: Any) -> None:
    channel = Channel.create(f"blocks-{name.replace(' ', '-')}", Block, maxsize=items, prefetch=items, **spec)
    producer = Producer.remote(channel)
    ray.get(producer.stats.remote())  # (started)
    start = time.perf_counter()
    putting = producer.put.remote(items, numel)
    got = [channel.get(timeout=60) for _ in range(items)]
    seconds = time.perf_counter() - start
    ray.get(putting)
    exact = all(torch.equal(item.data, block(item.index, numel)) for item in got)
    stats = ray.get(producer.stats.remote())
    mib = items * numel * 4 / 2**20
    print(f"{name}: {items} tensors, {mib:.0f} MiB in {seconds:.3f} s; every byte exact: {exact}; "
          f"held in shared memory while the driver keeps them: {stats['shared_bytes_used'] / 2**20:.0f} MiB "
          f"(over the socket for want of room: {stats['shared_bytes_overflow'] / 2**20:.0f} MiB)")
    del got
    deadline = time.monotonic() + 30
    while ray.get(producer.stats.remote())["shared_bytes_used"] and time.monotonic() < deadline:
        time.sleep(0.05)  # (released at the consumer's next report, within half a heartbeat)
    print(f"{name}: after the driver let go: {ray.get(producer.stats.remote())['shared_bytes_used'] / 2**20:.0f} MiB")
    channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--mib", type=float, default=1.0)
    args = parser.parse_args()
    numel = int(args.mib * 2**20) // 4
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # (a Ray of its own, even beside another)
    try:
        run("shared memory", args.items, numel)
        run("socket only", args.items, numel, shared_bytes=0)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
