"""User-facing errors. Each one says what was wrong and how to fix it; the CLI prints it without a traceback."""

from __future__ import annotations


class RlinfPipeError(Exception):
    """Base class of errors caused by user input or the environment (not by a bug in rlinf_pipe)."""


class ConfigError(RlinfPipeError):
    """A config file or override is invalid: unknown key, wrong type, or an inconsistent value."""


class UserCodeError(RlinfPipeError):
    """Code the user gave the run (a reward function from a file) failed in a way that stops the run; the message
    names the file and line. Raised in a worker, it reaches the command line as its message alone."""


class PlacementError(RlinfPipeError):
    """`cluster.component_placement` breaks a placement rule.

    The message names the YAML key, the offending value, the rule, and a fix.
    """

    def __init__(self, key: str, value: object, rule: str, fix: str):
        self.key, self.value, self.rule, self.fix = key, value, rule, fix
        super().__init__(
            f"invalid placement `{key}: {value}` (cluster.component_placement)\n"
            f"  rule: {rule}\n"
            f"  fix:  {fix}"
        )


class ClusterError(RlinfPipeError):
    """The Ray cluster is missing, too small, or does not match `cluster` in the config."""


class WorkerError(RlinfPipeError):
    """A remote worker raised or died. Names the group, rank, node and GPUs, with the remote traceback."""


class WorkerLost(WorkerError):
    """A worker process is gone (`how` = "died") or alive but not answering (`how` = "hung"): the failures a
    restart can mend (`runner.max_restarts`), unlike an exception the worker's code raised."""

    def __init__(self, worker: str, where: str, how: str, detail: str = ""):
        self.worker, self.where, self.how = worker, where, how
        super().__init__(f"worker {worker} {how}: {where}" + (f"\n{detail}" if detail else ""))


class OutputError(RlinfPipeError):
    """The run could not write its outputs (a full disk, a folder made read-only): names what and where, and the
    last complete checkpoint to resume from."""


class RunStopped(RlinfPipeError):
    """The run stopped on a signal (SIGINT / SIGTERM); the message says where it stopped and how to resume."""

    def __init__(self, signum: int, message: str):
        self.signum = signum
        super().__init__(message)

    @property
    def exit_code(self) -> int:
        """128 + the signal number: 130 for SIGINT, 143 for SIGTERM (what a shell reports)."""
        return 128 + self.signum


class CheckpointError(RlinfPipeError):
    """A checkpoint folder is missing, incomplete, or not in the expected format."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds pickled objects other than the few types rlinf_pipe's states use: loading it could run
    code, so it is refused. The message names the file and what it holds."""


class ChannelError(RlinfPipeError):
    """Base of channel errors; every message names the channel."""


class ChannelClosed(ChannelError):
    """The channel (or this end of it) is closed: the stream has ended, or put/get was called after close()."""


class ChannelTimeout(ChannelError):
    """A blocking channel call did not complete within its `timeout`."""


class ChannelPeerError(ChannelError):
    """A peer process of the channel stopped responding (died or hung) while a call depended on it."""
