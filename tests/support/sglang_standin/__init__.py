"""A CPU stand-in for sglang 0.5.23's offline engine, for testing the SGLang adapter without a GPU.

`Engine` is the stand-in `sglang.Engine`; `io_struct` holds the request classes (built from the contract that
`scripts/sglang_contract.py` extracts from the real wheel). Pass the module as the adapter's `sglang` argument:
`SGLangEngine(path, sglang=support.sglang_standin)`. What it models, and why, is in the docstrings of `engine`,
`tokenizer_manager` and `scheduler`; `tests/unit/test_sglang_contract.py` holds it to the contract.
"""

from . import io_struct
from .contract import CONTRACT
from .engine import Engine
from .scheduler import SchedulerDied

__all__ = ["CONTRACT", "Engine", "SchedulerDied", "io_struct"]
