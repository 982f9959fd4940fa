"""docs/protocol.schema.json applied to a message as the wire carries it
(decoded msgpack): the subset of JSON Schema that msgspec writes, plus our
`x-msgpack: "bin"` for bytes.  Used by the conformance tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMA_FILE = Path(__file__).resolve().parent.parent / "docs" / "protocol.schema.json"
SCHEMA = json.loads(SCHEMA_FILE.read_text())
DEFS = SCHEMA["$defs"]


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = DEFS[node["$ref"].rsplit("/", 1)[1]]
    return node


def _problems(value: Any, node: dict[str, Any], where: str) -> list[str]:
    """What a JSON Schema (the subset msgspec writes) finds wrong with value."""
    node = _resolve(node)
    if "anyOf" in node:
        mapping = node.get("discriminator", {}).get("mapping")
        if mapping is not None and isinstance(value, dict):
            ref = mapping.get(value.get("type"))
            if ref is None:
                return [f"{where}: no message of type {value.get('type')!r} here"]
            return _problems(value, {"$ref": ref}, where)
        options = [_problems(value, option, where) for option in node["anyOf"]]
        return [] if any(not p for p in options) else min(options, key=len)
    if "enum" in node:
        return [] if value in node["enum"] else [f"{where}: {value!r} not one of {node['enum']}"]
    kinds = {"integer": int, "number": (int, float), "string": str, "boolean": bool, "null": type(None),
             "array": list, "object": dict}
    kind = node.get("type")
    if kind is not None:
        if kind == "string" and node.get("x-msgpack") == "bin":
            ok = isinstance(value, bytes)
        else:
            ok = isinstance(value, kinds[kind]) and not (kind in ("integer", "number") and isinstance(value, bool))
        if not ok:
            return [f"{where}: {value!r} is not {kind}"]
    out: list[str] = []
    if kind == "object" and "properties" in node:
        props = node["properties"]
        out += [f"{where}: missing {key!r}" for key in node.get("required", ()) if key not in value]
        out += [f"{where}: unknown field {key!r}" for key in value if key not in props]
        for key, item in value.items():
            if key in props:
                out += _problems(item, props[key], f"{where}.{key}")
    elif kind == "object" and isinstance(node.get("additionalProperties"), dict):
        for key, item in value.items():
            out += _problems(item, node["additionalProperties"], f"{where}[{key!r}]")
    elif kind == "array" and "items" in node:
        for i, item in enumerate(value):
            out += _problems(item, node["items"], f"{where}[{i}]")
    return out


def conforms(msg: dict[str, Any], union: str) -> None:
    problems = _problems(msg, DEFS[union], msg.get("type", "?"))
    assert not problems, f"{msg!r} does not match docs/protocol.schema.json: {problems}"
