"""Verifiable math reward: is the final answer of a response mathematically equal to the reference?

    score(response, "72", ScoreConfig(correct_score=1, wrong_score=-1))  # ScoreResult(correct=..., reward=...)

The answer is extracted by `extract.extract_answer`; math-verify parses it and the reference into sympy and
compares them (numeric tolerance, equivalent forms, sets, intervals, equations like `x = 5`). Its own signal-based
timeouts are switched off (they fail outside the main thread); time limits come from `deadline` here and, hard,
from `RewardPool`. `verdict.verify_math` gives a yes / no under a limit that holds in any thread.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from rlinf_pipe.engines.reward.context import references_of
from rlinf_pipe.engines.reward.deadline import VerifyTimeout, deadline
from rlinf_pipe.engines.reward.extract import (
    THINKING_MODES,
    answer_region,
    compile_pattern,
    extract_answer,
    last_boxed,
    normalize_answer,
)
from rlinf_pipe.errors import ConfigError

logger = logging.getLogger(__name__)

class _DropDisabledTimeoutWarning(logging.Filter):
    """math-verify warns when its timeout is off; ours is on (deadline / pool), so that warning is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@dataclass(frozen=True)
class _MathVerify:
    """What scoring uses of math-verify and sympy."""

    parse: Callable[..., list[Any]]
    verify: Callable[..., bool]
    extraction: tuple[Any, ...]
    math_types: tuple[type, ...]


@lru_cache(maxsize=1)
def _math_verify() -> _MathVerify:
    """math-verify and sympy, imported on first use (about a second of CPU) and warmed by one comparison (the LaTeX
    grammar and sympy's lazy parts, about 0.1 s more), so no caller's time limit pays for either. A process that only
    quick-scores, or hands its items to the pool's processes (which load them in their forkserver), never loads them."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from sympy import Basic, MatrixBase

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropDisabledTimeoutWarning())
    extraction = (LatexExtractionConfig(), ExprExtractionConfig())
    try:
        verify(parse("\\boxed{0.5}", extraction, parsing_timeout=None),
               parse("\\boxed{\\frac{1}{2}}", extraction, parsing_timeout=None), timeout_seconds=None)
    except Exception:  # (only the warm-up: scoring reports its own errors)
        logger.warning("reward: math-verify's warm-up comparison failed; the first score may be slow", exc_info=True)
    return _MathVerify(parse, verify, extraction, (Basic, MatrixBase))


@dataclass(frozen=True, slots=True)
class RewardFailure:
    """Why a reward function gave no reward: where (`file:line in NAME`), the exception type (or `bad return`), the
    message."""

    where: str
    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.kind}: {self.message}"


@dataclass(frozen=True, slots=True)
class ScoreResult:
    """Verdict on one response.

    correct: the answer equals the reference (one of them, where there are several). parsed: an answer was found
    and read as math (False for a missing, empty, truncated or unreadable answer, and for a timeout). timed_out:
    verification ran out of time (scored as wrong). reward: the scalar reward. answer: the extracted answer text, if
    any. extras: a reward function's other numeric values (logged as `reward/<key>` means). error: why a reward
    function failed (it then scores 0).
    """

    correct: bool
    parsed: bool
    timed_out: bool
    reward: float
    answer: str | None = None
    extras: dict[str, float] | None = None
    error: RewardFailure | None = None


@dataclass(frozen=True)
class ScoreConfig:
    """Reward values and answer extraction (config keys `reward.*`, see docs/reward.md).

    reward = (correct_score if correct else wrong_score) + (format_score if the response states an answer).
    A timed-out verification gets wrong_score only.
    """

    correct_score: float = 1.0
    wrong_score: float = 0.0
    format_score: float = 0.0
    answer_pattern: str | None = None
    thinking: str = "auto"  # reasoning blocks: `extract.answer_region`

    def __post_init__(self) -> None:
        if self.thinking not in THINKING_MODES:
            raise ConfigError(f"reward.thinking: {self.thinking!r} is not one of {', '.join(THINKING_MODES)}")
        if self.answer_pattern is not None:
            try:
                compile_pattern(self.answer_pattern)
            except Exception as exc:  # re.error, or a non-string value
                raise ConfigError(
                    f"reward.answer_pattern: {self.answer_pattern!r} is not a valid regular expression ({exc}); "
                    "write e.g. '#### (.*)' with one group around the answer"
                ) from None

    def timeout_result(self) -> ScoreResult:
        """The result of a verification that ran out of time."""
        return ScoreResult(correct=False, parsed=False, timed_out=True, reward=float(self.wrong_score))


DEFAULT_CONFIG = ScoreConfig()
# What scores one (response, reference) pair, e.g. `score`. The reference is whatever the scorer reads: a string,
# a list of reference answers, or a `context.RewardContext`.
Scorer = Callable[[str, Any], ScoreResult]


def score(
    response: str, reference: Any, config: ScoreConfig | None = None, *, timeout_s: float | None = None
) -> ScoreResult:
    """Score one response against its reference answer: a string, a list of them (correct when the answer matches
    any) or a `RewardContext` (its `references`).

    `timeout_s` bounds the work in this process when called from the main thread (see `deadline`); elsewhere it is
    ignored. Never raises for bad input: a missing or unreadable answer scores as wrong with parsed=False.
    """
    cfg = config or DEFAULT_CONFIG
    answer = None
    _math_verify()  # (its first import takes about a second: never inside the time limit, nor cut by its signal)
    try:
        with deadline(timeout_s):
            answer = extract_answer(response or "", cfg.answer_pattern, cfg.thinking)
            if answer is None:
                return ScoreResult(correct=False, parsed=False, timed_out=False, reward=float(cfg.wrong_score))
            predicted = _math_objects(parse_answer(answer))
            correct = bool(predicted) and any(_equal(parse_reference(ref), predicted)
                                              for ref in references_of(reference))
    except VerifyTimeout:
        return ScoreResult(correct=False, parsed=False, timed_out=True, reward=float(cfg.wrong_score), answer=answer)
    base = cfg.correct_score if correct else cfg.wrong_score
    return ScoreResult(
        correct=correct, parsed=bool(predicted), timed_out=False, reward=float(base + cfg.format_score), answer=answer
    )


@dataclass(frozen=True)
class MathScorer:
    """The built-in math reward (`reward.reward_type: math`) as a pool scorer: `score` in the pool's processes, and
    `quick` (`quick_score`) in the calling thread for what needs no sympy."""

    config: ScoreConfig = DEFAULT_CONFIG

    def __call__(self, response: str, reference: Any) -> ScoreResult:
        return score(response, reference, self.config)

    def quick(self, response: str, reference: Any) -> ScoreResult | None:
        return quick_score(response, reference, self.config)


_INTEGER = re.compile(r"-?[0-9]+")


def quick_score(response: str, reference: Any, config: ScoreConfig | None = None) -> ScoreResult | None:
    """The verdict `score` gives, where it can be had without sympy (so it cannot hang): no answer stated, or a plain
    integer answer (`\\boxed{-12}`) against plain integer references (any of them equal: correct; all of them
    integers and none equal: wrong), compared exactly. None otherwise, and when the answer would come from
    `answer_pattern` (a user's regular expression may run long): score it in full."""
    cfg = config or DEFAULT_CONFIG
    region = answer_region(response or "", cfg.thinking)
    raw = None if region is None else last_boxed(region)
    if raw is None and region is not None and cfg.answer_pattern:
        return None
    answer = normalize_answer(raw) if raw is not None else ""
    if not answer:
        return ScoreResult(correct=False, parsed=False, timed_out=False, reward=float(cfg.wrong_score))
    if not _INTEGER.fullmatch(answer):
        return None
    integers = [int(ref) for ref in (r.strip() for r in references_of(reference)) if _INTEGER.fullmatch(ref)]
    correct = int(answer) in integers
    if not correct and len(integers) < len(references_of(reference)):
        return None  # (a reference that is not an integer may still equal it)
    base = cfg.correct_score if correct else cfg.wrong_score
    return ScoreResult(correct=correct, parsed=True, timed_out=False, reward=float(base + cfg.format_score),
                       answer=answer)


def parse_answer(answer: str) -> list[Any]:
    """math-verify's reading of an answer text (sympy objects, then its literal-string fallback)."""
    math = _math_verify()
    return math.parse("\\boxed{" + answer + "}", math.extraction, parsing_timeout=None)


@lru_cache(maxsize=4096)
def parse_reference(reference: str) -> tuple[Any, ...]:
    """The sympy objects of a reference answer (a plain answer, or text whose last `\\boxed{}` holds it); cached,
    as each reference is scored once per sample of its prompt group."""
    text = last_boxed(reference)
    objects = _math_objects(parse_answer(normalize_answer(reference if text is None else text)))
    if not objects:
        logger.warning("reward: reference answer %r cannot be parsed; every response to it scores as wrong", reference)
    return tuple(objects)


def warm_up() -> None:
    """Load math-verify, the LaTeX grammar and sympy's lazy parts now, so the first real item is not slow."""
    _math_verify()


def _math_objects(parsed: list[Any]) -> list[Any]:
    # A bare string is math-verify's fallback for text it could not read; we never accept one as an answer.
    return [item for item in parsed if isinstance(item, _math_verify().math_types)]


def _equal(gold: tuple[Any, ...], predicted: list[Any]) -> bool:
    return bool(gold) and _math_verify().verify(list(gold), predicted, timeout_seconds=None)
