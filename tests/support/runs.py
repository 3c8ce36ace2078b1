"""Comparing the outputs of two runs of the runner (their metrics and final actor weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlinf_pipe.models.megatron_checkpoint import load_model_shard
from rlinf_pipe.utils.metrics import read_metrics


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The last checkpoint's actor weights in HF names, whole (gathered from every TP / PP shard)."""
    return checkpoint_weights(sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "actor")


def checkpoint_weights(actor: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's actor weights (`<checkpoint>/actor`) in HF names, whole, whatever its TP and PP sizes."""
    from rlinf_pipe.models.convert import megatron_to_hf
    from rlinf_pipe.models.megatron_checkpoint import read_megatron_meta
    from rlinf_pipe.models.weight_map import read_hf_arch

    meta = read_megatron_meta(actor)
    shards = {(t, p): load_model_shard(actor, t, p) for p in range(meta.pp) for t in range(meta.tp)}
    return megatron_to_hf(shards, read_hf_arch(meta.hf_dir), tp=meta.tp, pp=meta.pp)


def assert_trains_like(reference: Path, other: Path, summed_otherwise: bool = False) -> None:
    """Same seed: the same rollouts, and losses and final parameters equal within float tolerance.

    `summed_otherwise`: the runs sum each gradient in another order (another tensor-parallel split), so a gradient
    element near zero may differ in sign, which Adam turns into an update of up to 2 x lr in the other direction:
    a few elements (at most 4, or 0.1% of a larger tensor) may then differ by up to 2 x lr per optimizer step."""
    ref = read_metrics(reference / "metrics.jsonl")
    got = [r for r in read_metrics(other / "metrics.jsonl") if "reward/mean" in r]  # (not validation's)
    for a, b in zip(ref, got, strict=True):
        for key in ("reward/mean", "reward/accuracy", "response_length/mean", "rollout/samples"):
            assert a[key] == b[key], (key, a["step"], a[key], b[key])
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5), ("loss", a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-6), (
            "grad_norm", a["step"], a["grad_norm"], b["grad_norm"], reference, other)
    wa, wb = final_weights(reference), final_weights(other)
    assert wa.keys() == wb.keys()
    flip = 2 * sum(r["lr"] * r["optimizer_steps"] for r in ref) if summed_otherwise else 0.0
    for name in wa:
        close = torch.isclose(wa[name], wb[name], atol=1e-5, rtol=1e-4)
        few = int((~close).sum()) <= max(4, close.numel() // 1000)
        if flip and few and float((wa[name] - wb[name]).abs().max()) <= flip:
            continue
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=1e-4, msg=name)
