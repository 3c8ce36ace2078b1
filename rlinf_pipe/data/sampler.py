"""Deterministic, resumable prompt sampling.

A finite dataset is read in a fresh permutation each epoch, drawn from (seed, epoch); batches run on across
epoch boundaries, so no prompt is skipped and each item records the epoch that drew it. An endless dataset is
read in index order (its items are already random). The state is (epoch, position): a sampler restored with
`load_state_dict` yields exactly what the saved one would have yielded next, whatever the batch sizes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np

from rlinf_pipe.data.datasets import PromptDataset
from rlinf_pipe.data.errors import DataError
from rlinf_pipe.data.structs import PromptItem


def epoch_permutation(size: int, seed: int, epoch: int) -> np.ndarray:
    """The order of a dataset of `size` items in `epoch` (a pure function of its arguments)."""
    rng = np.random.Generator(np.random.PCG64([seed % 2**63, epoch]))
    return rng.permutation(size)


class PromptSampler:
    """Yields batches of `batch_size` prompts from `dataset`; `shuffle=False` keeps index order."""

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int = 0, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if dataset.size is not None and dataset.size < 1:
            raise DataError(f"dataset {dataset.name!r} is empty")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, permutation) cache

    def _index(self, epoch: int, position: int) -> int:
        if self.dataset.size is None or not self.shuffle:
            return position
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_permutation(self.dataset.size, self.seed, epoch))
        return int(self._order[1][position])

    def next_item(self) -> PromptItem:
        """The next prompt, tagged with its epoch."""
        item = self.dataset[self._index(self.epoch, self.position)]
        item = msgspec.structs.replace(item, epoch=self.epoch)
        self.position += 1
        if self.dataset.size is not None and self.position >= self.dataset.size:
            self.epoch, self.position = self.epoch + 1, 0
        return item

    def next_batch(self, batch_size: int | None = None) -> list[PromptItem]:
        """The next `batch_size` (default: the sampler's) prompts."""
        return [self.next_item() for _ in range(self.batch_size if batch_size is None else batch_size)]

    def __iter__(self) -> Iterator[list[PromptItem]]:
        """Endless batches."""
        while True:
            yield self.next_batch()

    def _identity(self) -> dict[str, Any]:
        dataset = self.dataset
        return {"seed": self.seed, "shuffle": self.shuffle, "dataset": dataset.name, "dataset_size": dataset.size}

    def state_dict(self) -> dict[str, Any]:
        """Where the sampler stands, plus what the order depends on (JSON-serialisable)."""
        return {"epoch": self.epoch, "position": self.position, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()` of a sampler over the same dataset, seed and shuffle setting."""
        for key, mine in self._identity().items():
            if key in state and state[key] != mine:
                raise DataError(
                    f"cannot resume the prompt sampler: the checkpoint has {key}={state[key]!r} but this run has "
                    f"{mine!r}, so the prompt order would differ; restore the original data settings and seed"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0 or (self.dataset.size is not None and position >= self.dataset.size):
            raise DataError(
                f"invalid sampler state epoch={epoch} position={position} (dataset size {self.dataset.size})"
            )
        self.epoch, self.position = epoch, position
