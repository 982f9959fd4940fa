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
