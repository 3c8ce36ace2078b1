"""Filled in by later issues (see DESIGN.md)."""
