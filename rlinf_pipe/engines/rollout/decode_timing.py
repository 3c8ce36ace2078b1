"""`DecodeTiming`: what an engine's decoding cost, by how many rows decoded together (the planner's decode curve)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeTiming:
    """Per batch size (rows decoding together), the decode steps taken and their seconds; the prefills' prompt
    tokens and seconds; the decode calls (each ends where a row finishes). `take` hands them over and starts again
    (one generation's worth per span)."""

    steps: dict[int, list[float]] = field(default_factory=dict)  # rows -> [steps, seconds]
    prefill: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [prompt tokens, seconds]
    calls: int = 0

    def add_steps(self, rows: int, steps: int, seconds: float) -> None:
        self.calls += 1
        if rows > 0 and steps > 0:
            entry = self.steps.setdefault(rows, [0.0, 0.0])
            entry[0] += steps
            entry[1] += seconds

    def add_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill[0] += tokens
        self.prefill[1] += seconds

    def take(self) -> dict[str, object]:
        """`{"decode_steps": [[rows, steps, seconds], ...], "prefill": [tokens, seconds], "decode_calls": n}` since
        the last take."""
        out = {"decode_steps": [[rows, int(s), round(t, 6)] for rows, (s, t) in sorted(self.steps.items())],
               "prefill": [int(self.prefill[0]), round(self.prefill[1], 6)], "decode_calls": self.calls}
        self.steps, self.prefill, self.calls = {}, [0.0, 0.0], 0
        return out
