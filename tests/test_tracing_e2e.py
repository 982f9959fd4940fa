"""OpenTelemetry traces through the real daemon, exported to a real OTLP/HTTP
receiver on loopback (tests/otlp_receiver.py decodes them with
opentelemetry-proto): the span tree of an agent turn with a tool and a
sub-agent, as Phoenix and Langfuse read it, with content capture off and
on; a client's traceparent continued; a collector that is down; a tool
killed with its worker by the memory cap; the same over OTLP/gRPC."""

from __future__ import annotations

import json
import os
import socket

import psutil
import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import wait_for
from ipc import messages as m
from otlp_receiver import OtlpGrpcReceiver, OtlpReceiver, Received, tree

pytestmark = pytest.mark.process

PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TURN = "invoke_agent agent"  # a turn of the agent handler
# What a viewer shows only when the operator opts in to content capture.
CONTENT = ("input.value", "output.value", "gen_ai.input.messages", "gen_ai.output.messages",
           "gen_ai.tool.call.arguments", "gen_ai.tool.call.result")


def agent_config(llm: FakeLLM, extra: str = "") -> str:
    return f"""
[agent]
handler = "agent"
[agent.worker]
heartbeat_interval_secs = 0.2
[provider]
base_url = "{llm.base_url}"
model = "test-model"
retry_backoff_initial_ms = 1
[daemon]
stop_grace_secs = 1.0
{extra}
"""


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch):
    with OtlpReceiver() as rx:
        # The standard variables, as every OpenTelemetry SDK reads them.
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "sessiond-test")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        yield rx


def _one(spans: list[Received], name: str, **attrs: object) -> Received:
    found = [s for s in spans if s.name == name and all(s.attributes.get(k) == v for k, v in attrs.items())]
    assert len(found) == 1, (name, attrs, [(s.name, s.attributes) for s in spans])
    return found[0]


def _render(node: Received, depth: int = 0) -> list[str]:
    lines = ["  " * depth + node.name]
    for child in node.children:
        lines += _render(child, depth + 1)
    return lines


def test_an_agent_turn_with_a_tool_and_a_subagent_is_one_trace(
    make_daemon, llm: FakeLLM, receiver: OtlpReceiver,
) -> None:
    d = make_daemon(agent_config(llm))
    llm.script(
        tool_call_stream(("c1", "bash", {"command": "echo hi; exit 3"})),          # root
        tool_call_stream(("c2", "spawn_agent", {"task": "child task"})),           # root
        text_stream("child result"),                                               # child
        text_stream("root ", "done"),                                              # root
    )
    with d.client() as c:
        root = c.create(session="root").id
        events = list(c.send(root, "go", traceparent=f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"))
        assert isinstance(events[-1], m.TurnDone) and events[-1].reply == "root done"
        child = next(s.id for s in c.list() if s.parent == root)

    def complete(spans: list[Received]) -> bool:
        return sum(s.name == TURN for s in spans) == 2 and sum(
            s.name == "sessiond.commit.durable" for s in spans) == 2
    spans = receiver.wait_for(complete)
    assert {s.trace_id for s in spans} == {PARENT_TRACE}, "one trace, the caller's"
    assert {s.service for s in spans} == {"sessiond-test"}
    (turn,) = tree(spans, PARENT_TRACE)
    # The turn: an agent's invocation, as the GenAI conventions and
    # OpenInference (Phoenix) name it, with its session and user.
    assert turn.name == TURN and turn.parent_id == PARENT_SPAN and turn.kind == 2  # SERVER
    assert turn.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert turn.attributes["openinference.span.kind"] == "AGENT"
    assert turn.attributes["gen_ai.agent.name"] == "agent"
    assert turn.attributes["session.id"] == turn.attributes["gen_ai.conversation.id"] == root
    assert turn.attributes["user.id"] == str(os.geteuid())
    assert turn.attributes["sessiond.session.id"] == root and turn.attributes["sessiond.turn"] == 1
    assert turn.attributes["sessiond.turn.outcome"] == "done"
    everything = json.dumps([s.attributes for s in spans])
    assert not [k for s in spans for k in s.attributes if k in CONTENT], "no content unless the operator opts in"
    assert "echo hi" not in everything and "root done" not in everything and "child task" not in everything
    printed = "\n".join(_render(turn))
    assert [c.name for c in turn.children] == [
        "sessiond.queue", "sessiond.input.durable", "chat test-model", "execute_tool bash",
        "chat test-model", "execute_tool spawn_agent", "chat test-model", "sessiond.commit.durable",
    ], printed
    # Each LLM call, as the GenAI conventions name it.
    chat = turn.children[2]
    assert chat.kind == 3  # CLIENT (protobuf's numbering: internal 1, server 2, client 3)
    assert chat.attributes["gen_ai.operation.name"] == "chat"
    assert chat.attributes["openinference.span.kind"] == "LLM"
    assert chat.attributes["gen_ai.request.model"] == "test-model"
    # What the provider said answered (tests/fakellm.py's chunks say it).
    assert chat.attributes["gen_ai.response.model"] == "fake-model"
    assert chat.attributes["gen_ai.response.id"] == "chatcmpl-fake"
    assert chat.attributes["gen_ai.provider.name"] == "openai"
    assert chat.attributes["gen_ai.response.finish_reasons"] == ["tool_calls"]
    assert chat.attributes["server.address"] == "127.0.0.1"
    assert "gen_ai.input.messages" not in chat.attributes, "no content unless the operator opts in"
    last = turn.children[6]
    assert last.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert [e[0] for e in last.events] == ["gen_ai.first_token"]
    assert last.attributes["gen_ai.response.time_to_first_chunk"] >= 0
    # The tool call: its name, its exit.
    bash = turn.children[3]
    assert bash.attributes["gen_ai.tool.name"] == "bash" and bash.attributes["gen_ai.tool.call.id"] == "c1"
    assert bash.attributes["openinference.span.kind"] == "TOOL"
    assert bash.attributes["process.exit.code"] == 3
    # The sub-agent: a child span of the spawn_agent call, its turn traced
    # on its own worker beneath it.
    (subagent,) = turn.children[5].children
    assert subagent.name == f"sessiond.subagent {child}" and subagent.attributes["sessiond.session.id"] == child
    (child_turn,) = subagent.children
    assert child_turn.name == TURN and child_turn.attributes["sessiond.session.id"] == child
    assert child_turn.attributes["openinference.span.kind"] == "AGENT"
    assert child_turn.attributes["session.id"] == child
    names = [c.name for c in child_turn.children]
    assert "chat test-model" in names and "sessiond.commit.durable" in names, names
    child_chat = _one(child_turn.children, "chat test-model")
    assert child_chat.attributes["sessiond.session.id"] == child
    # The daemon's spans cover the worker's: queue first, commit last.
    assert turn.children[0].end_ns <= chat.start_ns and turn.children[-1].end_ns <= turn.end_ns

    # A bad traceparent is refused, clearly, before anything runs.
    with d.client() as c:
        with pytest.raises(Exception, match="invalid traceparent"):
            list(c.send(root, "x", traceparent="00-" + "0" * 32 + "-" + PARENT_SPAN + "-01"))
    result = d.ctl("send", root, "x", "--traceparent", "nonsense")
    assert result.returncode == 2 and "traceparent" in result.stderr


def test_sessionctl_passes_TRACEPARENT_and_content_only_when_opted_in(
    make_daemon, llm: FakeLLM, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    d = make_daemon(agent_config(llm))
    llm.script(
        tool_call_stream(("c1", "bash", {"command": "echo tool-said-this"}), ("c2", "no_such_tool", {})),
        text_stream("hello ", "there"),
    )
    session = d.ctl("create").stdout.strip()
    monkeypatch.setenv("TRACEPARENT", f"00-{PARENT_TRACE}-{PARENT_SPAN}-01")
    result = d.ctl("send", session, "a secret prompt")
    assert result.returncode == 0, result.stderr
    spans = receiver.wait_for(lambda spans: any(s.name == "sessiond.commit.durable" for s in spans))
    turn = _one(spans, TURN)
    assert (turn.trace_id, turn.parent_id) == (PARENT_TRACE, PARENT_SPAN)
    # The turn's input and reply, as Phoenix's and Langfuse's trace views
    # read them (OpenInference's names) and as the GenAI conventions say.
    assert turn.attributes["input.value"] == "a secret prompt"
    assert turn.attributes["output.value"] == "hello there"
    assert turn.attributes["input.mime_type"] == turn.attributes["output.mime_type"] == "text/plain"
    assert json.loads(turn.attributes["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": "a secret prompt"}]}]
    assert json.loads(turn.attributes["gen_ai.output.messages"])[0]["parts"] == [
        {"type": "text", "content": "hello there"}]
    assert turn.attributes["user.id"] == str(os.geteuid()) and turn.attributes["session.id"] == session
    chat = _one(spans, "chat test-model", **{"gen_ai.response.finish_reasons": ["stop"]})
    assert "a secret prompt" in chat.attributes["gen_ai.input.messages"]
    assert "hello there" in chat.attributes["gen_ai.output.messages"]
    # Each tool call's arguments and result.
    bash = _one(spans, "execute_tool bash")
    assert json.loads(bash.attributes["gen_ai.tool.call.arguments"]) == {"command": "echo tool-said-this"}
    assert bash.attributes["input.value"] == bash.attributes["gen_ai.tool.call.arguments"]
    assert "tool-said-this" in bash.attributes["gen_ai.tool.call.result"]
    assert bash.attributes["output.value"] == bash.attributes["gen_ai.tool.call.result"]
    assert bash.status_code != 2 and "error.type" not in bash.attributes
    # A call that failed: its status an error, and its kind.
    unknown = _one(spans, "execute_tool no_such_tool")
    assert unknown.status_code == 2 and "unknown tool" in unknown.status_message
    assert unknown.attributes["error.type"] == "tool_error"
    assert "unknown tool" in unknown.attributes["gen_ai.tool.call.result"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_collector_that_is_down_neither_fails_turns_nor_grows_the_daemon(make_daemon) -> None:
    # Configured by keys this time; nothing listens at the endpoint.
    d = make_daemon(f"""
[tracing]
exporter = "otlp"
endpoint = "http://127.0.0.1:{_closed_port()}/v1/traces"
queue_size = 64
export_timeout_secs = 5
""")
    with d.client() as c:
        session = c.create(handler="echo").id
        for i in range(1, 61):
            assert c.send_text(session, f"n{i}") == f"{i}: n{i}"
        rss_after_warmup = psutil.Process(d.pid).memory_info().rss
        for i in range(61, 361):
            assert c.send_text(session, f"n{i}") == f"{i}: n{i}"
        # The exporter process's counts come back within half a second.
        wait_for(lambda: c.stats().tracing["in_transit"] == 0, 10, "the exporter's counts")
        tracing = c.stats().tracing
    assert tracing["exporter"] == "otlp"
    # Four daemon spans a turn: far more than the queue holds; the rest dropped, counted.
    assert tracing["spans"] >= 4 * 360
    assert tracing["queued"] <= 64 and tracing["exported"] == 0
    assert tracing["dropped"] >= tracing["spans"] - 64 - tracing["exporting"] - tracing["failed"] > 0, tracing
    assert tracing["spans"] == sum(tracing[k] for k in ("dropped", "queued", "exporting", "exported", "failed"))
    grown = psutil.Process(d.pid).memory_info().rss - rss_after_warmup
    assert grown < 8 * 1024 * 1024, f"the daemon grew {grown} bytes over 300 turns"
    # The span exporter process dies: turns go on, its spans are dropped.
    (exporter,) = [p for p in psutil.Process(d.pid).children() if "otel_export" in " ".join(p.cmdline())]
    exporter.kill()
    exporter.wait(10)
    with d.client() as c:
        for i in range(361, 381):
            assert c.send_text(session, f"n{i}") == f"{i}: n{i}"
        wait_for(lambda: "span exporter" in d.log, 10, "the exporter's loss logged")


def test_a_worker_that_dies_mid_turn_shows_its_restart_in_the_turn_s_trace(
    make_daemon, receiver: OtlpReceiver,
) -> None:
    d = make_daemon()
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:crash_mid_turn").id
        events = list(c.send(sid, "crash"))
        assert isinstance(events[-1], m.TurnFailed)
        assert c.send_text(sid, "after") == "1: after"  # the restarted worker took it
    spans = receiver.wait_for(lambda spans: any(s.name == "sessiond.restart" for s in spans)
                              and sum(s.name.startswith("invoke_agent ") for s in spans) == 2)
    restart = _one(spans, "sessiond.restart")
    turn = "invoke_agent fixture_handlers:crash_mid_turn"
    failed = next(s for s in spans if s.name == turn and s.span_id == restart.parent_id)
    assert failed.status_code == 2 and "SIGKILL" in failed.status_message
    assert failed.attributes["sessiond.turn.outcome"] == "failed"
    assert failed.attributes["error.type"] == "crashed"
    assert restart.attributes["sessiond.session.id"] == sid and restart.status_code != 2
    assert [e[0] for e in restart.events][-1] == "sessiond.state.idle"


def test_a_tool_killed_by_the_memory_cap_has_its_span_and_the_log_names_the_trace(
    make_daemon, llm: FakeLLM, receiver: OtlpReceiver,
) -> None:
    # The daemon logs JSON lines: those about the traced turn carry its ids.
    d = make_daemon(agent_config(llm, 'log_format = "json"'))
    bomb = "python3 -c 'import signal; b = b\"x\" * (256 << 20); signal.pause()'"
    llm.script(tool_call_stream(("c0", "bash", {"command": bomb})), text_stream("survived"))
    with d.client() as c:
        sid = c.create(settings={"agent.limits.max_memory_mb": 64}).id
        events = list(c.send(sid, "blow up"))
        assert isinstance(events[-1], m.TurnDone) and events[-1].reply.endswith("survived")
        assert c.status(sid).last_exit.reason == "killed_memory"
    spans = receiver.wait_for(lambda spans: any(s.name == "sessiond.commit.durable" for s in spans))
    turn = _one(spans, TURN)
    # The worker died with the tool: the daemon, which saw its step begin
    # and never end, made its span, its status naming the limit.
    killed = _one(spans, "execute_tool bash")
    assert killed.parent_id == turn.span_id and killed.trace_id == turn.trace_id
    assert killed.status_code == 2 and killed.status_message.startswith("killed_memory: ")
    assert killed.attributes["error.type"] == "killed_memory"
    assert killed.attributes["sessiond.tool.killed_by"] == "memory"
    assert killed.attributes["gen_ai.tool.call.id"] == "c0" and killed.attributes["gen_ai.tool.name"] == "bash"
    assert killed.attributes["openinference.span.kind"] == "TOOL"
    assert turn.start_ns <= killed.start_ns <= killed.end_ns <= turn.end_ns
    assert turn.attributes["sessiond.turn.outcome"] == "done"
    assert [e[0] for e in turn.events] == ["sessiond.turn.resumed"]

    # Every daemon line about the turn, while it ran, names its trace and span.
    lines = [json.loads(line) for line in d.log.splitlines() if line]
    kill = next(o for o in lines if o.get("SESSION_ID") == sid and "killing worker" in o["MESSAGE"])
    assert (kill["TRACE_ID"], kill["SPAN_ID"]) == (turn.trace_id, turn.span_id), kill
    resumed = next(o for o in lines if o.get("SESSION_ID") == sid and "turn 1 resumed" in o["MESSAGE"])
    restarting = next(o for o in lines if o.get("SESSION_ID") == sid and o.get("SESSION_STATE") == "restarting")
    assert resumed["TRACE_ID"] == restarting["TRACE_ID"] == turn.trace_id
    # ... and no line about it once it ended.
    assert d.ctl("stop", sid).returncode == 0
    lines = [json.loads(line) for line in d.log.splitlines() if line]
    stopped = [o for o in lines if o.get("SESSION_ID") == sid and o.get("SESSION_STATE") == "stopped"]
    assert stopped and all("TRACE_ID" not in o for o in stopped)


def test_spans_go_over_otlp_grpc_when_asked(make_daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpGrpcReceiver() as rx:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        d = make_daemon()
        with d.client() as c:
            sid = c.create(handler="echo").id
            assert c.send_text(sid, "over grpc") == "1: over grpc"
            assert c.stats().tracing["protocol"] == "grpc"
        spans = rx.wait_for(lambda spans: any(s.name == "sessiond.commit.durable" for s in spans))
        turn = _one(spans, "invoke_agent echo")
        assert turn.attributes["session.id"] == sid and turn.service == "sessiond"
        assert {s.trace_id for s in spans} == {turn.trace_id}
        assert "OTLP/gRPC to " + rx.endpoint in d.log


def test_the_exporter_logs_in_the_daemon_s_json_format(make_daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    d = make_daemon(f"""
[daemon]
log_format = "json"
[tracing]
exporter = "otlp"
endpoint = "http://127.0.0.1:{_closed_port()}/v1/traces"
export_timeout_secs = 1
""")
    with d.client() as c:
        sid = c.create(handler="echo").id
        assert c.send_text(sid, "x") == "1: x"
        wait_for(lambda: c.stats().tracing["failed"] > 0, 30, "an export to fail")
    lines = [json.loads(line) for line in d.log.splitlines() if line]  # every line is JSON
    failed = [o for o in lines if o["LOGGER"].startswith("opentelemetry.exporter")]
    assert failed and all(o["PRIORITY"] == 3 for o in failed), failed
    assert failed[0]["PID"] != d.pid  # the span exporter's own line
