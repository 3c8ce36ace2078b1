"""`RewardCounters`: what a reward pool has scored since it started."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class RewardCounters:
    """Totals since the pool started. A parse failure is an item without a readable answer (timeouts and worker
    errors are counted on their own); restarts counts processes replaced after a timeout or a crash."""

    items: int = 0
    correct: int = 0
    parse_failures: int = 0
    timeouts: int = 0
    errors: int = 0  # a worker crashed, the scorer raised, or a reward function failed
    restarts: int = 0

    def as_dict(self) -> dict[str, float]:
        """The counters plus accuracy (correct / items), as metric values."""
        values: dict[str, float] = {key: float(value) for key, value in asdict(self).items()}
        values["accuracy"] = self.correct / self.items if self.items else 0.0
        return values
