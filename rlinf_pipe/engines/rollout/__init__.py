"""Rollout: generation engines behind one interface (`RolloutEngine`); see docs/rollout.md."""

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
