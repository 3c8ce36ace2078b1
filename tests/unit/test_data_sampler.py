"""Prompt sampling: per-epoch shuffles from (seed, epoch), batches across epochs, exact resumption."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlinf_pipe.data import (
    ArithmeticDataset,
    ArithmeticSpec,
    DataError,
    FileDataset,
    LoadReport,
    PromptItem,
    PromptSampler,
)


def make_dataset(size: int, name: str = "toy") -> FileDataset:
    items = [PromptItem(id=f"{name}/{i}", prompt=f"q{i}", answer=str(i), index=i) for i in range(size)]
    return FileDataset(name, items, LoadReport(name, size))


def draws(batches: list[list[PromptItem]]) -> list[tuple[str, int]]:
    return [(item.id, item.epoch) for batch in batches for item in batch]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    sampler = PromptSampler(make_dataset(10), batch_size=4, seed=3)
    flat = draws([sampler.next_batch() for _ in range(5)])  # 20 draws = 2 epochs
    first, second = flat[:10], flat[10:]
    assert sorted(i for i, _ in first) == sorted(i for i, _ in second) == sorted(f"toy/{i}" for i in range(10))
    assert {e for _, e in first} == {0} and {e for _, e in second} == {1}
    assert [i for i, _ in first] != [i for i, _ in second]
    assert [i for i, _ in first] != [f"toy/{i}" for i in range(10)]  # shuffled
    assert sampler.state_dict()["epoch"] == 2 and sampler.state_dict()["position"] == 0


def test_batches_span_epoch_boundaries():
    sampler = PromptSampler(make_dataset(3), batch_size=2, seed=0)
    assert [[item.epoch for item in sampler.next_batch()] for _ in range(3)] == [[0, 0], [0, 1], [1, 1]]


def test_same_seed_same_order_other_seed_other_order():
    def order(seed):
        return draws([PromptSampler(make_dataset(30), 5, seed=seed).next_batch()])

    assert order(1) == order(1) and order(1) != order(2)


def test_no_shuffle_and_endless_datasets_keep_index_order():
    sampler = PromptSampler(make_dataset(4), 3, shuffle=False)
    assert draws([sampler.next_batch(), sampler.next_batch()]) == [
        ("toy/0", 0), ("toy/1", 0), ("toy/2", 0), ("toy/3", 0), ("toy/0", 1), ("toy/1", 1)]
    sampler = PromptSampler(ArithmeticDataset(seed=5), 4, seed=9)
    assert [item.index for item in sampler.next_batch() + sampler.next_batch()] == list(range(8))
    assert sampler.state_dict()["epoch"] == 0 and sampler.state_dict()["position"] == 8


def resume(state: dict, dataset: FileDataset | ArithmeticDataset, batch_size: int, seed: int) -> PromptSampler:
    sampler = PromptSampler(dataset, batch_size, seed=seed)
    sampler.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint would store it
    return sampler


@settings(max_examples=150, deadline=None)
@given(
    size=st.integers(1, 25),
    batch_size=st.integers(1, 9),
    seed=st.integers(-(2**40), 2**40),
    stop=st.integers(0, 12),
    more=st.integers(0, 12),
)
def test_resumed_run_sees_exactly_the_uninterrupted_prompts(size, batch_size, seed, stop, more):
    dataset = make_dataset(size)
    uninterrupted = PromptSampler(dataset, batch_size, seed=seed)
    expected = [uninterrupted.next_batch() for _ in range(stop + more)]

    first = PromptSampler(dataset, batch_size, seed=seed)
    before = [first.next_batch() for _ in range(stop)]
    resumed = resume(first.state_dict(), dataset, batch_size, seed)
    after = [resumed.next_batch() for _ in range(more)]
    assert draws(before + after) == draws(expected)
    assert [[i.index for i in b] for b in before + after] == [[i.index for i in b] for b in expected]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 20), st.integers(1, 6), st.integers(1, 6), st.integers(0, 40), st.integers(0, 1000))
def test_resuming_with_another_batch_size_keeps_the_prompt_stream(size, b1, b2, stop, seed):
    dataset = make_dataset(size)
    stream = PromptSampler(dataset, 1, seed=seed).next_batch(stop + 3 * b2)
    first = PromptSampler(dataset, b1, seed=seed)
    head = first.next_batch(stop)
    tail = resume(first.state_dict(), dataset, b2, seed).next_batch()
    assert draws([head + tail]) == draws([stream[: stop + b2]])


def test_resume_of_an_endless_dataset():
    dataset = ArithmeticDataset(ArithmeticSpec(), seed=2)
    sampler = PromptSampler(dataset, 3, seed=2)
    sampler.next_batch()
    assert resume(sampler.state_dict(), dataset, 3, 2).next_batch() == sampler.next_batch()


@pytest.mark.parametrize(
    ("change", "key"),
    [({"seed": 8}, "seed"), ({"size": 11}, "dataset_size"), ({"name": "other"}, "dataset")],
)
def test_resume_refuses_a_different_order(change, key):
    saved = PromptSampler(make_dataset(10), 2, seed=7)
    saved.next_batch()
    dataset = make_dataset(change.get("size", 10), change.get("name", "toy"))
    with pytest.raises(DataError, match=f"the checkpoint has {key}="):
        PromptSampler(dataset, 2, seed=change.get("seed", 7)).load_state_dict(saved.state_dict())


def test_invalid_state_and_arguments():
    with pytest.raises(DataError, match="invalid sampler state"):
        PromptSampler(make_dataset(4), 2).load_state_dict({"epoch": 0, "position": 4})
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        PromptSampler(make_dataset(4), 0)
    with pytest.raises(DataError, match="is empty"):
        PromptSampler(make_dataset(0), 1)
