"""SGLang's request classes (`sglang.srt.managers.io_struct`), built from the contract: msgspec structs with
keyword-only fields, each also carrying `rid`, as the real ones; and `GenerateReqInput` (a dataclass in sglang)
with the fields an adapter sets. The real module does not import from the wheel
installed with `--no-deps` (its import chain, `sglang.srt.utils.common` first, needs orjson and the rest of
sglang's runtime dependencies), so the tests cannot build requests from the real classes."""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

import msgspec

from .contract import CONTRACT, default

_NO_DEFAULT = object()


def _build(name: str, fields: list[list[Any]]) -> type:
    spec: list[Any] = []
    for field, source in [*fields, ["rid", "None"]]:
        spec.append((field, Any) if source is None else (field, Any, default(source)))
    return msgspec.defstruct(name, spec, kw_only=True)


for _name, _fields in CONTRACT["request_classes"].items():
    globals()[_name] = _build(_name, _fields)


def _literal_or_none(source: str | None) -> Any:
    try:
        return default(source)
    except (ValueError, SyntaxError):  # (`field(default=None, kw_only=True)`)
        node = ast.parse(source or "None", mode="eval").body
        kw = {k.arg: k.value for k in getattr(node, "keywords", [])}
        return ast.literal_eval(kw["default"]) if "default" in kw else None


GenerateReqInput = dataclasses.make_dataclass(
    "GenerateReqInput",
    [(name, Any, dataclasses.field(default=_literal_or_none(source)))
     for name, source in [*CONTRACT["generate_request_fields"].items(), ("text", "None")]],
)

__all__ = sorted([*CONTRACT["request_classes"], "GenerateReqInput"])
