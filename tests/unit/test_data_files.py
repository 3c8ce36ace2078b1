"""Dataset files: .jsonl / .json / .parquet, malformed records (file and line in the message; skip vs fatal),
prompt-length filtering."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support.tiny_tokenizer import tiny_tokenizer

from rlinf_pipe.data import (
    DataError,
    MalformedDataError,
    PromptRenderer,
    filter_by_prompt_length,
    load_prompt_dataset,
    read_prompt_items,
)

RECORDS = [
    {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
    {"question": "How many legs do 3 cats have?", "answer": "\\boxed{12}"},
    {"question": "What is 1,000 + 1?", "answer": 1001},
]
EXPECTED_ANSWERS = ["5", "12", "1001"]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow as pa  # (a dependency of rlinf_pipe: no extra to install)
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.fixture(params=["jsonl", "json-list", "json-data", "parquet"])
def good_file(request, tmp_path) -> Path:
    kind = request.param
    if kind == "jsonl":
        lines = [json.dumps(r) for r in RECORDS]
        return write_jsonl(tmp_path / "d.jsonl", lines[:1] + [""] + lines[1:])  # a blank line is ignored
    if kind == "json-list":
        (tmp_path / "d.json").write_text(json.dumps(RECORDS))
        return tmp_path / "d.json"
    if kind == "json-data":
        (tmp_path / "d.json").write_text(json.dumps({"data": RECORDS, "meta": 1}))
        return tmp_path / "d.json"
    records = [dict(r, answer=str(r["answer"])) for r in RECORDS]  # parquet columns have one type
    return write_parquet(tmp_path / "d.parquet", records)


def test_every_format_loads(good_file):
    dataset = load_prompt_dataset(good_file)
    assert dataset.size == len(dataset) == 3 and dataset.name == "d"
    assert [item.prompt for item in dataset.items] == [r["question"] for r in RECORDS]
    assert [item.answer for item in dataset.items] == EXPECTED_ANSWERS
    assert [item.index for item in dataset.items] == [0, 1, 2]
    assert [item.id for item in dataset.items] == ["d/0", "d/1", "d/2"]
    assert dataset.report.num_records == 3 and dataset.report.num_loaded == 3 and not dataset.report.skipped


def test_custom_and_nested_keys(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [json.dumps({"problem": "Solve x", "extra": {"gt": "\\boxed{3}"}})])
    (item,) = load_prompt_dataset(path, prompt_key="problem", answer_key="extra.gt").items
    assert (item.prompt, item.answer) == ("Solve x", "3")


MALFORMED_JSONL = [
    json.dumps(RECORDS[0]),                                 # line 1 ok
    "{not json",                                            # line 2
    json.dumps({"prompt": "x", "answer": "1"}),             # line 3: missing question
    json.dumps({"question": 7, "answer": "1"}),             # line 4: non-string prompt
    json.dumps({"question": "q", "answer": "#### "}),       # line 5: unparseable answer
    json.dumps(["a", "list"]),                              # line 6: not an object
    json.dumps({"question": "q"}),                          # line 7: missing answer
    json.dumps(RECORDS[1]),                                 # line 8 ok
]


def test_malformed_jsonl_is_fatal_by_default_with_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", MALFORMED_JSONL)
    with pytest.raises(MalformedDataError) as info:
        load_prompt_dataset(path)
    message = str(info.value)
    assert "6 of 8 records are malformed" in message
    # (line 1 fixes the file's schema: question / answer; line 3 is an RLinf record, which does not fit it)
    for line, fragment in [(2, "invalid JSON"),
                           (3, "missing prompt key 'question' / 'problem' (record keys: prompt, answer); the file's "
                               "records are question-answer records"),
                           (4, "prompt 'question' must be a string or a list of chat messages, got int"),
                           (5, "answer 'answer': nothing after `####`"),
                           (6, "expected a JSON object, got a list"), (7, "missing answer key 'answer' / 'solution'")]:
        assert f"{path}:{line}: {fragment}" in message
    assert "data.skip_malformed=true" in message
    assert [issue.location for issue in info.value.issues] == [f"{path}:{n}" for n in range(2, 8)]


@pytest.mark.parametrize(("records", "keys", "hint"), [
    ([{"problem": "1+1", "answer": "2"}] * 3, {"prompt_key": "question"},
     "no record has that field: set data.prompt_key to the field that holds the problem"),
    ([{"question": "1+1", "solution": "\\boxed{2}"}] * 3, {"answer_key": "final"},
     "set data.answer_key to the field that holds the reference answer"),
])
def test_a_file_whose_every_record_lacks_the_field_names_the_key_to_set(tmp_path, records, keys, hint):
    """An explicit key no record has: skipping malformed records would skip them all."""
    path = write_jsonl(tmp_path / "other_fields.jsonl", [json.dumps(r) for r in records])
    with pytest.raises(MalformedDataError) as info:
        load_prompt_dataset(path, **keys)
    assert hint in str(info.value) and "skip_malformed" not in str(info.value)


def test_malformed_records_are_skipped_and_counted_when_asked(tmp_path, caplog):
    path = write_jsonl(tmp_path / "bad.jsonl", MALFORMED_JSONL)
    dataset = load_prompt_dataset(path, skip_malformed=True)
    assert [item.prompt for item in dataset.items] == [RECORDS[0]["question"], RECORDS[1]["question"]]
    assert [item.index for item in dataset.items] == [0, 1]
    assert [item.id for item in dataset.items] == ["bad/0", "bad/7"]  # ids keep the record number
    assert dataset.report.num_records == 8 and len(dataset.report.skipped) == 6 and dataset.report.num_loaded == 2
    assert "6 malformed skipped" in dataset.report.summary()
    assert "skipped 6 malformed of 8 records" in caplog.text


def test_fatal_message_lists_only_the_first_problems(tmp_path):
    path = write_jsonl(tmp_path / "many.jsonl", ["oops"] * 25)
    with pytest.raises(MalformedDataError) as info:
        read_prompt_items(path)
    message = str(info.value)
    assert f"{path}:10: invalid JSON" in message and f"{path}:11:" not in message and "and 15 more" in message


def test_json_record_index_and_parquet_record_index(tmp_path):
    (tmp_path / "b.json").write_text(json.dumps({"data": [RECORDS[0], {"question": "q"}]}))
    with pytest.raises(MalformedDataError, match=r"b\.json record \[1\]: missing answer key"):
        load_prompt_dataset(tmp_path / "b.json")
    path = write_parquet(tmp_path / "b.parquet", [{"question": "q", "answer": "5"}, {"question": None, "answer": "x"}])
    with pytest.raises(MalformedDataError, match=r"b\.parquet record \[1\]: prompt 'question' must be a string"):
        load_prompt_dataset(path)
    assert load_prompt_dataset(path, skip_malformed=True).size == 1


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("x.json", '[{"question": "q",\n  "answer": }]', "x.json:2:13: invalid JSON"),
        ("x.json", '{"rows": []}', "expected a list of records or an object with a `data` list"),
        ("x.csv", "question,answer\n", "unsupported suffix '.csv'"),
        ("x.jsonl", "\n\n", "no usable records"),
    ],
)
def test_file_level_problems_raise_data_error(tmp_path, name, content, fragment):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError) as info:
        load_prompt_dataset(tmp_path / name)
    assert fragment in str(info.value)


def test_missing_file_and_missing_parquet_column(tmp_path):
    with pytest.raises(DataError, match="absent.jsonl does not exist"):
        load_prompt_dataset(tmp_path / "absent.jsonl")
    with pytest.raises(DataError, match="is a folder, not a file"):
        load_prompt_dataset(tmp_path)
    with pytest.raises(DataError, match="data.answer_format 'latex' is unknown"):
        load_prompt_dataset(tmp_path / "absent.jsonl", answer_format="latex")  # type: ignore[arg-type]
    path = write_parquet(tmp_path / "c.parquet", [{"problem": "q", "answer": "1"}])
    with pytest.raises(DataError, match=r"no column\(s\) 'question'; the file has columns \['problem', 'answer'\]"):
        load_prompt_dataset(path, prompt_key="question")
    path = write_parquet(tmp_path / "d.parquet", [{"text": "q", "label": "1"}])
    with pytest.raises(DataError, match=r"none of the columns a record schema reads .*the file has columns "
                                        r"\['text', 'label'\] \(set data.prompt_key / data.answer_key\)"):
        load_prompt_dataset(path)


def test_non_utf8_line_is_a_record_issue(tmp_path):
    path = tmp_path / "enc.jsonl"
    path.write_bytes(json.dumps(RECORDS[0]).encode() + b"\n\xff\xfe\n")
    with pytest.raises(MalformedDataError, match=r"enc\.jsonl:2: not UTF-8"):
        load_prompt_dataset(path)


def test_prompt_length_filter_counts_drops(tmp_path, caplog):
    renderer = PromptRenderer(tiny_tokenizer(), "{prompt}")
    short, long = "What is 2 + 3?", "What is " + " + ".join(["1"] * 40) + "?"
    lines = [json.dumps({"question": q, "answer": "1"}) for q in [short, long, short, long, long]]
    path = write_jsonl(tmp_path / "len.jsonl", lines)
    limit = len(renderer.encode(short))
    dataset = load_prompt_dataset(path, renderer, max_prompt_length=limit)
    assert dataset.size == 2 and dataset.report.num_too_long == 3 and dataset.report.num_loaded == 2
    assert [item.id for item in dataset.items] == ["len/0", "len/2"] and [i.index for i in dataset.items] == [0, 1]
    assert all(item.prompt_ids == renderer.encode(short) for item in dataset.items)
    assert "3 over the prompt-length limit dropped" in dataset.report.summary()
    assert "dropped 3 of 5 prompts longer than data.max_prompt_length" in caplog.text

    kept, dropped = filter_by_prompt_length(dataset.items, limit - 1)
    assert kept == [] and dropped == 2
    with pytest.raises(DataError, match=r"all 5 prompts are longer than data.max_prompt_length=3 tokens"):
        load_prompt_dataset(path, renderer, max_prompt_length=3)


def test_max_length_without_renderer_is_a_usage_error(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [json.dumps(RECORDS[0])])
    with pytest.raises(ValueError, match="needs a renderer"):
        load_prompt_dataset(path, max_prompt_length=10)


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, monkeypatch):
    # (pyarrow is a dependency of rlinf_pipe; an environment that lost it is told how to get it back)
    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` fail
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"needs pyarrow, a dependency of rlinf_pipe that is missing here; reinstall "
                                        r"rlinf_pipe \(`bash scripts/setup.sh`\) or `pip install pyarrow`"):
        load_prompt_dataset(path)


def test_byte_order_mark_and_crlf_are_tolerated(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(RECORDS[0]).encode() + b"\r\n" + json.dumps(RECORDS[1]).encode())
    assert [item.answer for item in load_prompt_dataset(path).items] == ["5", "12"]


def test_corrupt_parquet_is_a_data_error(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not a parquet file at all")
    with pytest.raises(DataError, match=r"broken\.parquet: cannot read the parquet file"):
        load_prompt_dataset(path)
