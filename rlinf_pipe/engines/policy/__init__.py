"""The Megatron policy engine (no Ray): forward, backward and log-probs of one rank of a TP x PP x DP model
(`policy`), the optimizer step with exact normalisation and offload (`optimizer`), checkpoints (`checkpoint`),
the vocab-parallel log-prob / entropy functions (`logprobs`) and a replica's ranks (`parallel`)."""

from rlinf_pipe.engines.policy.logprobs import token_entropy, token_logprobs, token_logprobs_and_entropy
from rlinf_pipe.engines.policy.optimizer import warmup_lr
from rlinf_pipe.engines.policy.parallel import ReplicaRanks
from rlinf_pipe.engines.policy.policy import LossFn, MegatronPolicy

__all__ = [
    "LossFn",
    "MegatronPolicy",
    "ReplicaRanks",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "warmup_lr",
]
