"""Record schemas of dataset files: verl's, RLinf's math jsonl and question / answer records are detected with no
keys set; explicit keys win; a record that fits none is named with its place and what was expected; chat-message
prompts go through the tokenizer's chat template as given; several reference answers and what a reward function
receives (data_source, extra_info, ground_truth) travel with the item, through the channel codec too."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.tiny_tokenizer import tiny_tokenizer

from rlinf_pipe.config.schema import DataConfig
from rlinf_pipe.data import (
    ChatMessage,
    MalformedDataError,
    PromptItem,
    PromptRenderer,
    TemplateError,
    build_prompt_dataset,
    load_prompt_dataset,
)
from rlinf_pipe.data.factory import dataset_line
from rlinf_pipe.channels.codec import Codec


def verl_record(index: int, question: str, truth: object, system: bool = False) -> dict:
    """A record as verl's GSM8K preprocessing writes it (the instruction in the user message)."""
    messages = [{"role": "user", "content": f"{question} Let's think step by step."}]
    if system:
        messages.insert(0, {"role": "system", "content": "You are a careful solver."})
    return {"data_source": "openai/gsm8k", "prompt": messages, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "train", "index": index, "question": question}}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


VERL = [verl_record(0, "What is 2 + 3?", "5"), verl_record(1, "What is 4 * 3?", "12", system=True)]


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_a_verl_file_loads_with_no_keys_set(tmp_path, suffix):
    path = tmp_path / f"gsm8k.{suffix}"
    (write_parquet if suffix == "parquet" else write_jsonl)(path, VERL)
    dataset = load_prompt_dataset(path)
    first, second = dataset.items
    assert dataset.report.schema.startswith("verl schema (prompt `prompt`, answer `reward_model.ground_truth`")
    assert dataset.report.chat_prompts == 2 and "with 2 chat-message prompts" in dataset.report.summary()
    assert first.messages == (ChatMessage("user", "What is 2 + 3? Let's think step by step."),)
    assert first.prompt == "What is 2 + 3? Let's think step by step."  # (the last user message)
    assert [m.role for m in second.messages] == ["system", "user"]
    assert (first.answer, first.answers, first.references) == ("5", (), ("5",))
    assert first.data_source == "openai/gsm8k"
    assert json.loads(first.extra_info) == {"split": "train", "index": 0, "question": "What is 2 + 3?"}
    assert json.loads(second.ground_truth) == "12"  # as stored, for a reward function


def test_rlinf_math_records_with_an_answer_or_a_solutions_list(tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", [
        {"prompt": "Half of one?", "solutions": ["\\frac{1}{2}", "0.5", "\\boxed{1/2}"]},
        {"prompt": "One plus one?", "answer": "2"},
    ])
    several, one = load_prompt_dataset(path).items
    assert several.references == ("\\frac{1}{2}", "0.5", "1/2") and several.answer == "\\frac{1}{2}"
    assert one.references == ("2",) and one.answers == ()
    assert several.ground_truth == "" and several.extra_info == ""  # (derived from the references by the reward)
    assert several.data_source == "math"  # the dataset's name when the record has none
    assert load_prompt_dataset(path).report.schema.startswith("rlinf-math schema")


@pytest.mark.parametrize(("record", "prompt", "answer"), [
    ({"question": "2+2?", "answer": "so 4\n#### 4"}, "2+2?", "4"),
    ({"problem": "3+3?", "solution": "It is $\\boxed{6}$."}, "3+3?", "6"),
    ({"question": "5+5?", "answer": 10}, "5+5?", "10"),
])
def test_question_answer_records(tmp_path, record, prompt, answer):
    (item,) = load_prompt_dataset(write_jsonl(tmp_path / "qa.jsonl", [record])).items
    assert (item.prompt, item.answer, item.messages) == (prompt, answer, ())


def test_a_record_that_matches_no_schema_is_named_with_its_line_and_what_was_expected(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"text": "2+2?", "label": "4"}, {"prompt": "1+1?", "answer": "2"}])
    with pytest.raises(MalformedDataError) as info:
        load_prompt_dataset(path)
    message = str(info.value)
    assert f"{path}:1: matches no known record schema (record keys: text, label); expected verl's (`prompt` chat " \
           "messages + `reward_model.ground_truth`), RLinf's math (`prompt` + `answer` or a `solutions` list) or " \
           "`question`/`problem` + `answer`/`solution`, or set data.prompt_key / data.answer_key" in message
    assert f"{path}:2" not in message  # the second record fixes the schema and fits it
    assert load_prompt_dataset(path, skip_malformed=True).items[0].id == "odd/1"


def test_a_record_that_does_not_fit_the_files_schema_names_it(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [VERL[0], {"prompt": "1+1?", "answer": "2"}])
    with pytest.raises(MalformedDataError, match=r"mixed\.jsonl:2: missing answer key 'reward_model.ground_truth' "
                                                 r"\(record keys: prompt, answer\); the file's records are verl"):
        load_prompt_dataset(path)


def test_explicit_keys_win_over_detection(tmp_path):
    record = {"prompt": "ignored?", "answer": "1", "q": {"text": "3+4?"}, "final": "7"}
    path = write_jsonl(tmp_path / "own.jsonl", [record])
    (item,) = load_prompt_dataset(path, prompt_key="q.text", answer_key="final").items
    assert (item.prompt, item.answer) == ("3+4?", "7")
    assert load_prompt_dataset(path, prompt_key="q.text", answer_key="final").report.schema.startswith("custom")
    (item,) = load_prompt_dataset(path, answer_key="final").items  # the prompt still detected
    assert (item.prompt, item.answer) == ("ignored?", "7")
    (item,) = load_prompt_dataset(write_jsonl(tmp_path / "v.jsonl", VERL[:1]), answer_key="extra_info.index").items
    assert item.answer == "0" and item.ground_truth == ""  # not verl's ground truth any more


@pytest.mark.parametrize(("prompt", "fragment"), [
    ([], "prompt 'prompt' is an empty list of chat messages"),
    ([{"role": "user"}], "prompt 'prompt' message [0] must be an object with string `role` and `content`"),
    ([{"role": "system", "content": "Be brief."}], "prompt 'prompt' has no user message with content"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
     "prompt 'prompt' message [0] content must be a string (text prompts only), got list"),
    (["hi"], "prompt 'prompt' message [0] must be an object with string `role` and `content`, got 'hi'"),
])
def test_malformed_chat_messages_are_named(tmp_path, prompt, fragment):
    path = write_jsonl(tmp_path / "chat.jsonl", [VERL[0], dict(VERL[0], prompt=prompt)])
    with pytest.raises(MalformedDataError) as info:
        load_prompt_dataset(path)
    assert f"{path}:2: {fragment}" in str(info.value)


@pytest.mark.parametrize(("answer", "fragment"), [
    ([], "answer 'solutions' is an empty list"),
    ([{"x": 1}], "answer 'solutions' [0] must be a string or a number, got dict"),
    (["#### "], "answer 'solutions' [0]: nothing after `####`"),
])
def test_malformed_solutions_are_named(tmp_path, answer, fragment):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "p", "solutions": answer}])
    with pytest.raises(MalformedDataError) as info:
        load_prompt_dataset(path)
    assert f"{path}:1: {fragment}" in str(info.value)


def test_a_verl_ground_truth_list_is_several_references_and_passes_as_stored(tmp_path):
    (item,) = load_prompt_dataset(write_jsonl(tmp_path / "v.jsonl", [verl_record(0, "Q?", ["3", 3.0])])).items
    assert item.references == ("3", "3.0") and json.loads(item.ground_truth) == ["3", 3.0]


def test_chat_messages_render_as_given_through_the_chat_template():
    messages = (ChatMessage("system", "Own system."), ChatMessage("user", "2+2?"))
    expected = ("<|im_start|>system\nOwn system.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                "<|im_start|>assistant\n")
    tokenizer = tiny_tokenizer()
    chat = PromptRenderer(tokenizer, "chat", "Default system.", user_suffix="Box it.")
    assert chat.render(messages) == expected  # no data.system_prompt, no user_suffix: the record's own messages
    formatted = PromptRenderer(tokenizer, "Q: {prompt}\nA:")
    assert formatted.render(messages) == expected  # (a format template is for plain questions)
    assert formatted.render("2+2?") == "Q: 2+2?\nA:"
    ids = formatted.encode_many([messages, "2+2?"])
    assert tokenizer.decode(ids[0]) == expected and ids[0] == tokenizer(expected, add_special_tokens=False).input_ids
    assert ids[1] == formatted.encode("2+2?")
    with pytest.raises(TemplateError, match="chat-message prompt, which goes through the tokenizer's chat template"):
        PromptRenderer(tiny_tokenizer(chat_template=False), "{prompt}").render(messages)


def test_the_run_loads_a_verl_file_with_only_data_dataset_set(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", VERL)
    data = DataConfig(dataset=str(path))
    dataset = build_prompt_dataset(data, tiny_tokenizer(), seed=0)
    assert tiny_tokenizer().decode(dataset[0].prompt_ids) == (
        "<|im_start|>user\nWhat is 2 + 3? Let's think step by step.<|im_end|>\n<|im_start|>assistant\n")
    line = dataset_line("data.dataset", dataset)
    assert line == (f"data.dataset: {path}: verl schema (prompt `prompt`, answer `reward_model.ground_truth`, "
                    "data_source, extra_info) with 2 chat-message prompts; 2 prompts from 2 records (0 malformed "
                    "skipped, 0 over the prompt-length limit dropped)")
    assert dataset_line("data.dataset", build_prompt_dataset(DataConfig(), tiny_tokenizer(), seed=0)) is None


def test_the_reward_fields_travel_through_the_channel_codec():
    item = PromptItem(id="v/0", prompt="2+2?", answer="4", index=0, prompt_ids=[1, 2],
                      messages=(ChatMessage("user", "2+2?"),), answers=("4", "4.0"), data_source="openai/gsm8k",
                      extra_info='{"index":0}', ground_truth='["4","4.0"]')
    codec = Codec(PromptItem)
    out = codec.decode([bytes(memoryview(f)) for f in codec.encode(item)])
    assert out == item and out.references == ("4", "4.0")
