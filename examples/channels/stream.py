"""Stream items from a group of workers to the driver through a channel, step by step.

    python examples/channels/stream.py [cluster.ray_address=local]

Two producer workers (placed like rollout engines) put variable-length samples, weighted by their token count,
and end each step; the driver takes each step's samples as they arrive and sees `StepEnd` when the step is in.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])

import torch  # noqa: E402
from stream_items import Sample  # noqa: E402

from rlinf_pipe.cli import exit_on_user_error  # noqa: E402
from rlinf_pipe.config import load_config  # noqa: E402
from rlinf_pipe.channels import Channel, StepEnd  # noqa: E402
from rlinf_pipe.runtime.cluster import Cluster  # noqa: E402
from rlinf_pipe.planning.placement import plan_placement  # noqa: E402
from rlinf_pipe.runtime.worker import Worker  # noqa: E402
from rlinf_pipe.runtime.worker_group import WorkerGroup  # noqa: E402

STEPS, PER_STEP = 2, 6


class SampleProducer(Worker):
    """Puts `per_step` samples a step into the channel (a channel handle travels to workers by name)."""

    def produce(self, channel: Channel, steps: int, per_step: int) -> int:
        for _ in range(steps):
            for index in range(per_step):
                length = 3 + (index * 5 + self.rank) % 9
                channel.put(Sample(self.rank, index, torch.arange(length)), weight=length)
            channel.end_step()
        channel.close()  # returns once the driver has taken everything
        return steps * per_step


def main(overrides: list[str]) -> None:
    cfg = load_config(overrides=[
        "cluster.num_gpus_per_node=4", "cluster.component_placement={rollout: 0-1, actor: 2-3}", *overrides,
    ])
    cluster = Cluster(cfg)
    try:
        samples = Channel.create("samples", Sample, maxsize=64, num_producers=2)
        rollout = plan_placement(cfg, cluster.gpus_per_node).components["rollout"]
        producers = WorkerGroup.launch(SampleProducer, "rollout", rollout, cluster, distributed=False)
        done = producers.all.call(SampleProducer.produce, samples, STEPS, PER_STEP)
        for step in range(STEPS):
            got = []
            while not isinstance(item := samples.get(timeout=60), StepEnd):
                got.append(item)
            tokens = sum(len(s.tokens) for s in got)
            print(f"step {step}: {len(got)} samples, {tokens} tokens (producers {sorted({s.producer for s in got})})")
            print(f"step {item.step} complete")
        print("samples per producer:", done.wait())
        samples.close()
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main, sys.argv[1:]))
