"""OpenTelemetry traces through the real daemon, exported to a real OTLP/HTTP
receiver on loopback (tests/otlp_receiver.py decodes them with
opentelemetry-proto): the span tree of an agent turn with a tool and a
sub-agent, a client's traceparent continued, and a collector that is down."""

from __future__ import annotations

import socket

import psutil
import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import wait_for
from ipc import messages as m
from otlp_receiver import OtlpReceiver, Received, tree

pytestmark = pytest.mark.process

PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


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
        return sum(s.name == "sessiond.turn" for s in spans) == 2 and sum(
            s.name == "sessiond.commit.durable" for s in spans) == 2
    spans = receiver.wait_for(complete)
    assert {s.trace_id for s in spans} == {PARENT_TRACE}, "one trace, the caller's"
    assert {s.service for s in spans} == {"sessiond-test"}
    (turn,) = tree(spans, PARENT_TRACE)
    assert turn.name == "sessiond.turn" and turn.parent_id == PARENT_SPAN
    assert turn.attributes["sessiond.session.id"] == root and turn.attributes["sessiond.turn"] == 1
    assert turn.attributes["sessiond.turn.outcome"] == "done"
    printed = "\n".join(_render(turn))
    assert [c.name for c in turn.children] == [
        "sessiond.queue", "sessiond.input.durable", "chat test-model", "execute_tool bash",
        "chat test-model", "execute_tool spawn_agent", "chat test-model", "sessiond.commit.durable",
    ], printed
    # Each LLM call, as the GenAI conventions name it.
    chat = turn.children[2]
    assert chat.kind == 3  # CLIENT (protobuf's numbering: internal 1, server 2, client 3)
    assert chat.attributes["gen_ai.operation.name"] == "chat"
    assert chat.attributes["gen_ai.request.model"] == "test-model"
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
    assert bash.attributes["process.exit.code"] == 3
    # The sub-agent: a child span of the spawn_agent call, its turn traced
    # on its own worker beneath it.
    (invoke,) = turn.children[5].children
    assert invoke.name == f"invoke_agent {child}" and invoke.attributes["gen_ai.agent.name"] == child
    (child_turn,) = invoke.children
    assert child_turn.name == "sessiond.turn" and child_turn.attributes["sessiond.session.id"] == child
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


def test_sessionctl_passes_TRACEPARENT_and_prompts_only_when_opted_in(
    make_daemon, llm: FakeLLM, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    d = make_daemon(agent_config(llm))
    llm.script(text_stream("hello ", "there"))
    session = d.ctl("create").stdout.strip()
    monkeypatch.setenv("TRACEPARENT", f"00-{PARENT_TRACE}-{PARENT_SPAN}-01")
    result = d.ctl("send", session, "a secret prompt")
    assert result.returncode == 0, result.stderr
    spans = receiver.wait_for(lambda spans: any(s.name == "sessiond.commit.durable" for s in spans))
    turn = _one(spans, "sessiond.turn")
    assert (turn.trace_id, turn.parent_id) == (PARENT_TRACE, PARENT_SPAN)
    chat = _one(spans, "chat test-model")
    assert "a secret prompt" in chat.attributes["gen_ai.input.messages"]
    assert "hello there" in chat.attributes["gen_ai.output.messages"]


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
                              and sum(s.name == "sessiond.turn" for s in spans) == 2)
    restart = _one(spans, "sessiond.restart")
    failed = next(s for s in spans if s.name == "sessiond.turn" and s.span_id == restart.parent_id)
    assert failed.status_code == 2 and "SIGKILL" in failed.status_message
    assert failed.attributes["sessiond.turn.outcome"] == "failed"
    assert restart.attributes["sessiond.session.id"] == sid and restart.status_code != 2
    assert [e[0] for e in restart.events][-1] == "sessiond.state.idle"
