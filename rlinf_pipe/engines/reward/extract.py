"""Find the final answer in a model response and normalise its text before it is parsed.

Rules (see docs/reward.md):
- reasoning blocks (`answer_region`): with `thinking` `auto` (the default) only the text after a response's last
  `</think>` can hold the answer, and a `<think>` the response opened and never closed states none; with `closed`
  (a chat template that opens the block in the prompt, DeepSeek-R1's) a response without `</think>` states none;
  `ignore` reads the whole response;
- the answer is the content of the LAST `\\boxed{...}` (or `\\fbox{...}`), braces matched, escaped braces skipped;
  an unterminated last box (a truncated response) means "no answer", never an earlier box;
- without a box, an optional regex (`answer_pattern`): its last match, group 1 if it has groups;
- the text is then normalised: full-width characters, unicode minus, vulgar fractions, superscripts, degree signs,
  `√n`, space-like thousands separators and `1e3` notation become LaTeX that math-verify reads.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from functools import lru_cache
from typing import Any

from rlinf_pipe.utils.latex import last_boxed

log = logging.getLogger(__name__)

_MINUS_SIGNS = {"\u2212": "-", "\ufe63": "-", "\u2796": "-"}
_SUPERSCRIPTS = dict(zip("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-", strict=True))
_SUPERSCRIPT_RUN = re.compile(f"[{''.join(_SUPERSCRIPTS)}]+")
_VULGAR_FRACTION = re.compile(r"[\u00bc-\u00be\u2150-\u215e\u2189]")
_SQRT_SHORTHAND = re.compile(r"√\s*(\d+(?:\.\d+)?|[A-Za-z])")
# 1 234 567 with a space-like or LaTeX spacing separator between groups of three digits.
_SPACED_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:(?:\\,|\\ |\\!|\\;|~|[ \u00a0\u2009\u202f])\d{3})+(?![\d])")
_SEPARATOR = re.compile(r"\\,|\\ |\\!|\\;|~|[ \u00a0\u2009\u202f]")
_SCIENTIFIC = re.compile(r"^(-?\d+(?:\.\d+)?)[eE]([+-]?\d+)$")


@lru_cache(maxsize=64)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """Compile (and cache) an answer pattern; raises `re.error` for an invalid one."""
    return re.compile(pattern)


def pattern_answer(text: str, pattern: str) -> str | None:
    """Group 1 (or the whole match, when the pattern has no group) of the last match of `pattern` in `text`."""
    compiled = compile_pattern(pattern)
    matches = list(compiled.finditer(text))
    if not matches:
        return None
    found = matches[-1]
    return found.group(1) if compiled.groups else found.group(0)


THINKING_MODES = ("auto", "closed", "ignore")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def answer_region(response: str, thinking: str = "auto") -> str | None:
    """The part of `response` that can state the final answer (see the module docstring), or None when none can: a
    box floated while reasoning, in a response cut off before its reasoning ended, is no answer."""
    if thinking == "ignore":
        return response
    closed = response.rfind(THINK_CLOSE)
    if closed >= 0:
        return response[closed + len(THINK_CLOSE):]
    if thinking == "closed" or THINK_OPEN in response:
        return None
    return response


def thinking_for(mode: str, rendered_prompt: str) -> str:
    """`reward.thinking` for prompts rendered as `rendered_prompt`: `auto` becomes `closed` where the prompt leaves a
    reasoning block open for the response (a chat template that ends in `<think>`, DeepSeek-R1's): its responses
    close it before they answer, and one cut off before that states no answer."""
    if mode == "auto" and rendered_prompt.rfind(THINK_OPEN) > rendered_prompt.rfind(THINK_CLOSE):
        return "closed"
    return mode


def resolve_thinking(cfg: Any, tokenizer: Any) -> None:
    """Set `cfg.reward.thinking` `auto` to what the run's prompts call for (`thinking_for` of a prompt rendered with
    `cfg.data`'s template), before reward pools are made from the config."""
    from rlinf_pipe.data.factory import build_renderer

    resolved = thinking_for(cfg.reward.thinking, build_renderer(cfg.data, tokenizer).render("1 + 1"))
    if resolved != cfg.reward.thinking:
        log.info("reward.thinking: the prompts open a <think> block, so a response states its answer only after "
                 "</think> (%s)", resolved)
        cfg.reward.thinking = resolved


def extract_answer(response: str, answer_pattern: str | None = None, thinking: str = "auto") -> str | None:
    """The final answer text of `response` (normalised), or None when it states none.

    Only `answer_region(response, thinking)` is read. The last `\\boxed{}` wins; `answer_pattern` (e.g. `#### (.*)`)
    is the fallback for responses without a box. An empty answer counts as none.
    """
    region = answer_region(response, thinking)
    if region is None:
        return None
    response = region
    raw = last_boxed(response)
    if raw is None and answer_pattern:
        raw = pattern_answer(response, answer_pattern)
    if raw is None:
        return None
    answer = normalize_answer(raw)
    return answer or None


def normalize_answer(text: str) -> str:
    """Rewrite unicode math and number formatting that math-verify misreads into plain LaTeX."""
    text = _normalize_unicode(text).strip()
    text = _SPACED_THOUSANDS.sub(lambda m: _SEPARATOR.sub("", m.group(0)), text)
    scientific = _SCIENTIFIC.match(text)
    if scientific:
        text = f"{scientific.group(1)}\\times 10^{{{scientific.group(2)}}}"
    if text.endswith(".") and not text.endswith(".."):  # sentence full stop: "72." -> "72"
        text = text[:-1].rstrip()
    return text


def _normalize_unicode(text: str) -> str:
    chars = []
    for char in text:
        code = ord(char)
        if 0xFF01 <= code <= 0xFF5E:  # full-width ASCII (１２, ＋, ／)
            chars.append(chr(code - 0xFEE0))
        elif code == 0x3000:  # ideographic space
            chars.append(" ")
        else:
            chars.append(_MINUS_SIGNS.get(char, char))
    text = "".join(chars)
    text = _VULGAR_FRACTION.sub(_vulgar_to_latex, text)
    text = _SUPERSCRIPT_RUN.sub(lambda m: "^{" + "".join(_SUPERSCRIPTS[c] for c in m.group(0)) + "}", text)
    text = text.replace("°", "^\\circ")
    return _SQRT_SHORTHAND.sub(lambda m: f"\\sqrt{{{m.group(1)}}}", text)


def _vulgar_to_latex(match: re.Match[str]) -> str:
    numerator, _, denominator = unicodedata.normalize("NFKC", match.group(0)).partition("\u2044")
    return f"\\frac{{{numerator}}}{{{denominator}}}"
