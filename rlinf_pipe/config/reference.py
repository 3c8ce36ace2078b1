"""Render the config reference (every key, type, default, help) from the schema.

`python -m rlinf_pipe.config.reference` prints the Markdown that docs/configuration.md embeds between the
`<!-- reference:start -->` and `<!-- reference:end -->` markers; a test keeps the two in sync.
"""

from __future__ import annotations

import dataclasses
import typing

from rlinf_pipe.config.loader import type_name
from rlinf_pipe.config.schema import Config

START, END = "<!-- reference:start -->", "<!-- reference:end -->"


def render_reference() -> str:
    lines = []
    sections = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        cls = sections[section.name]
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        lines += [f"### `{section.name}`", "", doc, "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        defaults, hints = cls(), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = getattr(defaults, f.name)
            bound = f" (>= {f.metadata['min']:g})" if f.metadata.get("min") is not None else ""
            help_text = f.metadata.get("help", "").replace("|", "\\|")
            lines.append(
                f"| `{section.name}.{f.name}` | {type_name(hints[f.name])}{bound} | `{default!r}` | {help_text} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render_reference(), end="")
