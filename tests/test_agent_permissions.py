"""The permission rule matcher, a pure function, tested exhaustively."""

from __future__ import annotations

import itertools

import pytest

from session_worker.agent._permissions import decide
from ipc.settings import PermissionRule

pytestmark = pytest.mark.pure

TOOLS = ["bash", "read_file", "write_file", "list_dir", "spawn_agent", "my_tool"]
ARGS = ["", "ls", "rm -rf /", "src/a.py", "/etc/passwd", "x\nrm y", "README.MD"]
GLOBS = ["*", "rm *", "src/*", "*.py", "/etc/*", "*rm*", "README.md", "?s", "[rs]*"]
ACTIONS = ["allow", "deny", "ask"]


def rule(tool: str, match: str, action: str) -> PermissionRule:
    return PermissionRule(tool=tool, match=match, action=action)  # type: ignore[arg-type]


def reference(rules: list[PermissionRule], tool: str, arg: str) -> str:
    """A deliberately different implementation: regex translation by hand."""
    import re

    def glob(p: str) -> str:
        out = ""
        i = 0
        while i < len(p):
            c = p[i]
            if c == "*":
                out += ".*"
            elif c == "?":
                out += "."
            elif c == "[":
                j = p.index("]", i)
                out += "[" + p[i + 1 : j] + "]"
                i = j
            else:
                out += re.escape(c)
            i += 1
        return out

    for r in rules:
        if r.tool in ("*", tool) and re.fullmatch(glob(r.match), arg, re.DOTALL):
            return r.action
    return "allow"


def test_no_rules_allows_everything() -> None:
    for tool, arg in itertools.product(TOOLS, ARGS):
        assert decide([], tool, arg) == "allow"


def test_single_rules_against_reference() -> None:
    for tool_pat, glob, action in itertools.product(TOOLS + ["*"], GLOBS, ACTIONS):
        rules = [rule(tool_pat, glob, action)]
        for tool, arg in itertools.product(TOOLS, ARGS):
            assert decide(rules, tool, arg) == reference(rules, tool, arg), (rules, tool, arg)


def test_pairs_of_rules_first_match_wins() -> None:
    singles = [rule(t, g, a) for t in ["bash", "*", "read_file"] for g in GLOBS for a in ACTIONS]
    for first, second in itertools.product(singles, repeat=2):
        rules = [first, second]
        for tool, arg in itertools.product(["bash", "read_file", "my_tool"], ARGS):
            assert decide(rules, tool, arg) == reference(rules, tool, arg)


def test_examples() -> None:
    rules = [
        rule("bash", "rm *", "deny"),
        rule("bash", "*", "ask"),
        rule("write_file", "secrets/*", "deny"),
        rule("*", "*", "allow"),
    ]
    assert decide(rules, "bash", "rm -rf x") == "deny"
    assert decide(rules, "bash", "ls") == "ask"
    assert decide(rules, "write_file", "secrets/k") == "deny"
    assert decide(rules, "write_file", "src/k") == "allow"
    # Case-sensitive everywhere, and the tool name is not a glob.
    assert decide([rule("bash", "RM *", "deny")], "bash", "rm x") == "allow"
    assert decide([rule("b*", "*", "deny")], "bash", "ls") == "allow"
    # "*" spans "/" and newlines: a deny-all on a tool cannot be dodged.
    assert decide([rule("bash", "*", "deny")], "bash", "a/b\nc") == "deny"
