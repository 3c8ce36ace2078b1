"""Evaluation on held-out prompts: greedy pass@1 and sampled pass@k, with one record per problem.

The same functions serve the runner's periodic validation (its rollout engines generate, its reward workers score)
and `rlinf-pipe eval` (one local engine and a local reward pool). Every evaluation of a run samples with the same
seeds (a stable hash of the run seed and the prompt's id), so two evaluations differ only by the weights.

    requests = eval_requests(prompts, sampling, k, seed)          # per prompt: one greedy, one with k samples
    outputs = await generate_texts(engine, requests)              # or the rollout workers' `evaluate`
    problems = eval_problems(prompts, outputs, scores)            # scores: one per text, in `score_pairs` order
    eval_metrics(problems, k)                                     # {"val/pass@1": ..., "val/pass@k": ...}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from rlinf_pipe.data.structs import PromptItem
from rlinf_pipe.engines.reward.context import RewardContext, reward_context
from rlinf_pipe.engines.rollout.engine import GenerateRequest, RolloutEngine, SamplingParams, request_seed

GREEDY, SAMPLED = "greedy", "sampled"


class EvalOutput(msgspec.Struct, frozen=True):
    """The decoded samples of one evaluation request (`<kind>/<prompt index>`) and their lengths in tokens."""

    request_id: str
    texts: list[str]
    lengths: list[int]


class EvalProblem(msgspec.Struct, frozen=True):
    """One evaluated problem: the greedy answer and the k sampled ones, each with whether it is correct."""

    id: str
    prompt: str
    answer: str
    greedy: str
    greedy_correct: bool
    samples: list[str]
    samples_correct: list[bool]
    response_length: float


def eval_requests(prompts: Sequence[PromptItem], sampling: SamplingParams, k: int, seed: int
                  ) -> list[GenerateRequest]:
    """Per prompt, a greedy request (n 1) and a sampled one (n `k`, the rollout's sampling settings), both seeded
    from `seed` and the prompt's id only."""
    requests = []
    for i, prompt in enumerate(prompts):
        prompt_seed = request_seed(seed, f"val/{prompt.id}", 0)
        greedy = msgspec.structs.replace(sampling, temperature=0.0, n=1, seed=prompt_seed)
        sampled = msgspec.structs.replace(sampling, n=k, seed=prompt_seed)
        requests.append(GenerateRequest(request_id=f"{GREEDY}/{i}", prompt_ids=list(prompt.prompt_ids),
                                        sampling=greedy))
        requests.append(GenerateRequest(request_id=f"{SAMPLED}/{i}", prompt_ids=list(prompt.prompt_ids),
                                        sampling=sampled))
    return requests


async def generate_texts(engine: RolloutEngine, requests: Sequence[GenerateRequest]) -> list[EvalOutput]:
    """Generate `requests` on `engine`; the decoded outputs in request order."""
    by_id: dict[str, EvalOutput] = {}
    async for result in engine.generate(requests):
        by_id[result.request_id] = EvalOutput(
            result.request_id,
            [engine.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in result.samples],
            [len(s.response_ids) for s in result.samples],
        )
    return [by_id[r.request_id] for r in requests]


def score_pairs(prompts: Sequence[PromptItem], outputs: Sequence[EvalOutput]) -> list[tuple[str, RewardContext]]:
    """(response, the prompt's `RewardContext`: its reference answers and a reward function's arguments) of every
    text of `outputs`, in order: what the reward scores."""
    contexts = [reward_context(prompt) for prompt in prompts]
    return [(text, contexts[_index(o)]) for o in outputs for text in o.texts]


def eval_problems(prompts: Sequence[PromptItem], outputs: Sequence[EvalOutput], correct: Sequence[bool]
                  ) -> list[EvalProblem]:
    """One `EvalProblem` per prompt from the outputs and the correctness of each text (in `score_pairs` order)."""
    verdicts = iter(correct)
    found: dict[tuple[str, int], tuple[EvalOutput, list[bool]]] = {}
    for output in outputs:
        found[(output.request_id.split("/")[0], _index(output))] = (output, [next(verdicts) for _ in output.texts])
    problems = []
    for i, prompt in enumerate(prompts):
        (greedy, greedy_ok), (sampled, sampled_ok) = found[(GREEDY, i)], found[(SAMPLED, i)]
        lengths = greedy.lengths + sampled.lengths
        problems.append(EvalProblem(prompt.id, prompt.prompt, prompt.answer, greedy.texts[0], greedy_ok[0],
                                    sampled.texts, sampled_ok, sum(lengths) / len(lengths)))
    return problems


def eval_metrics(problems: Sequence[EvalProblem], k: int) -> dict[str, float]:
    """`val/pass@1` (greedy accuracy), `val/pass@k` (a problem counts if any of its k samples is correct),
    `val/sampled_accuracy` (over all samples), `val/response_length` (tokens), `val/k`, `val/problems`."""
    count = len(problems)
    samples = [ok for p in problems for ok in p.samples_correct]
    return {
        "val/pass@1": sum(p.greedy_correct for p in problems) / count,
        "val/pass@k": sum(any(p.samples_correct) for p in problems) / count,
        "val/sampled_accuracy": sum(samples) / len(samples),
        "val/response_length": sum(p.response_length for p in problems) / count,
        "val/k": float(k),
        "val/problems": float(count),
    }


def write_problems(path: Path, problems: Sequence[EvalProblem], **fields: Any) -> None:
    """Append one JSON line per problem (with `fields`, e.g. the step) to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        for problem in problems:
            out.write(json.dumps({**fields, **msgspec.structs.asdict(problem)}) + "\n")


def _index(output: EvalOutput) -> int:
    return int(output.request_id.split("/")[1])
