"""Streaming channels: named, typed FIFO streams between components (sockets)."""

from rlinf_pipe.scheduler.channel.buffer import StepEnd
from rlinf_pipe.scheduler.channel.channel import Channel
from rlinf_pipe.scheduler.channel.registry import ChannelSpec

__all__ = ["Channel", "ChannelSpec", "StepEnd"]
