"""Building the rollout engine of `rollout.backend` on this process's device."""

from __future__ import annotations

from typing import Any

import torch

from rlinf_pipe.engines.rollout.engine import RolloutEngine

BACKENDS = ("torch", "sglang")


def build_engine(backend: str, model_path: str, seed: int, **options: Any) -> RolloutEngine:
    """The rollout engine of `backend` (`torch`: any device; `sglang`: GPU only) serving `model_path`."""
    if backend == "torch":
        from rlinf_pipe.engines.rollout.torch_engine import TorchEngine

        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        return TorchEngine(model_path, device=device, dtype=dtype, seed=seed, **options)
    if backend == "sglang":
        from rlinf_pipe.engines.rollout.sglang import SGLangEngine

        return SGLangEngine(model_path=model_path, seed=seed, **options)
    raise ValueError(f"unknown rollout.backend {backend!r}; expected one of {BACKENDS}")
