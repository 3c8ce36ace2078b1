"""Models: Megatron GPT from HF configs, HF <-> Megatron conversion, the CPU patches for megatron-core, and the
tiny / warm-started / SmolLM2 model folders (see docs/models.md). The names below load their modules (and
transformers' model classes) on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlinf_pipe.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from rlinf_pipe.models.tiny import create_tiny_model, ensure_tiny_model
    from rlinf_pipe.models.tokenizer import train_tiny_tokenizer

_EXPORTS = {"create_tiny_model": "tiny", "ensure_tiny_model": "tiny", "train_tiny_tokenizer": "tokenizer"}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
