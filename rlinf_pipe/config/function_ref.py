"""`PATH.py:NAME` references to a function in a Python file (config `reward.function`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlinf_pipe.errors import ConfigError

DEFAULT_FUNCTION_NAME = "compute_score"


@dataclass(frozen=True)
class FunctionRef:
    """A function `name` defined in the Python file `path`."""

    path: str
    name: str = DEFAULT_FUNCTION_NAME

    def __str__(self) -> str:
        return f"{self.path}:{self.name}"


def parse_function_ref(value: str, key: str = "reward.function") -> FunctionRef:
    """`PATH.py` or `PATH.py:NAME` -> FunctionRef (NAME defaults to `compute_score`); a ConfigError naming `key`
    for anything else. The file itself is not looked at."""
    path, sep, name = value.rpartition(":")
    if not sep or not path.endswith(".py"):
        path, name = value, DEFAULT_FUNCTION_NAME
    if not path.endswith(".py") or path == ".py":
        raise ConfigError(f"{key}: {value!r} is not `PATH.py` or `PATH.py:NAME`; name a Python file and, unless "
                          f"it is `{DEFAULT_FUNCTION_NAME}`, the function in it, e.g. my_reward.py:my_score")
    if not name.isidentifier():
        raise ConfigError(f"{key}: {name!r} in {value!r} is not a Python function name; write `PATH.py:NAME`")
    return FunctionRef(path, name)


def absolute_function_ref(value: str, key: str = "reward.function") -> str:
    """`value` with its file made absolute (from the current folder), for processes that start in other folders."""
    ref = parse_function_ref(value, key)
    return str(FunctionRef(os.path.abspath(os.path.expanduser(ref.path)), ref.name))
