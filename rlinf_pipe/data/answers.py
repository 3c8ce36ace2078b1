"""Reference answers: extract the final answer from a dataset's answer field.

Styles:
- `gsm8k`: a worked solution ending in `#### 72`; the text after the last `####` is the answer, with thousands
  separators removed (`#### 1,000` -> `1000`).
- `boxed`: MATH-style text whose answer is the last `\\boxed{...}` (or `\\fbox{...}`); nested and escaped braces
  are handled (`\\boxed{\\frac{1}{2}}` -> `\\frac{1}{2}`).
- `plain`: the stripped text itself (`72`, `x = 3`).
- `auto` (default): `gsm8k` if the text contains `####`, else `boxed` if it contains `\\boxed` / `\\fbox`, else
  `plain` - where a multi-line plain text is refused, since it is a solution without a marked final answer.
"""

from __future__ import annotations

import re
from typing import Literal

from rlinf_pipe.data.errors import AnswerParseError
from rlinf_pipe.utils.latex import BOX_OPEN, last_boxed

AnswerFormat = Literal["auto", "gsm8k", "boxed", "plain"]
ANSWER_FORMATS: tuple[str, ...] = ("auto", "gsm8k", "boxed", "plain")

_GSM8K_MARK = "####"
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _short(text: str, limit: int = 60) -> str:
    flat = text.replace("\n", "\\n")
    return repr(flat if len(flat) <= limit else flat[: limit - 3] + "...")


def parse_gsm8k_answer(text: str) -> str:
    """The answer after the last `####`, commas between digit groups removed."""
    head, mark, tail = text.rpartition(_GSM8K_MARK)
    if not mark:
        raise AnswerParseError(f"no `####` final-answer marker in {_short(text)}")
    answer = tail.strip()
    if not answer:
        raise AnswerParseError(f"nothing after `####` in {_short(text)}")
    if "\n" in answer:
        raise AnswerParseError(f"the text after `####` spans several lines in {_short(text)}")
    return _THOUSANDS_COMMA.sub("", answer)


def parse_boxed_answer(text: str) -> str:
    """The contents of the last `\\boxed{...}` / `\\fbox{...}`, with balanced (and `\\{`-escaped) braces."""
    if not BOX_OPEN.search(text):
        command = next((c for c in _BOX_COMMANDS if c in text), None)
        if command:
            raise AnswerParseError(f"{command} is not followed by `{{` in {_short(text)}")
        raise AnswerParseError(f"no \\boxed{{...}} in {_short(text)}")
    answer = last_boxed(text)
    if answer is None:
        raise AnswerParseError(f"unbalanced braces after the last \\boxed in {_short(text)}")
    if not answer.strip():
        raise AnswerParseError(f"empty \\boxed{{}} in {_short(text)}")
    return answer.strip()


def parse_plain_answer(text: str) -> str:
    """The stripped text; it must not be empty."""
    answer = text.strip()
    if not answer:
        raise AnswerParseError("the answer is empty")
    return answer


def parse_reference_answer(text: str, answer_format: AnswerFormat = "auto") -> str:
    """Extract the final answer of `text` in the given style (see the module docstring).

    Raises AnswerParseError when there is no usable answer, ValueError for an unknown `answer_format`.
    """
    if not isinstance(text, str):
        raise AnswerParseError(f"the answer must be a string, got {type(text).__name__}")
    if answer_format == "gsm8k":
        return parse_gsm8k_answer(text)
    if answer_format == "boxed":
        return parse_boxed_answer(text)
    if answer_format == "plain":
        return parse_plain_answer(text)
    if answer_format != "auto":
        raise ValueError(f"unknown answer format {answer_format!r}; choose one of {', '.join(ANSWER_FORMATS)}")
    if _GSM8K_MARK in text:
        return parse_gsm8k_answer(text)
    if any(command in text for command in _BOX_COMMANDS):
        return parse_boxed_answer(text)
    answer = parse_plain_answer(text)
    if "\n" in answer:
        raise AnswerParseError(
            f"the answer spans several lines but has no `#### <answer>` or \\boxed{{<answer>}} in {_short(text)} "
            "(set data.answer_format=plain to use such text as is)"
        )
    return answer
