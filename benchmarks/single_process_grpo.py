"""The default run against what a single-machine user would write instead: a plain single-process GRPO loop.

    python benchmarks/single_process_grpo.py [--steps 12] [--warmup 2] [--repeats 3] [--json]

Both train the same warm-started tiny model on the same arithmetic prompts with the default config
(`tiny-grpo-megatron-pipeline.yaml`: 16 prompts x 8 samples a step, 32 new tokens at temperature 1, token-mean
PPO loss, one optimizer step a step, lr 2e-4):

- plain: one process, torch's default threads. Hugging Face `generate` (sampling, `num_return_sequences` = the
  group size), in-process scoring (`rlinf_pipe.engines.reward.verify.score`, the verifier our reward workers run),
  GRPO advantages, then one forward + backward over the step's samples (old log-probs = the same forward,
  detached, as a loop with one update per batch may take them) and an AdamW step.
- ours: `rlinf_pipe.runner.run` on the default config (2 virtual GPUs: the engine and the Megatron actor in their
  own processes, the reward worker beside them). With one optimizer step a step the old log-probs are the
  training forward's own and, with `kl_coef: 0`, no reference log-probs are computed (both as in the plain loop),
  so no log-prob stage runs; the override `algorithm.compute_ref_logprobs=true` adds the reference pass.

Completions per second = samples trained per step / the median step time over the steps after `warmup`. Each
repeat runs both (alternating order); medians over repeats and the ratio are reported. With --json the last
printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch

from rlinf_pipe.algorithms.advantages import compute_advantages
from rlinf_pipe.algorithms.losses import policy_loss
from rlinf_pipe.algorithms.terms import finalize
from rlinf_pipe.config import load_config
from rlinf_pipe.config.schema import Config
from rlinf_pipe.utils.metrics import read_metrics

CONFIG = "tiny-grpo-megatron-pipeline"


def default_config(steps: int, overrides: list[str]) -> Config:
    return load_config("examples/math/config", CONFIG, [f"runner.max_steps={steps}", "runner.progress=false",
                                                        "runner.tensorboard=false", "runner.save_interval=0",
                                                        *overrides])


class PlainLoop:
    """The single-process GRPO loop (see the module docstring)."""

    def __init__(self, cfg: Config):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlinf_pipe.data.factory import build_prompt_dataset, build_sampler
        from rlinf_pipe.engines.reward.verify import ScoreConfig
        from rlinf_pipe.models.resolve import resolve_model_path

        folder = str(resolve_model_path(cfg.actor.model_path, data=cfg.data))
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.actor.lr, weight_decay=0.0)
        self.sampler = build_sampler(cfg.data, build_prompt_dataset(cfg.data, self.tokenizer, cfg.runner.seed),
                                     cfg.runner.seed)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.score_config = ScoreConfig(cfg.reward.correct_score, cfg.reward.wrong_score, cfg.reward.format_score,
                                        cfg.reward.answer_pattern)

    def step(self) -> tuple[float, float]:
        """One GRPO step; returns (seconds, mean reward)."""
        from rlinf_pipe.engines.reward.verify import score

        cfg, group = self.cfg, self.cfg.algorithm.group_size
        start = time.perf_counter()
        prompts = self.sampler.next_batch()
        width = max(len(p.prompt_ids) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p.prompt_ids)) + list(p.prompt_ids) for p in prompts])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p.prompt_ids) for p in prompts])[:, None])
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask.long(), do_sample=True, temperature=cfg.rollout.temperature,
                top_k=0, max_new_tokens=cfg.rollout.max_new_tokens, num_return_sequences=group,
                pad_token_id=self.pad,
            )
        responses = out[:, width:]
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        answers = [p.answer for p in prompts for _ in range(group)]
        rewards = torch.tensor([score(t, a, self.score_config, timeout_s=cfg.reward.timeout_s).reward
                                for t, a in zip(texts, answers, strict=True)])
        group_ids = torch.arange(len(prompts)).repeat_interleave(group)
        advantages = compute_advantages(cfg.algorithm.adv_estimator, rewards, group_ids,
                                        norm_by_std=cfg.algorithm.norm_by_std)
        eos = set(self.tokenizer.all_special_ids)
        response_mask = torch.zeros_like(out, dtype=torch.bool)
        for row, tokens in enumerate(responses.tolist()):
            for pos, token in enumerate(tokens):  # up to and including the first end-of-sequence token
                response_mask[row, width + pos] = True
                if token in eos:
                    break
        attention = torch.cat([mask.repeat_interleave(group, 0), response_mask[:, width:]], dim=1)
        self.model.train()
        logits = self.model(input_ids=out, attention_mask=attention.long()).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, out[:, 1:, None]).squeeze(-1)
        logp = torch.nn.functional.pad(logp, (1, 0))
        adv = advantages[:, None].expand_as(logp)
        terms = policy_loss(logp, logp.detach(), None, adv, response_mask,
                            clip_ratio_low=cfg.algorithm.clip_ratio_low, clip_ratio_high=cfg.algorithm.clip_ratio_high,
                            loss_agg=cfg.algorithm.loss_agg)
        finalize(terms).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.actor.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, float(rewards.mean())


def plain_figures(cfg: Config, steps: int, warmup: int) -> dict[str, float]:
    loop = PlainLoop(cfg)
    times, rewards = zip(*(loop.step() for _ in range(steps)), strict=True)
    return {"step_s": statistics.median(times[warmup:]), "reward": statistics.mean(rewards)}


def ours_figures(cfg: Config, warmup: int, out: str) -> dict[str, float]:
    from rlinf_pipe.runner import run

    cfg.runner.output_dir = out
    launched = time.perf_counter()
    run_dir = run(cfg)
    whole = time.perf_counter() - launched
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "timing/step" in r]
    return {"step_s": statistics.median(r["timing/step"] for r in rows[warmup:]),
            "reward": statistics.mean(r["reward/mean"] for r in rows), "whole_run_s": whole}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for both")
    args = parser.parse_args()
    samples = None
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "ours": []}
    with tempfile.TemporaryDirectory(prefix="rlp-single-") as out:
        for repeat in range(args.repeats):
            order = ("plain", "ours") if repeat % 2 == 0 else ("ours", "plain")
            for name in order:
                cfg = default_config(args.steps, args.overrides)
                samples = cfg.data.rollout_batch_size * cfg.algorithm.group_size
                figures = (plain_figures(cfg, args.steps, args.warmup) if name == "plain"
                           else ours_figures(cfg, args.warmup, out))
                runs[name].append(figures)
                print(f"repeat {repeat} {name:>5}: {figures['step_s']:.3f} s/step, "
                      f"{samples / figures['step_s']:.0f} completions/s, reward {figures['reward']:.3f}", flush=True)
    step = {name: statistics.median(f["step_s"] for f in fs) for name, fs in runs.items()}
    summary = {
        "completions_per_s": {name: round(samples / s, 1) for name, s in step.items()},
        "step_s": {name: round(s, 4) for name, s in step.items()},
        "ours_over_plain_completions": round(step["plain"] / step["ours"], 3),
        "ours_whole_run_s": round(statistics.median(f["whole_run_s"] for f in runs["ours"]), 1),
        "samples_per_step": samples, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "torch_threads_plain": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
    }
    print(f"ours {summary['completions_per_s']['ours']} completions/s, plain single-process loop "
          f"{summary['completions_per_s']['plain']}: ratio {summary['ours_over_plain_completions']}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
