"""The daemon's MCP tool lists (supervisor.core.mcpcatalog) and a session
that uses them (session_worker.agent._mcp): listed once per server table,
kept across a reload that does not change it, a server that cannot be
listed backed off, a list that worked kept when a relist fails; a session
offers the listed tools without starting anything, waits for a list still
pending (listing it itself only past start_timeout_secs: tests/test_agent_mcp.py
has sessions with no list), and lists a server again itself when it says its
tools changed or runs another version than the one listed."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from fakellm import FakeLLM, fake_llm, text_stream, tool_call_stream
from ipc.mcp import McpListing, listing_key
from ipc.settings import McpSettings, SessionSettings
from supervisor.config import Config, parse_config
from supervisor.core.mcpcatalog import McpCatalog
from test_agent_support import FakeCtx, make_handler, make_settings, run
from polling import until

__all__ = ["fake_llm"]

SERVER = str(Path(__file__).with_name("mcp_servers.py"))


def _config(**mcp: Any) -> Config:
    return parse_config({"mcp": {"retry_backoff_secs": 3600, **mcp}}, "test")


class _Lister:
    """Answers as told, and counts what it was asked."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []
        self.broken: set[str] = set()
        self.version = "1"

    async def __call__(self, settings: SessionSettings) -> list[McpListing]:
        self.asked.append([s.name for s in settings.mcp.servers])
        return [McpListing(name=s.name, key="the lister's word", state="unavailable", error=f"{s.name}: exit 7")
                if s.name in self.broken else
                McpListing(name=s.name, key="x", state="listed", version=self.version) for s in settings.mcp.servers]


@pytest.mark.component
def test_the_catalog_lists_each_table_once_backs_off_and_keeps_what_worked() -> None:
    servers = [{"name": "ok", "command": ["ok"]}, {"name": "bad", "command": ["bad"]},
               {"name": "eager", "command": ["e"], "lazy": False}]
    lister = _Lister()
    lister.broken = {"bad"}
    published: list[Config] = []

    async def scenario() -> None:
        catalog = McpCatalog(lister, published.append)
        first = catalog.attach(_config(servers=servers))
        assert [(x.name, x.state) for x in first.mcp.listed] == [("ok", "pending"), ("bad", "pending")]
        await until(lambda: published, "the first lists")
        listed = {x.name: x for x in published[-1].mcp.listed}
        assert listed["ok"].state == "listed" and listed["bad"].state == "unavailable"
        assert listed["ok"].key == listing_key(first.mcp.servers[0]), "the key is the daemon's, never the lister's"
        assert lister.asked == [["ok", "bad"]], "one listing for all, none for the eager server"
        # The broken one waits out its backoff: not asked again now.
        assert catalog._due["bad"] > time.monotonic() + 3000
        # A reload that keeps the tables keeps their lists, and lists nothing.
        again = catalog.attach(_config(servers=servers))
        assert again.mcp.listed == published[-1].mcp.listed
        await asyncio.sleep(0.05)
        assert lister.asked == [["ok", "bad"]]
        # A changed table is listed again (pending meanwhile); a server the
        # config no longer has is dropped.
        changed = catalog.attach(_config(servers=[{"name": "ok", "command": ["ok", "--v2"]}]))
        assert [(x.name, x.state) for x in changed.mcp.listed] == [("ok", "pending")]
        await until(lambda: len(lister.asked) == 2, "the changed table's listing")
        assert lister.asked[1] == ["ok"]
        # A relist that fails keeps the list that worked.
        lister.broken = {"ok"}
        catalog._due["ok"] = 0.0
        catalog._wake.set()
        await until(lambda: len(lister.asked) == 3, "the relist")
        assert catalog.stats()["ok"]["state"] == "listed"
        assert catalog._task is not None
        catalog._task.cancel()

    asyncio.run(scenario())




def _listed(tmp_path: Path, settings: SessionSettings) -> SessionSettings:
    """The settings with the daemon's list of their servers, made by the
    lister's own code (in this process, unconfined: sandbox.mode off).
    Imported here: it brings the MCP SDK (~1 s), which collecting this
    module for the fast tier does not need."""
    from session_worker.mcplist import list_servers

    empty = tmp_path / "listing"
    empty.mkdir()
    listed = asyncio.run(list_servers(settings, empty))
    return msgspec.structs.replace(settings, mcp=msgspec.structs.replace(settings.mcp, listed=listed))


def _offered(request: Any) -> list[str]:
    return [t["function"]["name"] for t in request.json.get("tools", [])]


@pytest.mark.process
def test_a_session_offers_the_list_starts_at_the_first_call_and_follows_changes(
        fake_llm: FakeLLM, tmp_path: Path) -> None:
    server = {"name": "loc", "command": [sys.executable, SERVER, "stdio"]}
    base = msgspec.structs.replace(make_settings(fake_llm), mcp=msgspec.convert({"servers": [server]}, McpSettings))
    settings = _listed(tmp_path, base)
    (listing,) = settings.mcp.listed
    assert listing.state == "listed" and listing.version == "1" and listing.resources
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "version").write_text("2")  # this session's copy runs another version than the one listed
    fake_llm.script(text_stream("idle"),
                    tool_call_stream(("c1", "mcp__loc__grow", {})), text_stream("grew"),
                    text_stream("after"))
    ctx = FakeCtx(settings, ws)

    async def scenario() -> list[dict[str, int]]:
        handler = make_handler(settings, ws)
        starts = []
        try:
            await handler.handle("nothing to call", ctx)
            starts.append(handler._mcp.starts())
            await handler.handle("grow", ctx)
            starts.append(handler._mcp.starts())
            await handler.handle("again", ctx)
            starts.append(handler._mcp.starts())
        finally:
            await handler.aclose()
        return starts

    idle, called, after = run(scenario())
    assert idle == {}, "the first turn offered the listed tools and started nothing"
    assert called == after == {"loc": 1}
    requests = fake_llm.requests
    assert "mcp__loc__echo" in _offered(requests[0]) and "mcp__loc__read_resource" in _offered(requests[0])
    assert "mcp__loc__grown" not in _offered(requests[1])
    # It said its tools changed (and it is version 2, not the listed 1):
    # the session listed it itself, from its running copy.
    assert {"mcp__loc__grown", "mcp__loc__newer"} <= set(_offered(requests[3]))


@pytest.mark.process
def test_a_turn_waits_for_a_pending_list_and_starts_nothing(fake_llm: FakeLLM, tmp_path: Path) -> None:
    server = {"name": "loc", "command": [sys.executable, SERVER, "stdio"]}
    base = msgspec.structs.replace(make_settings(fake_llm), mcp=msgspec.convert(
        {"servers": [server], "start_timeout_secs": 20}, McpSettings))
    listed = _listed(tmp_path, base)
    pending = msgspec.structs.replace(base, mcp=msgspec.structs.replace(base.mcp, listed=[
        McpListing(name="loc", key=listing_key(base.mcp.servers[0]))]))
    fake_llm.script(text_stream("one"))

    async def scenario() -> dict[str, int]:
        handler = make_handler(pending, tmp_path)
        try:
            turn = asyncio.ensure_future(handler.handle("first", FakeCtx(pending, tmp_path)))
            await asyncio.sleep(0.2)
            assert not turn.done() and not fake_llm.requests, "the turn waits for the daemon's list"
            handler.reconfigure(listed)  # the daemon's list arrives, as new settings
            await turn
            return handler._mcp.starts()
        finally:
            await handler.aclose()

    assert run(scenario()) == {}, "nothing started: the list came"
    assert "mcp__loc__echo" in _offered(fake_llm.requests[0])


@pytest.mark.process
def test_calls_side_by_side_start_one_copy_of_a_server(fake_llm: FakeLLM, tmp_path: Path) -> None:
    """Tool calls may run side by side: the first calls of one server start
    it once, and all of them use that copy."""
    from session_worker.agent._mcp import McpTools
    from session_worker.agent._tools import ToolEnv

    server = {"name": "loc", "command": [sys.executable, SERVER, "stdio"]}
    base = msgspec.structs.replace(make_settings(fake_llm), mcp=msgspec.convert({"servers": [server]}, McpSettings))
    settings = _listed(tmp_path, base)
    ctx = FakeCtx(settings, tmp_path)

    async def scenario() -> tuple[list[str], dict[str, int]]:
        tools = McpTools(settings.mcp, tmp_path)
        try:
            await tools.discover(ctx.notice)
            echo = next(t for t in tools.tools() if t.name == "mcp__loc__echo")
            env = ToolEnv(tmp_path, settings, ctx)
            results = await asyncio.gather(*(echo.run({"text": str(i)}, env) for i in range(4)))
            return list(results), tools.starts()
        finally:
            await tools.aclose()

    results, starts = run(scenario())
    assert sorted(results) == [f"echo: {i}" for i in range(4)] and starts == {"loc": 1}
