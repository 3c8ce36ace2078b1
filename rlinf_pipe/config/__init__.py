"""Config: typed schema, YAML + override loading, one validation pass."""

from rlinf_pipe.config.loader import load_config
from rlinf_pipe.config.schema import Config

__all__ = ["Config", "load_config"]
