"""`sessiond config default`: the config file with every key, its default and
its meaning.  The meanings are the comments above each field in
`ipc.settings` and in `supervisor.config`, read from the source: one place
to write them.  Runs in `sessiond config default` only."""

from __future__ import annotations

import inspect
import re
import textwrap
import typing
from typing import Any

import msgspec
import tomli_w

from ipc.settings import McpServer, PermissionRule

__all__ = ["render"]


def render(config: msgspec.Struct) -> str:
    """Every key of `config` with its value and, above it, its meaning.
    Keys unset (TOML has no null) are printed commented out."""
    out = [
        "# sessiond configuration: every key, its default and its meaning.",
        "# Keys shown commented out are unset by default; uncomment to set one.",
    ]
    _emit_table(config, "", out)
    return "\n".join(out) + "\n"


# Arrays of tables: the struct of one item, a heading, and the example
# shown commented out in the default config.
_EXAMPLES: dict[str, tuple[type, str, tuple[tuple[str, str], ...]]] = {
    "permissions": (PermissionRule, "Permission rules, first match wins; none by default. One rule:",
                    (("tool", '"bash"'), ("match", '"rm *"'), ("action", '"ask"'))),
    "mcp.servers": (McpServer, "MCP servers (docs/agent.md); none by default. A stdio one "
                               "(or, instead of command, url = \"http://127.0.0.1:8931/mcp\"):",
                    (("name", '"files"'), ("command", '["/usr/local/bin/files-mcp", "--root", "."]'),
                     ("lazy", "true"))),
}

# Filled by the daemon, never written in a file: not printed.
_NOT_IN_FILES = frozenset({"mcp.listed"})

# Meanings of fields that carry no comment in the source (keep this short:
# a comment above the field is the better place).
_MEANINGS_NOT_IN_SOURCE = {
    "provider.model": "Model name sent to the provider; unset = no provider.",
}


def _field_comments(cls: type) -> dict[str, str]:
    """The comment lines right above each field of a config Struct."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}  # no source (a frozen build): the keys go without meanings
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped[1:].strip())
            continue
        field = _FIELD_LINE.match(line)
        if field:
            comments[field.group(1)] = " ".join(pending)
        pending = []
    return comments


_FIELD_LINE = re.compile(r"^    ([A-Za-z_]\w*)\s*:")


def _comment(text: str) -> list[str]:
    return ["# " + line for line in textwrap.wrap(text, 76)] if text else []


def _placeholder(cls: type, name: str) -> str:
    hint = typing.get_type_hints(cls).get(name)
    inner = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = getattr(inner[0] if inner else hint, "__name__", "value")
    return {"int": "<integer>", "float": "<number>", "str": '"<text>"'}.get(kind, f"<{kind}>")


def _emit_table(obj: msgspec.Struct, path: str, out: list[str]) -> None:
    cls = type(obj)
    meanings = _field_comments(cls)
    tables: list[tuple[str, msgspec.Struct]] = []
    arrays: list[tuple[str, list[Any]]] = []
    if path:
        out.append(f"\n[{path}]")
    for attr, name in zip(cls.__struct_fields__, cls.__struct_encode_fields__):
        value = getattr(obj, attr)
        key = f"{path}.{name}" if path else name
        if key in _NOT_IN_FILES:
            continue
        if isinstance(value, msgspec.Struct):
            tables.append((key, value))
            continue
        if key in _EXAMPLES:
            arrays.append((key, value))
            continue
        meaning = meanings.get(attr) or _MEANINGS_NOT_IN_SOURCE.get(key, "")
        out.extend(_comment(meaning))
        if value is None:
            out.append(f"# {name} = {_placeholder(cls, attr)}")
        else:
            out.append(tomli_w.dumps({name: msgspec.to_builtins(value)}).rstrip())
    for key, table in tables:
        _emit_table(table, key, out)
    for key, value in arrays:
        # Arrays of tables ([[permissions]], [[mcp.servers]]): none by
        # default; one commented-out table shows the shape.
        item_cls, heading, example = _EXAMPLES[key]
        meanings = _field_comments(item_cls)
        out.append("")
        out.extend(_comment(heading))
        out.append(f"# [[{key}]]")
        for name, shown in example:
            out.extend(_comment(meanings.get(name, "")))
            out.append(f"# {name} = {shown}")
        out.extend(tomli_w.dumps({key: msgspec.to_builtins(value)}).rstrip().splitlines() if value else [])
