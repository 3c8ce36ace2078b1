"""verify_math / score / extract_answer: a verdict table (what math-verify really decides, after our extraction and
unicode normalisation), reward values, the format reward, and the in-process deadline."""

from __future__ import annotations

import signal
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlinf_pipe.engines.reward import ScoreConfig, ScoreResult, extract_answer, score, verify_math
from rlinf_pipe.engines.reward.verify import quick_score
from rlinf_pipe.utils.latex import last_boxed
from rlinf_pipe.engines.reward.deadline import VerifyTimeout, deadline
from rlinf_pipe.errors import ConfigError

# (response, reference, expected verdict)
VERDICTS = [
    # plain integers and close-looking wrong answers
    ("\\boxed{72}", "72", True),
    ("So the total is \\boxed{72}.", "72", True),
    ("\\boxed{73}", "72", False),
    ("\\boxed{72.0}", "72", True),
    ("\\boxed{72.01}", "72", False),
    ("\\boxed{100000000000000000001}", "100000000000000000000", False),
    # several boxes: the last one wins; nested boxes read the innermost
    ("First \\boxed{3}, but on reflection \\boxed{4}", "4", True),
    ("First \\boxed{3}, but on reflection \\boxed{4}", "3", False),
    ("\\boxed{\\boxed{5}}", "5", True),
    # nested braces, fractions vs decimals, LaTeX forms
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", True),
    ("\\boxed{\\frac34}", "3/4", True),
    ("\\boxed{1/2}", "0.5", True),
    ("\\boxed{0.5}", "1/2", True),
    ("\\boxed{0.333333}", "\\frac{1}{3}", True),  # math-verify compares floats to 6 decimals
    ("\\boxed{0.33}", "\\frac{1}{3}", False),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{1}{2}\\sqrt{3}", True),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", True),
    ("\\boxed{1.414}", "\\sqrt{2}", False),
    ("\\boxed{3.14}", "\\pi", False),
    ("\\boxed{2\\frac{1}{2}}", "2.5", True),  # a mixed number
    # unicode: normalised before parsing (see docs/reward.md)
    ("\\boxed{½}", "0.5", True),
    ("\\boxed{2½}", "\\frac{5}{2}", True),
    ("\\boxed{−3}", "-3", True),  # U+2212 minus sign
    ("\\boxed{−3}", "3", False),
    ("\\boxed{７２}", "72", True),  # full-width digits
    ("\\boxed{１，２３４}", "1234", True),  # full-width digits and comma
    ("\\boxed{√2}", "\\sqrt{2}", True),
    ("\\boxed{π}", "\\pi", True),
    ("\\boxed{x²+1}", "x^2+1", True),
    ("\\boxed{90°}", "90", True),
    # thousands separators
    ("\\boxed{1,234}", "1234", True),
    ("\\boxed{1,234,567}", "1234567", True),
    ("\\boxed{1{,}234}", "1234", True),
    ("\\boxed{1\\,234}", "1234", True),
    ("\\boxed{1 234}", "1234", True),
    ("\\boxed{1,234}", "1243", False),
    ("\\boxed{\\$1,000}", "1000", True),
    # percentages: math-verify accepts the number with or without the percent sign, or as a fraction
    ("\\boxed{18\\%}", "18%", True),
    ("\\boxed{18}", "18%", True),
    ("\\boxed{0.18}", "18%", True),
    ("\\boxed{18\\%}", "0.18", True),
    ("\\boxed{81\\%}", "18%", False),
    # negative numbers
    ("\\boxed{-5}", "-5", True),
    ("\\boxed{5}", "-5", False),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", True),
    # LaTeX wrappers and units
    ("\\boxed{\\text{72}}", "72", True),
    ("\\boxed{\\textbf{72}}", "72", True),
    ("\\boxed{72\\text{ cm}}", "72", True),
    ("$\\boxed{72}$", "72", True),
    ("\\boxed{$72$}", "72", True),
    ("\\boxed{\\$72.00}", "72", True),
    ("\\boxed{x = 5}", "5", True),
    # garbage, empty, missing or truncated answers
    ("", "72", False),
    ("I do not know.", "72", False),
    ("The answer is 72", "72", False),  # no box and no answer_pattern
    ("\\boxed{}", "72", False),
    ("\\boxed{72", "72", False),  # truncated: the unclosed last box is no answer
    ("\\boxed{4} then \\boxed{72", "4", False),  # ... and an earlier box does not stand in for it
    ("\\boxed{@@@}", "72", False),
    ("\\boxed{hello}", "72", False),
    ("\\boxed{\\frac{1}{0}}", "1", False),
    # huge numbers that are cheap to compare
    ("\\boxed{2^{100}}", "1267650600228229401496703205376", True),
    ("\\boxed{10^{100}}", "10^{100}+1", False),
    ("\\boxed{1e3}", "1000", True),
    ("\\boxed{2.5E-3}", "0.0025", True),
    # sets, tuples, intervals, expressions, references given boxed
    ("\\boxed{3, 4}", "4, 3", True),
    ("\\boxed{(3, 4)}", "(4, 3)", False),
    ("\\boxed{\\infty}", "\\infty", True),
    ("\\boxed{x+1}", "1+x", True),
    ("\\boxed{2x+2}", "2(x+1)", True),
    ("\\boxed{72}", "\\boxed{72}", True),
    ("\\boxed{72}", "", False),  # an unparseable reference fails every response
]


@pytest.mark.parametrize("response, reference, expected", VERDICTS)
def test_verdict_table(response: str, reference: str, expected: bool) -> None:
    assert verify_math(response, reference) is expected


def test_table_is_large_and_mixed() -> None:
    verdicts = [expected for _, _, expected in VERDICTS]
    assert len(VERDICTS) >= 50 and verdicts.count(False) >= 20


@pytest.mark.parametrize(
    "response, pattern, expected",
    [
        ("... 8 + 64 = 72\n#### 72", "#### (.*)", "72"),
        ("#### 1,234", "#### (.*)", "1,234"),
        ("The answer is 72.", "The answer is (.*)", "72"),
        ("The answer is 5. Wait. The answer is 6.", "The answer is (.*?)\\.", "6"),  # last match
        ("The answer is \\boxed{9}. #### 8", "#### (.*)", "9"),  # a box wins over the pattern
        ("no marker at all", "#### (.*)", None),
        ("#### 72", "####", "####"),  # no group: the whole match
        ("\\boxed{ 3 }", None, "3"),
        ("\\boxed{\\{1, 2\\}}", None, "\\{1, 2\\}"),  # escaped braces do not close the box
        ("\\fbox{7}", None, "7"),
        ("\\boxed   {8}", None, "8"),
        ("\\boxed{   }", None, None),
    ],
)
def test_extract_answer(response: str, pattern: str | None, expected: str | None) -> None:
    assert extract_answer(response, pattern) == expected


def test_answer_pattern_scores_responses_without_a_box() -> None:
    assert verify_math("#### 1,234", "1234", answer_pattern="#### (.*)")
    assert not verify_math("#### 1,234", "1234")
    assert verify_math("The answer is $\\frac{1}{2}$.", "0.5", answer_pattern="The answer is (.*)")


def test_reward_values_and_parse_failures_are_distinct() -> None:
    config = ScoreConfig(correct_score=1.0, wrong_score=-1.0)
    assert score("\\boxed{72}", "72", config) == ScoreResult(True, True, False, 1.0, "72")
    assert score("\\boxed{71}", "72", config) == ScoreResult(False, True, False, -1.0, "71")
    assert score("no answer", "72", config) == ScoreResult(False, False, False, -1.0, None)
    assert score("\\boxed{@@@}", "72", config) == ScoreResult(False, False, False, -1.0, "@@@")


def test_format_score_is_added_when_an_answer_is_stated() -> None:
    config = ScoreConfig(correct_score=1.0, wrong_score=0.0, format_score=0.1)
    assert score("\\boxed{72}", "72", config).reward == pytest.approx(1.1)
    assert score("\\boxed{71}", "72", config).reward == pytest.approx(0.1)
    assert score("\\boxed{@@@}", "72", config).reward == pytest.approx(0.1)  # boxed, though unreadable
    assert score("72", "72", config).reward == 0.0
    # a penalty for a missing answer is the same rule with shifted values
    penalty = ScoreConfig(correct_score=0.0, wrong_score=-1.0, format_score=1.0)
    assert [score(r, "72", penalty).reward for r in ("\\boxed{72}", "\\boxed{1}", "72")] == [1.0, 0.0, -1.0]


def test_invalid_answer_pattern_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="reward.answer_pattern"):
        ScoreConfig(answer_pattern="#### (")


def test_a_deadline_in_the_main_thread_scores_a_timed_out_wrong_answer(monkeypatch) -> None:
    """The comparison stands for a power tower's: Python-level work that only the deadline ends. (A real tower can
    also land inside one C-level power that no signal interrupts; the reward pool kills the process then,
    tests/unit/test_reward_pool.py.)"""
    from rlinf_pipe.engines.reward import verify

    def spin(*_: object) -> bool:
        while True:
            pass

    monkeypatch.setattr(verify, "_equal", spin)
    result = score("\\boxed{9^{9^{9^{9}}}}", "72", timeout_s=0.3)  # (the comparison never returns by itself)
    assert result == ScoreResult(False, False, True, 0.0, "9^{9^{9^{9}}}")


def test_deadline_restores_an_outer_timer() -> None:
    fired = []
    outer_handler, outer_timer = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
    signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        with deadline(0.5):
            pass
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 20.0 < left <= 30.0  # (restored, not reset: the 30 s timer, less what a busy host took meanwhile)
    finally:
        signal.signal(signal.SIGALRM, outer_handler)  # pytest-timeout's alarm, if it runs one
        signal.setitimer(signal.ITIMER_REAL, *outer_timer)
    assert not fired


def test_deadline_interrupts_python_code() -> None:
    with pytest.raises(VerifyTimeout), deadline(0.05):
        while True:
            pass


def test_outside_the_main_thread_scoring_works_without_a_deadline() -> None:
    results: list[ScoreResult] = []
    thread = threading.Thread(target=lambda: results.append(score("\\boxed{\\frac12}", "0.5", timeout_s=0.5)))
    thread.start()
    thread.join()
    assert results == [ScoreResult(True, True, False, 1.0, "\\frac12")]


_DIGITS = st.text("0123456789", min_size=1, max_size=22)
_INTEGER_TEXT = st.builds(lambda sign, digits: sign + digits, st.sampled_from(["", "-", "\u2212", "+"]), _DIGITS)
_ANSWER_TEXT = st.one_of(
    _INTEGER_TEXT,
    _INTEGER_TEXT.map(lambda t: t + "."),  # a sentence's full stop
    _INTEGER_TEXT.map(lambda t: t.translate({ord(d): 0xFF10 + int(d) for d in "0123456789"})),  # full width
    st.builds(lambda a, b: f"{a} {b:03d}", st.integers(1, 999), st.integers(0, 999)),  # spaced thousands
    st.sampled_from(["", " ", "72.0", "1,000", "\\frac{1}{2}", "x = 5", "3/4", "1e3", "٣"]),
)
_RESPONSE = st.one_of(
    st.builds(lambda before, answer: f"{before} \\boxed{{{answer}}}", st.text(max_size=12), _ANSWER_TEXT),
    st.text(max_size=20),  # (mostly no box)
    _ANSWER_TEXT.map(lambda a: "\\boxed{" + a),  # truncated
)
_REFERENCE = st.one_of(_INTEGER_TEXT, st.sampled_from(["72", " 72 ", "0", "-0", "007", "1,000", "3/4", "72.0",
                                                       "\\boxed{72}"]))


def _same_or_near(n: int, zeros: int, offset: int) -> tuple[str, str]:
    """A boxed answer and a reference for the same integer (or one `offset` away), written differently."""
    answer = ("-" if n < 0 else "") + "0" * zeros + str(abs(n + offset))
    return f"so \\boxed{{{answer}}}", str(n)


_PAIR = st.one_of(st.tuples(_RESPONSE, _REFERENCE),
                  st.builds(_same_or_near, st.integers(-10**25, 10**25), st.integers(0, 3), st.sampled_from([0, 1])))


@settings(max_examples=400, deadline=None)
@given(_PAIR, st.sampled_from([None, "#### (.*)"]))
def test_quick_score_gives_scores_verdict_whenever_it_decides(pair, pattern):
    """The reward pool scores what `quick_score` decides in the caller, without sympy: whenever it decides, its
    result is exactly `score`'s (math-verify's); it leaves to the pool what it cannot decide, and every answer
    found by a user's pattern."""
    response, reference = pair
    cfg = ScoreConfig(correct_score=1.0, wrong_score=-0.5, format_score=0.25, answer_pattern=pattern)
    quick = quick_score(response, reference, cfg)
    if quick is not None:
        assert quick == score(response, reference, cfg), (response, reference)
        if pattern is not None:
            assert last_boxed(response) is not None  # (no box: the pattern's answer, which the pool scores)


def test_quick_score_decides_the_arithmetic_tasks_answers():
    cfg = ScoreConfig()
    assert quick_score("so \\boxed{-12}", "-12", cfg) == ScoreResult(True, True, False, 1.0, "-12")
    assert quick_score("so \\boxed{13}.", "12", cfg) == ScoreResult(False, True, False, 0.0, "13")
    assert quick_score("no answer", "12", cfg) == ScoreResult(False, False, False, 0.0)
    assert quick_score("\\boxed{3/4}", "0.75", cfg) is None  # (sympy's part)


R1_FINISHED = "Let me see, maybe \\boxed{4}? No: 2+3 is 5.\n</think>\n\nThe sum is \\boxed{5}."
R1_CUT_OFF = "Let me see, maybe \\boxed{5}? Hmm, wait, let me double check that again and again"


@pytest.mark.parametrize(("response", "thinking", "answer"), [
    (R1_FINISHED, "auto", "5"),  # only the text after the reasoning: the floated guess 4 does not count
    (R1_FINISHED, "closed", "5"),
    ("<think>" + R1_FINISHED, "auto", "5"),  # a model that opens the block itself (Qwen3)
    ("<think>" + R1_CUT_OFF, "auto", None),  # opened, never closed: cut off while reasoning
    (R1_CUT_OFF, "closed", None),  # the prompt opened it (DeepSeek-R1's template): the same
    (R1_CUT_OFF, "auto", "5"),  # no tags at all, prompts that open none: the whole response
    (R1_CUT_OFF, "ignore", "5"),
    ("</think> then \\boxed{4}", "ignore", "4"),
])
def test_reasoning_blocks_decide_where_the_answer_can_be(response, thinking, answer):
    assert extract_answer(response, thinking=thinking) == answer
    result = score(response, "5", ScoreConfig(thinking=thinking))
    assert result.correct == (answer == "5") and result.parsed == (answer is not None)
    quick = quick_score(response, "5", ScoreConfig(thinking=thinking))
    assert quick is not None and (quick.correct, quick.parsed) == (result.correct, result.parsed)


def test_auto_becomes_closed_for_prompts_that_open_a_reasoning_block():
    from rlinf_pipe.engines.reward.extract import thinking_for

    r1 = "<｜begin▁of▁sentence｜>Please reason step by step.<｜User｜>1 + 1<｜Assistant｜><think>\n"
    assert thinking_for("auto", r1) == "closed"
    assert thinking_for("auto", "<|im_start|>user\n1 + 1<|im_end|>\n<|im_start|>assistant\n") == "auto"
    assert thinking_for("auto", "<think>\n\n</think>\n\n") == "auto"  # a template that closes it (no reasoning)
    assert thinking_for("ignore", r1) == "ignore"  # the user's choice stays
    with pytest.raises(ConfigError, match="reward.thinking: 'sometimes' is not one of auto, closed, ignore"):
        ScoreConfig(thinking="sometimes")
