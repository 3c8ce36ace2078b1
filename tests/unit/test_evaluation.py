"""Evaluation: the held-out split, the requests and their seeds, counting pass@1 / pass@k, and `rlinf-pipe eval`
on a real engine (the tiny model) with a real reward pool."""

from __future__ import annotations

import json

import pytest
from support.tiny_tokenizer import tiny_tokenizer

from rlinf_pipe.config.schema import DataConfig
from rlinf_pipe.data import build_prompt_dataset
from rlinf_pipe.data.errors import DataError
from rlinf_pipe.data.factory import first_prompts, split_validation
from rlinf_pipe.data.structs import PromptItem
from rlinf_pipe.engines.evaluation import EvalOutput, eval_metrics, eval_problems, eval_requests, score_pairs
from rlinf_pipe.engines.rollout.engine import SamplingParams
from rlinf_pipe.runner.validation import Validation


def prompts(count: int) -> list[PromptItem]:
    return [PromptItem(id=f"p/{i}", prompt=f"q{i}", answer=str(i), index=i, prompt_ids=[1, 2, i + 3])
            for i in range(count)]


def test_heldout_arithmetic_is_drawn_apart_and_leaves_training_untouched():
    data = DataConfig(val_size=5)
    train = build_prompt_dataset(data, tiny_tokenizer(), seed=1)
    kept, val = split_validation(data, tiny_tokenizer(), 1, train)
    assert kept is train and len(val) == 5
    assert all(p.id.startswith("arithmetic-val-1/") for p in val)
    assert [p.prompt for p in val] != [p.prompt for p in first_prompts(train, 5)]
    _, named = split_validation(DataConfig(val_size=5, val_dataset="arithmetic"), tiny_tokenizer(), 1, train)
    assert [p.id for p in named] == [p.id for p in first_prompts(train, 5)]  # `rlinf-pipe eval --dataset arithmetic`


def test_heldout_file_records_leave_training_and_too_many_is_a_clear_error(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}+0?", "answer": str(i)}) + "\n" for i in range(10)))
    data = DataConfig(dataset=str(path), val_size=3, rollout_batch_size=4, template="{prompt}")
    train = build_prompt_dataset(data, tiny_tokenizer(), seed=0)
    kept, val = split_validation(data, tiny_tokenizer(), 0, train)
    assert [p.answer for p in kept.items] == [str(i) for i in range(7)] and [p.answer for p in val] == ["7", "8", "9"]
    data.val_size = 8
    with pytest.raises(DataError, match=r"data.val_size=8: .* leaves 2 for training, fewer than "
                                        r"data.rollout_batch_size=4; lower data.val_size"):
        split_validation(data, tiny_tokenizer(), 0, train)


def test_requests_are_one_greedy_and_one_sampled_per_prompt_seeded_by_prompt_only():
    sampling = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=7, n=16)
    requests = eval_requests(prompts(3), sampling, k=4, seed=1)
    assert [r.request_id for r in requests] == ["greedy/0", "sampled/0", "greedy/1", "sampled/1", "greedy/2",
                                                "sampled/2"]
    greedy, sampled = requests[0].sampling, requests[1].sampling
    assert (greedy.temperature, greedy.n, sampled.temperature, sampled.n) == (0.0, 1, 0.8, 4)
    assert greedy.seed == sampled.seed and sampled.top_p == 0.9 and sampled.max_new_tokens == 7
    assert requests[2].sampling.seed != greedy.seed  # another prompt
    shifted = eval_requests(prompts(3)[1:], sampling, k=4, seed=1)  # a prompt's seed ignores its position
    assert shifted[0].sampling.seed == requests[2].sampling.seed
    assert eval_requests(prompts(1), sampling, k=4, seed=2)[0].sampling.seed != greedy.seed


def test_problems_and_metrics_count_greedy_and_any_of_k_whatever_the_output_order():
    items = prompts(2)
    outputs = [EvalOutput("sampled/1", ["a", "b"], [4, 6]), EvalOutput("greedy/0", ["c"], [2]),
               EvalOutput("sampled/0", ["d", "e"], [2, 2]), EvalOutput("greedy/1", ["f"], [5])]
    pairs = score_pairs(items, outputs)  # (each text with its prompt's reference answers, what the reward reads)
    assert [(text, context.references) for text, context in pairs] == [
        ("a", ("1",)), ("b", ("1",)), ("c", ("0",)), ("d", ("0",)), ("e", ("0",)), ("f", ("1",))]
    problems = eval_problems(items, outputs, [False, True, True, False, False, False])
    assert [(p.greedy, p.greedy_correct, p.samples, p.samples_correct) for p in problems] == [
        ("c", True, ["d", "e"], [False, False]), ("f", False, ["a", "b"], [False, True])]
    assert problems[1].response_length == 5.0
    assert eval_metrics(problems, k=2) == {"val/pass@1": 0.5, "val/pass@k": 0.5, "val/sampled_accuracy": 0.25,
                                           "val/response_length": 3.5, "val/k": 2.0, "val/problems": 2.0}


@pytest.mark.parametrize(
    "interval, before, due",
    [(0, False, []), (0, True, [0]), (2, False, [2, 4, 5]), (2, True, [0, 2, 4, 5]), (5, False, [5])],
)
def test_validation_is_due_every_interval_and_after_the_last_step(tmp_path, interval, before, due):
    validation = Validation(prompts(1), interval, before, 5, 2, SamplingParams(), 1, tmp_path)
    assert [s for s in range(6) if validation.due(s)] == due
