"""The runner: one step loop for the disaggregated pipeline and the collocated mode (see docs/pipeline.md)."""

from rlinf_pipe.runner.runner import Runner, run

__all__ = ["Runner", "run"]
