"""Reward functions from a Python file (`reward.function: PATH.py:NAME`), called the way verl calls its reward
functions: `NAME(data_source=..., solution_str=..., ground_truth=..., extra_info=...)` (positionally, in that
order, when its parameters have other names), so a verl reward file works unchanged.

It returns a float, or a dict whose `score` is the reward; the dict's other numeric values travel as `extras`
(logged as `reward/<key>` means), and its `acc`, if any, says whether the response counts as correct (otherwise:
a score above 0). A call that raises or returns anything else scores 0 with the failure in `ScoreResult.error`.

The file is imported once per process as a module of its own (its folder appended to `sys.path`, so it can import
files beside it): in the reward pool's processes, and in the driver by `check_reward_function` before launch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlinf_pipe.config.function_ref import FunctionRef, parse_function_ref
from rlinf_pipe.engines.reward.context import RewardContext
from rlinf_pipe.engines.reward.verify import RewardFailure, ScoreResult
from rlinf_pipe.errors import ConfigError, UserCodeError

VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
CallStyle = Literal["keywords", "positional"]
_LOADED: dict[tuple[str, str], tuple[Callable[..., Any], CallStyle]] = {}


class RewardFunctionError(UserCodeError):
    """A reward function failed and `reward.fail_on_error` is true: the run stops."""


def load_reward_function(ref: FunctionRef) -> tuple[Callable[..., Any], CallStyle]:
    """The function `ref` names and how to call it (cached per process). A ConfigError, in one line, for a missing
    file, one that does not import, a missing or non-callable NAME, or one that cannot take verl's arguments."""
    key = (ref.path, ref.name)
    if key not in _LOADED:
        module = _import_file(Path(ref.path))
        if not hasattr(module, ref.name):
            defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
            raise ConfigError(f"reward.function: {ref.path} has no {ref.name!r} (its functions: "
                              f"{', '.join(defined) or 'none'}); write `PATH.py:NAME` with one of them")
        function = getattr(module, ref.name)
        _LOADED[key] = (function, call_style(function, ref))
    return _LOADED[key]


def check_reward_function(value: str) -> None:
    """Check a `reward.function` value before launch (imports the file in this process); a ConfigError says what
    is wrong."""
    load_reward_function(parse_function_ref(value))


def call_style(function: Any, ref: FunctionRef) -> CallStyle:
    """Whether `function` takes verl's four arguments as keywords (verl's own call) or only by position."""
    where = f"reward.function: {ref.name} in {ref.path}"
    if not callable(function):
        raise ConfigError(f"{where} is {type(function).__name__}, not a function")
    if inspect.iscoroutinefunction(function):
        raise ConfigError(f"{where} is an `async def`; make it a plain `def` (it runs in a process of its own)")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # (a builtin without one: call it as verl does)
        return "keywords"
    for style, bind in (("keywords", lambda: signature.bind(**dict.fromkeys(VERL_ARGUMENTS))),
                        ("positional", lambda: signature.bind(*[None] * len(VERL_ARGUMENTS)))):
        try:
            bind()
            return style  # type: ignore[return-value]
        except TypeError:
            continue
    raise ConfigError(f"{where} takes {signature}, so it cannot be called as {ref.name}({', '.join(VERL_ARGUMENTS)}) "
                      "as verl calls it; give it those four parameters (extra_info may default to None)")


@dataclass(frozen=True)
class FunctionScorer:
    """A reward pool scorer that calls the function `ref` names (picklable: it is loaded in each pool process)."""

    ref: FunctionRef

    def warm_up(self) -> None:
        """Import the file now, before the pool's first item (and its time limit)."""
        load_reward_function(self.ref)

    def __call__(self, response: str, reference: Any) -> ScoreResult:
        context = reference if isinstance(reference, RewardContext) else RewardContext.of_reference(reference)
        try:
            function, style = load_reward_function(self.ref)
        except ConfigError as exc:
            return failed(RewardFailure(self.ref.path, "ConfigError", str(exc)))
        values = (context.data_source, response, context.ground_truth, context.extra_info)
        try:
            value = function(**dict(zip(VERL_ARGUMENTS, values))) if style == "keywords" else function(*values)
        except Exception as exc:
            return failed(RewardFailure(raised_at(exc, self.ref), type(exc).__name__, str(exc)))
        return self.result_of(value, function)

    def result_of(self, value: Any, function: Any) -> ScoreResult:
        """A returned value as a ScoreResult; anything but a finite number or a dict with one as `score` fails."""
        extras: dict[str, float] = {}
        if isinstance(value, Mapping):
            extras = {str(k): float(v) for k, v in value.items() if k != "score" and _finite(v)}
            reward = value.get("score")
            correct = bool(value["acc"]) if "acc" in value else None
        else:
            reward, correct = value, None
        if not _finite(reward):
            what = f"a dict whose `score` is {_short(reward)}" if isinstance(value, Mapping) else _short(value)
            return failed(RewardFailure(defined_at(function, self.ref), "bad return",
                                        f"returned {what}; return a float, or a dict with a numeric `score`"))
        reward = float(reward)
        return ScoreResult(correct=reward > 0 if correct is None else correct, parsed=True, timed_out=False,
                           reward=reward, extras=extras or None)


def failed(failure: RewardFailure) -> ScoreResult:
    """The result of a call that gave no reward: 0, not correct, the failure attached."""
    return ScoreResult(correct=False, parsed=False, timed_out=False, reward=0.0, error=failure)


def raised_at(exc: BaseException, ref: FunctionRef) -> str:
    """`file:line in function` of the innermost frame of the user's file in `exc`'s traceback (else the innermost)."""
    frame = _frame_in(exc, ref.path)
    return ref.path if frame is None else f"{frame.filename}:{frame.lineno} in {frame.name}"


def _frame_in(exc: BaseException, path: str | Path) -> traceback.FrameSummary | None:
    """The innermost frame of `exc`'s traceback in the file `path`, else the innermost one (None: no traceback)."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if os.path.abspath(f.filename) == os.path.abspath(path)]
    return (mine or frames or [None])[-1]


def defined_at(function: Any, ref: FunctionRef) -> str:
    """`file:line in NAME` where the function is defined."""
    code = getattr(function, "__code__", None)
    return f"{ref.path}:{code.co_firstlineno} in {ref.name}" if code is not None else f"{ref.path} ({ref.name})"


def _import_file(path: Path) -> Any:
    """Import a Python file as a module of its own; a ConfigError with the file and line where importing it failed."""
    if not path.is_file():
        problem = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"reward.function: {path} {problem}; give the Python file that defines the reward function")
    name = f"rlinf_pipe_reward_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"reward.function: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses and pickling in the file look their module up)
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # (SystemExit and KeyboardInterrupt in a user's module too)
        del sys.modules[name]
        if isinstance(exc, KeyboardInterrupt):
            raise
        if isinstance(exc, SyntaxError):
            where = f"{exc.filename}:{exc.lineno}"
        else:
            frame = _frame_in(exc, path)
            where = f"{frame.filename}:{frame.lineno}" if frame else str(path)
        raise ConfigError(f"reward.function: importing {path} failed at {where}: {type(exc).__name__}: "
                          f"{_one_line(exc)}") from None
    return module


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(float(value))


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= limit else text[:limit - 3] + '...'}"


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""
