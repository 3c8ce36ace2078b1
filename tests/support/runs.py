"""Comparing the outputs of two runs of the runner (their metrics and final actor weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlinf_pipe.models.megatron_checkpoint import load_model_shard
from rlinf_pipe.utils.metrics import read_metrics


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return load_model_shard(ckpt / "actor", 0, 0)


def assert_trains_like(reference: Path, other: Path) -> None:
    """Same seed: the same rollouts, and losses and final parameters equal within float tolerance."""
    ref = read_metrics(reference / "metrics.jsonl")
    got = [r for r in read_metrics(other / "metrics.jsonl") if "reward/mean" in r]  # (not validation's)
    for a, b in zip(ref, got, strict=True):
        for key in ("reward/mean", "reward/accuracy", "response_length/mean", "rollout/samples"):
            assert a[key] == b[key], (key, a["step"], a[key], b[key])
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-6)
    wa, wb = final_weights(reference), final_weights(other)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=1e-4, msg=name)
