"""Record schemas of dataset files: which field of a record holds the prompt and which the reference answer(s).

Detected per file from its first record that matches one (config `data.prompt_key` / `data.answer_key`: `auto`):

- `verl`: `prompt` (chat messages) and `reward_model.ground_truth`, with `data_source` and `extra_info` beside them
  (the layout verl's preprocessing scripts write);
- `rlinf-math`: `prompt` and `answer`, or `prompt` and a `solutions` list (correct when any matches);
- `question-answer`: `question` or `problem`, and `answer` or `solution`.

An explicit key replaces that field of the schema (and only the other field is detected); two explicit keys make
the `custom` schema, with no detection.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

AUTO = "auto"
MISSING: Any = object()


@dataclass(frozen=True)
class RecordSchema:
    """Where a schema keeps the prompt and the reference answer: the first key of each tuple that a record has.
    `stored_ground_truth`: reward functions receive the answer field as stored (verl's `ground_truth`), not the
    parsed reference answer(s)."""

    name: str
    prompt_keys: tuple[str, ...]
    answer_keys: tuple[str, ...]
    stored_ground_truth: bool = False

    def prompt_key(self, record: Mapping[str, Any]) -> str | None:
        """The first of `prompt_keys` the record has, or None."""
        return next((k for k in self.prompt_keys if lookup(record, k) is not MISSING), None)

    def answer_key(self, record: Mapping[str, Any]) -> str | None:
        """The first of `answer_keys` the record has, or None."""
        return next((k for k in self.answer_keys if lookup(record, k) is not MISSING), None)

    def matches(self, record: Mapping[str, Any]) -> bool:
        """Whether the record has a prompt field and an answer field of this schema."""
        return self.prompt_key(record) is not None and self.answer_key(record) is not None

    def describe(self) -> str:
        """The schema's name and fields: `rlinf-math schema (prompt `prompt`, answer `answer` / `solutions`)`."""
        fields = f"prompt `{'` / `'.join(self.prompt_keys)}`, answer `{'` / `'.join(self.answer_keys)}`"
        return f"{self.name} schema ({fields}{', data_source, extra_info' if self.name == 'verl' else ''})"


VERL = RecordSchema("verl", ("prompt",), ("reward_model.ground_truth",), stored_ground_truth=True)
RLINF_MATH = RecordSchema("rlinf-math", ("prompt",), ("answer", "solutions"))
QUESTION_ANSWER = RecordSchema("question-answer", ("question", "problem"), ("answer", "solution"))
SCHEMAS: tuple[RecordSchema, ...] = (VERL, RLINF_MATH, QUESTION_ANSWER)
EXPECTED = ("verl's (`prompt` chat messages + `reward_model.ground_truth`), RLinf's math (`prompt` + `answer` or "
            "a `solutions` list) or `question`/`problem` + `answer`/`solution`")


def lookup(record: Mapping[str, Any], key: str) -> Any:
    """`record[key]`; a dotted key (`extra.question`) walks nested objects when the literal key is absent. MISSING
    when there is no such field."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return MISSING
        value = value[part]
    return value


class SchemaDetector:
    """The schema of one file under the configured keys: fixed by the first record that matches a schema (or at
    once, when both keys are explicit)."""

    def __init__(self, prompt_key: str = AUTO, answer_key: str = AUTO):
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.schema: RecordSchema | None = None
        if prompt_key != AUTO and answer_key != AUTO:
            self.schema = RecordSchema("custom", (prompt_key,), (answer_key,))

    def candidates(self) -> tuple[RecordSchema, ...]:
        """The schemas with the explicit keys put in."""
        out = []
        for schema in SCHEMAS:
            if self.prompt_key != AUTO:
                schema = replace(schema, prompt_keys=(self.prompt_key,))
            if self.answer_key != AUTO:
                schema = replace(schema, answer_keys=(self.answer_key,), stored_ground_truth=False)
            out.append(schema)
        return tuple(out)

    def schema_of(self, record: Mapping[str, Any]) -> RecordSchema | None:
        """The file's schema, detected from this record if not yet known; None if the record matches none."""
        if self.schema is None:
            self.schema = next((s for s in self.candidates() if s.matches(record)), None)
        return self.schema

    def no_match(self, record: Mapping[str, Any]) -> str:
        """Why a record fixes no schema: what it has and what was expected."""
        keys = ", ".join(map(str, record)) or "none"
        if self.prompt_key == AUTO and self.answer_key == AUTO:
            return (f"matches no known record schema (record keys: {keys}); expected {EXPECTED}, or set "
                    "data.prompt_key / data.answer_key to its fields")
        for field, key in (("prompt", self.prompt_key), ("answer", self.answer_key)):
            if key != AUTO and lookup(record, key) is MISSING:
                return f"missing {field} key {key!r} (record keys: {keys})"
        field = "answer" if self.answer_key == AUTO else "prompt"
        wanted = dict.fromkeys(k for s in SCHEMAS for k in (s.answer_keys if field == "answer" else s.prompt_keys))
        return (f"no {field} field among `{'` / `'.join(wanted)}` (record keys: {keys}); set data.{field}_key to "
                f"the field that holds the {'reference answer' if field == 'answer' else 'problem'}")
