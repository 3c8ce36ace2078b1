"""The built-in arithmetic dataset: deterministic per (seed, index), exact integer answers, difficulty knobs."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.tiny_tokenizer import tiny_tokenizer

from rlinf_pipe.data import ArithmeticDataset, ArithmeticSpec, DataError, PromptRenderer

PROMPT = re.compile(r"What is (.+)\?")


def python_value(prompt: str) -> float:
    """Python's own evaluation of the expression (same precedence; true division)."""
    expression = PROMPT.fullmatch(prompt).group(1)
    assert re.fullmatch(r"[0-9()+\-*/ ]+", expression)
    return eval(expression)  # noqa: S307 - digits and operators only, checked above


def operands_of(prompt: str) -> list[int]:
    """Operands; negatives are written `(-4)`, and a binary minus is followed by a space."""
    return [int(v) for v in re.findall(r"-?\d+", PROMPT.fullmatch(prompt).group(1).replace("(", "").replace(")", ""))]


def test_default_spec_is_small_additions_and_subtractions():
    dataset = ArithmeticDataset(seed=1)
    assert dataset.size is None
    for item in dataset.take(50):
        value = python_value(item.prompt)
        assert item.answer == str(int(value)) and value == int(value)
        assert all(1 <= v <= 20 for v in operands_of(item.prompt))
        assert re.fullmatch(r"What is \d+ [+-] \d+\?", item.prompt)


def test_same_seed_same_items_other_seed_other_items():
    a, b, c = ArithmeticDataset(seed=7), ArithmeticDataset(seed=7), ArithmeticDataset(seed=8)
    assert a.take(20) == b.take(20)
    assert a[13] == b[13]  # random access: item 13 does not depend on earlier items
    assert [i.prompt for i in a.take(20)] != [i.prompt for i in c.take(20)]
    assert [i.id for i in a.take(3)] == ["arithmetic-7/0", "arithmetic-7/1", "arithmetic-7/2"]


def test_items_are_pinned():
    """Item i depends only on (seed, i) through a hash-based seed: the same in every process and run."""
    assert [(i.prompt, i.answer) for i in ArithmeticDataset(seed=1).take(3)] == [
        ("What is 3 + 16?", "19"), ("What is 16 + 14?", "30"), ("What is 5 - 10?", "-5"),
    ]
    spec = ArithmeticSpec(num_operands=4, operators="+-*/", min_value=-9, max_value=30)
    assert [(i.prompt, i.answer) for i in ArithmeticDataset(spec, seed=3).take(3)] == [
        ("What is 140 / 14 + 11 * 10?", "120"),
        ("What is 24 * 15 + (-3) - 23?", "334"),
        ("What is 10 - (-4) - (-2) - 8?", "8"),
    ]


specs = st.builds(
    ArithmeticSpec,
    min_value=st.integers(-50, 10),
    max_value=st.integers(11, 60),
    num_operands=st.integers(2, 5),
    operators=st.lists(st.sampled_from("+-*/"), min_size=1, max_size=4, unique=True).map(tuple).filter(
        lambda ops: ops != ("/",)
    ),
)


@settings(max_examples=60, deadline=None)
@given(specs, st.integers(0, 2**31), st.integers(0, 10_000))
def test_answers_are_exact_integers_and_knobs_hold(spec, seed, index):
    item = ArithmeticDataset(spec, seed=seed)[index]
    value = python_value(item.prompt)
    assert value == int(value) and item.answer == str(int(value))
    symbols = re.findall(r" ([+\-*/]) ", item.prompt)
    assert len(symbols) == spec.num_operands - 1 and set(symbols) <= set(spec.operators)
    assert "/ (0)" not in item.prompt and not re.search(r"/ 0\b", item.prompt)
    assert "/ " not in item.prompt or not re.search(r"/ \(?-?\d+\)? /", item.prompt)  # no chained divisions
    if "/" not in spec.operators:
        assert all(spec.min_value <= v <= spec.max_value for v in operands_of(item.prompt))


def test_sized_dataset_and_rendering():
    renderer = PromptRenderer(tiny_tokenizer(), "{prompt}")
    dataset = ArithmeticDataset(ArithmeticSpec(size=5), seed=0, renderer=renderer, max_prompt_length=64)
    assert dataset.size == len(dataset) == 5
    assert dataset[4].prompt_ids == renderer.encode(dataset[4].prompt)
    with pytest.raises(IndexError):
        dataset[5]
    with pytest.raises(TypeError, match="endless"):
        len(ArithmeticDataset())


def test_too_long_prompt_is_a_clear_error():
    renderer = PromptRenderer(tiny_tokenizer(), "{prompt}")
    dataset = ArithmeticDataset(ArithmeticSpec(num_operands=30), renderer=renderer, max_prompt_length=8)
    with pytest.raises(DataError, match="over data.max_prompt_length=8; raise it or lower data.arithmetic"):
        dataset[0]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"min_value": 5, "max_value": 1}, "min_value 5 is above max_value 1"),
        ({"num_operands": 1}, "num_operands must be >= 2"),
        ({"operators": ("+", "%")}, "unknown ['%']"),
        ({"operators": ()}, "empty"),
        ({"operators": "/", "num_operands": 3}, "`/` as the only operator"),
        ({"operators": "/", "min_value": 0, "max_value": 0}, "nonzero operand"),
        ({"size": 0}, "size must be >= 1"),
    ],
)
def test_bad_knobs(kwargs, fragment):
    with pytest.raises(DataError) as info:
        ArithmeticSpec(**kwargs)
    assert fragment in str(info.value)


def test_operators_accept_a_string_or_a_list():
    assert ArithmeticSpec(operators="+ - *").operators == ("+", "-", "*")
    assert ArithmeticSpec(operators=["*", "/"]).operators == ("*", "/")  # type: ignore[arg-type]
