"""Streaming channels: named, typed FIFO streams between components (sockets)."""

from rlinf_pipe.channels.buffer import StepEnd
from rlinf_pipe.channels.channel import Channel
from rlinf_pipe.channels.registry import ChannelSpec

__all__ = ["Channel", "ChannelSpec", "StepEnd"]
