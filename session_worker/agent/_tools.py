"""Tool registry: what the model is offered and how a call is checked.

A `Tool` is a name, a description, a JSON schema for its arguments (sent to
the model as `tools`), the name of its main argument (what permission rules
match on) and an async function.  Arguments are checked against the schema
here, before permissions and before the tool runs, so each tool body sees
well-typed values and the model gets a readable error otherwise.

The schema language is the subset `_custom` can produce and the built-ins
use: an object of string, integer, number, boolean and array-of-those
properties.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from session_worker.handler import TurnContext
from ipc.settings import SessionSettings

__all__ = ["Tool", "ToolEnv", "ToolRegistry", "check_arguments"]


@dataclass(frozen=True, slots=True)
class ToolEnv:
    """What a running tool may use: the (resolved) workspace, the settings
    and the turn's context (for `spawn_agent`)."""

    workspace: Path
    settings: SessionSettings
    ctx: TurnContext


ToolFn = Callable[[dict[str, Any], ToolEnv], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    main_arg: str | None
    run: ToolFn

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def main_argument(self, arguments: dict[str, Any]) -> str:
        if self.main_arg is None:
            return ""
        value = arguments.get(self.main_arg)
        if value is None:
            return ""
        return value if isinstance(value, str) else str(value)


class ToolRegistry:
    """Built once per settings change (`_handler.build_registry`), so the
    schemas offered to the model are built once too, not per LLM call."""

    def __init__(self, tools: Sequence[Tool]) -> None:
        self._tools = {tool.name: tool for tool in tools}
        self._schemas = [tool.schema() for tool in self._tools.values()]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def names(self) -> list[str]:
        return list(self._tools)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def schemas(self) -> list[dict[str, Any]]:
        """The same list on every call (requests carry it as it is): not
        to be changed by the caller."""
        return self._schemas


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
}


def _type_ok(value: Any, schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if not isinstance(kind, str) or kind not in _JSON_TYPES:
        return True
    # bool is an int in Python but not a JSON integer or number.
    if isinstance(value, bool) and kind != "boolean":
        return False
    if not isinstance(value, _JSON_TYPES[kind]):
        return False
    if kind == "array":
        items = schema.get("items")
        if isinstance(items, dict) and isinstance(value, list):
            return all(_type_ok(item, items) for item in value)
    return True


def check_arguments(schema: dict[str, Any], arguments: Any) -> str | None:
    """None when `arguments` fits the object schema, else what is wrong."""
    if not isinstance(arguments, dict):
        return "arguments must be a JSON object"
    properties: dict[str, Any] = schema.get("properties", {})
    missing = [name for name in schema.get("required", []) if name not in arguments]
    if missing:
        return "missing required argument(s): " + ", ".join(missing)
    if schema.get("additionalProperties") is False:
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return (
                "unknown argument(s): "
                + ", ".join(unknown)
                + "; expected: "
                + ", ".join(properties)
            )
    for name, value in arguments.items():
        prop = properties.get(name)
        if isinstance(prop, dict) and not _type_ok(value, prop):
            return f"argument {name!r} must be of type {_describe(prop)}"
    return None


def _describe(schema: dict[str, Any]) -> str:
    kind = str(schema.get("type", "any"))
    items = schema.get("items")
    if kind == "array" and isinstance(items, dict):
        return f"array of {items.get('type', 'any')}"
    return kind
