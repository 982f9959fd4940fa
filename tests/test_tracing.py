"""Tracing's parts alone: the traceparent a client passes (hostile input),
when tracing is on, the worker's span recorder, and the daemon's checks on
the spans a worker sends (untrusted)."""

from __future__ import annotations

import contextvars
import threading
from typing import Any

import msgspec
import pytest

from ipc import messages as m
from ipc.traceparent import format_traceparent, parse_traceparent
from session_worker import tracing
from supervisor.config import ConfigError, TracingSettings, parse_config
from supervisor.ops.tracing_config import wanted

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.pure
def test_a_valid_traceparent_is_read() -> None:
    parent = parse_traceparent(GOOD)
    assert parent.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736 and parent.span_id == 0x00F067AA0BA902B7
    assert parent.sampled and not parse_traceparent(GOOD[:-2] + "00").sampled
    assert format_traceparent(parent.trace_id, parent.span_id) == GOOD
    # A later version may carry more fields; the known ones are read.
    assert parse_traceparent("01" + GOOD[2:] + "-what-comes").span_id == parent.span_id


@pytest.mark.pure
@pytest.mark.parametrize("bad", [
    "", "hello", GOOD.upper(), GOOD + "-extra", "ff" + GOOD[2:], GOOD.replace("4bf92f", "4bf92g"),
    "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", GOOD + "\n", " " + GOOD,
    "01" + GOOD[2:] + "-" + "x" * 300, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
])
def test_a_traceparent_not_in_its_exact_form_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="traceparent"):
        parse_traceparent(bad)


@pytest.mark.pure
@pytest.mark.parametrize(("key", "env", "on"), [
    ("", {}, False),
    ("", {"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ("", {"OTEL_TRACES_EXPORTER": "console,otlp"}, True),
    ("", {"OTEL_TRACES_EXPORTER": "none"}, False),
    ("none", {"OTEL_TRACES_EXPORTER": "otlp"}, False),
    ("otlp", {}, True),
    ("otlp", {"OTEL_SDK_DISABLED": "true"}, False),
])
def test_tracing_is_off_unless_the_config_or_OTEL_TRACES_EXPORTER_asks(
    key: str, env: dict[str, str], on: bool,
) -> None:
    assert wanted(TracingSettings(exporter=key), env) is on  # type: ignore[arg-type]


@pytest.mark.pure
def test_tracing_keys_are_checked() -> None:
    cfg = parse_config({"tracing": {"exporter": "otlp", "endpoint": "http://c:4318/v1/traces"}}, "x.toml")
    assert cfg.tracing.exporter == "otlp" and cfg.tracing.queue_size == 2048
    with pytest.raises(ConfigError, match="'tracing.endpoint'"):
        parse_config({"tracing": {"endpoint": "collector:4318"}}, "x.toml")
    with pytest.raises(ConfigError, match="'tracing.queue_size'"):
        parse_config({"tracing": {"queue_size": 10}}, "x.toml")
    with pytest.raises(ConfigError, match="'tracing.exporter'"):
        parse_config({"tracing": {"exporter": "zipkin"}}, "x.toml")


def _record(sent: list[Any]) -> list[m.SpanRecord]:
    return [span for msg in sent for span in msg.spans]


@pytest.mark.pure
def test_the_worker_records_nothing_for_an_untraced_turn() -> None:
    def turn() -> None:
        with tracing.span("chat x") as span:
            span.set("k", 1)
            assert not span.recording and tracing.current_span_id() == 0
        assert not tracing.active()

    contextvars.copy_context().run(turn)


@pytest.mark.pure
def test_the_worker_records_nested_spans_and_sends_each_as_it_ends() -> None:
    sent: list[Any] = []

    def turn() -> None:
        tracing.begin_turn(7, sent.append, content=True)
        assert tracing.capturing()
        with tracing.span("execute_tool bash", attributes={"gen_ai.tool.name": "bash"}) as outer:
            with tracing.span("inner", tracing.CLIENT) as inner:
                assert tracing.current_span_id() == inner.id
                tracing.annotate({"process.exit.code": 3})
            assert len(sent) == 1  # the inner one, at its end
            with pytest.raises(RuntimeError):
                with tracing.span("broken"):
                    raise RuntimeError("no")
            outer.event("gen_ai.first_token")
        assert tracing.current_span_id() == 0

    contextvars.copy_context().run(turn)
    assert all(isinstance(msg, m.WorkerSpans) and msg.turn == 7 for msg in sent)
    inner, broken, outer = _record(sent)
    assert outer.parent == 0 and inner.parent == outer.id and broken.parent == outer.id
    assert inner.kind == tracing.CLIENT and inner.attributes == {"process.exit.code": 3}
    assert broken.error == "RuntimeError: no"
    assert [e.name for e in outer.events] == ["gen_ai.first_token"]
    assert outer.start_ns <= inner.start_ns <= inner.end_ns <= outer.end_ns
    # It goes over the wire as any worker message does.
    raw = msgspec.msgpack.encode(sent[0])
    assert msgspec.msgpack.decode(raw, type=m.FromWorker) == sent[0]


@pytest.mark.component
def test_the_daemon_checks_what_a_worker_sends_as_untrusted() -> None:
    from supervisor.ops.otel import OtelTracer, worker_span

    tracer = OtelTracer(TracingSettings(exporter="otlp", max_spans_per_turn=5), environ={}, start=False)
    trace = tracer.begin("s1", 1, "agent", None)
    assert trace is not None and trace.recording
    turn = trace.spans.turn
    now = 1_700_000_000_000_000_000
    many = {f"k{i}": i for i in range(500)}
    hostile = m.SpanRecord(
        id=0xABC, parent=0, name="n" * 10_000, kind=99, start_ns=now, end_ns=now - 5, error="e" * 10_000,
        attributes={**{"big": "x" * 100_000, "gen_ai.input.messages": "y" * 200_000, "nested": {"a": 1},
                       "mixed": [1, "a"], "huge": 1 << 70, "ok": [1, 2], "": 1, "k" * 200: 1}, **many},
        events=[m.SpanEvent(name="ev", at_ns=now)] * 100 + [m.SpanEvent(name="bad", at_ns=-1)],
    )
    span = worker_span(hostile, turn.trace_id, turn.span_id, "s1")
    assert span is not None and span.worker
    assert span.trace_id == turn.trace_id, "placed in its own turn's trace, whatever it says"
    assert span.parent_id == turn.span_id and not span.parent_remote and span.kind == 0
    assert len(span.name) == 128 and span.end_ns == span.start_ns
    attrs = span.attributes
    assert len(attrs["big"]) == 4096 and len(attrs["gen_ai.input.messages"]) == 64 * 1024
    assert "nested" not in attrs and "mixed" not in attrs and "huge" not in attrs and "" not in attrs
    assert attrs["ok"] == [1, 2] and len(attrs) <= 65 and attrs["sessiond.session.id"] == "s1"
    assert len(span.events) == 64 and len(span.error) == 4096
    for bad in (dict(id=0), dict(id=1 << 64), dict(parent=-1), dict(start_ns=0), dict(end_ns=1 << 63)):
        record = msgspec.structs.replace(hostile, **bad)
        assert worker_span(record, turn.trace_id, turn.span_id, "s1") is None, bad
    # Past max_spans_per_turn (5 here) a turn's worker spans are dropped and counted.
    ok = m.SpanRecord(id=5, name="chat m", start_ns=now, end_ns=now + 1)
    before = tracer.made
    tracer.worker_spans(trace, m.WorkerSpans(turn=1, spans=[ok] * 8 + [msgspec.structs.replace(ok, id=0)]))
    assert tracer.made - before == 5 and trace.spans.dropped == 4


@pytest.mark.component
def test_the_exporter_process_s_pipeline_is_bounded_and_counts_its_drops() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from supervisor.ops.otel import ExportSpan
    from supervisor.ops.otel_export import Pipeline

    class Stuck(InMemorySpanExporter):
        """A collector that never answers: each export waits until released."""

        def __init__(self) -> None:
            super().__init__()
            self.release = threading.Event()

        def export(self, spans):  # type: ignore[no-untyped-def]
            self.release.wait(10)
            return super().export(spans)

    stuck = Stuck()
    pipeline = Pipeline(TracingSettings(exporter="otlp", queue_size=64), exporter=stuck)
    trace_id = (0x4BF92F3577B34DA6A3CE929D0E0E4736).to_bytes(16, "big")
    for i in range(1, 1001):
        pipeline.take(ExportSpan(trace_id, i, 7, True, "sessiond.turn", 1, 10, 20, "", {"a": 1},
                                 [("ev", 15, {})], False))
    counts = pipeline.counts()
    assert counts["received"] == 1000 and counts["queued"] + counts["exporting"] <= 64 + 64
    assert counts["dropped"] >= 1000 - 128
    stuck.release.set()
    pipeline.close()
    (first, *_) = stuck.get_finished_spans()
    assert first.parent.span_id == 7 and first.parent.is_remote and first.kind.value == 1
    assert first.resource.attributes["service.name"] == "sessiond"


@pytest.mark.pure
def test_the_protocol_is_the_config_s_else_the_standard_variables_and_an_unknown_one_is_refused() -> None:
    from supervisor.errors import StartupError
    from supervisor.ops.tracing_config import protocol

    assert protocol(TracingSettings(), {}) == "http/protobuf"
    assert protocol(TracingSettings(), {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    assert protocol(TracingSettings(), {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    assert protocol(TracingSettings(protocol="grpc"), {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}) == "grpc"
    # Once silently ignored: now said at start.
    with pytest.raises(StartupError, match="OTEL_EXPORTER_OTLP_PROTOCOL=http/json"):
        protocol(TracingSettings(), {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    with pytest.raises(ConfigError, match="'tracing.protocol'"):
        parse_config({"tracing": {"protocol": "http/json"}}, "x.toml")


@pytest.mark.pure
def test_a_failed_worker_span_says_its_error_type() -> None:
    sent: list[Any] = []

    class HTTPError(Exception):
        status = 429

    def turn() -> None:
        tracing.begin_turn(1, sent.append)
        for exc in (RuntimeError("no"), HTTPError("slow down")):
            with pytest.raises(type(exc)):
                with tracing.span("chat m"):
                    raise exc
        with tracing.span("execute_tool bash") as span:
            span.fail("error: permission denied: a rule", "permission_denied")
        with tracing.span("plain") as span:
            span.fail("it broke")
        with tracing.span("fine"):
            pass

    contextvars.copy_context().run(turn)
    runtime, http, denied, plain, fine = _record(sent)
    assert runtime.attributes["error.type"] == "RuntimeError" and runtime.error == "RuntimeError: no"
    assert http.attributes["error.type"] == "429", "an HTTP error's status, as the conventions say"
    assert denied.attributes["error.type"] == "permission_denied"
    assert plain.attributes["error.type"] == "_OTHER"
    assert "error.type" not in fine.attributes and not fine.error


@pytest.mark.pure
def test_the_response_s_model_and_id_are_read_from_either_dialect_s_stream() -> None:
    from session_worker.agent._anthropic import AnthropicAssembler
    from session_worker.agent._stream import StreamAssembler

    openai = StreamAssembler()
    openai.feed({"id": "chatcmpl-1", "model": "gpt-4o-mini-2024-07-18",
                 "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]})
    openai.feed({"id": "chatcmpl-other", "model": "x", "choices": [], "usage": {"prompt_tokens": 1}})
    done = openai.finish()
    assert (done.model, done.response_id) == ("gpt-4o-mini-2024-07-18", "chatcmpl-1")
    anthropic = AnthropicAssembler()
    anthropic.feed({"type": "message_start", "message": {"id": "msg_01", "model": "claude-x", "usage": {}}})
    anthropic.feed({"type": "message_delta", "delta": {"stop_reason": "end_turn"}})
    done = anthropic.finish()
    assert (done.model, done.response_id) == ("claude-x", "msg_01")
    # What a server says is cut to size, and a value that is not text ignored.
    hostile = StreamAssembler()
    hostile.feed({"id": ["not text"], "model": "m" * 10_000, "choices": []})
    done = hostile.finish()
    assert done.response_id == "" and len(done.model) == 256


@pytest.mark.pure
def test_a_tool_its_worker_died_in_is_named_from_its_step_and_the_death() -> None:
    from supervisor.ops.genai import killed_tool
    from supervisor.ops.labels import killed_by

    name, attrs = killed_tool("tool:bash:call_7", "killed_memory: memory cap 64 MiB exceeded (signal SIGKILL)")
    assert name == "execute_tool bash" and attrs["gen_ai.tool.call.id"] == "call_7"
    assert attrs["error.type"] == "killed_memory" and attrs["sessiond.tool.killed_by"] == "memory"
    name, attrs = killed_tool("tool:mcp__fs__read:a:b", "crashed (signal SIGSEGV)")
    assert name == "execute_tool mcp__fs__read" and attrs["gen_ai.tool.call.id"] == "a:b"
    assert attrs["error.type"] == "crashed" and "sessiond.tool.killed_by" not in attrs, "no limit killed it"
    # A handler's own step key; a hostile one, cut.
    assert killed_tool("fetch page", "the session was stopped")[0] == "execute_tool fetch page"
    name, attrs = killed_tool("tool:" + "x" * 10_000, "")
    assert len(attrs["gen_ai.tool.name"]) == 128 and "gen_ai.tool.call.id" not in attrs
    assert [killed_by(f"{r}: x (signal SIGKILL)") for r in (
        "killed_turn_timeout", "killed_heartbeat", "killed_processes", "killed_disk", "crashed", "stopped")] == [
        "turn_timeout", "heartbeat", "processes", "disk", "", ""]


@pytest.mark.component
def test_tools_in_flight_when_a_turn_fails_get_spans_and_its_log_ids_come_and_go() -> None:
    from supervisor import logtag
    from supervisor.ops.otel import OtelTracer

    tracer = OtelTracer(TracingSettings(exporter="otlp"), environ={}, start=False)
    emitted: list[Any] = []
    tracer.emit = emitted.append  # type: ignore[method-assign]
    trace = tracer.begin("s9", 1, "agent", None, text="secret words", owner_uid=1234)
    assert trace is not None and not trace.content
    turn = trace.spans.turn
    assert turn.name == "invoke_agent agent" and turn.attributes["user.id"] == "1234"
    assert "input.value" not in turn.attributes, "content capture is off"
    assert logtag._TRACED["s9"] == {"trace_id": turn.trace_id.hex(), "span_id": f"{turn.span_id:016x}"}
    tracer.step(trace, m.StepBegun(turn=1, n=0, key="llm:1", kind="llm"))
    tracer.step(trace, m.StepBegun(turn=1, n=1, key="tool:bash:c1", kind="tool"))
    tracer.step(trace, m.StepBegun(turn=1, n=2, key="tool:read_file:c2", kind="tool"))
    tracer.step(trace, m.StepDone(turn=1, n=2, key="tool:read_file:c2", kind="tool"))
    tracer.ended("s9", trace, failed="the session was stopped")
    assert "s9" in logtag._TRACED, "the lines of the turn's end still name it"
    (bash,) = [s for s in emitted if s.name.startswith("execute_tool")]
    assert bash.name == "execute_tool bash" and bash.parent_id == turn.span_id and bash.trace_id == turn.trace_id
    assert bash.error == "the session was stopped" and bash.attributes["error.type"] == "stopped"
    (ended,) = [s for s in emitted if s.span_id == turn.span_id]
    assert ended.error == "the session was stopped" and ended.attributes["error.type"] == "stopped"
    tracer.state_changed("s9", "stopping", "stopped", "", None)
    assert "s9" not in logtag._TRACED, "at rest, its lines no longer name the trace"


@pytest.mark.pure
def test_a_traced_session_s_log_records_carry_the_journal_fields_of_its_trace() -> None:
    import logging

    from ipc.logfields import encode_entry, record_fields
    from supervisor import logtag

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("sessiond.test-trace-ids")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logtag.traced("s1", "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
    try:
        logtag.tagged(logger, "s1").warning("worker %d killed", 7)
        logtag.tagged(logger, "s2").info("another session's line")
    finally:
        logtag.untraced("s1")
    logtag.tagged(logger, "s1").info("after the turn")
    traced, other, after = (record_fields(r) for r in records)
    assert traced["TRACE_ID"] == "4bf92f3577b34da6a3ce929d0e0e4736" and traced["SPAN_ID"] == "00f067aa0ba902b7"
    assert b"\nTRACE_ID=4bf92f3577b34da6a3ce929d0e0e4736\n" in encode_entry(traced)
    assert "TRACE_ID" not in other and "TRACE_ID" not in after


@pytest.mark.component
def test_a_workers_log_line_during_a_traced_turn_names_its_trace_and_span() -> None:
    """The daemon's lines about a traced turn carried TRACE_ID and SPAN_ID;
    the worker's own (its handler's errors, a tool host's words) did not."""
    import asyncio
    import io
    import json
    import logging

    from ipc.logfields import JsonFormatter
    from session_worker import tracing as worker_tracing
    from session_worker.worker._logtag import SessionTag

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(SessionTag("s1"))
    logger = logging.getLogger("sessiond.test-worker-trace")
    logger.propagate = False
    logger.addHandler(handler)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"

    async def turn() -> int:
        worker_tracing.begin_turn(1, lambda msg: None, False, trace_id)
        logger.warning("outside any span")
        with worker_tracing.span("execute_tool bash") as span:
            logger.warning("in the tool's span")
            return span.id

    try:
        span_id = asyncio.run(turn())
        logger.warning("no turn")
    finally:
        logger.removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(x.get("TRACE_ID"), x.get("SPAN_ID")) for x in lines] == [
        (trace_id, None), (trace_id, f"{span_id:016x}"), (None, None)]
    assert all(x["SESSION_ID"] == "s1" for x in lines)
