"""Writes ipc/_wire_table.py, the plain-data copy of the replies that
sessionctl's one-shot path (supervisor/ctl/fast.py) decodes, from their
msgspec Structs in ipc.messages: run by a maintainer, never at run time.

    .venv/bin/python -m ipc.wiregen          # rewrite ipc/_wire_table.py
    .venv/bin/python -m ipc.wiregen --check  # exit 1 if it is out of date

Why a generated copy: the one-shot path must not import msgspec (40-60 ms
of a 50 ms budget), yet must decode exactly what the full path decodes.
So the Structs stay the one description of the schema, and this turns them
into tables of builtins (a field's name, its kind, its default) that cost
nothing to import.  A new field is added to its Struct; regenerating
carries it over, and tests/test_ctl_fast.py fails until the checked-in
table is regenerated.

A kind is a small string grammar the one-shot path builds its checks from:
"str", "int", "float", "bool", "any", KIND + "?" (or None), "list[KIND]",
"dict[str,KIND]", a Struct's tag (a nested Struct), or an enum's name in
snake case (its values in ENUMS).  A field of a type outside the grammar
(or with constraints, which the one-shot path would have to check too) is
refused here, with its name: extend the grammar in both places first.
"""

from __future__ import annotations

import enum
import re
import sys
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from ipc import messages as m
from ipc.errors import UnsupportedField

__all__ = ["REPLIES", "TABLE_PATH", "UnsupportedField", "render", "main"]

TABLE_PATH = Path(__file__).with_name("_wire_table.py")

# The replies the one-shot path reads: to hello, its requests, and refusals.
# The Structs they nest are added by following their fields.
REPLIES: tuple[type[msgspec.Struct], ...] = (
    m.Welcome, m.Error, m.SessionList, m.StatusReply, m.Pong, m.StatsReply,
)


def _no_constraints(t: Any, where: str) -> None:
    for name in ("gt", "ge", "lt", "le", "multiple_of", "min_length", "max_length", "pattern"):
        if getattr(t, name, None) is not None:
            raise UnsupportedField(f"{where}: a constraint ({name}) the one-shot path does not check")


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class _Walk:
    def __init__(self) -> None:
        self.structs: dict[str, tuple[tuple[str, str, str], ...]] = {}
        self.enums: dict[str, tuple[str, ...]] = {}
        self._classes: dict[str, type] = {}

    def struct(self, info: mi.StructType) -> str:
        tag = info.tag
        if not isinstance(tag, str) or info.tag_field != "type" or info.array_like:
            raise UnsupportedField(f"{info.cls.__name__}: not a map tagged by `type`")
        known = self._classes.get(tag)
        if known is info.cls:
            return tag
        if known is not None:
            raise UnsupportedField(f"{info.cls.__name__} and {known.__name__} share the tag {tag!r}")
        self._classes[tag] = info.cls
        self.structs[tag] = ()  # (a Struct that nests itself finds its tag taken)
        fields = []
        for f in info.fields:
            where = f"{info.cls.__name__}.{f.name}"
            if f.encode_name != f.name:
                raise UnsupportedField(f"{where}: renamed on the wire")
            fields.append((f.name, self.kind(f.type, where), _default(f, where)))
        self.structs[tag] = tuple(fields)
        return tag

    def kind(self, t: Any, where: str) -> str:
        _no_constraints(t, where)
        simple: dict[type, str] = {mi.StrType: "str", mi.IntType: "int", mi.FloatType: "float", mi.BoolType: "bool",
                  mi.AnyType: "any"}
        if type(t) in simple:
            return simple[type(t)]
        if isinstance(t, mi.UnionType):
            rest = [x for x in t.types if not isinstance(x, mi.NoneType)]
            if len(rest) == 1 and len(t.types) == 2:
                return self.kind(rest[0], where) + "?"
        elif isinstance(t, mi.ListType):
            return f"list[{self.kind(t.item_type, where)}]"
        elif isinstance(t, mi.DictType) and isinstance(t.key_type, mi.StrType):
            _no_constraints(t.key_type, where)
            return f"dict[str,{self.kind(t.value_type, where)}]"
        elif isinstance(t, mi.StructType):
            return self.struct(t)
        elif isinstance(t, mi.EnumType) and issubclass(t.cls, enum.StrEnum):
            name = _snake(t.cls.__name__)
            self.enums[name] = tuple(member.value for member in t.cls)
            return name
        raise UnsupportedField(f"{where}: no kind for {t!r}")


def _default(f: mi.Field, where: str) -> str:
    """The default as the table's source text: REQUIRED, list or dict (a new
    empty one each time), or a constant."""
    if f.required:
        return "REQUIRED"
    if f.default_factory is not msgspec.NODEFAULT:
        if f.default_factory in (list, dict):
            return "list" if f.default_factory is list else "dict"
        raise UnsupportedField(f"{where}: a default factory other than list or dict")
    if f.default is None or type(f.default) in (str, int, float, bool):
        return repr(f.default)
    raise UnsupportedField(f"{where}: a default of type {type(f.default).__name__}")


def render() -> str:
    """The text of ipc/_wire_table.py, as ipc.messages describes it now."""
    walk = _Walk()
    replies = [walk.struct(mi.type_info(cls)) for cls in REPLIES]  # type: ignore[arg-type]
    out = [
        '"""GENERATED by `python -m ipc.wiregen` from ipc.messages: do not edit.',
        "",
        "The control protocol's replies that sessionctl's one-shot path decodes",
        "(supervisor/ctl/fast.py), as plain data: that path imports no msgspec.",
        "Each Struct's fields in declared order (the order `--json` prints):",
        "(name, kind, default); REQUIRED: none; list, dict: a new empty one.",
        'The kinds\' grammar is in ipc/wiregen.py."""',
        "",
        "REQUIRED = object()",
        "",
        f"PROTOCOL_VERSION = {m.PROTOCOL_VERSION!r}",
        "# Error codes added after protocol 1 (Hello.error_codes), sorted.",
        f"NEW_ERROR_CODES = {sorted(c.value for c in m.NEW_ERROR_CODES)!r}",
        "",
        "# Enums by kind: their values.",
        "ENUMS: dict[str, tuple[str, ...]] = {",
    ]
    out += [f"    {name!r}: {values!r}," for name, values in sorted(walk.enums.items())]
    out += ["}", "", "# Replies and the Structs they nest, by tag.",
            "STRUCTS: dict[str, tuple[tuple[str, str, object], ...]] = {"]
    for tag, fields in walk.structs.items():
        out.append(f"    {tag!r}: (")
        out += [f"        ({name!r}, {kind!r}, {default})," for name, kind, default in fields]
        out.append("    ),")
    out += ["}", "", "# The tags of the replies (the others are only nested).", f"REPLIES: tuple[str, ...] = {tuple(replies)!r}", ""]
    return "\n".join(out)


def write_or_check(argv: list[str] | None, path: Path, text: str, command: str, against: str = "") -> int:
    """A generator's command line (this one's and ipc.protogen's): write
    `text` to `path`, or with `--check` say whether it is current (1: stale,
    naming `command`, which regenerates it).  `against`: what it is generated from."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--check"]:
        current = path.read_text() if path.exists() else ""
        if current != text:
            print(f"{path} is out of date{against}: run `{command}`", file=sys.stderr)
            return 1
        return 0
    if args:
        print(f"usage: {command} [--check]", file=sys.stderr)
        return 2
    path.write_text(text)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return write_or_check(argv, TABLE_PATH, render(), "python -m ipc.wiregen")


if __name__ == "__main__":
    sys.exit(main())
