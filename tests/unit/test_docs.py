"""Docs that are generated from code stay in sync with it."""

from __future__ import annotations

from pathlib import Path

from rlinf_pipe.config.reference import END, START, render_reference

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_configuration_reference_matches_schema():
    text = (DOCS / "configuration.md").read_text()
    embedded = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert embedded == render_reference().strip(), (
        "docs/configuration.md is out of date: regenerate the block with `python -m rlinf_pipe.config.reference --write`"
    )
