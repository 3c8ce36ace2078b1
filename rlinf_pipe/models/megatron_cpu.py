"""CPU compatibility layer for megatron-core (development and CI machines without CUDA).

megatron-core assumes CUDA in a handful of places: it seeds and forks the CUDA RNG, it
allocates a few buffers with ``device="cuda"`` / ``torch.cuda.current_device()`` or checks
that parameters are ``torch.cuda.FloatTensor``, and it moves a few model tensors to CUDA
(the RoPE ``inv_freq``, the tied embedding copy on the last pipeline stage).  Everything else (TP/PP/DP collectives,
the Megatron optimizer, the distributed optimizer) works on gloo with CPU tensors.

``enable_cpu_compat()`` patches exactly those call sites and nothing else:

* It is a no-op (returns ``False``) when ``torch.cuda.is_available()``: on CUDA nothing
  is patched.
* Each patch is recorded in ``PATCHES`` (name, target, reason; the table is
  ``megatron_cpu_patches``); ``describe_patches()`` lists them.
* Each patch verifies its target before touching it.  Two kinds exist:

  - *replace*: the target function is swapped for a CPU implementation written here;
    the target's parameter names must match the ones we expect.
  - *edit*: the target function's own source is taken from the installed megatron-core,
    specific fragments (e.g. ``device="cuda"``) are replaced by CPU equivalents, and the
    result is compiled in the target module's namespace.  Every fragment must occur
    exactly the expected number of times.  This keeps the rest of megatron's logic
    as-is (no copy of megatron code lives in this repository) and makes a changed
    call site impossible to miss.

  If a check fails, ``MegatronCpuCompatError`` names the patch and the megatron-core
  version: "megatron-core X changed <target>; update rlinf_pipe/models/megatron_cpu_patches.py".
* Supported megatron-core range: ``SUPPORTED_VERSIONS`` (0.16.x).  Other versions only
  warn; the per-patch checks still run and are what actually decides.

No ``TorchFunctionMode`` and no global torch patch is used: all patches are per call site.
See docs/megatron-cpu.md.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
import threading
import warnings
from typing import Any, Callable

import torch

from rlinf_pipe.models.megatron_cpu_patches import PATCHES, Patch

__all__ = [
    "SUPPORTED_VERSIONS",
    "MegatronCpuCompatError",
    "Patch",
    "PATCHES",
    "enable_cpu_compat",
    "disable_cpu_compat",
    "is_enabled",
    "check_patches",
    "describe_patches",
    "megatron_core_version",
]

# Supported megatron-core versions: (major, minor) pairs. 0.17+ needs Python >= 3.12.
SUPPORTED_VERSIONS: tuple[tuple[int, int], ...] = ((0, 16),)

_PATCH_TABLE = "rlinf_pipe/models/megatron_cpu_patches.py"


class MegatronCpuCompatError(RuntimeError):
    """A patch target is missing or no longer has the shape this module expects."""


def megatron_core_version() -> str:
    from rlinf_pipe.models.megatron_import import import_megatron_core

    import_megatron_core()
    from megatron.core import package_info

    return package_info.__version__


def _version_supported(version: str) -> bool:
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) in SUPPORTED_VERSIONS


_lock = threading.Lock()
_enabled = False


# --------------------------------------------------------------------------------------
# Checking and applying
# --------------------------------------------------------------------------------------


def _fail(patch: Patch, detail: str) -> MegatronCpuCompatError:
    version = _safe_version()
    return MegatronCpuCompatError(
        f"megatron-core {version} changed {patch.target} (patch '{patch.name}': {detail}); "
        f"update {_PATCH_TABLE}"
    )


def _safe_version() -> str:
    try:
        return megatron_core_version()
    except Exception:  # pragma: no cover - megatron not importable
        return "<unknown>"


def _resolve(patch: Patch) -> tuple[Any, str, Any]:
    """Return (owner, attribute name, raw attribute) for the patch target."""
    try:
        module = importlib.import_module(patch.module_name)
    except ImportError as exc:
        raise _fail(patch, f"module cannot be imported: {exc}") from exc
    owner: Any = module
    parts = patch.qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            raise _fail(patch, f"'{part}' no longer exists")
    attr = parts[-1]
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    if raw is None:
        raise _fail(patch, f"'{attr}' no longer exists")
    return owner, attr, raw


def _function_of(raw: Any) -> Callable:
    """Underlying plain function of a (static/class)method or decorated function."""
    if isinstance(raw, (staticmethod, classmethod)):
        raw = raw.__func__
    return inspect.unwrap(raw)


def _current_source(patch: Patch, raw: Any) -> str:
    func = _function_of(raw)
    try:
        return textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError) as exc:
        raise _fail(patch, f"source not available: {exc}") from exc


def _check(patch: Patch) -> tuple[Any, str, Any]:
    owner, attr, raw = _resolve(patch)
    if patch.patched is not None and raw is patch.patched:
        # already applied: check the original we replaced
        raw = patch.original
    func = _function_of(raw)
    if not callable(func):
        raise _fail(patch, "target is not a function")
    if patch.kind == "replace":
        params = tuple(inspect.signature(func).parameters)
        if params != patch.params:
            raise _fail(patch, f"signature is {params}, expected {patch.params}")
    elif patch.kind == "edit":
        src = _current_source(patch, raw)
        for old, _new, count in patch.edits:
            found = src.count(old)
            if found != count:
                raise _fail(patch, f"expected {count} occurrence(s) of {old!r}, found {found}")
        if "__class__" in src:
            raise _fail(patch, "source uses __class__ explicitly; cannot be recompiled")
    else:  # pragma: no cover - programming error
        raise ValueError(f"unknown patch kind {patch.kind!r}")
    for alias in patch.aliases:
        mod_name, alias_attr = alias.split(":", 1)
        mod = importlib.import_module(mod_name)
        current = getattr(mod, alias_attr, None)
        if current is not raw and (patch.patched is None or current is not patch.patched):
            raise _fail(patch, f"alias {alias} no longer refers to the target")
    return owner, attr, raw


def _build_edited(patch: Patch, owner: Any, raw: Any) -> Any:
    src = _current_source(patch, raw)
    for old, new, _count in patch.edits:
        src = src.replace(old, new)
    func = _function_of(raw)
    module = sys.modules[func.__module__]
    # Compile inside a factory taking ``__class__`` so that zero-argument super() in
    # methods keeps working after recompilation.
    factory_src = (
        "def __rlinf_factory__(__class__):\n"
        + textwrap.indent(src, "    ")
        + f"\n    return {func.__name__}\n"
    )
    filename = f"<megatron_cpu patch {patch.name}: {inspect.getsourcefile(func)}>"
    code = compile(factory_src, filename, "exec")
    scope: dict[str, Any] = {}
    exec(code, module.__dict__, scope)  # noqa: S102 - megatron's own source, edited
    cls = owner if isinstance(owner, type) else None
    new = scope["__rlinf_factory__"](cls)
    new_func = _function_of(new)
    new_func.__qualname__ = func.__qualname__
    new_func.__doc__ = func.__doc__
    new_func.__rlinf_cpu_patch__ = patch.name
    return new


def _rebind_imported_names(old: Any, new: Any) -> list[tuple[Any, str]]:
    """``from x import f [as g]`` copies ``f`` into the importing module: rebind those
    copies (module-level names bound to the very same object) in already-imported
    megatron modules. Modules imported later pick up the patched attribute themselves."""
    rebound = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("megatron"):
            continue
        for name, value in list(getattr(mod, "__dict__", {}).items()):
            if value is old:
                setattr(mod, name, new)
                rebound.append((mod, name))
    return rebound


def check_patches() -> list[str]:
    """Verify that every patch target exists with the expected shape (whether or not
    the patches are applied, and whether or not CUDA is present). Raises
    ``MegatronCpuCompatError`` naming the first broken patch; returns the patch names."""
    for patch in PATCHES:
        _check(patch)
    return [p.name for p in PATCHES]


def _version_guard() -> None:
    version = megatron_core_version()
    if not _version_supported(version):
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VERSIONS)
        warnings.warn(
            f"megatron-core {version} is outside the range supported by rlinf_pipe.models.megatron_cpu "
            f"({supported}); the per-call-site checks still run",
            RuntimeWarning,
            stacklevel=3,
        )


def enable_cpu_compat() -> bool:
    """Patch megatron-core's CUDA-only call sites for CPU use.

    Returns ``True`` when the patches are active (first call or already applied) and
    ``False`` when CUDA is available (nothing is patched). Idempotent and thread-safe.
    Raises ``MegatronCpuCompatError`` if megatron-core changed one of the targets; in
    that case nothing is patched.
    """
    global _enabled
    if torch.cuda.is_available():
        return False
    with _lock:
        if _enabled:
            return True
        _version_guard()
        checked = [(patch, *_check(patch)) for patch in PATCHES]  # all or nothing
        built = []
        for patch, owner, attr, raw in checked:
            if patch.kind == "replace":
                new = patch.replacement
            else:
                new = _build_edited(patch, owner, raw)
            built.append((patch, owner, attr, raw, new))
        for patch, owner, attr, raw, new in built:
            patch.original = raw
            patch.patched = new
            setattr(owner, attr, new)
            for alias in patch.aliases:
                mod_name, alias_attr = alias.split(":", 1)
                setattr(importlib.import_module(mod_name), alias_attr, new)
            if not isinstance(owner, type):
                patch.rebound = _rebind_imported_names(raw, new)
        _enabled = True
        return True


def disable_cpu_compat() -> None:
    """Restore every patched target (mainly for tests)."""
    global _enabled
    with _lock:
        if not _enabled:
            return
        for patch in reversed(PATCHES):
            owner, attr, _raw = _resolve(patch)
            setattr(owner, attr, patch.original)
            for alias in patch.aliases:
                mod_name, alias_attr = alias.split(":", 1)
                setattr(importlib.import_module(mod_name), alias_attr, patch.original)
            for mod, name in patch.rebound:
                setattr(mod, name, patch.original)
            patch.original = patch.patched = None
            patch.rebound = []
        _enabled = False


def is_enabled() -> bool:
    return _enabled


def describe_patches() -> list[dict[str, str]]:
    """One entry per patch: name, target, kind, reason, applied."""
    return [
        {
            "name": p.name,
            "target": p.target,
            "kind": p.kind,
            "reason": p.reason,
            "applied": str(_enabled),
        }
        for p in PATCHES
    ]
