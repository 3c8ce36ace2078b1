"""Training step time: our Megatron trainer (`MegatronPolicy`) against plain Hugging Face + torch on one batch.

    python benchmarks/megatron_step_bench.py [--model tiny|warm|smollm2] [--arch qwen2] [--batch 16] [--seq-len 48]
        [--response-len 16] [--ragged] [--group-size 1] [--padded] [--repeats 20] [--threads N] [--json]

Both train the same model folder (the tiny model, created locally on first use, or with --model warm the
warm-started tiny model from the default model cache, built there on first use, or with --model smollm2
SmolLM2-135M-Instruct, converted into the default cache on first use), fp32 CPU, on the same fixed `TrainBatch`:
`batch` sequences of `seq_len` random token ids,
response mask on the last `response_len` tokens, random old log-probs and advantages; with --ragged, rows of
random lengths as the default run's arithmetic rollouts have them (a prompt of 10-16 tokens and a response of 1-32,
right-padded to the longest: about 60% of the positions hold real tokens); with --group-size N, each run of N rows
shares its first row's prompt, as a GRPO group's samples do (Megatron then runs each prompt once,
`actor.share_prompts`; HF + torch computes it in every row). One step = forward + backward +
optimizer step with the whole batch as one micro-batch, the PPO loss `policy_loss` (token-mean):

- megatron: `MegatronPolicy.train_micro_batch(batch, loss_fn)` then `optimizer_step()` (gloo, world size 1,
  TP = PP = 1; Megatron DDP + Megatron optimizer, AdamW, grad clipping at 1.0), on packed sequences (the
  default, `actor.pack_sequences`) or with --padded on the padded batch.
- hf: `AutoModelForCausalLM` forward on the padded batch (what a plain loop does), `log_softmax` of the logits gathered at the next tokens, the same
  `policy_loss` through `finalize(terms)`, `loss.backward()`, grad clipping at 1.0, `torch.optim.AdamW.step()`,
  `zero_grad()`.

Also timed (same repeats): the forward alone (model + token log-probs, autograd on) for each, and the two parts of
a step (forward + backward, then optimizer step). The two step kinds alternate so background load hits both alike.
Medians and the ratio are reported; with --json the last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from rlinf_pipe.algorithms.losses import policy_loss
from rlinf_pipe.algorithms.terms import LossTerms, finalize
from rlinf_pipe.data.train_batch import TrainBatch
from rlinf_pipe.engines.policy.model_inputs import packing
from rlinf_pipe.utils.net import free_port

LR = 1e-5
CLIP = 1.0


def make_batch(batch: int, seq_len: int, response_len: int, vocab: int, ragged: bool = False,
               group_size: int = 1) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    if ragged:  # a prompt of 10-16 tokens, a response of 1-32 (right-padded to the longest row)
        prompts, responses = torch.randint(10, 17, (batch,), generator=g), torch.randint(1, 33, (batch,), generator=g)
    else:
        prompts, responses = torch.full((batch,), seq_len - response_len), torch.full((batch,), response_len)
    first = torch.arange(batch) // group_size * group_size  # each row's group's first row: its prompt for all
    prompts = prompts[first]
    seq_len = int((prompts + responses).max())
    columns = torch.arange(seq_len)[None, :]
    valid = columns < (prompts + responses)[:, None]
    response_mask = valid & (columns >= prompts[:, None])
    input_ids = torch.randint(3, vocab, (batch, seq_len), generator=g)
    input_ids = torch.where(columns < prompts[:, None], input_ids[first], input_ids).masked_fill(~valid, 0)
    old_logprobs = (-torch.rand(batch, seq_len, generator=g) * 6.0).masked_fill(~response_mask, 0.0)
    adv = torch.randn(batch, generator=g)
    advantages = adv[:, None].expand(batch, seq_len).masked_fill(~response_mask, 0.0).contiguous()
    return TrainBatch(
        input_ids=input_ids, attention_mask=valid,
        response_mask=response_mask, old_logprobs=old_logprobs, advantages=advantages,
        rewards=(adv > 0).float(), version=0, num_sequences=batch, num_tokens=int(response_mask.sum()),
    )


def make_loss_fn() -> Callable[[torch.Tensor, torch.Tensor | None, TrainBatch], LossTerms]:
    loss = functools.partial(policy_loss, clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg="token-mean")

    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: TrainBatch) -> LossTerms:
        return loss(logprobs, batch.old_logprobs, batch.ref_logprobs, batch.advantages, batch.response_mask,
                    entropy=entropy)

    return loss_fn


def init_megatron() -> None:
    import torch.distributed as dist

    from rlinf_pipe.models.megatron_gpt import init_model_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    init_model_parallel(1, 1)


class MegatronStep:
    def __init__(self, folder: str, batch: TrainBatch, packed: bool) -> None:
        from rlinf_pipe.engines.policy.policy import MegatronPolicy

        self.policy = MegatronPolicy(folder, lr=LR, clip_grad=CLIP, params_dtype="float32", pack_sequences=packed)
        self.batch, self.loss_fn = batch, make_loss_fn()

    def step(self) -> tuple[float, float, float]:
        """(total, forward + backward, optimizer step) seconds; also checks the loss is finite."""
        t0 = time.perf_counter()
        self.policy.train_micro_batch(self.batch, self.loss_fn)
        t1 = time.perf_counter()
        out = self.policy.optimizer_step()
        t2 = time.perf_counter()
        if not torch.isfinite(torch.tensor(out["loss"])):
            raise RuntimeError(f"megatron step gave a non-finite loss: {out}")
        return t2 - t0, t1 - t0, t2 - t1

    def forward(self) -> float:
        """Forward alone (model + token log-probs + loss, autograd recording, no backward)."""
        p, b = self.policy, self.batch
        t0 = time.perf_counter()
        inputs = p.model_inputs(b)
        lp, _ = p._token_values(inputs.run(p.model), inputs, 1.0, False)
        finalize(self.loss_fn(lp, None, b))
        return time.perf_counter() - t0


class HFStep:
    def __init__(self, folder: str, batch: TrainBatch) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                                           weight_decay=0.0)
        self.batch, self.loss_fn = batch, make_loss_fn()
        self.vocab = self.model.config.vocab_size

    def _loss(self) -> torch.Tensor:
        b = self.batch
        logits = self.model(input_ids=b.input_ids, attention_mask=b.attention_mask.long()).logits
        lp = torch.log_softmax(logits[:, :-1, : self.vocab].float(), dim=-1)
        lp = lp.gather(-1, b.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        lp = torch.nn.functional.pad(lp, (1, 0))  # aligned like TrainBatch: position 0 has no log-prob
        return finalize(self.loss_fn(lp, None, b))

    def step(self) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        loss = self._loss()
        loss.backward()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if not torch.isfinite(loss.detach()):
            raise RuntimeError("hf step gave a non-finite loss")
        return t2 - t0, t1 - t0, t2 - t1

    def forward(self) -> float:
        t0 = time.perf_counter()
        self._loss()
        return time.perf_counter() - t0


def model_folder(kind: str, arch: str) -> str:
    if kind == "smollm2":  # a real model (134.5M parameters, llama): compute dominates the step
        from rlinf_pipe.models.resolve import resolve_model_path

        return str(resolve_model_path("smollm2-135m"))
    if kind == "warm":  # the default model cache: shared with the tests and examples (building it takes minutes)
        from rlinf_pipe.models.warmstart import ensure_warm_tiny_model

        return str(ensure_warm_tiny_model())
    from rlinf_pipe.models import ensure_tiny_model

    return str(ensure_tiny_model(os.path.join(tempfile.gettempdir(), "rlinf_pipe_bench_models"), arch=arch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny", "warm", "smollm2"])
    parser.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"], help="tiny model only")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=48)
    parser.add_argument("--response-len", type=int, default=16)
    parser.add_argument("--ragged", action="store_true", help="rows of random lengths (see the module docstring)")
    parser.add_argument("--group-size", type=int, default=1, help="rows a prompt is shared by (1: none)")
    parser.add_argument("--padded", action="store_true", help="megatron on the padded batch (no packing)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not 0 < args.response_len < args.seq_len:
        parser.error("need 0 < --response-len < --seq-len")
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    start = time.perf_counter()
    folder = model_folder(args.model, args.arch)
    init_megatron()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(folder).vocab_size
    batch = make_batch(args.batch, args.seq_len, args.response_len, vocab, args.ragged, args.group_size)
    megatron, hf = MegatronStep(folder, batch, packed=not args.padded), HFStep(folder, batch)
    n_params = sum(p.numel() for p in hf.model.parameters())
    for _ in range(args.warmup):
        megatron.step()
        hf.step()
        megatron.forward()
        hf.forward()

    runs: dict[str, list[float]] = {k: [] for k in (
        "megatron_step", "megatron_fwd_bwd", "megatron_optim", "hf_step", "hf_fwd_bwd", "hf_optim",
        "megatron_forward", "hf_forward")}
    for i in range(args.repeats):
        order = (("megatron", megatron), ("hf", hf)) if i % 2 == 0 else (("hf", hf), ("megatron", megatron))
        for name, runner in order:
            total, fwd_bwd, optim = runner.step()
            runs[f"{name}_step"].append(total)
            runs[f"{name}_fwd_bwd"].append(fwd_bwd)
            runs[f"{name}_optim"].append(optim)
        for name, runner in order:
            runs[f"{name}_forward"].append(runner.forward())
    med = {k: statistics.median(v) for k, v in runs.items()}
    summary = {
        "step_s": {"megatron": med["megatron_step"], "hf": med["hf_step"]},
        "megatron_over_hf_step_time": med["megatron_step"] / med["hf_step"],
        "forward_s": {"megatron": med["megatron_forward"], "hf": med["hf_forward"]},
        "megatron_over_hf_forward_time": med["megatron_forward"] / med["hf_forward"],
        "fwd_bwd_s": {"megatron": med["megatron_fwd_bwd"], "hf": med["hf_fwd_bwd"]},
        "optimizer_s": {"megatron": med["megatron_optim"], "hf": med["hf_optim"]},
        "model": args.model, "arch": args.arch if args.model == "tiny" else {"warm": "qwen2"}.get(args.model, "llama"),
        "params": n_params,
        "batch": args.batch, "seq_len": int(batch.input_ids.shape[1]), "response_len": args.response_len,
        "ragged": args.ragged, "group_size": args.group_size,
        "packed": packing(batch, megatron.policy.pack_sequences, megatron.policy.share_prompts)[0],
        "real_token_fraction": round(float(batch.attention_mask.float().mean()), 3),
        "repeats": args.repeats, "warmup": args.warmup, "threads": torch.get_num_threads(),
        "runtime_s": time.perf_counter() - start,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
    }
    print(f"{'median seconds':<22}{'megatron':>12}{'hf + torch':>12}{'ratio':>8}")
    for label, key in (("step", "step"), ("  forward + backward", "fwd_bwd"), ("  optimizer step", "optim"),
                       ("forward alone", "forward")):
        m, h = med[f"megatron_{key}"], med[f"hf_{key}"]
        print(f"{label:<22}{m * 1e3:>10.2f}ms{h * 1e3:>10.2f}ms{m / h:>7.2f}x")
    print(f"{args.model} model ({n_params:,} parameters), batch {args.batch} x {summary['seq_len']} tokens "
          f"({summary['real_token_fraction']:.0%} real, megatron {'packed' if summary['packed'] else 'padded'}), "
          f"{args.repeats} repeats, {torch.get_num_threads()} threads, {summary['runtime_s']:.1f} s")
    if args.json:
        for key in ("step_s", "forward_s", "fwd_bwd_s", "optimizer_s"):
            summary[key] = {k: round(v, 6) for k, v in summary[key].items()}
        for key in ("megatron_over_hf_step_time", "megatron_over_hf_forward_time", "runtime_s"):
            summary[key] = round(summary[key], 3)
        print(json.dumps(summary))
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
