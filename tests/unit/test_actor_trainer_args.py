"""MegatronPolicy pieces that need no process group: the LR schedule and argument errors."""

from __future__ import annotations

import pytest

from rlinf_pipe.engines.policy import MegatronPolicy, warmup_lr


def test_warmup_lr_is_linear_then_constant():
    assert [warmup_lr(s, 1.0, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_lr(0, 3e-4, 0) == 3e-4


def test_missing_model_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        MegatronPolicy(tmp_path / "nope")


def test_needs_initialised_process_group(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="init_process_group"):
        MegatronPolicy(tmp_path)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="logprob_max_tokens"):
        MegatronPolicy(tmp_path, logprob_max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        MegatronPolicy(tmp_path, temperature=0.0)
