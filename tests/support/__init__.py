"""Helpers importable by the tests and by the Ray workers they start (tests/ is on both paths)."""
