"""Rollout engine throughput: TorchEngine against Hugging Face `generate` on the same model and batch.

    python benchmarks/engine_bench.py [--model tiny|smollm2] [--arch qwen2] [--batch 8] [--new-tokens 64]
        [--repeats 5] [--threads N] [--device cpu|cuda] [--dtype float32|bfloat16] [--json]

Both sample `batch` prompts (16-23 tokens) for exactly `new_tokens` tokens at temperature 1 on the tiny model
(created locally on first use) or SmolLM2-135M-Instruct (converted into the default cache on first use), fp32 on
the CPU unless --device / --dtype say otherwise, with `threads` torch intra-op threads (default: torch's default,
one per core). Both run in the same thread, the process's compute thread (`rlinf_pipe.utils.compute_thread`), the
main thread keeping one torch thread: two threads of a process with OpenMP teams of their own slow each other
down. Each measurement is repeated; medians and the ratio are reported. With --json the last printed line is one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from rlinf_pipe.engines.rollout import GenerateRequest, SamplingParams, TorchEngine
from rlinf_pipe.models import ensure_tiny_model
from rlinf_pipe.utils.compute_thread import compute_thread


def prompts(batch: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (16 + i % 8,), generator=generator).tolist() for i in range(batch)]


def engine_tokens_per_s(engine: TorchEngine, batch: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=1)
    requests = [GenerateRequest(request_id=str(i), prompt_ids=p, sampling=params) for i, p in enumerate(batch)]

    async def run() -> int:
        tokens = 0
        async for result in engine.generate(requests):
            tokens += sum(len(sample.response_ids) for sample in result.samples)
        return tokens

    start = time.perf_counter()
    tokens = asyncio.run(run())
    return tokens / (time.perf_counter() - start)


def hf_tokens_per_s(model, batch: list[list[int]], new_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in batch)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0, top_k=0,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id,
        )
    if out.is_cuda:
        torch.cuda.synchronize()
    return (out.shape[1] - width) * len(batch) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"], help="tiny model only")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(1)  # this thread; the measured work runs in the compute thread
    compute = compute_thread(threads)

    if args.model == "smollm2":
        from rlinf_pipe.models.resolve import resolve_model_path

        folder = resolve_model_path("smollm2-135m")
    else:
        folder = ensure_tiny_model(os.path.join(tempfile.gettempdir(), "rlinf_pipe_bench_models"), arch=args.arch)
    engine = TorchEngine(str(folder), device=args.device, dtype=dtype, cpu_threads=threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(args.device).eval()
    batch = prompts(args.batch, model.config.vocab_size)
    engine_tokens_per_s(engine, batch, args.new_tokens)  # warm-up
    compute.call(hf_tokens_per_s, model, batch, args.new_tokens, engine.pad_id)
    runs: dict[str, list[float]] = {"torch_engine": [], "hf_generate": []}
    for _ in range(args.repeats):
        runs["torch_engine"].append(engine_tokens_per_s(engine, batch, args.new_tokens))
        runs["hf_generate"].append(compute.call(hf_tokens_per_s, model, batch, args.new_tokens, engine.pad_id))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    summary = {
        "tokens_per_s": {name: round(value) for name, value in medians.items()},
        "ratio_vs_hf_generate": round(medians["torch_engine"] / medians["hf_generate"], 3),
        "model": args.model, "batch": args.batch, "new_tokens": args.new_tokens,
        "arch": args.arch if args.model == "tiny" else "llama", "repeats": args.repeats,
        "threads": threads, "device": args.device, "dtype": args.dtype,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
                   + (f", {torch.cuda.get_device_name(args.device)}" if args.device.startswith("cuda") else ""),
    }
    print(f"torch engine {medians['torch_engine']:,.0f} tokens/s, HF generate {medians['hf_generate']:,.0f} "
          f"tokens/s, ratio {summary['ratio_vs_hf_generate']}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
