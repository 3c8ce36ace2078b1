"""One dataset record -> an unrendered `PromptItem`, under the file's `RecordSchema` (`rlinf_pipe.data.schemas`).

The prompt is a non-empty string, or a list of chat messages (`{"role": ..., "content": ...}` objects, at least one
from the user), kept as given for the tokenizer's chat template. The answer is a string or a number, or a
non-empty list of them (several reference answers: a response is correct when it matches any); each is parsed with
`data.answer_format`. `data_source` and `extra_info` are taken from the record when it has them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rlinf_pipe.data.answers import AnswerFormat, parse_reference_answer
from rlinf_pipe.data.errors import AnswerParseError, DataError
from rlinf_pipe.data.schemas import RecordSchema, lookup
from rlinf_pipe.data.structs import ChatMessage, PromptItem

Record = Mapping[str, Any]


def record_to_item(record: Record, schema: RecordSchema, *, name: str, number: int,
                   answer_format: AnswerFormat = "auto") -> PromptItem:
    """One record -> an unrendered PromptItem (`id` = `{name}/{number}`, `data_source` = `name` when the record has
    none). Raises DataError naming the problem."""
    keys = ", ".join(map(str, record)) or "none"
    prompt_key, answer_key = schema.prompt_key(record), schema.answer_key(record)
    if prompt_key is None:
        raise DataError(f"missing prompt key {_names(schema.prompt_keys)} (record keys: {keys})" + _of(schema))
    if answer_key is None:
        raise DataError(f"missing answer key {_names(schema.answer_keys)} (record keys: {keys})" + _of(schema))
    prompt, messages = read_prompt(lookup(record, prompt_key), prompt_key)
    stored = lookup(record, answer_key)
    references = read_references(stored, answer_key, answer_format)
    source = record.get("data_source")
    extra = record.get("extra_info")
    return PromptItem(
        id=f"{name}/{number}", prompt=prompt, answer=references[0], index=number, messages=messages,
        answers=references if len(references) > 1 else (),
        data_source=name if source is None else str(source),
        extra_info="" if extra is None else to_json_text(extra),
        ground_truth=to_json_text(stored) if schema.stored_ground_truth else "",
    )


def read_prompt(value: Any, key: str) -> tuple[str, tuple[ChatMessage, ...]]:
    """(prompt text, chat messages) of a prompt field: a string gives no messages; a list of messages gives the last
    user message's content as the text."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"prompt {key!r} is empty")
        return value, ()
    if not isinstance(value, (list, tuple)):
        raise DataError(f"prompt {key!r} must be a string or a list of chat messages, got {type(value).__name__}")
    if not value:
        raise DataError(f"prompt {key!r} is an empty list of chat messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or "content" not in message:
            raise DataError(f"prompt {key!r} message [{i}] must be an object with string `role` and `content`, got "
                            f"{_short(message)}")
        if not isinstance(message["content"], str):
            raise DataError(f"prompt {key!r} message [{i}] content must be a string (text prompts only), got "
                            f"{type(message['content']).__name__}")
        messages.append(ChatMessage(message["role"], message["content"]))
    users = [m.content for m in messages if m.role == "user"]
    if not users or not any(u.strip() for u in users):
        raise DataError(f"prompt {key!r} has no user message with content (roles: "
                        f"{', '.join(m.role for m in messages)})")
    return users[-1], tuple(messages)


def read_references(value: Any, key: str, answer_format: AnswerFormat) -> tuple[str, ...]:
    """The parsed reference answers of an answer field: one for a string or number, one each for a list's items."""
    many = isinstance(value, (list, tuple))
    values = list(value) if many else [value]
    if many and not values:
        raise DataError(f"answer {key!r} is an empty list")
    parsed = []
    for i, item in enumerate(values):
        where = f"answer {key!r}" + (f" [{i}]" if many else "")
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            item = str(item)
        if not isinstance(item, str):
            kind = "a string, a number or a list of them" if not many else "a string or a number"
            raise DataError(f"{where} must be {kind}, got {type(item).__name__}")
        try:
            parsed.append(parse_reference_answer(item, answer_format))
        except AnswerParseError as exc:
            raise DataError(f"{where}: {exc}") from None
    return tuple(parsed)


def to_json_text(value: Any) -> str:
    """A record's value as compact JSON text (what travels with the item; values JSON lacks become strings)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _names(keys: tuple[str, ...]) -> str:
    return " / ".join(map(repr, keys))


def _of(schema: RecordSchema) -> str:
    return "" if schema.name == "custom" else f"; the file's records are {schema.name} records"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

