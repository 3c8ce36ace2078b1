"""Reference-answer parsing: GSM8K `####`, MATH `\\boxed{}`, plain; malformed answers raise AnswerParseError."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlinf_pipe.data import AnswerParseError, parse_boxed_answer, parse_reference_answer

GOOD = [
    # (text, format, expected)
    ("Janet sells 9 eggs.\nShe makes 9 * 2 = $18.\n#### 18", "auto", "18"),
    ("#### 72", "gsm8k", "72"),
    ("so the total is\n#### 1,000", "auto", "1000"),
    ("#### 12,345,678", "auto", "12345678"),
    ("#### -2,500.50", "auto", "-2500.50"),
    ("#### 3,4", "auto", "3,4"),  # not a thousands separator: kept
    ("#### 7  ", "auto", "7"),
    ("The answer is $\\boxed{5}$.", "auto", "5"),
    ("\\boxed{\\frac{1}{2}}", "boxed", "\\frac{1}{2}"),
    ("first \\boxed{1} then \\boxed{ 2 }", "auto", "2"),  # the last box
    ("\\boxed {x^{2}+1}", "auto", "x^{2}+1"),
    ("\\boxed{\\{1, 2\\}}", "auto", "\\{1, 2\\}"),  # escaped braces do not nest
    ("\\fbox{42}", "auto", "42"),
    ("72", "auto", "72"),
    ("  x = 3 \n", "auto", "x = 3"),
    ("line one\nline two", "plain", "line one\nline two"),
]

BAD = [
    ("#### ", "auto", "nothing after"),
    ("no marker here", "gsm8k", "no `####`"),
    ("\\boxed{1 + {2}", "auto", "unbalanced"),
    ("\\boxed{}", "auto", "empty"),
    ("\\boxed 5", "auto", "not followed by"),
    ("no box", "boxed", "no \\boxed"),
    ("   ", "auto", "empty"),
    ("step one\nstep two", "auto", "several lines"),
]


@pytest.mark.parametrize(("text", "fmt", "expected"), GOOD)
def test_answers_parse(text, fmt, expected):
    assert parse_reference_answer(text, fmt) == expected


@pytest.mark.parametrize(("text", "fmt", "fragment"), BAD)
def test_malformed_answers_raise(text, fmt, fragment):
    with pytest.raises(AnswerParseError) as info:
        parse_reference_answer(text, fmt)
    assert fragment in str(info.value)


def test_non_string_and_unknown_format():
    with pytest.raises(AnswerParseError, match="must be a string"):
        parse_reference_answer(72)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown answer format"):
        parse_reference_answer("1", "latex")  # type: ignore[arg-type]


balanced = st.recursive(
    st.text(alphabet="abc123+-^ ", max_size=5),
    lambda inner: st.builds(lambda a, b: a + "{" + b + "}", inner, inner),
    max_leaves=8,
)


@given(balanced.filter(lambda s: s.strip()), st.text(alphabet="xyz .", max_size=5))
def test_boxed_returns_its_balanced_contents(inner, suffix):
    assert parse_boxed_answer(f"so \\boxed{{{inner}}}{suffix}") == inner.strip()
