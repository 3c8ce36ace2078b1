"""rlinf_pipe: Ray-based RL post-training for LLMs with GPU-range placement."""

__version__ = "0.1.0"
