"""Prompt rendering: the tokenizer's chat template (with a system prompt) or a format template, then token ids."""

from __future__ import annotations

import pytest
from support.tiny_tokenizer import tiny_tokenizer

from rlinf_pipe.data import DEFAULT_SYSTEM_PROMPT, PromptRenderer, TemplateError

QUESTION = "What is 2 + 3?"


def test_chat_template_with_default_system_prompt():
    tokenizer = tiny_tokenizer()
    renderer = PromptRenderer(tokenizer)
    text = renderer.render(QUESTION)
    assert text == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = renderer.encode(QUESTION)
    assert tokenizer.decode(ids) == text
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens are single ids


@pytest.mark.parametrize("system_prompt", ["", None])
def test_chat_template_without_system_prompt(system_prompt):
    text = PromptRenderer(tiny_tokenizer(), "chat", system_prompt).render(QUESTION)
    assert text == f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


def test_custom_system_prompt():
    text = PromptRenderer(tiny_tokenizer(), "chat", "Answer briefly.").render(QUESTION)
    assert text.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n")


def test_format_template():
    tokenizer = tiny_tokenizer()
    renderer = PromptRenderer(tokenizer, "{prompt}\nPut the final answer in \\boxed{{}}.", "ignored here")
    text = renderer.render(QUESTION)
    assert text == f"{QUESTION}\nPut the final answer in \\boxed{{}}."
    assert renderer.encode(QUESTION) == tokenizer(text)["input_ids"]
    assert tokenizer.decode(renderer.encode(QUESTION)) == text


def test_chat_mode_needs_a_chat_template():
    with pytest.raises(TemplateError, match="has no chat template; set data.template to a format string"):
        PromptRenderer(tiny_tokenizer(chat_template=False), "chat")
    # a format template works with such a tokenizer
    assert PromptRenderer(tiny_tokenizer(chat_template=False), "Q: {prompt}\nA:").render("x") == "Q: x\nA:"


@pytest.mark.parametrize(
    ("template", "fragment"),
    [
        ("{question}\nAnswer:", "unknown field(s) {question}"),
        ("{prompt} {0}", "unknown field(s) {0}"),
        ("{prompt} \\boxed{}", "unknown field(s) {}"),
        ("{prompt", "not a valid format string"),
        ("Answer the question.", "has no {prompt} field"),
    ],
)
def test_bad_format_templates(template, fragment):
    with pytest.raises(TemplateError) as info:
        PromptRenderer(tiny_tokenizer(), template)
    assert fragment in str(info.value)


def test_a_user_suffix_follows_the_problem_in_the_user_turn():
    """(DeepSeek-R1 models: no system prompt, the instruction after the problem.)"""
    text = PromptRenderer(tiny_tokenizer(), "chat", None, "Put the final answer within \\boxed{}.").render(QUESTION)
    assert text == (f"<|im_start|>user\n{QUESTION}\nPut the final answer within \\boxed{{}}.<|im_end|>\n"
                    "<|im_start|>assistant\n")


class BosTokenizer:
    """Adds its BOS when asked for special tokens, as a Llama-style fast tokenizer does; takes a text or a list of
    them, as transformers' tokenizers do."""

    bos_token = "<s>"

    def __call__(self, text, add_special_tokens=True):
        def ids(one):
            return ([1] if add_special_tokens else []) + [ord(c) for c in one]

        return {"input_ids": ids(text) if isinstance(text, str) else [ids(t) for t in text]}


def test_a_format_template_that_writes_the_bos_token_gets_no_second_one():
    written = PromptRenderer(BosTokenizer(), "<s>User: {prompt}\nAssistant:")
    assert written.encode("x") == [ord(c) for c in "<s>User: x\nAssistant:"]
    plain = PromptRenderer(BosTokenizer(), "User: {prompt}\nAssistant:")
    assert plain.encode("x") == [1] + [ord(c) for c in "User: x\nAssistant:"]


@pytest.mark.parametrize("template", ["chat", "{prompt}\nAnswer:"])
def test_prompts_encoded_together_are_encoded_as_one_at_a_time(template):
    tokenizer = tiny_tokenizer()
    renderer = PromptRenderer(tokenizer, template)
    prompts = [f"What is {i} + {i * 7}?" + " Think." * (i % 3) for i in range(7)] + ["", "2 + 2 = ?"]
    one_at_a_time = [tokenizer(renderer.render(p), add_special_tokens=template != "chat")["input_ids"] for p in prompts]
    assert renderer.encode_many(prompts, chunk=2) == one_at_a_time
    assert [renderer.encode(p) for p in prompts] == one_at_a_time
    assert renderer.encode_many([]) == []


def test_prompts_with_and_without_their_own_bos_encoded_together():
    renderer = PromptRenderer(BosTokenizer(), "{prompt}")  # some prompts start with the BOS, some do not
    prompts = ["<s>a", "b", "<s>c", "d", "e"]
    assert renderer.encode_many(prompts, chunk=2) == [[ord(c) for c in "<s>a"], [1, ord("b")], [ord(c) for c in "<s>c"],
                                             [1, ord("d")], [1, ord("e")]]
