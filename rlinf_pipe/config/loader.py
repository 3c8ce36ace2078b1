"""Load a run config: YAML file + `key=value` overrides -> typed `Config`, then one validation pass.

Errors are `ConfigError`s that name the key, where it came from (file or override) and what would be valid.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.utils.text import closest


@dataclasses.dataclass(frozen=True)
class _Sources:
    """Where config values came from, to name them in errors."""

    file: str | None
    overrides: tuple[str, ...]

    def of(self, path: str) -> str:
        for override in reversed(self.overrides):
            key = override.split("=", 1)[0].lstrip("+")
            if key == path or path.startswith(key + ".") or key.startswith(path + "."):
                return f"override `{override}`"
        return f"file {self.file}" if self.file else "the defaults"


def find_config_file(config_path: str | Path, config_name: str) -> Path:
    """Resolve `--config-path DIR --config-name NAME` (NAME with or without .yaml)."""
    folder = Path(config_path)
    if not folder.is_dir():
        raise ConfigError(f"--config-path {config_path}: no such folder")
    name = config_name if config_name.endswith((".yaml", ".yml")) else f"{config_name}.yaml"
    path = folder / name
    if not path.is_file():
        available = [p.stem for p in folder.glob("*.yaml")]
        raise ConfigError(
            f"--config-name {config_name}: no file {path}; " + closest(Path(name).stem, available)
        )
    return path


UTF16_MARKS = (b"\xff\xfe", b"\xfe\xff")


def read_config_file(file: Path) -> dict[str, Any]:
    """A YAML config file's mapping of sections (unresolved), or a `ConfigError` naming the file for text that is
    not UTF-8, a top level that is not a mapping, or invalid YAML (raised by the caller's handler)."""
    data = file.read_bytes()
    if data.startswith(UTF16_MARKS):
        raise ConfigError(f"file {file}: UTF-16 text; configs are read as UTF-8: save the file as UTF-8")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"file {file}: not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x}, perhaps "
                          "Latin-1); configs are read as UTF-8: save the file as UTF-8") from None
    if "\x00" in text:
        raise ConfigError(f"file {file}: holds a NUL character (byte {text.index(chr(0))}); is it a text file?")
    top = yaml.safe_load(text)  # (only its type: OmegaConf's own loader reads the values, `1e-6` as a number)
    if top is None:
        return {}
    if not isinstance(top, dict):
        raise ConfigError(f"file {file}: the top level must be a mapping of sections (`cluster:`, `runner:`, ...), "
                          f"got {type_name(type(top))} {str(top)[:40]!r}")
    return typing.cast(dict[str, Any], OmegaConf.to_container(OmegaConf.create(text), resolve=False))


def load_config(
    config_path: str | Path | None = None,
    config_name: str | None = None,
    overrides: typing.Sequence[str] = (),
) -> Config:
    """Build and validate a `Config` from an optional YAML file plus dotlist overrides.

    With no file, the schema defaults (the tiny CPU pipeline) are the base.
    """
    file = find_config_file(config_path or ".", config_name) if config_name else None
    sources = _Sources(str(file) if file else None, tuple(overrides))
    try:
        merged: dict[str, Any] = {}
        whole: set[str] = set()  # mapping fields given as a whole: they replace the default, never merge into it
        if file is not None:
            merged = read_config_file(file)
            whole.update(p for p in MAPPING_FIELDS if _select(merged, p) is not None)
        for key, value in _parse_overrides(overrides):
            _check_split_placement(key, value)
            # A mapping-valued field (e.g. cluster.component_placement) is replaced by its override, not merged;
            # one of its entries (cluster.component_placement.actor) is merged into it.
            if _is_mapping_field(key):
                whole.add(key)
            _update(merged, key, value, merge=not _is_mapping_field(key))
        # The schema defaults underneath, so interpolations may name any key and an entry override of a mapping
        # the file does not set merges into the default mapping.
        full = _merge(_defaults(), merged)
        for path in whole:
            _update(full, path, _select(merged, path), merge=False)
        raw = OmegaConf.to_container(OmegaConf.create(full), resolve=True) if _has_interpolation(full) else full
    except OmegaConfBaseException as exc:
        where = f"file {file}" if file else "overrides"
        raise ConfigError(f"{where}: {exc}".split("\n    full_key")[0]) from None
    except yaml.YAMLError as exc:  # the file's own syntax (overrides are parsed, with their own message, above)
        problem = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise ConfigError(f"file {file}: not valid YAML: {problem}") from None
    cfg = _convert(Config, raw or {}, "", sources)
    from rlinf_pipe.config.validate import validate_config

    validate_config(cfg, sources.of)
    return cfg


@functools.lru_cache(maxsize=None)
def _hints(tp: Any) -> dict[str, Any]:
    """The resolved field types of a schema dataclass (cached: resolving them is most of a load's time)."""
    return typing.get_type_hints(tp)


def _defaults() -> dict[str, Any]:
    """The schema defaults as plain containers (a fresh copy each call)."""
    return copy.deepcopy(_DEFAULTS)


def _merge(base: Any, other: Any) -> Any:
    """`other` deep-merged over `base` (mappings merge key by key; anything else replaces); `base` is updated."""
    if isinstance(base, dict) and isinstance(other, dict):
        for key, value in other.items():
            base[key] = _merge(base[key], value) if key in base else value
        return base
    return other


def _update(tree: dict[str, Any], dotted: str, value: Any, merge: bool) -> None:
    """Set `dotted` (e.g. `cluster.component_placement.actor`, or a list index `data.x.0`) in `tree`, creating
    mappings on the way; with `merge`, a mapping value merges into the mapping already there."""
    *parents, last = dotted.split(".")
    node: Any = tree
    for part in parents:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"override of `{dotted}`: `{part}` is inside a value that is not a mapping")
        if not isinstance(node.get(part), (dict, list)):
            node[part] = {}
        node = node[part]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = _merge(node[last], value) if merge and isinstance(node.get(last), dict) else value
    else:
        raise ConfigError(f"override of `{dotted}`: `{last}` is inside a value that is not a mapping")


def _select(tree: Any, dotted: str) -> Any:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _has_interpolation(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_has_interpolation(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_interpolation(v) for v in value)
    return False


def _parse_overrides(overrides: typing.Sequence[str]) -> list[tuple[str, Any]]:
    """`key=value` strings -> (key, YAML-parsed value) pairs."""
    parsed = []
    for override in overrides:
        key, sep, _ = override.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override `{override}` must look like key=value, e.g. runner.max_steps=5")
        key = key.strip().lstrip("+")
        text = override.partition("=")[2]
        try:
            value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]))["v"]
        except Exception as exc:  # yaml's and OmegaConf's parse errors (user input, whatever the exception class)
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"override `{override}`: the value `{text}` is not valid YAML ({reason}); quote a string value, "
                f"e.g. {key}='...', and close every bracket and quote"
            ) from None
        parsed.append((key, value))
    return parsed


def _check_split_placement(key: str, value: Any) -> None:
    """`cluster.component_placement={actor,rollout: all}` on a command line: YAML splits the flow mapping at the
    comma into `actor: null` and `rollout: all`. Say so, with the quoting that keeps the joined key. Likewise
    `{rollout:0, actor:1}`: without a space after the colon, `rollout:0` is one key with no value."""
    if key == "cluster.component_placement" and isinstance(value, dict):
        empty = [name for name, ids in value.items() if ids is None]
        glued = [str(name) for name in empty if ":" in str(name)]
        split = [str(name) for name in empty if ":" not in str(name)]
        problems = []
        if glued:
            fixed = ", ".join(f"`{n.split(':', 1)[0]}: {n.split(':', 1)[1]}`" for n in glued)
            problems.append(f"{', '.join(f'`{n}`' for n in glued)} got no GPUs: YAML needs a space after the colon, "
                            f"or it reads one key with no value; write {fixed}")
        if split:
            problems.append(f"{', '.join(f'`{n}`' for n in split)} got no GPUs. YAML splits `{{actor,rollout: all}}` "
                            "at the comma into `actor: null, rollout: all`; quote a joined key inside the braces: "
                            "'cluster.component_placement={\"actor,rollout\": all}'")
        if problems:
            raise ConfigError(f"override `{key}=...`: " + "; and ".join(problems))


def _mapping_fields(tp: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the mapping-valued fields of a schema dataclass (e.g. `cluster.component_placement`)."""
    out = []
    for name, hint in _hints(tp).items():
        path = f"{prefix}{name}"
        if dataclasses.is_dataclass(hint):
            out += _mapping_fields(hint, f"{path}.")
        elif typing.get_origin(hint) is dict:
            out.append(path)
    return out


MAPPING_FIELDS = _mapping_fields(Config)
_DEFAULTS = dataclasses.asdict(Config())


def _is_mapping_field(key: str) -> bool:
    tp: Any = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(tp):
            return False
        hints = _hints(tp)
        if part not in hints:
            return False
        tp = hints[part]
    return typing.get_origin(tp) is dict


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of {type_name(typing.get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping (section)"
    return getattr(tp, "__name__", str(tp))


class _Mismatch(Exception):
    pass


class _NotFinite(ConfigError):
    """A NaN or an infinity where the schema wants a number."""


def _convert(tp: Any, value: Any, path: str, sources: _Sources) -> Any:
    """Convert a plain value to `tp`, raising ConfigError with the key path on any mismatch."""
    try:
        return _convert_inner(tp, value, path, sources)
    except _Mismatch:
        raise ConfigError(
            f"{path}: expected {type_name(tp)}, got {type(value).__name__} {value!r} (from {sources.of(path)})"
        ) from None


def _convert_inner(tp: Any, value: Any, path: str, sources: _Sources) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch
        hints = _hints(tp)
        fields = {f.name for f in dataclasses.fields(tp)}
        for key in value:
            if key not in fields:
                key_path = f"{path}.{key}" if path else str(key)
                section = f"section `{path}`" if path else "the top level"
                raise ConfigError(
                    f"unknown key `{key_path}` (from {sources.of(key_path)}) in {section}; {closest(str(key), fields)}"
                )
        kwargs = {
            key: _convert(hints[key], item, f"{path}.{key}" if path else key, sources) for key, item in value.items()
        }
        return tp(**kwargs)
    if origin in (Union, types.UnionType):
        refusal: _NotFinite | None = None  # a number arm that refused the value says why
        for arg in typing.get_args(tp):
            try:
                return _convert_inner(arg, value, path, sources)
            except _NotFinite as exc:
                refusal = refusal or exc
            except (_Mismatch, ConfigError):
                continue
        if refusal is not None:
            raise refusal
        raise _Mismatch
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise _Mismatch
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch
        (item_tp,) = typing.get_args(tp)
        return [_convert(item_tp, item, f"{path}[{i}]", sources) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        _, item_tp = typing.get_args(tp)
        return {str(k): _convert(item_tp, item, f"{path}.{k}", sources) for k, item in value.items()}
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise _NotFinite(f"{path}: expected a finite number, got {value} (from {sources.of(path)})")
            return float(value)
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            if "\x00" in value:
                raise ConfigError(f"{path}: holds a NUL character (from {sources.of(path)}), which no name, path or "
                                  "text of a run can hold; remove it")
            return value
        raise _Mismatch
    raise TypeError(f"schema type {tp!r} at {path} is not supported by the config loader")
