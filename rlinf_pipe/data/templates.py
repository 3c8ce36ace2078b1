"""Prompt rendering: a question -> the prompt text the model sees -> its token ids.

Two modes, chosen by `template` (config `data.template`):
- `"chat"`: the tokenizer's chat template over `[system, user]` messages (system omitted when `system_prompt`
  is empty or None; the user turn is the problem, then `user_suffix` on a new line when given), with the
  assistant turn opened; tokenized without adding special tokens (the template
  writes them).
- a format string with one field, `{prompt}`, e.g. `"{prompt}\\nPut the final answer in \\\\boxed{{}}."`
  (literal braces doubled); tokenized with the tokenizer's special tokens (e.g. BOS), unless the text already
  starts with the tokenizer's BOS token. `system_prompt` and `user_suffix` are unused.

A record's own chat messages (verl's `prompt`) go through the tokenizer's chat template in either mode, as given:
no `system_prompt` or `user_suffix` is added, and the assistant turn is opened.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

from rlinf_pipe.data.errors import TemplateError
from rlinf_pipe.data.structs import ChatMessage

Prompt = str | Sequence[ChatMessage]  # a question, or a record's own chat messages

CHAT = "chat"
ENCODE_CHUNK = 1024  # prompts per call of the tokenizer in `encode_many`
DEFAULT_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


def check_format_template(template: str) -> None:
    """Raise TemplateError unless `template` is a format string whose only field is `{prompt}` (at least once)."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise TemplateError(
            f"data.template {template!r} is not a valid format string ({exc}); write literal braces as {{{{ }}}}"
        ) from None
    unknown = sorted({name for name in fields if name != "prompt"})
    if unknown:
        raise TemplateError(
            f"data.template {template!r} uses unknown field(s) {', '.join('{' + n + '}' for n in unknown)}; "
            "the only field is {prompt} (write literal braces as {{ }}), or use `chat` for the tokenizer's "
            "chat template"
        )
    if "prompt" not in fields:
        raise TemplateError(f"data.template {template!r} has no {{prompt}} field, so every prompt would be the same")


class PromptRenderer:
    """Renders and tokenizes prompts with a tokenizer (a transformers tokenizer) and a template."""

    def __init__(self, tokenizer: Any, template: str = CHAT, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
                 user_suffix: str | None = None):
        self.tokenizer = tokenizer
        self.template = template
        self.system_prompt = system_prompt or None
        self.user_suffix = user_suffix or None
        if template == CHAT:
            if not getattr(tokenizer, "chat_template", None):
                name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
                raise TemplateError(
                    f"data.template is `chat` but the tokenizer {name!r} has no chat template; set data.template "
                    "to a format string such as '{prompt}\\nAnswer:' or use a chat model's tokenizer"
                )
        else:
            check_format_template(template)

    def render(self, prompt: Prompt) -> str:
        """The prompt text the model sees."""
        if not isinstance(prompt, str):
            return self._chat([{"role": m.role, "content": m.content} for m in prompt])
        if self.template != CHAT:
            return self.template.format(prompt=prompt)
        content = prompt if self.user_suffix is None else f"{prompt}\n{self.user_suffix}"
        messages = [{"role": "user", "content": content}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self._chat(messages)

    def _chat(self, messages: list[dict[str, str]]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
            raise TemplateError(
                f"a dataset record has a chat-message prompt, which goes through the tokenizer's chat template, but "
                f"the tokenizer {name!r} has none; use a chat model's tokenizer, or give the prompts as text"
            )
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str):
            raise TemplateError(f"the tokenizer's chat template returned {type(text).__name__}, not text")
        return text

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of the rendered prompt."""
        return self.encode_many([prompt])[0]

    def encode_many(self, prompts: Sequence[Prompt], chunk: int = ENCODE_CHUNK) -> list[list[int]]:
        """Token ids of each rendered prompt, the same as `encode`'s: the tokenizer takes them `chunk` at a time (a
        fast tokenizer encodes a list in its own threads: 1.8x a prompt at a time at a dataset's launch, on 2 cores)."""
        texts = [self.render(prompt) for prompt in prompts]
        bos = getattr(self.tokenizer, "bos_token", None)
        adds = [self.template != CHAT and isinstance(prompt, str) and not (bos and text.startswith(bos))
                for prompt, text in zip(prompts, texts, strict=True)]  # (a chat template or a format with BOS: no)
        ids: list[list[int]] = [[] for _ in texts]
        for add_special in set(adds):
            which = [i for i, add in enumerate(adds) if add == add_special]
            for start in range(0, len(which), chunk):
                part = which[start:start + chunk]
                encoded = self.tokenizer([texts[i] for i in part], add_special_tokens=add_special)["input_ids"]
                for i, row in zip(part, encoded, strict=True):
                    ids[i] = list(row)
        return ids
