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
