"""User tools from `tools.custom`: `package.module:function`.

The function's annotated signature becomes the JSON schema the model sees:
`str`, `int`, `float`, `bool` and `list[...]` of those; `X | None` /
`Optional[X]` is X; a parameter with a default is optional.  The docstring is
the description.  The first parameter is the main argument (what permission
rules match on).  Anything else (no annotation, *args, positional-only, other
types) is refused when the handler starts, naming the tool and parameter, so
a bad tool fails the worker's boot instead of confusing the model later.

Sync functions run in a thread so they cannot stall the worker's loop (and
with it the heartbeat); async functions are awaited.  They run inside the
worker process, so unlike `bash` they see its whole environment.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import types
import typing
from collections.abc import Callable
from typing import Any

from session_worker.agent._errors import ToolLoadError
from session_worker.agent._tools import Tool, ToolEnv
from session_worker.handler import import_object

__all__ = ["load_custom_tool", "schema_for"]

_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _json_type(annotation: Any, where: str) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _json_type(args[0], where)
    if origin is list:
        (item,) = typing.get_args(annotation) or (None,)
        if item in _SCALARS:
            return {"type": "array", "items": {"type": _SCALARS[item]}}
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    raise ToolLoadError(
        f"{where}: unsupported type {annotation!r}; use str, int, float, bool, "
        "list[...] of those, or Optional of them"
    )


def schema_for(fn: Callable[..., Any], where: str) -> tuple[dict[str, Any], str | None]:
    """The JSON schema of `fn`'s parameters and the name of its first one."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:
        raise ToolLoadError(f"{where}: cannot read its annotations: {exc}") from exc
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        spot = f"{where}, parameter {param.name!r}"
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise ToolLoadError(f"{spot}: only named parameters can be filled from JSON")
        if param.name not in hints:
            raise ToolLoadError(f"{spot}: needs a type annotation")
        properties[param.name] = _json_type(hints[param.name], spot)
        if param.default is param.empty:
            required.append(param.name)
    schema = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return schema, next(iter(properties), None)


def load_custom_tool(spec: str) -> Tool:
    fn = import_object(spec, "tools.custom entry", ToolLoadError)
    name = getattr(fn, "__name__", spec.partition(":")[2])
    schema, main_arg = schema_for(fn, f"custom tool {spec!r}")
    description = inspect.getdoc(fn) or f"User tool {name}."
    is_async = inspect.iscoroutinefunction(fn)

    async def run(args: dict[str, Any], env: ToolEnv) -> str:
        if is_async:
            result = await fn(**args)
        else:
            result = await asyncio.to_thread(fn, **args)
        if isinstance(result, str):
            return result
        try:
            return json.dumps(result, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            return str(result)

    return Tool(name, description, schema, main_arg, run)
