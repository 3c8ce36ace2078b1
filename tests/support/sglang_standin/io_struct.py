"""SGLang's request classes (`sglang.srt.managers.io_struct`), built from the contract: msgspec structs with
keyword-only fields, each also carrying `rid`, as the real ones. The real module does not import from the wheel
installed with `--no-deps` (its import chain, `sglang.srt.utils.common` first, needs orjson and the rest of
sglang's runtime dependencies), so the tests cannot build requests from the real classes."""

from __future__ import annotations

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

__all__ = sorted(CONTRACT["request_classes"])
