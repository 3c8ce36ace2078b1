"""Models: tiny HF models for tests and the default config (more backends arrive with the model-backend issue)."""

from rlinf_pipe.models.tiny import create_tiny_model, ensure_tiny_model
from rlinf_pipe.models.tokenizer import train_tiny_tokenizer

__all__ = ["create_tiny_model", "ensure_tiny_model", "train_tiny_tokenizer"]
