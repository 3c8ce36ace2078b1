"""Warm start of the tiny model: a short supervised pass on the arithmetic data, so that RL starts from a
policy that is sometimes right (RL from a random initialisation never sees a reward on a 2-core CPU).

`warm_start(model_dir, out_dir, data, ...)` fine-tunes a model folder with plain torch (AdamW, loss on the
response tokens only) on rendered arithmetic prompts with targets `a + b = c. \\boxed{c}<|im_end|>`, and stops
early on purpose: the policy must leave RL room to climb. Half of the targets (`boxed_fraction`) stop after
`= c.` instead, which the reward cannot read, so RL also has a habit to learn (box every answer).
`ensure_warm_tiny_model(cache_dir, data)` builds the warm-started folder once per (tiny spec, warm-start knobs,
data knobs). What the defaults measure (accuracy before and after, learning curves) is in docs/models.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlinf_pipe.config.schema import DataConfig
from rlinf_pipe.data.arithmetic import ArithmeticDataset, parse_operators
from rlinf_pipe.data.factory import ARITHMETIC, build_prompt_dataset
from rlinf_pipe.models.tiny import TinySpec, default_cache_dir, ensure_tiny_model
from rlinf_pipe.utils.folders import build_folder_once, is_complete

logger = logging.getLogger(__name__)


# Tiny model knobs of the warm-started default policy (`ensure_tiny_model` keyword arguments).
TINY_KNOBS: dict[str, Any] = {
    "arch": "qwen2",
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 256,
}


@dataclass(frozen=True)
class WarmStartSpec:
    """Knobs of the supervised warm start; equal specs (and data and base model) give identical weights."""

    steps: int = 250
    lr: float = 5e-3
    batch_size: int = 32
    warmup_steps: int = 10
    weight_decay: float = 0.0
    boxed_fraction: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.warmup_steps < 0 or self.lr < 0:
            raise ValueError(f"invalid warm-start knobs {self}")
        if not 0.0 <= self.boxed_fraction <= 1.0:
            raise ValueError(f"boxed_fraction must be in [0, 1], got {self.boxed_fraction}")


def target_text(expression: str, answer: int | str, boxed: bool = True) -> str:
    """The supervised response to `What is {expression}?` (the EOS token is appended separately); without
    `boxed` the answer is not put in `\\boxed{}`, so the reward cannot read it."""
    return f"{expression} = {answer}." + (f" \\boxed{{{answer}}}" if boxed else "")


def arithmetic_dataset(data: DataConfig, tokenizer: Any, seed: int) -> ArithmeticDataset:
    if data.dataset != ARITHMETIC:
        raise ValueError(f"the warm start needs data.dataset: {ARITHMETIC}, got {data.dataset!r}")
    dataset = build_prompt_dataset(data, tokenizer, seed)
    assert isinstance(dataset, ArithmeticDataset)
    return dataset


def _batch(
    dataset: ArithmeticDataset, rows_spec: list[tuple[int, bool]], eos_id: int, pad_id: int, tokenizer: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) right-padded for (problem index, boxed) pairs; labels are -100
    except on response tokens."""
    rows: list[tuple[list[int], list[int]]] = []
    for index, boxed in rows_spec:
        item, problem = dataset[index], dataset.problem(index)
        text = target_text(problem.expression, problem.answer, boxed)
        response = tokenizer(text, add_special_tokens=False)["input_ids"]
        rows.append((list(item.prompt_ids or ()), list(response) + [eos_id]))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (prompt, response) in enumerate(rows):
        n = len(prompt) + len(response)
        ids[i, :n] = torch.tensor(prompt + response)
        mask[i, :n] = 1
        labels[i, len(prompt):n] = torch.tensor(response)
    return ids, mask, labels


def _response_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100)


def warm_start(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    data: DataConfig | None = None,
    steps: int = WarmStartSpec.steps,
    lr: float = WarmStartSpec.lr,
    seed: int = WarmStartSpec.seed,
    batch_size: int = WarmStartSpec.batch_size,
    warmup_steps: int = WarmStartSpec.warmup_steps,
    weight_decay: float = WarmStartSpec.weight_decay,
    boxed_fraction: float = WarmStartSpec.boxed_fraction,
) -> dict[str, float]:
    """Fine-tune `model_dir` on `steps` batches of arithmetic problems; save model + tokenizer to `out_dir`.

    Linear warmup then cosine decay to 10% of `lr`; loss is the mean cross-entropy over response tokens
    (EOS included). Problems come from the arithmetic generator seeded apart from RL's (`seed` picks them and
    seeds the weights' randomness). Returns `{"first_loss", "final_loss", "seconds"}` (losses: mean of the
    first / last 10 steps).
    """
    data = data or DataConfig()
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    dataset = arithmetic_dataset(data, tokenizer, seed=10_007 + seed)
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
        rng = random.Random(f"warm-start:{seed}")
        span = dataset.size or 1 << 30
        losses: list[float] = []
        for step in range(steps):
            warm = (step + 1) / warmup_steps if step < warmup_steps else 1.0
            progress = max(0, step - warmup_steps) / max(1, steps - warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
            picks = [(rng.randrange(span), rng.random() < boxed_fraction) for _ in range(batch_size)]
            batch = _batch(dataset, picks, eos_id, pad_id, tokenizer)
            loss = _response_loss(model, *batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(float(loss.detach()))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    head, tail = losses[:10] or [math.nan], losses[-10:] or [math.nan]
    return {
        "first_loss": sum(head) / len(head),
        "final_loss": sum(tail) / len(tail),
        "seconds": time.perf_counter() - start,
    }


def _data_knobs(data: DataConfig) -> dict[str, Any]:
    arithmetic = asdict(data.arithmetic)
    arithmetic["operators"] = list(parse_operators(arithmetic["operators"]))
    return {"arithmetic": arithmetic, "template": data.template, "system_prompt": data.system_prompt}


def warm_digest(tiny: TinySpec, spec: WarmStartSpec, data: DataConfig) -> str:
    """A short stable hash of everything the warm-started weights depend on."""
    blob = {"tiny": tiny.knobs(), "warm": asdict(spec), "data": _data_knobs(data)}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:12]


def ensure_warm_tiny_model(
    cache_dir: str | os.PathLike[str] | None = None,
    data: DataConfig | None = None,
    *,
    spec: WarmStartSpec | None = None,
    tiny_knobs: dict[str, Any] | None = None,
) -> Path:
    """The warm-started tiny model folder under `cache_dir` (default `default_cache_dir()`), built on first use.

    The base model comes from `ensure_tiny_model(cache_dir, **tiny_knobs)` (default `TINY_KNOBS`); the warm
    start is written to `tiny-<arch>-warm-<digest>` next to it, built in a temporary sibling and renamed into
    place with its marker file already written (same scheme as `ensure_tiny_model`).
    """
    data, spec = data or DataConfig(), spec or WarmStartSpec()
    knobs = dict(TINY_KNOBS if tiny_knobs is None else tiny_knobs)
    tiny = TinySpec(**knobs)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"tiny-{tiny.arch}-warm-{warm_digest(tiny, spec, data)}"
    if is_complete(final):
        return final
    base = ensure_tiny_model(root, **knobs)

    def build(tmp: Path) -> dict:
        stats = warm_start(base, tmp, data, **asdict(spec))
        logger.info("warm start of %s: %s", final.name, stats)
        return {"tiny": tiny.knobs(), "warm": asdict(spec), "data": _data_knobs(data), "stats": stats}

    return build_folder_once(final, build)


__all__ = [
    "TINY_KNOBS",
    "WarmStartSpec",
    "arithmetic_dataset",
    "ensure_warm_tiny_model",
    "target_text",
    "warm_digest",
    "warm_start",
]
