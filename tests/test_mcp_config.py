"""MCP servers configured as people already write them: Claude Code's
`.mcp.json` (imported as is, `[mcp] import` or `sessiond mcp import`),
`${VAR}` and `${VAR:-default}`, and Claude Code's permission shapes, which
must match (a rule that can never match is refused: it would guard
nothing)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import msgspec
import pytest

from ipc.mcp import expand, rule_covers, rule_problem
from ipc.mcpjson import servers_from_json
from ipc.settings import McpSettings, PermissionRule
from session_worker.agent._permissions import decide
from supervisor.cli import main
from supervisor.config import ConfigError, load_config, parse_config

CLAUDE = {"mcpServers": {
    "memory": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-memory"],
               "env": {"MEMORY_FILE_PATH": "${HOME}/memory.json"}},
    "search": {"type": "http", "url": "https://search.example/mcp",
               "headers": {"Authorization": "Bearer ${SEARCH_TOKEN}"}},
    "legacy": {"type": "sse", "url": "${LEGACY_URL:-http://127.0.0.1:8931}/sse"},
    "off": {"command": "x", "disabled": True},
}}


@pytest.mark.pure
def test_claude_codes_permission_shapes_name_a_servers_tools() -> None:
    assert rule_covers("mcp__memory", "mcp__memory__create_entities")
    assert rule_covers("mcp__fsroot__*", "mcp__fsroot__read_file")
    assert rule_covers("mcp__fsroot__read_file", "mcp__fsroot__read_file")
    assert rule_covers("*", "bash")
    assert not rule_covers("mcp__memory", "mcp__memoryx__create")
    assert not rule_covers("mcp__fsroot__*", "mcp__fsrootx__read")
    assert not rule_covers("b*", "bash"), "a tool's name is not a glob"
    rules = [PermissionRule(tool="mcp__memory", action="deny"),
             PermissionRule(tool="mcp__fsroot__*", match="/etc/*", action="ask")]
    assert decide(rules, "mcp__memory__delete_entities", "x") == "deny"
    assert decide(rules, "mcp__fsroot__read_file", "/etc/passwd") == "ask"
    assert decide(rules, "mcp__fsroot__read_file", "/home/x") == "allow"
    assert decide(rules, "read_file", "/etc/passwd") == "allow"


@pytest.mark.pure
def test_a_rule_that_can_never_match_is_refused_naming_what_there_is() -> None:
    tools, servers = ["bash", "read_file"], ["memory"]
    for ok in ("*", "bash", "mcp__memory", "mcp__memory__*", "mcp__memory__create_entities"):
        assert rule_problem(ok, tools, servers) == "", ok
    assert "no MCP server named 'fsroot'" in rule_problem("mcp__fsroot__*", tools, servers)
    assert "mcp__memory" in rule_problem("mcp__fsroot", tools, servers)  # what there is
    assert "not a glob" in rule_problem("b*", tools, servers)
    assert "no tool has this name" in rule_problem("bsh", tools, servers)
    assert rule_problem("mcp__memory__", tools, servers)
    with pytest.raises(ConfigError, match=r"permissions\[1\]\.tool.*'mcp__memory' can never match.*no MCP server"):
        parse_config({"permissions": [{"tool": "bash", "action": "ask"}, {"tool": "mcp__memory", "action": "deny"}]},
                     "c.toml")
    cfg = parse_config({"permissions": [{"tool": "mcp__memory", "action": "deny"}],
                        "mcp": {"servers": [{"name": "memory", "command": ["x"]}]}}, "c.toml")
    assert cfg.permissions[0].covers("mcp__memory__read_graph")


@pytest.mark.pure
def test_variables_come_from_the_environment_given_with_defaults() -> None:
    env = {"TOKEN": "t0k", "EMPTY": ""}
    assert expand("Bearer ${TOKEN}", env) == "Bearer t0k"
    assert expand("${MISSING:-http://127.0.0.1:1}/mcp", env) == "http://127.0.0.1:1/mcp"
    assert expand("${EMPTY:-fallback}", env) == "fallback"  # as a shell: unset or empty
    assert expand("${EMPTY}", env) == "" and expand("no $VAR here", env) == "no $VAR here"
    with pytest.raises(KeyError, match="MISSING"):
        expand("${MISSING}", env)


@pytest.mark.pure
def test_a_claude_code_mcp_json_becomes_server_tables() -> None:
    tables = servers_from_json(CLAUDE)
    assert tables == [
        {"name": "memory", "command": ["npx", "-y", "@modelcontextprotocol/server-memory"],
         "env": {"MEMORY_FILE_PATH": "${HOME}/memory.json"}},
        {"name": "search", "url": "https://search.example/mcp", "type": "http",
         "headers": {"Authorization": "Bearer ${SEARCH_TOKEN}"}},
        {"name": "legacy", "url": "${LEGACY_URL:-http://127.0.0.1:8931}/sse", "type": "sse"},
    ]
    servers = msgspec.convert({"servers": tables}, McpSettings).servers
    assert [s.transport for s in servers] == ["stdio", "http", "sse"] and all(s.lazy for s in servers)
    assert servers_from_json({"servers": {"x": {"command": "y", "lazy": False}}})[0]["lazy"] is False  # VS Code's key
    for bad, why in (({"mcpServers": {"a": {"command": "x", "cwd": "/"}}}, "unknown key 'cwd'"),
                     ({"mcpServers": {"a": {"command": "x", "type": "websocket"}}}, "websocket"),
                     ({"mcpServers": {"a": {"url": "http://x/", "args": ["y"]}}}, "args and env are for a command"),
                     ({"mcpServers": []}, "mcpServers"), ([], "mcpServers")):
        with pytest.raises(ValueError, match=why):
            servers_from_json(bad)


@pytest.mark.component
def test_mcp_import_takes_the_file_as_is_and_says_what_is_wrong_with_it(tmp_path: Path) -> None:
    (tmp_path / ".mcp.json").write_text(json.dumps(CLAUDE))
    (tmp_path / "config.toml").write_text('[mcp]\nimport = ".mcp.json"\n[[mcp.servers]]\nname = "local"\n'
                                          'command = ["/bin/true"]\n[[permissions]]\ntool = "mcp__memory"\n'
                                          'action = "ask"\n')
    cfg = load_config(tmp_path / "config.toml")
    assert [s.name for s in cfg.mcp.servers] == ["local", "memory", "search", "legacy"]
    assert cfg.mcp.servers[3].url == "${LEGACY_URL:-http://127.0.0.1:8931}/sse"  # read when it starts
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": {"bad.name": {"command": "x"}}}))
    with pytest.raises(ConfigError, match=r"'mcp.import'.*server 'bad.name'\.name"):
        load_config(tmp_path / "config.toml")
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": {"local": {"command": "x"}}}))
    with pytest.raises(ConfigError, match="local listed twice"):
        load_config(tmp_path / "config.toml")
    (tmp_path / ".mcp.json").write_text("{not json")
    with pytest.raises(ConfigError, match="'mcp.import'"):
        load_config(tmp_path / "config.toml")
    with pytest.raises(ConfigError, match="'mcp.listed' is filled by the daemon"):
        parse_config({"mcp": {"listed": [{"name": "x", "key": "k"}]}}, "c.toml")


@pytest.mark.component
def test_sessiond_mcp_import_prints_tables_a_config_takes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / ".mcp.json").write_text(json.dumps(CLAUDE))
    assert main(["mcp", "import", str(tmp_path / ".mcp.json")]) == 0
    printed = capsys.readouterr().out
    cfg = parse_config(tomllib.loads(printed), "printed")
    assert [s.name for s in cfg.mcp.servers] == ["memory", "search", "legacy"]
    assert cfg.mcp.servers[1].headers == {"Authorization": "Bearer ${SEARCH_TOKEN}"}
    (tmp_path / "config.toml").write_text(printed)
    monkeypatch.delenv("SEARCH_TOKEN", raising=False)
    assert main(["config", "check", str(tmp_path / "config.toml")]) == 0
    err = capsys.readouterr().err
    assert "MCP server 'search' names ${SEARCH_TOKEN}, which is not set" in err
    assert "LEGACY_URL" not in err  # it has a default
    (tmp_path / "bad.json").write_text('{"mcpServers": {"a": {"command": "x", "cwd": "/"}}}')
    assert main(["mcp", "import", str(tmp_path / "bad.json")]) == 2
    assert "unknown key 'cwd'" in capsys.readouterr().err


@pytest.mark.pure
def test_a_servers_whole_list_is_bounded_as_every_session_carries_it() -> None:
    from ipc.mcp import MAX_LISTING_CHARS, ListedTool, McpListing, bounded

    big = [ListedTool(f"t{i}", "d" * 2000, '{"type": "object", "description": "' + "x" * 14000 + '"}')
           for i in range(40)]
    kept = bounded(McpListing(name="s", key="k", state="listed", tools=big))
    assert 0 < len(kept.tools) < 40
    assert sum(len(t.name) + len(t.description) + len(t.schema) for t in kept.tools) <= MAX_LISTING_CHARS
    assert len(kept.refused) == 40 - len(kept.tools) and "over" in kept.refused[0].reason
