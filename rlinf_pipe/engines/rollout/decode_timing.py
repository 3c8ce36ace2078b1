"""What an engine's decoding cost, for the planner's decode curve: `DecodeTiming` (the torch engine's decode steps by
how many rows decoded together) and `RequestTiming` (SGLang's requests, whose overlap gives its concurrency)."""

from __future__ import annotations

import time
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


@dataclass
class RequestTiming:
    """Per sample an engine ran to its end: when it was sent and when it returned (seconds since the last `take`),
    its prompt and response tokens. SGLang's adapter records these (its engine reports no decode steps): how many
    ran at once, and how fast each decoded, give the engine's decode rate against its concurrency
    (`planning.profile`)."""

    origin: float = field(default_factory=time.perf_counter)
    requests: list[tuple[float, float, int, int]] = field(default_factory=list)

    def add(self, sent: float, returned: float, prompt_tokens: int, response_tokens: int) -> None:
        """A sample's `time.perf_counter()` times and its tokens."""
        self.requests.append((sent - self.origin, returned - self.origin, prompt_tokens, response_tokens))

    def take(self) -> dict[str, object]:
        """`{"requests": [[sent, returned, prompt tokens, response tokens], ...]}` since the last take (which the
        times count from)."""
        out: dict[str, object] = {"requests": [[round(a, 6), round(b, 6), p, r] for a, b, p, r in self.requests]}
        self.requests, self.origin = [], time.perf_counter()
        return out
