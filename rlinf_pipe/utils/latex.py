"""LaTeX helpers shared by dataset answer parsing and reward extraction."""

from __future__ import annotations

import re

BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` in `text`, braces matched and escaped braces (`\\{`)
    skipped; None when there is no box or the last one is never closed (e.g. a truncated response)."""
    openings = list(BOX_OPEN.finditer(text))
    if not openings:
        return None
    start = index = openings[-1].end()
    depth = 1
    while index < len(text):
        char = text[index]
        if char == "\\":  # an escaped character (\{ \} \\) never opens or closes a group
            index += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:index]
        index += 1
    return None
