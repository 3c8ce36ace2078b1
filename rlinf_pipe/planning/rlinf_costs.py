"""`rlinf_costs`: RLinf's three hand-measured seconds per step (actor, rollout, inference, each measured collocated
on the same GPUs) turned into `Costs`, so that a search from them compares like for like with RLinf's
auto-placement tool.

The response lengths, prompt tokens and the decode curve's shape are the default's (`costs.default_costs`); the
curve is scaled so that the collocated engines (the config's rollout TP, every GPU) take `rollout_s` for the step's
samples (one engine simulated on evenly spaced quantiles of the lengths, `planning.batching`); the log-prob and
training rates are the step's sequence tokens over the replicas' seconds (`inference_s`, `actor_s`, the optimizer
steps included in `actor_s`). RLinf's numbers say nothing of the weight sync, the phase switches or the reward:
those keep the default's values, and `missing` says so.
"""

from __future__ import annotations

from dataclasses import replace

from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.planning.batching import Request, max_running, prefill_share, quantile_lengths, run_engine
from rlinf_pipe.planning.costs import (RLINF_SOURCE, Costs, Parallel, carried, default_costs, logprob_passes,
                                       pass_tokens, shares_prompts)


def parse_costs(text: str) -> tuple[float, float, float]:
    """`ACTOR_S,ROLLOUT_S,INFERENCE_S` (e.g. `101,224,10`) as three positive seconds."""
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or any(v <= 0 for v in values):
        raise ConfigError(f"--costs {text!r}: give three positive seconds per step, ACTOR_S,ROLLOUT_S,INFERENCE_S "
                          "(each measured collocated on every GPU), e.g. --costs 101,224,10")
    return values[0], values[1], values[2]


def rlinf_costs(actor_s: float, rollout_s: float, inference_s: float, gpus: int, cfg: Config,
                gpu: str = "H100") -> Costs:
    """Costs from RLinf's three numbers measured collocated on `gpus` GPUs (see the module docstring)."""
    rollout = Parallel(cfg.rollout.tensor_parallel_size)
    actor = Parallel(cfg.actor.tensor_parallel_size, cfg.actor.pipeline_parallel_size,
                     cfg.actor.context_parallel_size)
    inference = Parallel(cfg.inference.tensor_parallel_size, cfg.inference.pipeline_parallel_size,
                         cfg.inference.context_parallel_size)
    base = carried(default_costs(cfg, gpu), rollout, inference, actor)
    samples = cfg.data.rollout_batch_size * cfg.algorithm.group_size
    per_engine = -(-samples // max(1, gpus // rollout.gpus))
    share = prefill_share(base.prompt_tokens, cfg.algorithm.group_size)
    requests = [Request(0, share, n) for n in quantile_lengths(base.response_lengths, per_engine)]
    simulated = run_engine(requests, 0.0, lambda n: base.decode.at(n), base.prefill_tokens_per_s,
                           max_running(cfg)).end
    scale = simulated / rollout_s
    tokens = pass_tokens(samples * base.mean_response, samples * base.prompt_tokens, cfg.algorithm.group_size,
                         shares_prompts(cfg))  # (as the simulator counts a pass's tokens)
    passes = logprob_passes(cfg)
    return replace(
        base, decode=base.decode.scaled(scale), prefill_tokens_per_s=base.prefill_tokens_per_s * scale,
        logprob_tokens_per_s=passes * tokens / (max(1, gpus // inference.gpus) * inference_s),
        train_tokens_per_s=tokens / (max(1, gpus // actor.gpus) * actor_s), optimizer_step_s=0.0,
        source=f"{RLINF_SOURCE} ({actor_s:g} s actor, {rollout_s:g} s rollout, {inference_s:g} s inference per "
               f"step, measured collocated on {gpus} GPUs)",
        missing=("response lengths and prompt tokens (the default's)", "weight sync (the default's)",
                 "phase switches (the default's)", "reward (the default's)"))
