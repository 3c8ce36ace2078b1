"""`rlinf-pipe eval`: one model on one dataset in this process (no Ray): the rollout engine of the config generates,
a local reward pool judges, and OUT_DIR gets `metrics.json` (the `val/*` metrics of training's validation) and
`problems.jsonl` (each problem's greedy and sampled responses).

The model is an HF folder, a built-in name (`tiny`, ...), or a run's checkpoint (`checkpoints/step_N`, or its
`actor/` Megatron folder), converted to an HF folder under OUT_DIR first.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from transformers import AutoTokenizer

from rlinf_pipe.config.schema import Config
from rlinf_pipe.data.factory import build_prompt_dataset, first_prompts, split_validation, warm_start_data
from rlinf_pipe.engines.evaluation import (
    eval_metrics,
    eval_problems,
    eval_requests,
    generate_texts,
    score_pairs,
    write_problems,
)
from rlinf_pipe.engines.reward.extract import resolve_thinking
from rlinf_pipe.engines.reward.registry import reward_pool
from rlinf_pipe.engines.rollout.factory import build_engine, sampling_params
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.models.convert import convert_megatron_to_hf
from rlinf_pipe.models.megatron_checkpoint import is_megatron_checkpoint
from rlinf_pipe.models.resolve import resolve_model_path

PROBLEMS = "problems.jsonl"
METRICS = "metrics.json"


def eval_model_folder(model: str, cfg: Config, out_dir: Path) -> Path:
    """The HF folder of `model` (see the module docstring); a checkpoint is converted into `out_dir/model`."""
    path = Path(model).expanduser()
    if (path / "actor").is_dir() and is_megatron_checkpoint(path / "actor"):
        path = path / "actor"
    if path.is_dir() and is_megatron_checkpoint(path):
        converted = out_dir / "model"
        if not (converted / "config.json").is_file():
            convert_megatron_to_hf(path, converted)
        return converted
    try:
        return resolve_model_path(model, data=warm_start_data(cfg.data))
    except ValueError as exc:
        raise ConfigError(f"--model: {exc} A run's checkpoint (checkpoints/step_N) works too.") from None


def evaluate_model(cfg: Config, model: str, out_dir: Path, limit: int, k: int, heldout: bool = False
                   ) -> dict[str, float | str]:
    """Evaluate `model` on the first `limit` prompts of `cfg.data.dataset` (`heldout`: of the config's validation
    set, the problems a run with this config validates on); returns the metrics (also written)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    folder = eval_model_folder(model, cfg, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    resolve_thinking(cfg, tokenizer)
    dataset = build_prompt_dataset(cfg.data, tokenizer, cfg.runner.seed)
    if heldout:
        _, prompts = split_validation(cfg.data, tokenizer, cfg.runner.seed, dataset)
        prompts = prompts[:limit]
    else:
        prompts = first_prompts(dataset, limit)
    engine = build_engine(cfg.rollout, str(folder), seed=cfg.runner.seed, collocated=False)
    requests = eval_requests(prompts, sampling_params(cfg.rollout, k), k, cfg.runner.seed)
    try:
        outputs = asyncio.run(generate_texts(engine, requests))
    finally:  # before the reward pool starts: SGLang's shutdown kills every process this one started
        if (shutdown := getattr(engine, "shutdown", None)) is not None:
            shutdown()
    pool = reward_pool(cfg.reward)
    try:
        scores = pool.score_batch(score_pairs(prompts, outputs))
    finally:
        pool.close()
    problems = eval_problems(prompts, outputs, [s.correct for s in scores])
    (out_dir / PROBLEMS).unlink(missing_ok=True)
    write_problems(out_dir / PROBLEMS, problems)
    source = f"{cfg.data.dataset} (validation set: {cfg.data.val_dataset})" if heldout else cfg.data.dataset
    metrics: dict[str, float | str] = {**eval_metrics(problems, k), "model": str(folder), "dataset": source}
    (out_dir / METRICS).write_text(json.dumps(metrics, indent=2))
    return metrics
