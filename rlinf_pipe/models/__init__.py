"""Models: Megatron GPT from HF configs, HF <-> Megatron conversion, the CPU patches for megatron-core, and the
tiny / warm-started / SmolLM2 model folders (see docs/models.md)."""

from rlinf_pipe.models.tiny import create_tiny_model, ensure_tiny_model
from rlinf_pipe.models.tokenizer import train_tiny_tokenizer

__all__ = ["create_tiny_model", "ensure_tiny_model", "train_tiny_tokenizer"]
