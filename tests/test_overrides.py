"""Per-session overrides (pure): the allow-list of leaf keys and each key's
rule against the operator's value, in strict mode (a client's create) and in
clamping mode (restore and reload).  The attacks of the audit (issue 9:
parent tables, the provider key, lifted deny rules, unbounded restarts) are
replayed here against the policy itself; the daemon-level tests replay them
through sessionctl."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from ipc.settings import PermissionRule, SessionSettings
from supervisor.core.overrides import ALLOWED, OverrideError, Rule, resolve_overrides

pytestmark = pytest.mark.pure

BASE = SessionSettings(
    permissions=[PermissionRule(tool="bash", match="rm *", action="deny")],
)
BASE_TREE = msgspec.to_builtins(BASE)


def _leaf(key: str) -> Any:
    node: Any = BASE_TREE
    for part in key.split("."):
        node = node[part]
    return node


def _bigger(value: Any) -> Any:
    return True if isinstance(value, bool) else value * 2 + 1


def _smaller(value: Any) -> Any:
    return False if isinstance(value, bool) else type(value)(value / 2)


def _numeric(rule: Rule) -> list[str]:
    return [k for k, r in ALLOWED.items() if r is rule and _leaf(k) is not None]


def test_every_allowed_key_is_a_leaf_of_the_schema() -> None:
    for key in ALLOWED:
        if key == "permissions":
            continue
        parent = BASE_TREE
        for part in key.split(".")[:-1]:
            parent = parent[part]
        assert isinstance(parent, dict) and key.split(".")[-1] in parent, key
        assert not isinstance(parent[key.split(".")[-1]], dict), f"{key} is a table"


@pytest.mark.parametrize("key", _numeric(Rule.CEILING))
def test_ceilings_tighten_and_never_raise(key: str) -> None:
    operator = _leaf(key)
    lower = _smaller(operator) if not isinstance(operator, bool) else False
    if not isinstance(operator, bool) and lower < 1:
        lower = operator
    assert _get(resolve_overrides(BASE, {key: lower}).settings, key) == lower
    if not isinstance(operator, bool) or operator is False:
        with pytest.raises(OverrideError, match="above the operator's limit"):
            resolve_overrides(BASE, {key: _bigger(operator)})


@pytest.mark.parametrize("key", _numeric(Rule.FLOOR))
def test_floors_lengthen_and_never_shorten(key: str) -> None:
    operator = _leaf(key)
    assert _get(resolve_overrides(BASE, {key: operator * 2}).settings, key) == operator * 2
    with pytest.raises(OverrideError, match="below the operator's minimum"):
        resolve_overrides(BASE, {key: _smaller(operator)})


def _get(settings: SessionSettings, key: str) -> Any:
    node: Any = msgspec.to_builtins(settings)
    for part in key.split("."):
        node = node[part]
    return node


@pytest.mark.parametrize("key, value, reason", [
    # The audit's own requests: a parent table smuggles an operator-only key.
    ("provider", {"base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key_env": "SESSIOND_API_KEY"}, "a table"),
    ("tools", {"workspace_dir": "/"}, "a table"),
    ("agent", {"limits": {"max_memory_mb": 1 << 20}}, "a table"),
    ("agent.limits", {"max_memory_mb": 1 << 20}, "a table"),
    ("provider.base_url", "http://127.0.0.1:9/v1", "only the operator"),
    ("provider.api_key_env", "PATH", "only the operator"),
    ("provider.kind", "openai", "only the operator"),
    ("tools.workspace_dir", "/", "only the operator"),
    ("tools.custom", ["os:system"], "only the operator"),
    ("agent.handler", "json:loads", "only the operator"),
    ("agent.allowed_handlers", ["json:*"], "only the operator"),
    ("agent.subagents.allowed_handlers", ["json:loads"], "only the operator"),
    ("provider.allowed_models", ["x"], "only the operator"),
    ("agent.limits.max_concurrent_sessions", 1, "daemon-wide"),
    ("agent.limits.memory_poll_interval_ms", 60_000, "daemon-wide"),
    ("agent.stream_buffer_size", 1 << 20, "daemon-wide"),
    ("agent.worker.snapshot_every_turns", 1, "daemon-wide"),
    ("daemon.state_dir", "/", "unknown key"),
    ("agent.limits.nope", 1, "unknown key"),
    ("", 1, "non-empty"),
])
def test_keys_a_session_may_not_set(key: str, value: Any, reason: str) -> None:
    with pytest.raises(OverrideError, match=reason):
        resolve_overrides(BASE, {key: value})


def test_the_restart_storm_of_the_audit_is_refused() -> None:
    storm = {
        "agent.worker.restart_backoff_initial_ms": 1,
        "agent.worker.restart_window_secs": 0.001,
        "agent.worker.retry_aborted_turn": True,
        "agent.worker.heartbeat_interval_secs": 3600,
        "provider.max_retries": 1_000_000,
    }
    # (Resuming turns is on by default now: refused where the operator turned it off.)
    no_resume = msgspec.structs.replace(BASE, agent=msgspec.structs.replace(
        BASE.agent, worker=msgspec.structs.replace(BASE.agent.worker, retry_aborted_turn=False)))
    for key, value in storm.items():
        with pytest.raises(OverrideError, match=key.replace(".", r"\.")):
            resolve_overrides(no_resume, {key: value})


def test_operator_rules_come_first_and_stay() -> None:
    gone = resolve_overrides(BASE, {"permissions": []}).settings
    assert gone.permissions == BASE.permissions
    added = resolve_overrides(
        BASE, {"permissions": [{"tool": "read_file", "match": "*.key", "action": "deny"},
                               {"tool": "bash", "action": "ask"}]}
    ).settings
    assert added.permissions[0] == BASE.permissions[0]
    assert [r.action for r in added.permissions] == ["deny", "deny", "ask"]
    with pytest.raises(OverrideError, match="only add rules that deny or ask"):
        resolve_overrides(BASE, {"permissions": [{"tool": "bash", "match": "rm *", "action": "allow"}]})
    with pytest.raises(OverrideError, match="permissions"):
        resolve_overrides(BASE, {"permissions": "allow everything"})
    with pytest.raises(OverrideError, match="at most 64 rules"):
        resolve_overrides(BASE, {"permissions": [{"tool": "bash", "action": "deny"}] * 65})


def test_tools_may_only_be_narrowed() -> None:
    narrow = resolve_overrides(BASE, {"tools.enabled": ["read_file"]}).settings
    assert narrow.tools.enabled == ["read_file"]
    base = SessionSettings(tools=msgspec.structs.replace(BASE.tools, enabled=["read_file"]))
    with pytest.raises(OverrideError, match="not enabled by the operator"):
        resolve_overrides(base, {"tools.enabled": ["read_file", "bash"]})


def test_model_only_from_the_operators_list() -> None:
    base = SessionSettings(provider=msgspec.structs.replace(
        BASE.provider, base_url="http://127.0.0.1:9/v1", model="small", allowed_models=["large"]))
    assert resolve_overrides(base, {"provider.model": "large"}).settings.provider.model == "large"
    assert resolve_overrides(base, {"provider.model": "small"}).settings.provider.model == "small"
    with pytest.raises(OverrideError, match="not a model the operator allows"):
        resolve_overrides(base, {"provider.model": "o1-pro"})


def test_optional_limit_can_be_set_but_not_lifted() -> None:
    s = resolve_overrides(BASE, {"agent.limits.memory_high_mb": 100}).settings
    assert s.agent.limits.memory_high_mb == 100
    with pytest.raises(OverrideError, match="must be below"):
        resolve_overrides(BASE, {"agent.limits.memory_high_mb": 4096})
    capped = resolve_overrides(BASE, {"agent.limits.memory_high_mb": 100}).settings
    with pytest.raises(OverrideError, match="above the operator's limit"):
        resolve_overrides(capped, {"agent.limits.memory_high_mb": 200})
    with pytest.raises(OverrideError, match="cannot lift"):
        resolve_overrides(capped, {"agent.limits.memory_high_mb": None})


def test_bad_values_name_the_key() -> None:
    with pytest.raises(OverrideError, match="agent.max_turns"):
        resolve_overrides(BASE, {"agent.max_turns": "lots"})
    with pytest.raises(OverrideError, match="agent.system_prompt"):
        resolve_overrides(BASE, {"agent.system_prompt": "x" * (64 * 1024 + 1)})
    with pytest.raises(OverrideError, match="at most 64 keys"):
        resolve_overrides(BASE, {f"k{i}": 1 for i in range(65)})


def test_clamping_pulls_stored_overrides_inside_new_bounds() -> None:
    stored = {
        "agent.limits.max_memory_mb": 512,
        "tools.enabled": ["bash", "read_file"],
        "agent.worker.restart_backoff_initial_ms": 50,
        "provider.base_url": "http://127.0.0.1:9/v1",  # stored by an older version
        "permissions": [{"tool": "bash", "action": "allow"}, {"tool": "list_dir", "action": "deny"}],
    }
    lowered = SessionSettings(
        agent=msgspec.structs.replace(
            BASE.agent, limits=msgspec.structs.replace(BASE.agent.limits, max_memory_mb=256)),
        tools=msgspec.structs.replace(BASE.tools, enabled=["read_file"]),
        permissions=BASE.permissions,
    )
    resolved = resolve_overrides(lowered, stored, strict=False)
    s = resolved.settings
    assert s.agent.limits.max_memory_mb == 256
    assert s.tools.enabled == ["read_file"]
    assert s.agent.worker.restart_backoff_initial_ms == 100
    assert s.provider.base_url is None
    assert [(r.tool, r.action) for r in s.permissions] == [("bash", "deny"), ("list_dir", "deny")]
    assert len(resolved.adjusted) == 5, resolved.adjusted
    assert resolve_overrides(BASE, {"agent.limits.max_memory_mb": 64}, strict=False).adjusted == []
