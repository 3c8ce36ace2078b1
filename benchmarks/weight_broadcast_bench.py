"""A group weight transport alone (no Ray, no runner) against a raw gloo broadcast of the same bytes.

    python benchmarks/weight_broadcast_bench.py [--model DIR] [--receivers 2] [--bucket-mb 64 16 4]
        [--transport broadcast|ipc] [--json]

Spawns 1 + `--receivers` processes (torch.multiprocessing) that open the `--transport` ends exactly as the actor
and the engines do (`rlinf_pipe.weights.transports`, layout planned from the model's config; `ipc` hands the
bytes over POSIX shared memory and its control group is the gloo group the raw broadcast uses). Per
iteration, in the same group and on the same bytes: a raw broadcast of one flat buffer over the transport's process
group, then one version through `publish` / `receive` of random weights in the layout, with each receiver copying
every tensor out into its own preallocated tensor (what an engine's load does). Both are timed between barriers; medians of `--iters` after
2 warm-up iterations. `protocol_over_raw_bw` = raw time / protocol time (1.0 = no overhead).
With --json the last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from rlinf_pipe.utils.net import free_port


def _member(rank: int, world: int, port: int, model: str, bucket_mb: int, iters: int, out: str, transport: str) -> None:
    from rlinf_pipe.models.weight_map import hf_weight_names, hf_weight_shape, read_hf_arch
    from rlinf_pipe.weights import WeightVersion, plan_weight_layout
    from rlinf_pipe.weights.process_group import Rendezvous
    from rlinf_pipe.weights.transports import open_receiver, open_sender

    torch.set_num_threads(1)
    arch = read_hf_arch(model)
    layout = plan_weight_layout(arch, torch.float32, bucket_mb << 20)
    rendezvous = Rendezvous("127.0.0.1", port, world)
    if rank == 0:
        end = open_sender(transport, layout, rendezvous)
    else:
        end = open_receiver(transport, layout, arch, f"receiver {rank}", rendezvous, rank)
    group = (end.member if transport == "ipc" else end.ring.member).group
    weights = [(n, torch.randn(hf_weight_shape(arch, n))) for n in hf_weight_names(arch)]
    loaded = {n: torch.empty_like(t) for n, t in weights}

    async def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in bucket:
            loaded[name].copy_(tensor)

    flat = torch.empty(layout.num_bytes, dtype=torch.uint8)
    loop = asyncio.new_event_loop()  # receiving is a coroutine (engines load from their event loop)
    raw, protocol = [], []
    for version in range(iters + 2):
        group.barrier().wait()
        start = time.perf_counter()
        group.broadcast(flat, 0).wait()
        group.barrier().wait()
        raw.append(time.perf_counter() - start)
        group.barrier().wait()
        start = time.perf_counter()
        if rank == 0:
            end.publish(version, weights)
        else:
            loop.run_until_complete(end.receive(WeightVersion(version), load))
        group.barrier().wait()
        protocol.append(time.perf_counter() - start)
    loop.close()
    if rank == 0:
        Path(out).write_text(json.dumps({
            "bytes": layout.num_bytes, "buckets": len(layout.buckets),
            "raw_s": statistics.median(raw[2:]), "protocol_s": statistics.median(protocol[2:]),
        }))


def measure(model: str, receivers: int, bucket_mb: int, iters: int, transport: str = "broadcast") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_member, args=(1 + receivers, free_port(), model, bucket_mb, iters, out, transport),
                 nprocs=1 + receivers, join=True)
        result = json.loads(Path(out).read_text())
    result["protocol_over_raw_bw"] = result["raw_s"] / result["protocol_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model folder (default: the tiny model)")
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[64, 16, 4])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--transport", choices=["broadcast", "ipc"], default="broadcast",
                        help="the weight transport timed against the raw broadcast")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        from rlinf_pipe.models.tiny import ensure_tiny_model

        args.model = str(ensure_tiny_model())
    results = {}
    for bucket_mb in args.bucket_mb:
        r = results[bucket_mb] = measure(args.model, args.receivers, bucket_mb, args.iters, args.transport)
        print(f"bucket {bucket_mb:>3} MiB ({r['buckets']} buckets of {r['bytes'] / 2**20:.1f} MiB): raw broadcast "
              f"{r['raw_s'] * 1e3:.1f} ms, protocol {r['protocol_s'] * 1e3:.1f} ms, ratio "
              f"{r['protocol_over_raw_bw']:.2f}", flush=True)
    if args.json:
        print(json.dumps({"receivers": args.receivers, "model": args.model, "transport": args.transport,
                          "by_bucket_mb": {str(k): {kk: round(vv, 5) for kk, vv in v.items()}
                                           for k, v in results.items()}}))


if __name__ == "__main__":
    main()
