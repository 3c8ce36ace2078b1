"""Errors of the data layer. All are `RlinfPipeError`s: the CLI prints their message without a traceback."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlinf_pipe.errors import RlinfPipeError


class DataError(RlinfPipeError):
    """A dataset, template or data package is unusable; the message says what and where."""


class AnswerParseError(DataError, ValueError):
    """A reference answer has no recognisable final answer (e.g. `####` with nothing after it, unbalanced
    `\\boxed{`)."""


class TemplateError(DataError):
    """A prompt template cannot be used (unknown field, bad braces, tokenizer without a chat template)."""


@dataclass(frozen=True)
class RecordIssue:
    """One malformed record: where it is (`file:line` or `file record N`) and what is wrong with it."""

    location: str
    reason: str

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}"


class MalformedDataError(DataError):
    """A dataset file has malformed records and `skip_malformed` is off. Lists the first problems."""

    SHOWN = 10

    def __init__(self, source: str, issues: Sequence[RecordIssue], num_records: int):
        self.source, self.issues, self.num_records = source, list(issues), num_records
        shown = "\n".join(f"  {issue}" for issue in self.issues[: self.SHOWN])
        more = f"\n  ... and {len(self.issues) - self.SHOWN} more" if len(self.issues) > self.SHOWN else ""
        super().__init__(
            f"{source}: {len(self.issues)} of {num_records} records are malformed:\n{shown}{more}\n"
            + (_key_hint(self.issues, num_records) or "fix them, or set data.skip_malformed=true to skip malformed "
                                                        "records")
        )


def _key_hint(issues: Sequence[RecordIssue], num_records: int) -> str | None:
    """Where every record lacks the same field: the config key that names it (skipping them would skip them all)."""
    reasons = {issue.reason.split(" (record keys:")[0] for issue in issues}
    if len(issues) != num_records or len(reasons) != 1:
        return None
    (reason,) = reasons
    for kind in ("prompt", "answer"):
        if reason.startswith(f"missing {kind} key "):
            return (f"no record has that field: set data.{kind}_key to the field that holds the "
                    f"{'problem' if kind == 'prompt' else 'reference answer'}")
    return None
