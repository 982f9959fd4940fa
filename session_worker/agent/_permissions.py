"""Permission policy: which tool calls run, which are refused, which ask.

Pure functions, no I/O: the handler awaits `ctx.ask_permission` itself.
Rules come from `settings.permissions` in order (the daemon puts the global
rules before the session's); the first rule that matches decides, and a call
no rule matches is allowed.  `tool` is a tool name, "*", or one of Claude
Code's shapes for MCP tools, `mcp__SERVER` and `mcp__SERVER__*` (every
tool of that server: `PermissionRule.covers`); `match` is an fnmatch glob (case-sensitive on every platform, `*` crosses `/` and newlines)
on the call's main argument.

A glob on a shell command is a coarse filter: `rm *` does not match
`ls; rm x`.  Use `ask` or `deny` on `bash` with `*` when that matters.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Literal

from ipc.settings import PermissionRule

__all__ = ["Action", "decide"]

Action = Literal["allow", "deny", "ask"]


def decide(rules: Sequence[PermissionRule], tool: str, main_arg: str) -> Action:
    for rule in rules:
        if not rule.covers(tool):
            continue
        if fnmatch.fnmatchcase(main_arg, rule.match):
            return rule.action
    return "allow"
