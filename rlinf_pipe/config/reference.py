"""Render the config reference (every key, type, default, help) from the schema.

`python -m rlinf_pipe.config.reference` prints the Markdown that docs/configuration.md embeds between the
`<!-- reference:start -->` and `<!-- reference:end -->` markers; a test keeps the two in sync.
"""

from __future__ import annotations

import dataclasses
import typing

from rlinf_pipe.config.loader import type_name
from rlinf_pipe.config.schema import Config
from rlinf_pipe.config.validate import bound_text

START, END = "<!-- reference:start -->", "<!-- reference:end -->"


def render_reference() -> str:
    lines: list[str] = []
    sections = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        _render_section(sections[section.name], section.name, lines)
    return "\n".join(lines).rstrip() + "\n"


def _render_section(cls: type, path: str, lines: list[str]) -> None:
    """One table per section; nested sections (e.g. data.arithmetic) get their own table after it."""
    doc = (cls.__doc__ or "").strip().splitlines()[0]
    lines += [f"### `{path}`", "", doc, "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    defaults, hints, nested = cls(), typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            nested.append((hints[f.name], f"{path}.{f.name}"))
            continue
        bounds = [f"{sign} {bound_text(f.metadata[key])}" for key, sign in (("min", ">="), ("below", "<"))
                  if f.metadata.get(key) is not None]
        bound = f" ({', '.join(bounds)})" if bounds else ""
        help_text = f.metadata.get("help", "").replace("|", "\\|")
        default = repr(getattr(defaults, f.name))
        lines.append(f"| `{path}.{f.name}` | {type_name(hints[f.name])}{bound} | `{default}` | {help_text} |")
    lines.append("")
    for nested_cls, nested_path in nested:
        _render_section(nested_cls, nested_path, lines)


def write_reference(path: str = "docs/configuration.md") -> None:
    """Replace the generated block (between the START and END markers) of `path`."""
    from pathlib import Path

    doc = Path(path)
    text = doc.read_text()
    start, end = text.index(START) + len(START), text.index(END)
    doc.write_text(text[:start] + "\n" + render_reference().strip() + "\n" + text[end:])


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--write"]:
        write_reference()
    else:
        print(render_reference(), end="")
