"""A procedural arithmetic dataset: `What is 7 + 3 * 12?` with an exact integer answer.

Item `index` is generated from (seed, index) alone, so the dataset is random-access, deterministic across
processes and runs, and endless (`size=None`) or sized. Knobs (config `data.arithmetic.*`):

- `min_value`, `max_value`: operands are drawn uniformly from this inclusive range (negatives shown as `(-4)`)
- `num_operands`: operands per expression (>= 2)
- `operators`: any of `+ - * /`, drawn uniformly. Usual precedence applies. Division is always exact: the
  dividend is replaced by divisor x quotient (so it may exceed `max_value`), a divisor is never 0, and two
  divisions never follow each other.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

import msgspec

from rlinf_pipe.data.errors import DataError
from rlinf_pipe.data.structs import PromptItem
from rlinf_pipe.data.templates import PromptRenderer

OPERATORS = ("+", "-", "*", "/")


def parse_operators(value: str | Iterable[str]) -> tuple[str, ...]:
    """`"+-*"` or `["+", "-", "*"]` -> ("+", "-", "*")."""
    return tuple(value.replace(" ", "").replace(",", "")) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class ArithmeticSpec:
    """Difficulty knobs of the generator (see the module docstring). `size` None: endless."""

    min_value: int = 1
    max_value: int = 20
    num_operands: int = 2
    operators: tuple[str, ...] | str = ("+", "-")
    size: int | None = None

    def __post_init__(self) -> None:
        ops = parse_operators(self.operators)
        object.__setattr__(self, "operators", ops)
        if self.min_value > self.max_value:
            raise DataError(f"data.arithmetic: min_value {self.min_value} is above max_value {self.max_value}")
        if self.num_operands < 2:
            raise DataError(f"data.arithmetic.num_operands must be >= 2, got {self.num_operands}")
        bad = [op for op in ops if op not in OPERATORS]
        if not ops or bad:
            raise DataError(
                f"data.arithmetic.operators {list(ops)}: " + (f"unknown {bad}; " if bad else "empty; ")
                + f"choose from {list(OPERATORS)}"
            )
        if "/" in ops and self.min_value == self.max_value == 0:
            raise DataError("data.arithmetic: division needs a nonzero operand in [min_value, max_value]")
        if set(ops) == {"/"} and self.num_operands > 2:
            raise DataError(
                "data.arithmetic: with `/` as the only operator num_operands must be 2 (divisions never follow "
                "each other); add another operator"
            )
        if self.size is not None and self.size < 1:
            raise DataError(f"data.arithmetic.size must be >= 1 or null (endless), got {self.size}")


@dataclass(frozen=True)
class Problem:
    expression: str
    answer: int


def _operand(value: int) -> str:
    return f"({value})" if value < 0 else str(value)


def evaluate(operands: list[int], operators: list[str]) -> Fraction:
    """Exact value of `o0 op0 o1 op1 ...` with * and / binding tighter than + and -."""
    total, term = Fraction(0), Fraction(operands[0])
    sign = 1
    for op, value in zip(operators, operands[1:], strict=True):
        if op == "*":
            term *= value
        elif op == "/":
            term /= value
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), Fraction(value)
    return total + sign * term


def generate_problem(spec: ArithmeticSpec, rng: random.Random) -> Problem:
    """One expression and its exact integer value."""
    lo, hi = spec.min_value, spec.max_value
    operators: list[str] = []
    for _ in range(spec.num_operands - 1):
        choices = [op for op in spec.operators if not (op == "/" and operators and operators[-1] == "/")]
        operators.append(rng.choice(choices))
    operands = [rng.randint(lo, hi) for _ in range(spec.num_operands)]
    for i, op in enumerate(operators):
        if op == "/":
            divisor = 0
            while divisor == 0:
                divisor = rng.randint(lo, hi)
            operands[i + 1] = divisor
            operands[i] = divisor * rng.randint(lo, hi)  # dividend = divisor x quotient: exact division
    value = evaluate(operands, operators)
    if value.denominator != 1:  # cannot happen: every division's left side is a multiple of its divisor
        raise AssertionError(f"non-integer arithmetic problem {operands} {operators}")
    pieces = [_operand(operands[0])]
    for op, value_ in zip(operators, operands[1:], strict=True):
        pieces += [op, _operand(value_)]
    return Problem(" ".join(pieces), int(value))


class ArithmeticDataset:
    """Endless (or `spec.size`-long) arithmetic prompts; item i depends only on (seed, i).

    With a renderer, items come with `prompt_ids`; a prompt over `max_prompt_length` tokens raises DataError
    (dropping it would break random access; arithmetic prompts are short).
    """

    def __init__(
        self,
        spec: ArithmeticSpec | None = None,
        seed: int = 0,
        renderer: PromptRenderer | None = None,
        max_prompt_length: int | None = None,
        name: str = "arithmetic",
    ):
        self.spec, self.seed, self.renderer, self.max_prompt_length, self.name = (
            spec or ArithmeticSpec(), seed, renderer, max_prompt_length, name,
        )

    @property
    def size(self) -> int | None:
        return self.spec.size

    def problem(self, index: int) -> Problem:
        """The expression and answer at `index`."""
        if index < 0 or (self.size is not None and index >= self.size):
            raise IndexError(f"{self.name}: index {index} out of range (size {self.size})")
        return generate_problem(self.spec, random.Random(f"{self.name}:{self.seed}:{index}"))

    def __getitem__(self, index: int) -> PromptItem:
        problem = self.problem(index)
        prompt = f"What is {problem.expression}?"
        item = PromptItem(id=f"{self.name}-{self.seed}/{index}", prompt=prompt, answer=str(problem.answer), index=index,
                          data_source="arithmetic")
        if self.renderer is None:
            return item
        ids = self.renderer.encode(prompt)
        if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
            raise DataError(
                f"{self.name}: prompt {index} ({prompt!r}) has {len(ids)} tokens, over data.max_prompt_length="
                f"{self.max_prompt_length}; raise it or lower data.arithmetic.num_operands / max_value"
            )
        return msgspec.structs.replace(item, prompt_ids=ids)

    def __len__(self) -> int:
        if self.size is None:
            raise TypeError(f"{self.name} is endless (data.arithmetic.size is null); it has no length")
        return self.size

    def take(self, count: int, start: int = 0) -> list[PromptItem]:
        """Items start .. start+count-1."""
        return [self[i] for i in range(start, start + count)]
