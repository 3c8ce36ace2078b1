"""Reading dataset files into raw records, each with its location for error messages.

Formats by suffix: `.jsonl` (one JSON object per line; blank lines ignored), `.json` (a list of objects, or an
object whose `data` key holds that list), `.parquet` (needs pyarrow; imported only here). Problems with one record
(invalid JSON line, not an object) are yielded as `RecordIssue`s so the caller can skip or report them; problems
with the whole file (missing file, unknown suffix, unreadable JSON document) raise DataError.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rlinf_pipe.data.errors import DataError, RecordIssue

SUFFIXES = (".jsonl", ".json", ".parquet")

Record = dict[str, Any]


def iter_records(path: Path, columns: Sequence[str] = ()) -> Iterator[tuple[str, Record | RecordIssue]]:
    """Yield `(location, record)` or `(location, issue)` for every record of `path`, in file order.

    `columns` are the keys the caller needs (parquet reads only those top-level columns).
    """
    check_data_file(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _iter_jsonl(path)
    if suffix == ".json":
        return _iter_json(path)
    return _iter_parquet(path, columns)


def check_data_file(path: Path, key: str = "data.dataset") -> None:
    """Raise DataError (naming the config `key`) unless `path` is a file with a suffix this module reads."""
    if not path.is_file():
        problem = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise DataError(f"{key}: {path} {problem}; give a {', '.join(SUFFIXES)} file")
    if path.suffix.lower() not in SUFFIXES:
        raise DataError(f"{key}: {path} has an unsupported suffix {path.suffix!r}; use {', '.join(SUFFIXES)}")


def _check_object(location: str, value: Any) -> tuple[str, Record | RecordIssue]:
    if isinstance(value, dict):
        return location, value
    return location, RecordIssue(location, f"expected a JSON object, got {_json_type(value)}")


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Record | RecordIssue]]:
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            location = f"{path}:{number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # tolerate a byte-order mark
            except UnicodeDecodeError as exc:
                yield location, RecordIssue(location, f"not UTF-8 text ({exc.reason} at byte {exc.start})")
                continue
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                yield location, RecordIssue(location, f"invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            yield _check_object(location, value)


def _iter_json(path: Path) -> Iterator[tuple[str, Record | RecordIssue]]:
    try:
        document = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON ({exc.msg})") from None
    if isinstance(document, dict) and isinstance(document.get("data"), list):
        document = document["data"]
    if not isinstance(document, list):
        found = f"an object with keys {sorted(document)[:8]}" if isinstance(document, dict) else _json_type(document)
        raise DataError(f"{path}: expected a list of records or an object with a `data` list, got {found}")
    for index, value in enumerate(document):
        yield _check_object(f"{path} record [{index}]", value)


def _iter_parquet(path: Path, columns: Sequence[str]) -> Iterator[tuple[str, Record | RecordIssue]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading .parquet files needs pyarrow, which is not installed; run `pip install pyarrow` "
            "or convert the file to .jsonl"
        ) from None
    try:
        available = list(pq.read_schema(path).names)
        wanted = [c if c in available else c.split(".", 1)[0] for c in columns]  # dotted keys: top-level column
        present = [c for c in dict.fromkeys(wanted) if c in available]
        table = pq.read_table(path, columns=present)
    except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
        raise DataError(f"{path}: cannot read the parquet file ({exc})") from None
    missing = [c for c in dict.fromkeys(wanted) if c not in available]
    if missing:
        raise DataError(
            f"{path}: no column(s) {', '.join(map(repr, missing))}; the file has columns {available} "
            "(set data.prompt_key / data.answer_key)"
        )
    for index, record in enumerate(table.to_pylist()):
        yield f"{path} record [{index}]", record
