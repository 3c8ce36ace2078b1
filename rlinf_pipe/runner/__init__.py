"""The runner: one step loop for the disaggregated pipeline and the collocated mode (see docs/pipeline.md).

`from rlinf_pipe.runner import run` is light (`rlinf_pipe.runner.entry`: the driver stack loads while Ray starts);
`Runner` loads the driver stack on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlinf_pipe.runner.entry import run
    from rlinf_pipe.runner.runner import Runner

__all__ = ["Runner", "run"]


def __getattr__(name: str) -> Any:
    if name == "run":
        from rlinf_pipe.runner.entry import run

        return run
    if name == "Runner":
        from rlinf_pipe.runner.runner import Runner

        return Runner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
