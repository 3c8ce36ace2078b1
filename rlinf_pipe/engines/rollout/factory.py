"""Building the rollout engine of `rollout.backend` on this process's device, from the rollout config."""

from __future__ import annotations

from rlinf_pipe.config.schema import RolloutConfig
from rlinf_pipe.engines.rollout.engine import RolloutEngine, SamplingParams
from rlinf_pipe.planning.engine_sizes import TORCH_MAX_RUNNING, memory_fraction

BACKENDS = ("torch", "sglang")


def sampling_params(rollout: RolloutConfig, n: int) -> SamplingParams:
    """The sampling settings of `rollout`, `n` samples per request."""
    return SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                          max_new_tokens=rollout.max_new_tokens, n=n)


def build_engine(rollout: RolloutConfig, model_path: str, seed: int, collocated: bool,
                 first_batch_size: int | None = None, first_gpu: int | None = None) -> RolloutEngine:
    """The engine of `rollout.backend` (`torch`: any device; `sglang`: GPU only) serving `model_path`; `seed` is
    this engine's own (the run seed plus its rank); `first_batch_size`: the torch engine's first batch of a call;
    `first_gpu`: the index on its node of its first GPU (SGLang's engines on one node take distinct ports by it)."""
    if rollout.backend == "torch":
        import torch

        from rlinf_pipe.engines.rollout.torch_engine import TorchEngine

        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        return TorchEngine(model_path, device=device, dtype=dtype, seed=seed,
                           max_batch_size=rollout.max_running_requests or TORCH_MAX_RUNNING,
                           first_batch_size=first_batch_size)
    if rollout.backend == "sglang":
        from rlinf_pipe.engines.rollout.sglang_engine import SGLangEngine

        # (an engine that takes turns on its GPUs sleeps after every generation, and one may follow with no weight
        # sync between, e.g. after validation or a second round of dynamic sampling: it keeps its weights on the
        # host, as TorchEngine does)
        return SGLangEngine(model_path, tp_size=rollout.tensor_parallel_size, seed=seed,
                            mem_fraction_static=memory_fraction(rollout, collocated),
                            max_running_requests=rollout.max_running_requests, deterministic=rollout.deterministic,
                            cpu_backup=collocated, first_gpu=first_gpu)
    raise ValueError(f"unknown rollout.backend {rollout.backend!r}; expected one of {BACKENDS}")
