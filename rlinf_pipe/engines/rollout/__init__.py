"""Rollout: generation engines behind one interface (`RolloutEngine`); see docs/rollout.md. `TorchEngine` loads
transformers' model classes on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlinf_pipe.engines.rollout.engine import (
    EngineAsleepError,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    SampleOutput,
    SamplingParams,
    sample_seed,
    to_rollout_samples,
)
from rlinf_pipe.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from rlinf_pipe.engines.rollout.torch_engine import TorchEngine

__all__ = [
    "EngineAsleepError",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "RolloutEngine",
    "SampleOutput",
    "SamplingParams",
    "TorchEngine",
    "sample_seed",
    "to_rollout_samples",
]
__getattr__ = lazy_exports(__name__, {"TorchEngine": "torch_engine"})
