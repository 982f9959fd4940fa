"""MCP tools: real servers built with the SDK (tests/mcp_servers.py), a stdio
one started for the session and a streamable-HTTP one on 127.0.0.1, driven
by the scripted LLM server.  The model calls them as `mcp__<name>__<tool>`;
a server that crashes, hangs or speaks garbage fails the call with a clear
error and the session goes on; permissions apply; an override narrows."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from fakellm import FakeLLM, fake_llm, text_stream, tool_call_stream
from mcp_servers import LONG_DESCRIPTION, http_server
from session_worker.agent._mcp import tool_name
from ipc.settings import McpSettings, PermissionRule, SessionSettings
from supervisor.core.overrides import OverrideError, resolve_overrides
from test_agent_support import FakeCtx, make_handler, make_settings, poll, run

__all__ = ["fake_llm"]

SERVER = str(Path(__file__).with_name("mcp_servers.py"))
STDIO = {"name": "loc", "command": [sys.executable, SERVER, "stdio"]}


@pytest.fixture(scope="module")
def web() -> Iterator[str]:
    with http_server() as url:
        yield url


def with_mcp(settings: SessionSettings, servers: list[dict[str, Any]], **mcp: Any) -> SessionSettings:
    return msgspec.structs.replace(settings, mcp=msgspec.convert({"servers": servers, **mcp}, McpSettings))


def results(request: Any) -> list[str]:
    return [m["content"] for m in request.json["messages"] if m["role"] == "tool"]


def offered(request: Any) -> list[str]:
    return [t["function"]["name"] for t in request.json.get("tools", [])]


async def turns(handler: Any, ctx: FakeCtx, *texts: str) -> list[Any]:
    try:
        return [await handler.handle(text, ctx) for text in texts]
    finally:
        await handler.aclose()


@pytest.mark.process
def test_the_model_calls_stdio_and_http_tools_beside_the_builtins(
        fake_llm: FakeLLM, web: str, tmp_path: Path) -> None:
    settings = with_mcp(make_settings(fake_llm), [STDIO, {"name": "web", "url": web + "/mcp/"}])
    fake_llm.script(
        tool_call_stream(("c1", "mcp__loc__echo", {"text": "hi"}), ("c2", "mcp__web__add", {"a": 2, "b": 40}),
                         ("c3", "mcp__loc__whoami", {}), ("c4", "mcp__web__big", {"n": 100_000}),
                         ("c5", "mcp__web__big", {"n": 9 << 20}), ("c6", "mcp__loc__big", {"n": 9 << 20})),
        text_stream("done"),
    )
    ctx = FakeCtx(settings, tmp_path)
    [result] = run(turns(make_handler(settings, tmp_path), ctx, "go"))
    assert result.reply == "done"
    first, second = fake_llm.requests
    names = offered(first)
    assert names[:5] == ["bash", "read_file", "write_file", "list_dir", "spawn_agent"]
    for server in ("loc", "web"):
        assert {f"mcp__{server}__{t}" for t in ("echo", "add", "crash", "hang", "verbose")} <= set(names)
    # A name no provider takes is rewritten to one that fits, unique by a digest.
    hostile = tool_name("loc", "bad name/\u00fcn\u00ef")
    assert hostile is not None and hostile in names and hostile.startswith("mcp__loc__bad_name")
    assert all(len(n) <= 64 and n.replace("_", "").replace("-", "").isalnum() for n in names)
    described = {t["function"]["name"]: t["function"]["description"] for t in first.json["tools"]}
    assert len(described["mcp__loc__verbose"]) < 2100 < len(LONG_DESCRIPTION)
    echo, added, whoami, capped, huge_http, huge_stdio = results(second)
    assert echo == "echo: hi" and added == "42"
    assert f"cwd={tmp_path.resolve()}" in whoami
    # The tools' output cap holds; a message past the transport's bound ends the connection.
    assert capped.startswith("x" * 1000) and "bytes of output cut (output_limit_bytes)" in capped
    assert len(capped) < 34_000
    assert huge_http.startswith("error: MCP server 'web'") and "1048576" not in huge_http
    assert "over 8388608 bytes" in huge_stdio
    assert [n["name"] for n in ctx.notices_of("tool_result")][:3] == ["mcp__loc__echo", "mcp__web__add",
                                                                        "mcp__loc__whoami"]
    assert [n["ok"] for n in ctx.notices_of("tool_result")] == [True] * 4 + [False] * 2


@pytest.mark.process
def test_a_server_that_crashes_hangs_or_speaks_garbage_fails_the_call_and_the_session_lives(
        fake_llm: FakeLLM, web: str, tmp_path: Path) -> None:
    servers = [STDIO, {"name": "web", "url": web + "/mcp/"}, {"name": "junk", "url": web + "/garbage"},
               {"name": "nope", "command": ["/nonexistent/mcp-server"]}]
    # The timeout is what the two hangs wait out, and all a server just
    # started again (after the crash) has for its first answer: 0.5 s was
    # too little for that answer with 8 CPU hogs beside the suite.
    settings = with_mcp(make_settings(fake_llm), servers, call_timeout_secs=2.0, start_timeout_secs=20.0)
    fake_llm.script(
        tool_call_stream(("c1", "mcp__loc__crash", {}), ("c2", "mcp__loc__echo", {"text": "after crash"}),
                         ("c3", "mcp__loc__hang", {}), ("c4", "mcp__loc__garbage", {}),
                         ("c5", "mcp__web__hang", {}), ("c6", "mcp__loc__echo", {"text": "still here"})),
        text_stream("survived"),
        text_stream("next turn"),
    )
    ctx = FakeCtx(settings, tmp_path)
    first, second = run(turns(make_handler(settings, tmp_path), ctx, "go", "again"))
    assert (first.reply, second.reply) == ("survived", "next turn")
    crash, after, hang, garbage, web_hang, still = results(fake_llm.requests[1])
    assert "MCP server 'loc' exited with code 3 during the call to crash" in crash
    assert "crashes on purpose" in crash  # its last words on stderr
    assert after == "echo: after crash"  # started again for the next call
    assert "did not answer hang within 2 s (mcp.call_timeout_secs)" in hang
    assert "not JSON-RPC on stdout" in garbage and "<html>" in garbage
    assert "MCP server 'web' did not answer hang within 2 s" in web_hang
    assert still == "echo: still here"
    ok = [n["ok"] for n in ctx.notices_of("tool_result")]
    assert ok == [False, True, False, False, False, True]
    # A server that answers garbage over HTTP, one that cannot be started:
    # reported once (not tried again at the next turn: its backoff), their
    # tools not offered, the rest are.
    unavailable = {n["server"]: n["error"] for n in ctx.notices_of("mcp_server_unavailable")}
    assert "Failed to parse JSON" in unavailable["junk"]
    assert "MCP server 'nope' cannot be started" in unavailable["nope"] and "nonexistent" in unavailable["nope"]
    assert len(ctx.notices_of("mcp_server_unavailable")) == 2
    assert not any(n.startswith(("mcp__junk__", "mcp__nope__")) for n in offered(fake_llm.requests[0]))


@pytest.mark.process
def test_an_interrupt_ends_a_waiting_mcp_call_and_the_server_serves_the_next_turn(
        fake_llm: FakeLLM, tmp_path: Path) -> None:
    settings = with_mcp(make_settings(fake_llm), [{**STDIO, "env": {"MCP_TEST_MARK": "1"}}])
    fake_llm.script(
        tool_call_stream(("c1", "mcp__loc__hang", {})),
        tool_call_stream(("c2", "mcp__loc__echo", {"text": "back"})),
        text_stream("fine"),
    )
    ctx = FakeCtx(settings, tmp_path)

    async def scenario() -> tuple[Any, Any]:
        handler = make_handler(settings, tmp_path)
        try:
            task = asyncio.ensure_future(handler.handle("wait", ctx))
            await poll(lambda: (tmp_path / "hanging").exists(), what="the server to be in the call")
            task.cancel()
            interrupted = await task
            return interrupted, await handler.handle("again", ctx)
        finally:
            await handler.aclose()

    interrupted, after = run(scenario())
    assert interrupted.interrupted and after.reply == "fine"
    assert results(fake_llm.requests[-1])[-1] == "echo: back"


@pytest.mark.component
def test_permissions_ask_and_deny_apply_to_mcp_tools_and_headers_come_from_the_environment(
        fake_llm: FakeLLM, web: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_MCP_AUTH", "Bearer mcp-token-7")
    rules = [PermissionRule(tool="mcp__web__echo", match="secret*", action="deny"),
             PermissionRule(tool="mcp__web__echo", match="*", action="ask")]
    server = {"name": "web", "url": web + "/mcp/", "headers_env": {"Authorization": "SESSIOND_TEST_MCP_AUTH"}}
    settings = with_mcp(make_settings(fake_llm, permissions=rules), [server])
    fake_llm.script(
        tool_call_stream(("c1", "mcp__web__echo", {"text": "secret plans"}),
                         ("c2", "mcp__web__echo", {"text": "refused by the user"}),
                         ("c3", "mcp__web__echo", {"text": "approved"}),
                         ("c4", "mcp__web__authorization", {})),
        text_stream("ok"),
    )
    ctx = FakeCtx(settings, tmp_path, answers=[False, True])
    run(turns(make_handler(settings, tmp_path), ctx, "go"))
    denied, refused, approved, authorization = results(fake_llm.requests[1])
    assert authorization == "Bearer mcp-token-7"
    assert "permission denied: a rule forbids this mcp__web__echo call" in denied
    assert "did not approve" in refused
    assert approved == "echo: approved"
    assert ctx.asked == [("mcp__web__echo", {"text": "refused by the user"}),
                         ("mcp__web__echo", {"text": "approved"})]


@pytest.mark.component
def test_an_override_narrows_the_servers_and_cannot_widen_them(
        fake_llm: FakeLLM, web: str, tmp_path: Path) -> None:
    base = with_mcp(SessionSettings(), [STDIO, {"name": "web", "url": web + "/mcp/"},
                                        {"name": "other", "url": web + "/mcp/"}], enabled=["loc", "web"])
    narrowed = resolve_overrides(base, {"mcp.enabled": ["web"]}).settings
    assert [s.name for s in narrowed.mcp.offered()] == ["web"]
    for widen in ({"mcp.enabled": ["other"]}, {"mcp.enabled": ["web", "nowhere"]},
                  {"mcp.servers": [{"name": "x", "url": "http://evil.example/"}]},
                  {"mcp.call_timeout_secs": 1e6}):
        with pytest.raises(OverrideError):
            resolve_overrides(base, widen)
    # A stored override is clamped after the operator narrows the set.
    clamped = resolve_overrides(with_mcp(base, base.mcp.servers, enabled=["loc"]),
                                {"mcp.enabled": ["web", "loc"]}, strict=False)
    assert clamped.settings.mcp.enabled == ["loc"] and clamped.adjusted
    # The narrowed session is offered only web's tools.
    session = msgspec.structs.replace(narrowed, provider=make_settings(fake_llm).provider)
    fake_llm.script(text_stream("hello"))
    run(turns(make_handler(session, tmp_path), FakeCtx(session, tmp_path), "hi"))
    names = offered(fake_llm.requests[0])
    assert any(n.startswith("mcp__web__") for n in names)
    assert not any(n.startswith(("mcp__loc__", "mcp__other__")) for n in names)


@pytest.mark.pure
def test_server_tool_names_are_checked_and_made_to_fit() -> None:
    assert tool_name("files", "read") == "mcp__files__read"
    long = tool_name("files", "x" * 200)
    assert long is not None and len(long) <= 64 and long.startswith("mcp__files__xxx")
    assert tool_name("files", "a.b") != tool_name("files", "a_b") == "mcp__files__a_b"
    assert tool_name("files", "a_b", {"mcp__files__a_b"}) not in (None, "mcp__files__a_b")
    assert tool_name("files", "") is None and tool_name("files", "y" * 300) is None
    for bad in ({"servers": [{"name": "a__b", "command": ["x"]}]},
                {"servers": [{"name": "a", "command": ["x"], "url": "http://x/"}]},
                {"servers": [{"name": "a"}]},
                {"servers": [{"name": "a", "command": []}]},
                {"servers": [{"name": "a", "url": "file:///etc/passwd"}]},
                {"servers": [{"name": "a", "url": "http://x/"}, {"name": "a", "command": ["y"]}]},
                {"servers": [{"name": "a", "url": "http://x/", "env": {"K": "v"}}]},
                {"servers": [{"name": "a", "command": ["x"], "headers_env": {"Authorization": "V"}}]},
                {"servers": [{"name": "a", "url": "http://x/", "headers_env": {"Bad Header": "V"}}]},
                {"servers": [], "enabled": ["ghost"]}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, McpSettings)


@pytest.mark.pure
def test_a_servers_tool_list_is_bounded_as_hostile_input(tmp_path: Path) -> None:
    """What a server lists is refused past its bounds, each tool with its
    reason (the `mcp_tools_refused` notice): a schema over 16 KiB or not an
    object schema, a name over 256 characters, tools past 128 a server."""
    from types import SimpleNamespace

    from session_worker.agent._mcp import adapt_all

    def listed(name: str, schema: object = None) -> object:
        return SimpleNamespace(name=name, description="d", schema={"type": "object"} if schema is None else schema)

    async def never(*_: object) -> tuple[bool, str]:
        raise AssertionError

    hostile = [listed("huge", {"type": "object", "properties": {"p": {"description": "x" * (16 << 10)}}}),
               listed("array", {"type": "array"}), listed("n" * 257)]
    kept, refused = adapt_all("s", never, [*hostile, *(listed(f"t{i}") for i in range(130))], set())
    assert [t.name for _, t in kept] == [f"mcp__s__t{i}" for i in range(128)]
    reasons = {r["tool"]: r["reason"] for r in refused}
    assert reasons["'huge'"] == "its input schema is over 16384 bytes"
    assert reasons["'array'"] == "its input schema is not a JSON object schema"
    assert "over 256 characters" in reasons[repr("n" * 257)[:80]]
    assert reasons["'t128'"] == reasons["'t129'"] == "more than 128 tools"


@pytest.mark.process
def test_through_the_daemon_a_stdio_server_runs_in_the_sessions_sandbox_and_create_may_narrow(
        make_daemon, llm: FakeLLM, web: str) -> None:
    """The stdio server is started by the session's tool host: inside its
    PID namespace (a small pid) and workspace; `--set mcp.enabled` narrows
    the servers at create and cannot widen them."""
    import os

    import mcp

    from ipc import messages as m
    from test_agent_e2e import agent_config

    site = str(Path(mcp.__file__).resolve().parent.parent)
    python = os.path.realpath(sys.executable)
    extra = f"""
[sandbox]
read_paths = [{site!r}, {str(Path(SERVER).parent)!r}]
[mcp]
enabled = ["loc", "web"]
[[mcp.servers]]
name = "loc"
command = [{python!r}, {SERVER!r}, "stdio", {site!r}]
[[mcp.servers]]
name = "web"
url = "{web}/mcp/"
[[mcp.servers]]
name = "spare"
url = "{web}/mcp/"
"""
    d = make_daemon(agent_config(llm, extra, key_env=None))
    llm.script(tool_call_stream(("c1", "mcp__loc__whoami", {})), text_stream("done"), text_stream("narrow"))
    with d.client() as c:
        sid = c.create().id
        events = list(c.send(sid, "where are you?"))
        assert isinstance(events[-1], m.TurnDone) and events[-1].reply == "done"
        narrow = c.create(settings={"mcp.enabled": ["web"]}).id
        assert c.send_text(narrow, "hi") == "narrow"
        with pytest.raises(Exception, match="not offered by the operator"):
            c.create(settings={"mcp.enabled": ["spare"]})
    [whoami] = results(llm.requests[1])
    fields = dict(part.split("=", 1) for part in whoami.split())
    assert fields["cwd"] == str(d.workspace(sid).resolve())
    assert int(fields["pid"]) < 100, whoami  # the sandbox's own PID namespace
    full, narrowed = offered(llm.requests[0]), offered(llm.requests[2])
    assert "mcp__loc__whoami" in full and "mcp__web__echo" in full
    assert not any(n.startswith("mcp__spare__") for n in full)
    assert "mcp__web__echo" in narrowed and not any(n.startswith("mcp__loc__") for n in narrowed)


@pytest.mark.component
def test_a_reload_drops_the_tools_of_servers_no_longer_offered_and_lists_new_ones(
        fake_llm: FakeLLM, web: str, tmp_path: Path) -> None:
    servers = [{"name": "web", "url": web + "/mcp/"}, {"name": "more", "url": web + "/mcp/"}]
    settings = with_mcp(make_settings(fake_llm), servers, enabled=["web"])
    fake_llm.script(text_stream("one"), text_stream("two"))
    ctx = FakeCtx(settings, tmp_path)

    async def scenario() -> list[list[str]]:
        handler = make_handler(settings, tmp_path)
        seen = []
        try:
            await handler.handle("first", ctx)
            seen.append(handler.tools.names())
            handler.reconfigure(with_mcp(settings, servers, enabled=["more"]))
            seen.append(handler.tools.names())  # web's are gone at once
            await handler.handle("second", ctx)
            seen.append(handler.tools.names())
        finally:
            await handler.aclose()
        return seen

    first, reloaded, second = run(scenario())
    assert "mcp__web__echo" in first and not any(n.startswith("mcp__more__") for n in first)
    assert not any(n.startswith("mcp__") for n in reloaded)
    assert "mcp__more__echo" in second and "mcp__web__echo" not in second
    assert "mcp__more__echo" in offered(fake_llm.requests[1])


@pytest.mark.process
def test_the_worker_side_does_not_import_the_sdk_until_a_server_is_listed() -> None:
    """The zygote preloads the worker side: the SDK (pydantic, httpx2...)
    must stay out of every worker that has no MCP server."""
    import subprocess

    code = ("import sys, session_worker.zygote, session_worker.worker.main, session_worker.agent; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'mcp', 'mcp_types', 'pydantic', 'httpx2'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "[]", out


@pytest.mark.component
def test_config_check_names_what_an_mcp_table_lacks(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from supervisor.cli import main

    monkeypatch.delenv("SESSIOND_TEST_UNSET", raising=False)
    path = tmp_path / "config.toml"
    path.write_text('[[mcp.servers]]\nname = "search"\nurl = "http://127.0.0.1:1/mcp"\n'
                    'headers_env = { Authorization = "SESSIOND_TEST_UNSET" }\n')
    assert main(["config", "check", str(path)]) == 0
    assert "headers_env.Authorization names SESSIOND_TEST_UNSET, which is not set" in capsys.readouterr().err
    path.write_text('[[mcp.servers]]\nname = "both"\ncommand = ["x"]\nurl = "http://127.0.0.1:1/mcp"\n')
    assert main(["config", "check", str(path)]) == 2
    assert "mcp.servers[0]" in capsys.readouterr().err
