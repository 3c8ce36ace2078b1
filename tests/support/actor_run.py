"""Drive `MegatronPolicy` in spawned gloo process groups (CPU) for the actor tests."""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable, Sequence

import msgspec
import torch
import torch.multiprocessing as mp

from rlinf_pipe.algorithms import policy_loss
from rlinf_pipe.data.train_batch import TrainBatch
from rlinf_pipe.utils.net import free_port

PAD_ID = 0


def ppo_loss(logprobs, entropy, batch: TrainBatch, **kw):
    """`policy_loss` on a TrainBatch (the loss_fn signature MegatronPolicy expects)."""
    return policy_loss(
        logprobs, batch.old_logprobs, batch.ref_logprobs, batch.advantages, batch.response_mask, entropy=entropy, **kw
    )


LOSS = functools.partial(ppo_loss, loss_agg="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2)


def vocab_size(model_path: str) -> int:
    """The vocabulary size of an HF model folder (its config.json)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).vocab_size


def make_batch(seed: int, rows: int, vocab: int, max_prompt: int = 6, max_response: int = 8) -> TrainBatch:
    """A right-padded batch of random prompts + responses with random advantages (old log-probs 0)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, max_prompt + 1, (rows,), generator=g)
    responses = torch.randint(1, max_response + 1, (rows,), generator=g)
    row_adv = torch.randn(rows, generator=g)
    parts = []
    for r in range(rows):
        p, n = int(prompts[r]), int(responses[r])
        ids = torch.randint(1, vocab, (p + n,), generator=g)
        parts.append((ids[:p], ids[p:], float(row_adv[r])))
    return _padded_batch(parts, row_adv.clone())


def one_sequence_batch(vocab: int, tokens: int) -> TrainBatch:
    """One random sequence of `tokens` tokens, the first ninth of them prompt (1024 of 9216, as in the example
    configs), advantage 1 and old log-probs -2 on every token: a micro-batch at a token budget."""
    g = torch.Generator().manual_seed(0)
    prompt = tokens // 9
    return msgspec.structs.replace(
        make_batch(0, 1, vocab, max_prompt=2, max_response=2),
        input_ids=torch.randint(1, vocab, (1, tokens), generator=g),
        attention_mask=torch.ones(1, tokens, dtype=torch.bool),
        response_mask=torch.cat([torch.zeros(1, prompt, dtype=torch.bool),
                                 torch.ones(1, tokens - prompt, dtype=torch.bool)], dim=1),
        old_logprobs=torch.full((1, tokens), -2.0), advantages=torch.ones(1, tokens), num_tokens=tokens - prompt)


def make_grouped_batch(seed: int, groups: int, group_size: int, vocab: int) -> TrainBatch:
    """`make_batch`'s rows in GRPO groups: `group_size` responses to each of `groups` random prompts, the groups'
    rows interleaved (row r belongs to group r % groups)."""
    batch = make_batch(seed, groups * group_size, vocab)
    g = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(1, vocab, (int(n),), generator=g) for n in torch.randint(2, 7, (groups,), generator=g)]
    parts = [(prompts[r % groups], batch.input_ids[r][batch.response_mask[r]],
              float(batch.advantages[r][batch.response_mask[r]][0])) for r in range(batch.num_sequences)]
    return _padded_batch(parts, batch.rewards)


def _padded_batch(parts: list[tuple[torch.Tensor, torch.Tensor, float]], rewards: torch.Tensor) -> TrainBatch:
    """Right-padded rows of (prompt ids, response ids, the response's advantage); old log-probs 0."""
    rows, width = len(parts), max(len(p) + len(x) for p, x, _ in parts)
    input_ids = torch.full((rows, width), PAD_ID, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.bool)
    response = torch.zeros(rows, width, dtype=torch.bool)
    adv = torch.zeros(rows, width)
    for r, (prompt, answer, advantage) in enumerate(parts):
        p, n = len(prompt), len(answer)
        input_ids[r, : p + n] = torch.cat([prompt, answer])
        attention[r, : p + n] = True
        response[r, p : p + n] = True
        adv[r, p : p + n] = advantage
    return TrainBatch(
        input_ids=input_ids, attention_mask=attention, response_mask=response,
        old_logprobs=torch.zeros(rows, width), advantages=adv, rewards=rewards, version=0,
        num_sequences=rows, num_tokens=int(response.sum()),
    )


def select_rows(batch: TrainBatch, rows: Sequence[int]) -> TrainBatch:
    """The micro-batch of `rows` (any order), trimmed to its longest row."""
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    width = int(batch.attention_mask[idx].sum(1).max())
    cut = lambda t: t[idx][:, :width].clone()  # noqa: E731
    return msgspec.structs.replace(
        batch, input_ids=cut(batch.input_ids), attention_mask=cut(batch.attention_mask),
        response_mask=cut(batch.response_mask), old_logprobs=cut(batch.old_logprobs),
        ref_logprobs=None if batch.ref_logprobs is None else cut(batch.ref_logprobs),
        advantages=cut(batch.advantages), rewards=batch.rewards[idx].clone(), num_sequences=len(idx),
        num_tokens=int(batch.response_mask[idx].sum()),
    )


def with_old_logprobs(batch: TrainBatch, logprobs: torch.Tensor) -> TrainBatch:
    return msgspec.structs.replace(batch, old_logprobs=torch.where(batch.response_mask, logprobs, 0.0))


def capture_grads(policy) -> dict[str, torch.Tensor]:
    """Record the (finalised, scaled) main gradients each time the optimizer steps; returns the live dict."""
    grads: dict[str, torch.Tensor] = {}
    megatron_optimizer = policy.optimizer.optimizer
    original = megatron_optimizer.step

    def step():
        grads.clear()
        for name, p in policy.model.module.named_parameters():
            grads[name] = p.main_grad.detach().clone()
        return original()

    megatron_optimizer.step = step
    return grads


def params_of(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in policy.module.named_parameters()}


def _worker(rank: int, world: int, port: int, parallel: dict, fn: Callable, kwargs: dict, out_dir: str,
            backend: str) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import parallel_state

    from rlinf_pipe.models.megatron_gpt import init_model_parallel

    try:
        init_model_parallel(parallel.get("tp", 1), parallel.get("pp", 1), parallel.get("cp", 1))
        result = fn(rank=rank, **kwargs)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def spawn(world: int, fn: Callable, out_dir: str, parallel: dict | None = None, backend: str = "gloo",
          **kwargs) -> list[dict]:
    """Run `fn(rank=..., **kwargs)` on `world` ranks (gloo; or NCCL, rank r on GPU r) with Megatron TP/PP from
    `parallel`; return each rank's result (`fn` must be a module-level function)."""
    os.makedirs(out_dir, exist_ok=True)
    mp.spawn(_worker, args=(world, free_port(), parallel or {}, fn, kwargs, out_dir, backend), nprocs=world,
             join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
