"""The actor: Megatron training and log-probs of the policy (`trainer.MegatronPolicy`) and the vocab-parallel
log-prob / entropy functions it uses (`logprobs`). The Ray wrapper lives next to them."""

from rlinf_pipe.workers.actor.logprobs import token_entropy, token_logprobs, token_logprobs_and_entropy
from rlinf_pipe.workers.actor.trainer import COMPLETE_MARKER, LossFn, MegatronPolicy, warmup_lr

__all__ = [
    "COMPLETE_MARKER",
    "LossFn",
    "MegatronPolicy",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "warmup_lr",
]
