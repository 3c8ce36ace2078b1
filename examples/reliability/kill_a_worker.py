"""Kill a worker of a running job and watch the run recover (docs/reliability.md).

    python examples/reliability/kill_a_worker.py [--worker rollout:0] [--signal KILL|STOP] [key=value ...]

Runs the tiny CPU pipeline with an inference stage (reference log-probs, so that every kind of worker runs; 6
steps, a checkpoint after every step, `runner.max_restarts=1`) and, once the checkpoint before step 2 is complete,
sends SIGKILL (or SIGSTOP: a hung worker, found by the heartbeat) to one worker. That worker is relaunched on its GPUs while the others stay; the step is retried (from the actor's state
before it, or from that checkpoint when the actor was lost) and the run finishes. It prints the restart as
`events.jsonl` recorded it and the steps of `metrics.jsonl` (each once).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray

from rlinf_pipe.config import load_config
from rlinf_pipe.errors import RlinfPipeError
from rlinf_pipe.runner import run
from rlinf_pipe.utils.metrics import read_metrics


def sabotage(out: Path, worker: str, signum: int, done: threading.Event) -> None:
    """Once `checkpoints/step_000002` of the run under `out` is complete, signal worker `rlinf_pipe:<worker>`."""
    while not any(out.glob("*/*/checkpoints/step_000002/COMPLETE")):
        if done.wait(0.02):
            return
    pid = ray.get(ray.get_actor(f"rlinf_pipe:{worker}").ping.remote())
    print(f"--- sending {signal.Signals(signum).name} to rlinf_pipe:{worker} (pid {pid}) in step 2 ---", flush=True)
    os.kill(pid, signum)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", default="rollout:0", help="component:rank (rollout:0, inference:0, reward:0, "
                        "actor:0)")
    parser.add_argument("--signal", default="KILL", choices=["KILL", "STOP"], help="KILL: dies; STOP: hangs")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="rlp-kill-"))
    try:
        cfg = load_config("examples/math/config", "tiny-grpo-megatron-pipeline", [
            f"runner.output_dir={out}", "runner.max_steps=6", "runner.save_interval=1", "runner.max_restarts=1",
            "runner.heartbeat_timeout_s=5", "data.rollout_batch_size=4", "algorithm.group_size=4",
            "actor.micro_batch_size=4", "algorithm.compute_ref_logprobs=true", "cluster.num_gpus_per_node=3",
            "cluster.component_placement={rollout: 0, inference: 1, actor: 2}",  # every kind of worker runs
            *args.overrides,
        ])
    except RlinfPipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    done = threading.Event()
    saboteur = threading.Thread(target=sabotage, args=(out, args.worker, getattr(signal, f"SIG{args.signal}"), done),
                                daemon=True)
    saboteur.start()
    started = time.time()
    try:
        run_dir = run(cfg)
    except RlinfPipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        done.set()
    print(f"\nfinished in {time.time() - started:.0f} s; run folder {run_dir}")
    for event in (json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()):
        print(f"event: {event['event']} - {event['worker']} {event['how']} in step {event['step']} "
              f"({event['where']}); relaunched {event['relaunched']}, continued at step {event['resumed_at']} from "
              f"{event['resumed_from']} after {event['seconds']:.1f} s")
    print("steps in metrics.jsonl:", [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
