"""Advantage estimators, selected by name (`algorithm.adv_estimator`) through an extensible registry.

An estimator maps per-sample `rewards` `[num_samples]` and `group_ids` `[num_samples]` (samples of one prompt share
an id) plus keyword options to per-sample advantages `[num_samples]`; the caller broadcasts them over the response
tokens. Every estimator is defined for any groups: no NaN, and 0 where a baseline leaves nothing to learn (a group
whose rewards are all equal, a group of one). Formulas and references: docs/algorithms.md.

The registry needs no torch: the built-in estimators (`estimators`) load on first use, so the checks a run
passes before Ray starts know their names and scopes without importing torch.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, TypeVar

if TYPE_CHECKING:
    from torch import Tensor

AdvantageFn = Callable[..., "Tensor"]
"""`fn(rewards, group_ids, **options) -> advantages`, all 1-D tensors of one length."""

F = TypeVar("F", bound=AdvantageFn)
Scope = Literal["group", "batch"]

_REGISTRY: dict[str, AdvantageFn | str] = {}  # a function, or the name of a built-in one in `estimators`
_SCOPES: dict[str, Scope] = {}
_BUILTIN_MODULE = "rlinf_pipe.algorithms.estimators"
BUILTIN_ESTIMATORS: dict[str, Scope] = {
    "grpo": "group", "dr_grpo": "group", "rloo": "group",
    "reinforce_plus_plus": "batch", "reinforce_plus_plus_baseline": "batch",
}
"""The built-in estimators (functions of the same names in `estimators`) and their scopes."""


def register_advantage(name: str, *, scope: Scope = "group", override: bool = False) -> Callable[[F], F]:
    """Decorator: make `fn(rewards, group_ids, **options)` available as `algorithm.adv_estimator=name`.

    `scope="group"` promises that a sample's advantage depends only on its own group, so a streaming runner may
    call the estimator on each group as it completes; `"batch"` estimators need the whole step's rewards at once.
    Registering a taken name raises ValueError unless `override=True`.
    """
    if scope not in ("group", "batch"):
        raise ValueError(f"scope must be 'group' or 'batch', got {scope!r}")

    def decorator(fn: F) -> F:
        if name in _REGISTRY and not override:
            raise ValueError(f"advantage estimator {name!r} is already registered (pass override=True to replace it)")
        _REGISTRY[name], _SCOPES[name] = fn, scope
        return fn

    return decorator


def advantage_scope(name: str) -> Scope:
    """`group` if the estimator can run group by group as groups stream in, `batch` if it needs the whole step
    (without loading a built-in estimator's code: a run's checks before Ray starts ask)."""
    if name not in _SCOPES:
        get_advantage(name)  # (the error naming the registered ones)
    return _SCOPES[name]


def registered_advantages() -> list[str]:
    """Names of the registered estimators, sorted."""
    return sorted(_REGISTRY)


def get_advantage(name: str) -> AdvantageFn:
    """The estimator registered as `name`; ValueError naming the registered ones and the closest otherwise."""
    if name in _REGISTRY:
        fn = _REGISTRY[name]
        if isinstance(fn, str):  # a built-in one, loaded now
            fn = _REGISTRY[name] = getattr(importlib.import_module(_BUILTIN_MODULE), fn)
        return fn
    names = registered_advantages()
    closest = difflib.get_close_matches(name, names, n=1, cutoff=0.0)
    hint = f"; closest: {closest[0]!r}" if closest else ""
    raise ValueError(
        f"unknown advantage estimator {name!r} (algorithm.adv_estimator); registered: {', '.join(names)}{hint}. "
        f"Register your own with @rlinf_pipe.algorithms.register_advantage({name!r})."
    )


def compute_advantages(name: str, rewards: Tensor, group_ids: Tensor, **options: object) -> Tensor:
    """Run the estimator registered as `name`."""
    return get_advantage(name)(rewards, group_ids, **options)


_REGISTRY.update((name, name) for name in BUILTIN_ESTIMATORS)
_SCOPES.update(BUILTIN_ESTIMATORS)
