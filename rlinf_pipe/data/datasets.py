"""Math prompt datasets from files: records -> PromptItems, malformed-record handling, prompt-length filtering.

Every dataset the sampler draws from satisfies `PromptDataset`: random access by index, and a `size` that is
None for an endless generator (see `rlinf_pipe.data.arithmetic`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec

from rlinf_pipe.data.answers import ANSWER_FORMATS, AnswerFormat
from rlinf_pipe.data.errors import DataError, MalformedDataError, RecordIssue
from rlinf_pipe.data.record_items import record_to_item
from rlinf_pipe.data.records import iter_records
from rlinf_pipe.data.schemas import AUTO, SCHEMAS, SchemaDetector
from rlinf_pipe.data.structs import PromptItem
from rlinf_pipe.data.templates import PromptRenderer

log = logging.getLogger(__name__)


@runtime_checkable
class PromptDataset(Protocol):
    """Prompts by index. `size`: number of items, or None when every index >= 0 is valid (endless)."""

    name: str

    @property
    def size(self) -> int | None: ...

    def __getitem__(self, index: int) -> PromptItem: ...


@dataclass(frozen=True)
class LoadReport:
    """What loading a file did: records read, malformed records skipped, over-long prompts dropped."""

    source: str
    num_records: int
    skipped: tuple[RecordIssue, ...] = ()
    num_too_long: int = 0
    schema: str = ""  # the record schema detected (`RecordSchema.describe`); "" when no record matched one
    chat_prompts: int = 0  # prompts given as chat messages (rendered with the tokenizer's chat template)

    @property
    def num_loaded(self) -> int:
        return self.num_records - len(self.skipped) - self.num_too_long

    def summary(self) -> str:
        chat = f" with {self.chat_prompts} chat-message prompts" if self.chat_prompts else ""
        schema = f"{self.schema}{chat}; " if self.schema else ""
        return (
            f"{self.source}: {schema}{self.num_loaded} prompts from {self.num_records} records "
            f"({len(self.skipped)} malformed skipped, {self.num_too_long} over the prompt-length limit dropped)"
        )


class FileDataset:
    """A loaded, finite list of prompts (see `load_prompt_dataset`)."""

    def __init__(self, name: str, items: Sequence[PromptItem], report: LoadReport):
        self.name, self.items, self.report = name, list(items), report

    @property
    def size(self) -> int:
        return len(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]


def read_prompt_items(
    path: str | Path,
    *,
    name: str | None = None,
    prompt_key: str = AUTO,
    answer_key: str = AUTO,
    answer_format: AnswerFormat = "auto",
    skip_malformed: bool = False,
) -> tuple[list[PromptItem], LoadReport]:
    """Read every record of a file into unrendered PromptItems (index = record number).

    The record schema is detected from the first record that matches one (`rlinf_pipe.data.schemas`; an explicit
    `prompt_key` / `answer_key` replaces that field). Malformed records raise MalformedDataError listing the first
    problems, or with `skip_malformed` are skipped, counted in the report and logged.
    """
    if answer_format not in ANSWER_FORMATS:
        raise DataError(f"data.answer_format {answer_format!r} is unknown; choose one of {', '.join(ANSWER_FORMATS)}")
    path = Path(path)
    name = name or path.stem
    detector = SchemaDetector(prompt_key, answer_key)
    items: list[PromptItem] = []
    issues: list[RecordIssue] = []
    number = 0
    explicit = [key for key in (prompt_key, answer_key) if key != AUTO]
    records = iter_records(path, _columns(explicit), explicit)
    for number, (location, record) in enumerate(records, start=1):
        if isinstance(record, RecordIssue):
            issues.append(record)
            continue
        schema = detector.schema_of(record)
        if schema is None:
            issues.append(RecordIssue(location, detector.no_match(record)))
            continue
        try:
            items.append(record_to_item(record, schema, name=name, number=number - 1, answer_format=answer_format))
        except DataError as exc:
            issues.append(RecordIssue(location, str(exc)))
    if issues and not skip_malformed:
        raise MalformedDataError(str(path), issues, number)
    if issues:
        log.warning(
            "%s: skipped %d malformed of %d records (data.skip_malformed=true); first: %s",
            path, len(issues), number, "; ".join(map(str, issues[:3])),
        )
    schema = detector.schema.describe() if detector.schema is not None else ""
    return items, LoadReport(str(path), number, tuple(issues), schema=schema,
                             chat_prompts=sum(bool(item.messages) for item in items))


def _columns(explicit: list[str]) -> list[str]:
    """The record fields a schema may read, with the `explicit` keys (parquet reads only these columns)."""
    keys = list(explicit)
    for schema in SCHEMAS:
        keys += [*schema.prompt_keys, *schema.answer_keys]
    return list(dict.fromkeys([*keys, "data_source", "extra_info"]))


def render_items(items: Sequence[PromptItem], renderer: PromptRenderer) -> list[PromptItem]:
    """Items with `prompt_ids` filled in by the renderer (a chat-message prompt through the chat template)."""
    ids = renderer.encode_many([item.messages or item.prompt for item in items])
    return [msgspec.structs.replace(item, prompt_ids=row) for item, row in zip(items, ids, strict=True)]


def filter_by_prompt_length(items: Sequence[PromptItem], max_prompt_length: int) -> tuple[list[PromptItem], int]:
    """Keep rendered items of at most `max_prompt_length` prompt tokens; returns (kept, number dropped)."""
    kept = [item for item in items if len(item.prompt_ids) <= max_prompt_length]
    return kept, len(items) - len(kept)


def load_prompt_dataset(
    path: str | Path,
    renderer: PromptRenderer | None = None,
    *,
    name: str | None = None,
    prompt_key: str = AUTO,
    answer_key: str = AUTO,
    answer_format: AnswerFormat = "auto",
    skip_malformed: bool = False,
    max_prompt_length: int | None = None,
) -> FileDataset:
    """Load a .jsonl / .json / .parquet math dataset, render and tokenize its prompts, drop over-long ones.

    Item `index` is the position in the returned dataset; `id` keeps the record number in the file. Without a
    renderer prompts stay untokenized (and `max_prompt_length` must be None). Raises DataError when nothing is
    left to train on.
    """
    path = Path(path)
    name = name or path.stem
    items, report = read_prompt_items(
        path, name=name, prompt_key=prompt_key, answer_key=answer_key, answer_format=answer_format,
        skip_malformed=skip_malformed,
    )
    if not items:
        raise DataError(f"{path}: no usable records ({report.num_records} read, {len(report.skipped)} malformed)")
    dropped = 0
    if renderer is not None:
        items = render_items(items, renderer)
        if max_prompt_length is not None:
            shortest = min(len(item.prompt_ids) for item in items)
            items, dropped = filter_by_prompt_length(items, max_prompt_length)
            if not items:
                raise DataError(
                    f"{path}: all {dropped} prompts are longer than data.max_prompt_length={max_prompt_length} "
                    f"tokens (the shortest has {shortest}); raise data.max_prompt_length"
                )
            if dropped:
                log.warning(
                    "%s: dropped %d of %d prompts longer than data.max_prompt_length=%d tokens",
                    path, dropped, dropped + len(items), max_prompt_length,
                )
    elif max_prompt_length is not None:
        raise ValueError("load_prompt_dataset: max_prompt_length needs a renderer to count prompt tokens")
    items = [msgspec.structs.replace(item, index=index) for index, item in enumerate(items)]
    report = dataclasses.replace(report, num_too_long=dropped)
    return FileDataset(name, items, report)
