"""The runner: one step loop for the disaggregated pipeline and the collocated mode (see docs/pipeline.md).

`from rlinf_pipe.runner import run` loads the driver stack on first use; importing this package alone is light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlinf_pipe.runner.runner import Runner, run

__all__ = ["Runner", "run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rlinf_pipe.runner import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
