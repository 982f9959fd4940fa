"""MCP servers cost a session nothing until it calls one: through one real
daemon with eight servers built on the official SDK (tests/mcp_servers.py:
stdio, streamable HTTP and the legacy HTTP+SSE transport), two of them
imported from a Claude Code `.mcp.json` with `${VAR}`, two that cannot
start, and tracing to the project's OTLP receiver.

The daemon lists the lazy servers once, in a sandbox of its own; a session
is offered their tools without starting anything, starts its own copy of
one server at its first call (in its sandbox), and keeps it; a server that
cannot start is said once, with its exit code and stderr, and not tried
again at the next turn; Claude Code's permission shapes hold; a call
carries the turn's trace context to the server."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import Daemon, wait_for
from ipc import messages as m
from mcp_servers import http_server
from otlp_receiver import OtlpReceiver, Received, tree
from test_tracing_e2e import agent_config

pytestmark = pytest.mark.process

SERVER = str(Path(__file__).with_name("mcp_servers.py"))
HEALTHY = ["s1", "s2", "s3", "s4", "web", "legacy"]


class Setup:
    def __init__(self, daemon: Daemon, llm: FakeLLM, receiver: OtlpReceiver) -> None:
        self.d, self.llm, self.receiver = daemon, llm, receiver

    def turn(self, session: str, *responses: Any, text: str = "go") -> tuple[list[Any], list[Any]]:
        """One turn of `session`, the model answering `responses`: (its
        events, the requests the model got)."""
        before = len(self.llm.requests)
        self.llm.script(*responses)
        with self.d.client() as c:
            events = list(c.send(session, text))
        assert isinstance(events[-1], m.TurnDone), events[-1]
        return events, self.llm.requests[before:]

    def servers_of(self, session: str) -> list[psutil.Process]:
        """The MCP server processes the session's worker started (anywhere below it)."""
        with self.d.client() as c:
            pid = c.status(session).pid
        assert pid
        return [p for p in psutil.Process(pid).children(recursive=True) if _runs(p, "mcp_servers.py")]


def _runs(proc: psutil.Process, what: str) -> bool:
    try:
        return any(what in part for part in proc.cmdline())
    except psutil.Error:
        return False


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    import mcp

    site = str(Path(mcp.__file__).resolve().parent.parent)
    python = os.path.realpath(sys.executable)
    root = tmp_path_factory.mktemp("mcp-lazy")
    with FakeLLM() as llm, http_server() as web, OtlpReceiver() as receiver, pytest.MonkeyPatch.context() as env:
        # The daemon's environment: its EnvironmentFile under systemd.
        env.setenv("MCP_TEST_PYTHON", python)
        env.setenv("MCP_TEST_WEB", web)
        env.setenv("MCP_TEST_TOKEN", "sekrit-7")
        env.setenv("OTEL_TRACES_EXPORTER", "otlp")
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        # As Claude Code users write it, taken as is.
        (root / "d").mkdir()
        (root / "d" / ".mcp.json").write_text(json.dumps({"mcpServers": {
            "s4": {"command": "${MCP_TEST_PYTHON}", "args": [SERVER, "stdio", "${MCP_TEST_SITE:-" + site + "}"]},
            "legacy": {"type": "sse", "url": "${MCP_TEST_WEB}/legacy/sse",
                       "headers": {"Authorization": "Bearer ${MCP_TEST_TOKEN}"}},
        }}))
        stdio = "\n".join(f'[[mcp.servers]]\nname = "{name}"\ncommand = [{python!r}, {SERVER!r}, "stdio", {site!r}]\n'
                          for name in ("s1", "s2", "s3"))
        config = agent_config(llm, f"""
[sandbox]
read_paths = [{site!r}, {str(Path(SERVER).parent)!r}]
[mcp]
import = ".mcp.json"
start_timeout_secs = 30
retry_backoff_secs = 3600
{stdio}
[[mcp.servers]]
name = "web"
url = "{web}/mcp/"
[[mcp.servers]]
name = "broken"
command = ["/bin/sh", "-c", "echo 'npm ERR! code EAI_AGAIN: cannot download the package' >&2; exit 7"]
[[mcp.servers]]
name = "eagerbroken"
lazy = false
command = ["/bin/sh", "-c", "echo started >> starts; echo 'no network here' >&2; exit 9"]
[[permissions]]
tool = "mcp__s2__*"
action = "deny"
[[permissions]]
tool = "mcp__s3"
action = "deny"
""")
        d = Daemon(root / "d", config)
        d.start()
        try:
            yield Setup(d, llm, receiver)
        finally:
            d.cleanup()


def offered(request: Any) -> list[str]:
    return [t["function"]["name"] for t in request.json.get("tools", [])]


def results(request: Any) -> list[str]:
    return [msg["content"] for msg in request.json["messages"] if msg["role"] == "tool"]


def test_a_turn_that_calls_no_mcp_tool_starts_no_server_and_the_first_call_starts_one(setup: Setup) -> None:
    with setup.d.client() as c:
        sid = c.create(settings={"mcp.enabled": HEALTHY}).id
    _, (request,) = setup.turn(sid, text_stream("no tools needed"))
    names = offered(request)
    for server in HEALTHY:  # all six servers' tools, listed by the daemon
        assert f"mcp__{server}__echo" in names and f"mcp__{server}__read_resource" in names, (server, names)
    with setup.d.client() as c:
        worker = psutil.Process(c.status(sid).pid)
    assert worker.children(recursive=True) == [], "no MCP server, no tool host: nothing started"

    events, requests = setup.turn(sid, tool_call_stream(("c1", "mcp__s1__whoami", {})),
                                  tool_call_stream(("c2", "mcp__s1__echo", {"text": "again"})), text_stream("done"))
    # One start, said once (what sessiond_mcp_server_starts_total{outcome="ok"} counts).
    assert [e.data["server"] for e in events if isinstance(e, m.Notice) and e.kind == "mcp_server_started"] == ["s1"]
    whoami = dict(part.split("=", 1) for part in results(requests[1])[0].split())
    assert whoami["cwd"] == str(setup.d.workspace(sid).resolve())  # the session's workspace
    assert int(whoami["pid"]) < 100  # in the session's own PID namespace
    assert results(requests[2])[-1] == "echo: again"
    assert len(setup.servers_of(sid)) == 1, "exactly one server started, and kept for the second call"

    # HTTP servers are reached lazily too; the imported one got its header.
    _, requests = setup.turn(sid, tool_call_stream(("c3", "mcp__legacy__authorization", {}),
                                                   ("c4", "mcp__web__add", {"a": 2, "b": 3}),
                                                   ("c5", "mcp__legacy__read_resource", {"uri": "test://greeting"})),
                             text_stream("ok"))
    assert results(requests[1])[-3:] == ["Bearer sekrit-7", "5", "hello from a resource"]
    assert len(setup.servers_of(sid)) == 1


def test_a_server_that_cannot_start_is_said_once_with_its_stderr_and_not_tried_again(setup: Setup) -> None:
    with setup.d.client() as c:
        sid = c.create(settings={"mcp.enabled": ["broken", "eagerbroken", "s1"]}).id
    events, (request,) = setup.turn(sid, text_stream("first"))
    told = {e.data["server"]: e.data["error"] for e in events if isinstance(e, m.Notice)
            and e.kind == "mcp_server_unavailable"}
    assert set(told) == {"broken", "eagerbroken"}, told
    # The daemon could not list it (in its own sandbox): its exit code and stderr.
    assert "exited with code 7" in told["broken"] and "npm ERR! code EAI_AGAIN" in told["broken"]
    # The eager one, started by the session itself: the same.
    assert "exited with code 9" in told["eagerbroken"] and "no network here" in told["eagerbroken"]
    assert not any(n.startswith(("mcp__broken__", "mcp__eagerbroken__")) for n in offered(request))
    assert "mcp__s1__echo" in offered(request)

    events, _ = setup.turn(sid, text_stream("second"))
    assert not [e for e in events if isinstance(e, m.Notice) and e.kind == "mcp_server_unavailable"]
    starts = (setup.d.workspace(sid) / "starts").read_text().splitlines()
    assert starts == ["started"], "started once at the first turn, not again at the second"
    assert setup.servers_of(sid) == []

    # sessionctl send shows the notice (not only --json and attach).
    fresh = setup.d.ctl("create", "--set", 'mcp.enabled=["broken"]').stdout.strip()
    setup.llm.script(text_stream("hello"))
    shown = setup.d.ctl("send", fresh, "hi")
    assert shown.returncode == 0 and shown.stdout.strip() == "hello"
    assert "[mcp] server broken is unavailable" in shown.stderr and "exited with code 7" in shown.stderr


def test_claude_code_permission_shapes_deny_a_servers_tools(setup: Setup) -> None:
    with setup.d.client() as c:
        sid = c.create(settings={"mcp.enabled": ["s2", "s3", "s4"]}).id
    _, requests = setup.turn(sid, tool_call_stream(("c1", "mcp__s2__echo", {"text": "a"}),
                                                   ("c2", "mcp__s3__echo", {"text": "b"}),
                                                   ("c3", "mcp__s4__echo", {"text": "c"})), text_stream("ok"))
    denied_star, denied_server, allowed = results(requests[1])
    assert "permission denied: a rule forbids this mcp__s2__echo call" in denied_star  # mcp__s2__*
    assert "permission denied: a rule forbids this mcp__s3__echo call" in denied_server  # mcp__s3
    assert allowed == "echo: c"
    assert len(setup.servers_of(sid)) == 1, "a denied call starts no server"


def test_a_lazily_started_server_gets_the_trace_context_and_its_spans_join_the_turn(setup: Setup) -> None:
    with setup.d.client() as c:
        sid = c.create(settings={"mcp.enabled": ["s1", "web"]}).id
    _, requests = setup.turn(sid, tool_call_stream(("c1", "mcp__s1__traceparent", {}),
                                                   ("c2", "mcp__web__traceparent", {})), text_stream("traced"))
    stdio, http = (json.loads(r) for r in results(requests[1]))

    def complete(spans: list[Received]) -> bool:
        return any(s.name.startswith("invoke_agent ") and s.attributes.get("sessiond.session.id") == sid
                   and "sessiond.turn.outcome" in s.attributes for s in spans) and sum(
            s.name.startswith("tools/call") for s in spans if s.attributes.get("sessiond.session.id") == sid) == 2
    spans = setup.receiver.wait_for(complete)
    turn = next(s for s in spans if s.name.startswith("invoke_agent ") and s.attributes.get("sessiond.session.id") == sid)
    (root,) = tree(spans, turn.trace_id)
    tools = [s for s in root.children if s.name.startswith("execute_tool mcp__")]
    assert [t.name for t in tools] == ["execute_tool mcp__s1__traceparent", "execute_tool mcp__web__traceparent"]
    # The session's first call of s1 starts it (the SDK's import, the server's
    # start and handshake): spans of their own, before the call's; no gap.
    sdk, start, call = tools[0].children
    assert sdk.name == "import mcp"
    assert start.name == "initialize s1" and start.attributes["network.transport"] == "pipe"
    assert start.attributes["sessiond.mcp.server.version"] == "1" and start.kind == 3  # CLIENT
    assert call.name == "tools/call traceparent" and call.attributes["mcp.method.name"] == "tools/call"
    assert start.end_ns <= call.start_ns
    # The server was handed the trace context of its call's span: its spans
    # would be children of it.
    assert stdio["meta"] == f"00-{turn.trace_id}-{call.span_id}-01" and stdio["header"] == ""
    web_start, web_call = tools[1].children
    assert web_start.name == "initialize web" and web_start.attributes["network.transport"] == "tcp"
    assert http["meta"] == http["header"] == f"00-{turn.trace_id}-{web_call.span_id}-01"
    # No span of a listing in the turn: the daemon listed before it.
    assert not any(s.name.startswith("tools/list") for s in spans if s.trace_id == turn.trace_id)


def test_a_sub_agent_is_offered_the_same_list_and_starts_nothing_either(setup: Setup) -> None:
    with setup.d.client() as c:
        root = c.create(settings={"mcp.enabled": ["s1", "web"]}).id
    _, requests = setup.turn(root, tool_call_stream(("c1", "spawn_agent", {"task": "look around"})),
                             text_stream("child done"), text_stream("root done"))
    child_request = next(r for r in requests if r.json["messages"][-1]["content"] == "look around")
    assert {"mcp__s1__echo", "mcp__web__echo"} <= set(offered(child_request))
    with setup.d.client() as c:
        child = next(s for s in c.list() if s.parent == root)
        assert child.pid and psutil.Process(child.pid).children(recursive=True) == []
        assert psutil.Process(c.status(root).pid).children(recursive=True) == []
