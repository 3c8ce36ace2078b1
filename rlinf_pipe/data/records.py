"""Reading dataset files into raw records, each with its location for error messages.

Formats by suffix: `.jsonl` (one JSON object per line; blank lines ignored), `.json` (a list of objects, or an
object whose `data` key holds that list), `.parquet` (read with pyarrow, imported only here). Problems with one record
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


def iter_records(path: Path, columns: Sequence[str] = (), required: Sequence[str] = ()
                 ) -> Iterator[tuple[str, Record | RecordIssue]]:
    """Yield `(location, record)` or `(location, issue)` for every record of `path`, in file order.

    `columns` are the keys the caller may read and `required` those it cannot do without (parquet reads only those
    top-level columns; a missing required one, or none of `columns` there, is a DataError naming the file's
    columns). Empty `columns`: every column.
    """
    check_data_file(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _iter_jsonl(path)
    if suffix == ".json":
        return _iter_json(path)
    return _iter_parquet(path, columns, required)


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


def _iter_parquet(path: Path, columns: Sequence[str], required: Sequence[str]
                  ) -> Iterator[tuple[str, Record | RecordIssue]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading .parquet files needs pyarrow, a dependency of rlinf_pipe that is missing here; "
            "reinstall rlinf_pipe (`bash scripts/setup.sh`) or `pip install pyarrow`"
        ) from None

    def top(key: str) -> str:  # a dotted key's top-level column (a literal column name with a dot is kept)
        return key if key in available else key.split(".", 1)[0]

    try:
        available = list(pq.read_schema(path).names)
        wanted = list(dict.fromkeys(top(c) for c in columns)) if columns else available
        present = [c for c in wanted if c in available]
        missing = [c for c in dict.fromkeys(top(c) for c in required) if c not in available]
        if missing or not present:
            what = f"no column(s) {', '.join(map(repr, missing))}" if missing else "none of the columns a record " \
                f"schema reads ({', '.join(wanted)})"
            raise DataError(f"{path}: {what}; the file has columns {available} (set data.prompt_key / "
                            "data.answer_key)")
        table = pq.read_table(path, columns=present)
    except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
        raise DataError(f"{path}: cannot read the parquet file ({exc})") from None
    for index, record in enumerate(table.to_pylist()):
        yield f"{path} record [{index}]", record
