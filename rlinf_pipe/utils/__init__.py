"""Utilities: spans and timelines (tracing, timeline), metric sinks (metrics), LaTeX answer helpers, asyncio
future helpers (futures)."""
