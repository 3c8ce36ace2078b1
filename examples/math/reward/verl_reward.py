"""A reward function in verl's form: `reward.function: examples/math/reward/verl_reward.py:compute_score`.

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)`, and so does rlinf_pipe, so a file
like this one works in both. It reads the response's final answer (the last `\\boxed{...}`, else the text after the
last `####`) and compares it with the ground truth as a number; a list of ground truths (several reference answers)
counts when any matches. It returns a dict: `score` is the reward; `acc` (correct or not) and `answered` (an answer
was found) are logged as the means `reward/acc` and `reward/answered`, and `acc` decides the run's accuracy.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (no nested braces), else the line after the last `####`."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        end = text.find("}", start)
        return text[start + len("\\boxed{"):end] if end >= 0 else None
    mark = text.rfind("####")
    if mark >= 0:
        return text[mark + len("####"):].strip().split("\n", 1)[0]
    return None


def as_number(text: str) -> float | None:
    """The first number in `text` (thousands commas dropped), or None."""
    match = _NUMBER.search(text.replace(",", ""))
    return float(match.group()) if match else None


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict:
    """1.0 when the response's final answer equals the ground truth (or one of them), else 0.0."""
    answer = final_answer(solution_str)
    value = None if answer is None else as_number(answer)
    truths = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    correct = value is not None and any(value == as_number(str(truth)) for truth in truths)
    return {"score": 1.0 if correct else 0.0, "acc": correct, "answered": float(answer is not None)}
