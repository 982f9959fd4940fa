"""Per-session overrides: which leaf keys a client may set, within what.

A client's `create --set KEY=VALUE` is a privilege, not configuration: the
operator's config.toml is the only place where a provider, a path, a module,
an environment variable or a daemon-wide knob is chosen.  So the policy is an
explicit table of the *leaf* keys a session may set, each with its rule
against the operator's value:

    ceiling   the session's value may only be lower (limits, timeouts, counts,
              `retry_aborted_turn` and other switches that cost more when on)
    floor     may only be higher (backoffs and windows: longer means fewer
              restarts and retries)
    subset    a list that may only shrink (`tools.enabled`)
    servers   the MCP servers offered: only names the operator offers
              (`mcp.enabled`; unset offers every listed server)
    model     the operator's model or one of `provider.allowed_models`
    free      any value the schema accepts (`agent.system_prompt`)
    rules     session permission rules: only `deny` or `ask`, and always
              after the operator's rules, which come first and stay

A key not in the table is refused, with the reason when there is one to give
(daemon-wide, operator-only, a table rather than a leaf).  The merged result
is validated by the schema and then each overridden leaf is checked against
the operator's value: what is checked is the value the session will run
with, never the spelling of the key.

Two modes: `strict` (a client's create: any violation is an error naming the
key) and clamping (a session restored at start-up or re-derived after a
SIGHUP: its stored overrides are pulled back inside the new ceilings, so a
lowered limit takes effect at once, and what no longer applies is dropped
with a warning).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ipc.settings import NETWORK_LEVELS, PermissionRule, SessionSettings
from supervisor.config import plain_error, valid_handler_name
from supervisor.errors import BadRequest, OverrideError

__all__ = ["OverrideError", "Resolved", "check_handler", "choose_handler", "resolve_overrides"]


class Rule(enum.Enum):
    CEILING = "ceiling"
    FLOOR = "floor"
    SUBSET = "subset"
    MODEL = "model"
    FREE = "free"
    RULES = "rules"
    LEVEL = "level"
    SERVERS = "servers"


_C, _F = Rule.CEILING, Rule.FLOOR

# The whole allow-list.  Adding a key here is a security decision: say in
# its rule why a session may not use it to weaken a limit.
ALLOWED: dict[str, Rule] = {
    "agent.system_prompt": Rule.FREE,
    "agent.max_turns": _C,
    "agent.max_tool_calls_per_turn": _C,
    "agent.session_timeout_secs": _C,
    "agent.turn_timeout_secs": _C,
    "agent.limits.max_memory_mb": _C,
    "agent.limits.memory_high_mb": _C,
    "agent.limits.max_processes": _C,
    "agent.limits.max_file_size_mb": _C,
    "agent.limits.max_open_files": _C,  # RLIMIT_NOFILE: only fewer fds than the operator's
    "agent.limits.max_disk_mb": _C,  # only a smaller quota (None lifts none: refused)
    "agent.limits.max_disk_inodes": _C,
    "agent.worker.heartbeat_interval_secs": _C,  # a longer one would blunt hang detection
    "agent.worker.max_restart_attempts": _C,
    "agent.worker.restart_window_secs": _F,  # a longer window gives up sooner
    "agent.worker.restart_backoff_initial_ms": _F,
    "agent.worker.restart_backoff_max_ms": _F,
    "agent.worker.retry_aborted_turn": _C,  # true resumes turns (the uncertain step redone)
    "agent.worker.max_step_kb": _C,  # more journal per step, per turn
    "agent.worker.max_turn_steps_mb": _C,
    "agent.subagents.max_concurrent": _C,
    "agent.subagents.max_depth": _C,
    "agent.subagents.max_total_spawns": _C,
    "agent.subagents.child_timeout_secs": _C,
    "agent.loop.compaction_threshold_tokens": _C,  # more context is more tokens billed
    "agent.loop.compaction_keep_recent_turns": _C,
    # Budgets: a session may only spend less.  An unset operator ceiling
    # admits any (it tightens); unsetting one the operator set is refused.
    "agent.budget.turn_max_llm_calls": _C,
    "agent.budget.session_max_llm_calls": _C,
    "agent.budget.session_max_input_tokens": _C,
    "agent.budget.session_max_output_tokens": _C,
    "agent.budget.session_max_reasoning_tokens": _C,
    "provider.model": Rule.MODEL,
    "provider.connect_timeout_secs": _C,
    "provider.read_timeout_secs": _C,
    "provider.max_retries": _C,
    "provider.retry_backoff_initial_ms": _F,
    "provider.retry_backoff_max_ms": _C,
    "tools.enabled": Rule.SUBSET,
    "tools.rerun_after_crash": Rule.SUBSET,  # a tool re-run after a crash may act twice
    "tools.parallel": Rule.SUBSET,  # tools run at once may race each other
    "tools.bash_timeout_secs": _C,
    "tools.output_limit_bytes": _C,
    "permissions": Rule.RULES,
    "sandbox.network": Rule.LEVEL,  # only less reach than the operator's
    "mcp.enabled": Rule.SERVERS,  # only fewer of the operator's MCP servers
    "mcp.call_timeout_secs": _C,
    "mcp.start_timeout_secs": _C,
}
# The order of a LEVEL key's values, least privilege first.
_LEVELS: dict[str, tuple[str, ...]] = {"sandbox.network": NETWORK_LEVELS}

# Refused with a reason: knobs of the whole daemon, and keys that choose a
# provider, a path, a module or an environment variable.
_DAEMON_WIDE = {
    "agent.stream_buffer_size",
    "agent.limits.max_concurrent_sessions",
    "agent.limits.memory_poll_interval_ms",
    "agent.worker.snapshot_every_turns",
    # A uid's ceilings bound all its sessions together: not one session's to set.
    "agent.budget.uid_max_llm_calls",
    "agent.budget.uid_max_input_tokens",
    "agent.budget.uid_max_output_tokens",
    "agent.budget.uid_max_reasoning_tokens",
}
_OPERATOR_ONLY = {
    "agent.handler": "choose the handler with --handler",
    "agent.allowed_handlers": "",
    "agent.subagents.allowed_handlers": "",
    "provider.kind": "",
    "provider.base_url": "it decides where prompts and the API key are sent",
    "provider.api_key_env": "it names a variable of the daemon's environment",
    "provider.allowed_models": "",
    "tools.custom": "it names code to import",
    "tools.workspace_dir": "it names a directory on the daemon's host",
    "tools.disk_quota": "it says how the daemon caps every workspace",
    "sandbox.mode": "the sandbox is the operator's to weaken",
    "sandbox.namespaces": "the sandbox is the operator's to weaken",
    "sandbox.read_paths": "it names directories on the daemon's host",
    "sandbox.tmp_size_mb": "",
    "mcp.servers": "it names commands to run and URLs to reach; narrow with mcp.enabled",
    "mcp.import": "it names a file on the daemon's host",
    "mcp.listed": "the daemon fills it with the servers' tool lists",
    "mcp.relist_interval_secs": "",
    "mcp.retry_backoff_secs": "",
}
_MAX_KEYS = 64
_MAX_SESSION_RULES = 64
_MAX_TEXT = 64 * 1024


@dataclass(slots=True)
class Resolved:
    settings: SessionSettings
    # What clamping changed or dropped, one readable line each (empty in strict mode).
    adjusted: list[str] = field(default_factory=list)


def resolve_overrides(
    base: SessionSettings, overrides: dict[str, Any], *, strict: bool = True
) -> Resolved:
    """`base` (the operator's settings) with a session's overrides applied.

    strict: any key or value outside the policy raises OverrideError.
    Otherwise out-of-bounds values are clamped to the operator's and
    refused keys dropped, each noted in `adjusted`.
    """
    adjusted: list[str] = []
    if not overrides:
        return Resolved(base, adjusted)
    if not isinstance(overrides, dict):
        raise OverrideError("settings must be a table of KEY = VALUE")
    if len(overrides) > _MAX_KEYS:
        raise OverrideError(f"--set: at most {_MAX_KEYS} keys per session")
    base_tree = msgspec.to_builtins(base)
    tree = msgspec.to_builtins(base)
    session_rules: list[Any] = []
    for key, value in overrides.items():
        try:
            rule = _rule_for(key)
        except OverrideError:
            if strict:
                raise
            adjusted.append(f"{key}: no longer settable per session; dropped")
            continue
        if rule is Rule.RULES:
            session_rules = _session_rules(value, strict, adjusted)
            continue
        _put(tree, key, value)
    # Operator rules first, always; the session's only after them.
    tree["permissions"] = list(base_tree.get("permissions", [])) + session_rules
    settings = _convert(tree, strict, overrides, adjusted, base)
    new_tree = msgspec.to_builtins(settings)
    changed = False
    for key in overrides:
        leaf_rule = ALLOWED.get(key)
        if leaf_rule is None or leaf_rule is Rule.RULES:
            continue
        old, new = _get(base_tree, key), _get(new_tree, key)
        fixed = _enforce(key, leaf_rule, old, new, base, strict)
        if fixed is not _KEEP:
            adjusted.append(f"{key}={new!r} is outside the operator's bounds; using {fixed!r}")
            _put(new_tree, key, fixed)
            changed = True
    _cross_checks(new_tree, strict, adjusted)
    if changed or adjusted:
        settings = msgspec.convert(new_tree, SessionSettings)
    return Resolved(settings, adjusted)


def _rule_for(key: str) -> Rule:
    if not isinstance(key, str) or not key:
        raise OverrideError("--set: a key must be a non-empty string")
    rule = ALLOWED.get(key)
    if rule is not None:
        return rule
    if key in _DAEMON_WIDE:
        raise OverrideError(f"--set {key}: daemon-wide; only the operator's config.toml sets it")
    if key in _OPERATOR_ONLY:
        why = _OPERATOR_ONLY[key]
        raise OverrideError(
            f"--set {key}: only the operator's config.toml may set this key" + (f" ({why})" if why else "")
        )
    if any(k.startswith(key + ".") for k in (*ALLOWED, *_DAEMON_WIDE, *_OPERATOR_ONLY)):
        raise OverrideError(
            f"--set {key}: a table, not a key; set its keys one at a time (e.g. --set {_example(key)}=...)"
        )
    raise OverrideError(f"--set {key}: unknown key, or not one a session may set")


def _example(table: str) -> str:
    return next((k for k in ALLOWED if k.startswith(table + ".")), table + ".KEY")


def _session_rules(value: Any, strict: bool, adjusted: list[str]) -> list[Any]:
    if not isinstance(value, list):
        raise OverrideError("--set permissions: expected a list of {tool, match, action} rules")
    if len(value) > _MAX_SESSION_RULES:
        raise OverrideError(f"--set permissions: at most {_MAX_SESSION_RULES} rules per session")
    try:
        rules = msgspec.convert(value, list[PermissionRule])
    except msgspec.ValidationError as exc:
        raise OverrideError(f"--set permissions: {exc}") from None
    kept: list[Any] = []
    for rule in rules:
        if len(rule.tool) > 256 or len(rule.match) > 4096:
            raise OverrideError("--set permissions: a rule's tool or match is too long")
        if rule.action == "allow":
            if strict:
                raise OverrideError(
                    "--set permissions: a session may only add rules that deny or ask "
                    "(the operator's rules come first and decide what is allowed)"
                )
            adjusted.append(f"permissions: allow rule for {rule.tool!r} dropped")
            continue
        kept.append(msgspec.to_builtins(rule))
    return kept


def _convert(
    tree: dict[str, Any], strict: bool, overrides: dict[str, Any],
    adjusted: list[str], base: SessionSettings,
) -> SessionSettings:
    try:
        return msgspec.convert(tree, SessionSettings)
    except msgspec.ValidationError as exc:
        if strict:
            raise OverrideError(_describe(exc, tree)) from None
    # Clamping a stored override that the schema no longer takes: drop the
    # offending keys one at a time until the rest fits.
    kept = dict(overrides)
    for key in list(kept):
        kept.pop(key)
        adjusted.append(f"{key}: no longer valid; dropped")
        try:
            return resolve_overrides(base, kept, strict=False).settings
        except OverrideError:
            continue
    return base


def _describe(exc: msgspec.ValidationError, tree: dict[str, Any]) -> str:
    text = str(exc)
    marker = " - at `$."
    if marker in text:
        msg, _, path = text.partition(marker)
        path = path.rstrip("`")
        value = _get(tree, path) if "[" not in path else _NO_VALUE
        return f"--set {path}: {plain_error(msg, SessionSettings, path, *(() if value is _NO_VALUE else (value,)))}"
    return f"--set: {text}"


_NO_VALUE: Any = object()


class _Keep:
    pass


_KEEP: Any = _Keep()


def _enforce(key: str, rule: Rule, old: Any, new: Any, base: SessionSettings, strict: bool) -> Any:
    """_KEEP when `new` is within the operator's `old`, else the value to use
    (clamping) or OverrideError (strict)."""
    if rule is Rule.FREE:
        if isinstance(new, str) and len(new) > _MAX_TEXT:
            return _refuse(strict, f"--set {key}: longer than {_MAX_TEXT} characters", old)
        return _KEEP
    if rule is Rule.MODEL:
        allowed = {m for m in (base.provider.model, *base.provider.allowed_models) if m}
        if new in allowed:
            return _KEEP
        return _refuse(
            strict,
            f"--set {key}={new!r}: not a model the operator allows "
            f"(provider.model, provider.allowed_models: {sorted(allowed) or 'none'})",
            old,
        )
    if rule is Rule.SUBSET:
        return _narrowed(strict, key, new, old, "enabled")
    if rule is Rule.SERVERS:
        offered = [server.name for server in base.mcp.offered()]
        if new is None:
            if old is None:
                return _KEEP
            return _refuse(strict, f"--set {key}: cannot offer every MCP server; the operator offers {offered}",
                           old)
        return _narrowed(strict, key, new, offered, "offered")
    if rule is Rule.LEVEL:
        order = _LEVELS[key]
        if order.index(new) <= order.index(old):
            return _KEEP
        return _refuse(strict, f"--set {key}={new}: more than the operator's {old} (order: {', '.join(order)})", old)
    if old is None:
        return _KEEP  # the operator set no bound: any value tightens
    if new is None:
        return _refuse(strict, f"--set {key}: cannot lift the operator's limit of {old}", old)
    if rule is Rule.CEILING and new > old:
        return _refuse(strict, f"--set {key}={_show(new)}: above the operator's limit of {_show(old)}", old)
    if rule is Rule.FLOOR and new < old:
        return _refuse(strict, f"--set {key}={_show(new)}: below the operator's minimum of {_show(old)}", old)
    return _KEEP


def _refuse(strict: bool, message: str, fallback: Any) -> Any:
    if strict:
        raise OverrideError(message)
    return fallback


def _narrowed(strict: bool, key: str, new: list[Any], allowed: list[Any], verb: str) -> Any:
    """A list a session may only narrow: kept when within `allowed`; else
    refused, or (not strict: a stored override) pulled back inside it."""
    extra = [x for x in new if x not in allowed]
    if not extra:
        return _KEEP
    return _refuse(strict, f"--set {key}: {extra} not {verb} by the operator; a session may only narrow {allowed}",
                   [x for x in new if x in allowed])


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _cross_checks(tree: dict[str, Any], strict: bool, adjusted: list[str]) -> None:
    """Relations between keys that each fit on their own."""
    limits = tree["agent"]["limits"]
    high = limits.get("memory_high_mb")
    if high is not None and high >= limits["max_memory_mb"]:
        message = (f"agent.limits.memory_high_mb={high} must be below "
                   f"agent.limits.max_memory_mb={limits['max_memory_mb']}")
        if strict:
            raise OverrideError("--set " + message)
        adjusted.append(message + "; memory_high_mb dropped")
        limits.pop("memory_high_mb")
    worker = tree["agent"]["worker"]
    if worker["restart_backoff_initial_ms"] > worker["restart_backoff_max_ms"]:
        message = ("agent.worker.restart_backoff_initial_ms must not exceed "
                   "agent.worker.restart_backoff_max_ms")
        if strict:
            raise OverrideError("--set " + message)
        adjusted.append(message + "; using the maximum")
        worker["restart_backoff_initial_ms"] = worker["restart_backoff_max_ms"]


def _get(tree: dict[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _put(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def check_handler(name: str, settings: SessionSettings) -> None:
    """A client's --handler: the operator's default, or one the operator
    listed in [agent] allowed_handlers ("module:*" admits a module's
    factories).  Anything else is refused before anything is imported."""
    if not valid_handler_name(name):
        raise BadRequest(f"invalid handler {name!r}: use 'agent', 'echo' or 'package.module:factory'")
    allowed = settings.agent.allowed_handlers
    module = name.partition(":")[0]
    if name == settings.agent.handler or name in allowed or f"{module}:*" in allowed:
        return
    raise BadRequest(
        f"handler {name!r} is not allowed here; the operator allows "
        f"{', '.join(allowed) or 'none'} ([agent] allowed_handlers in config.toml)"
    )


def choose_handler(handler: str | None, settings: SessionSettings, *, checked: bool) -> str:
    """The handler a new session runs: the one named (checked against the
    allow-list unless `checked`: a child session's came from its parent), or
    the settings' default; the agent without a provider falls back to echo
    only when nothing asked for it."""
    named = handler is not None
    if handler is None:
        handler = settings.agent.handler
    elif not checked:
        check_handler(handler, settings)
    if handler == "agent" and (missing := settings.provider.missing_text()) is not None:
        provider = settings.provider
        if named or provider.base_url or provider.model:
            # Asked for the agent, or half a provider: an echo session
            # would look like a working agent that answers nonsense.
            raise BadRequest(f"the agent handler needs an LLM provider: {missing}; or create an echo "
                             "session (--handler echo)")
        handler = "echo"  # no provider at all: the offline default, said at start-up
    return handler
