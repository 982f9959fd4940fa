"""The OpenTelemetry tracer: the daemon's spans, the workers' spans placed in
their turns' traces, one bounded exporter.  Imported only when tracing is on
(the `otel` extra: opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http).

Runs in the daemon's loop; the export runs in the SDK's batch thread.  Why
the shape (docs/tracing.md):

* Only the daemon exports.  Workers and their tools run sandboxed, maybe
  without network, maybe on another node: they record their spans and send
  them over the socket they already have (`m.WorkerSpans`), and learn neither
  the collector nor the trace id.  What a worker sends is untrusted: it is
  placed in the trace of the turn it runs (no other), its ids, times, names,
  attributes and events are checked and cut to size, and a turn keeps at
  most `max_spans_per_turn` of them.
* Export never blocks a turn: spans go to the SDK's batch processor, whose
  thread encodes and posts them.  Memory stays bounded when the collector
  is down: at most `queue_size` spans wait (counted from what was handed
  over and what the exporter took), and one more is dropped and counted.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace as api
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from ipc import messages as m
from ipc.traceparent import TraceParent
from supervisor import __version__
from supervisor.config import TracingSettings
from supervisor.ops.tracing import SubagentTrace, Tracer, TurnTrace

__all__ = ["OtelTracer"]

log = logging.getLogger("sessiond")

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_MAX_ID = (1 << 64) - 1
_MAX_NAME = 128
_MAX_ATTRIBUTES = 64
_MAX_EVENTS = 64
_MAX_VALUE_CHARS = 4096
_CONTENT_KEYS = frozenset({"gen_ai.input.messages", "gen_ai.output.messages"})
_MAX_CONTENT_CHARS = 64 * 1024
_MAX_LIST = 64
_EXIT_FLUSH_SECS = 2.0
# The span kinds a worker may name (internal, server, client, producer, consumer).
_KINDS = {k.value: k for k in SpanKind}
# Live states a restart span ends in (the worker is back), and the ones
# that end it otherwise.
_BACK = frozenset({"idle", "running"})
_GAVE_UP = frozenset({"failed", "stopped", "stopping", "deleted", "hibernated", "damaged"})


class _Counted(SpanExporter):
    """The OTLP exporter, counting what it was handed and how it went
    (read from the loop, written by the batch thread: plain ints)."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.handed = 0
        self.exported = 0
        self.failed = 0
        self._stopped = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.handed += len(spans)
        try:
            result = self.inner.export(spans)
        except Exception:
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        if not self._stopped:  # (the exit's timer, then the provider's shutdown)
            self._stopped = True
            self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _Bounded(SpanProcessor):
    """The batch processor behind a gate: a span is dropped (and counted)
    here when `limit` are already waiting, rather than pushing out one the
    processor holds; so the count of drops is exact."""

    def __init__(self, exporter: _Counted, limit: int, timeout_secs: float) -> None:
        self.exporter = exporter
        self.limit = limit
        self.handed = 0
        self.dropped = 0
        self.batch = BatchSpanProcessor(exporter, max_queue_size=limit,
                                        max_export_batch_size=min(512, limit),
                                        export_timeout_millis=timeout_secs * 1000)

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self.handed - self.exporter.handed >= self.limit:
            self.dropped += 1
            return
        self.handed += 1
        self.batch.on_end(span)

    def shutdown(self) -> None:
        self.batch.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.batch.force_flush(timeout_millis)


class _Spans:
    """A traced turn's open spans (TurnTrace.spans)."""

    __slots__ = ("turn", "context", "input", "commit", "worker_spans", "dropped", "session")

    def __init__(self, turn: Span, session: str) -> None:
        self.turn = turn
        self.context = api.set_span_in_context(turn)
        self.input: Span | None = None
        self.commit: Span | None = None
        self.worker_spans = 0
        self.dropped = 0
        self.session = session


class _Subagent(SubagentTrace):
    def __init__(self, tracer: OtelTracer, span: Span) -> None:
        self._tracer = tracer
        self._span = span

    def turn(self, received_ns: int) -> TurnTrace | None:
        ctx = self._span.get_span_context()
        return TurnTrace(received_ns, TraceParent(ctx.trace_id, ctx.span_id, int(ctx.trace_flags)))

    def child(self, session_id: str) -> None:
        self._span.set_attribute("gen_ai.agent.name", session_id)
        self._span.set_attribute("sessiond.session.id", session_id)
        self._span.update_name(f"invoke_agent {session_id}")

    def end(self, error: str = "") -> None:
        if error:
            self._span.set_status(Status(StatusCode.ERROR, error[:_MAX_VALUE_CHARS]))
        self._span.end()


class OtelTracer(Tracer):
    enabled = True

    def __init__(self, settings: TracingSettings, environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
        self._settings = settings
        self._content = settings.capture_content or environ.get(
            "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "").strip().lower() in ("true", "1")
        protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
        if protocol.strip() != "http/protobuf":
            log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: sessiond exports over http/protobuf only", protocol)
        attributes: dict[str, Any] = {"service.version": __version__}
        if settings.service_name:
            attributes["service.name"] = settings.service_name
        elif not environ.get("OTEL_SERVICE_NAME") and "service.name=" not in environ.get(
                "OTEL_RESOURCE_ATTRIBUTES", ""):
            attributes["service.name"] = "sessiond"
        self._resource = Resource.create(attributes)
        exporter = OTLPSpanExporter(endpoint=settings.endpoint or None, timeout=settings.export_timeout_secs)
        self.endpoint = exporter._endpoint  # for the operator: where spans go
        self._exporter = _Counted(exporter)
        self._processor = _Bounded(self._exporter, settings.queue_size, settings.export_timeout_secs)
        self._provider = TracerProvider(resource=self._resource, shutdown_on_exit=False)
        atexit.register(self._at_exit)
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer("sessiond", __version__)
        self._scope = InstrumentationScope("sessiond.worker", __version__)
        # Per session: the open restart span; the last worker boot (to show
        # in the turn it was made for); the turn a worker's exit just failed.
        self._restarts: dict[str, Span] = {}
        self._boots: dict[str, tuple[int, int]] = {}
        self._booting: dict[str, int] = {}
        self._just_failed: dict[str, Any] = {}
        log.info("tracing: turns are traced and exported over OTLP/HTTP to %s ([tracing])", self.endpoint)

    # ---------------------------------------------------------------- turns

    def request(self, parent: TraceParent | None, received_ns: int) -> TurnTrace | None:
        return TurnTrace(received_ns, parent)

    def begin(self, session_id: str, turn: int, handler: str, trace: TurnTrace | None) -> TurnTrace | None:
        now = time.time_ns()
        if trace is None:
            trace = TurnTrace(now)
        context = None
        if trace.parent is not None:
            parent = trace.parent
            context = api.set_span_in_context(api.NonRecordingSpan(SpanContext(
                parent.trace_id, parent.span_id, is_remote=True, trace_flags=TraceFlags(parent.flags & 0xFF))))
        self._just_failed.pop(session_id, None)
        span = self._tracer.start_span(
            "sessiond.turn", context=context, kind=SpanKind.SERVER, start_time=trace.received_ns,
            attributes={"session.id": session_id, "sessiond.session.id": session_id, "sessiond.turn": turn,
                        "sessiond.handler": handler},
        )
        if not span.is_recording():
            return None
        spans = _Spans(span, session_id)
        queue = self._tracer.start_span("sessiond.queue", context=spans.context, start_time=trace.received_ns)
        boot = self._boots.pop(session_id, None)
        if boot is not None and boot[0] >= trace.received_ns:
            self._tracer.start_span("sessiond.worker.start", context=api.set_span_in_context(queue),
                                    start_time=boot[0]).end(end_time=boot[1])
        queue.end(end_time=now)
        spans.input = self._tracer.start_span("sessiond.input.durable", context=spans.context, start_time=now)
        trace.spans = spans
        trace.recording = True
        trace.content = self._content
        return trace

    def input_durable(self, trace: TurnTrace, error: str = "") -> None:
        spans: _Spans = trace.spans
        if spans.input is not None:
            if error:
                spans.input.set_status(Status(StatusCode.ERROR, error))
            spans.input.end()
            spans.input = None

    def commit_started(self, trace: TurnTrace) -> None:
        spans: _Spans = trace.spans
        spans.commit = self._tracer.start_span("sessiond.commit.durable", context=spans.context)

    def ended(self, session_id: str, trace: TurnTrace, failed: str = "", done: m.Done | None = None) -> None:
        spans: _Spans = trace.spans
        if spans.input is not None:  # the flush that covered it was the commit's
            spans.input.end()
            spans.input = None
        if spans.commit is not None:
            if failed:
                spans.commit.set_status(Status(StatusCode.ERROR, failed[:_MAX_VALUE_CHARS]))
            spans.commit.end()
            spans.commit = None
        turn = spans.turn
        if spans.dropped:
            turn.set_attribute("sessiond.worker_spans.dropped", spans.dropped)
        if done is not None:
            turn.set_attribute("sessiond.turn.outcome", "interrupted" if done.interrupted else "done")
            if done.stop_reason:
                turn.set_attribute("sessiond.turn.stop_reason", done.stop_reason)
            for ours, theirs in (("prompt_tokens", "gen_ai.usage.input_tokens"),
                                 ("completion_tokens", "gen_ai.usage.output_tokens"),
                                 ("reasoning_tokens", "gen_ai.usage.reasoning.output_tokens")):
                if ours in done.usage:
                    turn.set_attribute(theirs, done.usage[ours])
        else:
            turn.set_attribute("sessiond.turn.outcome", "failed")
            turn.set_status(Status(StatusCode.ERROR, failed[:_MAX_VALUE_CHARS]))
            self._just_failed[session_id] = spans.context
            # Only the exit being handled now may take it as the turn it ended.
            asyncio.get_running_loop().call_soon(self._just_failed.pop, session_id, None)
        turn.end()

    def resumed(self, trace: TurnTrace | None, detail: str = "") -> None:
        if trace is not None and trace.spans is not None:
            trace.spans.turn.add_event("sessiond.turn.resumed", {"sessiond.detail": detail} if detail else None)

    # ---------------------------------------------------------------- the worker's spans

    def worker_spans(self, trace: TurnTrace, msg: m.WorkerSpans) -> None:
        spans: _Spans = trace.spans
        turn_ctx = spans.turn.get_span_context()
        limit = self._settings.max_spans_per_turn
        for record in msg.spans:
            if spans.worker_spans >= limit:
                spans.dropped += 1
                continue
            readable = self._readable(record, turn_ctx, spans.session)
            if readable is None:
                spans.dropped += 1
                continue
            spans.worker_spans += 1
            self._processor.on_end(readable)

    def _readable(self, record: m.SpanRecord, turn: SpanContext, session: str) -> ReadableSpan | None:
        """A worker's span as the SDK's, or None when it is not one."""
        if not 0 < record.id <= _MAX_ID or not 0 <= record.parent <= _MAX_ID:
            return None
        if not 0 < record.start_ns < (1 << 63) or not 0 < record.end_ns < (1 << 63):
            return None
        end = max(record.start_ns, record.end_ns)
        attributes = _clean(record.attributes)
        attributes["sessiond.session.id"] = session
        events = [Event(_text(e.name, _MAX_NAME), _clean(e.attributes), e.at_ns)
                  for e in record.events[:_MAX_EVENTS] if 0 < e.at_ns < (1 << 63)]
        status = Status(StatusCode.ERROR, _text(record.error, _MAX_VALUE_CHARS)) if record.error else Status()
        return ReadableSpan(
            name=_text(record.name, _MAX_NAME) or "worker",
            context=SpanContext(turn.trace_id, record.id, is_remote=False, trace_flags=_SAMPLED),
            parent=SpanContext(turn.trace_id, record.parent or turn.span_id, is_remote=False,
                               trace_flags=_SAMPLED),
            resource=self._resource, attributes=attributes, events=events,
            kind=_KINDS.get(record.kind, SpanKind.INTERNAL), status=status,
            start_time=record.start_ns, end_time=end, instrumentation_scope=self._scope,
        )

    # ---------------------------------------------------------------- sub-agents, restarts

    def subagent(self, trace: TurnTrace | None, span_id: int, handler: str) -> SubagentTrace | None:
        if trace is None or trace.spans is None:
            return None
        spans: _Spans = trace.spans
        context = spans.context
        if 0 < span_id <= _MAX_ID:  # under the worker's spawn_agent call
            turn = spans.turn.get_span_context()
            context = api.set_span_in_context(api.NonRecordingSpan(
                SpanContext(turn.trace_id, span_id, is_remote=False, trace_flags=_SAMPLED)))
        span = self._tracer.start_span("invoke_agent", context=context, kind=SpanKind.INTERNAL, attributes={
            "gen_ai.operation.name": "invoke_agent", "sessiond.handler": handler})
        return _Subagent(self, span)

    def state_changed(self, session_id: str, old: str, new: str, reason: str, trace: TurnTrace | None) -> None:
        if new == "starting":
            self._booting[session_id] = time.time_ns()
        elif old == "starting" and session_id in self._booting:
            started = self._booting.pop(session_id)
            if new == "idle":
                self._boots[session_id] = (started, time.time_ns())
        restart = self._restarts.get(session_id)
        if restart is None and new in ("crashed", "restarting"):
            context = trace.spans.context if trace is not None and trace.spans is not None else (
                self._just_failed.get(session_id))
            self._restarts[session_id] = self._tracer.start_span(
                "sessiond.restart", context=context,
                attributes={"sessiond.session.id": session_id, "sessiond.exit.reason": reason})
        elif restart is not None:
            restart.add_event(f"sessiond.state.{new}", {"sessiond.reason": reason} if reason else None)
            if new in _BACK or new in _GAVE_UP:
                if new not in _BACK:
                    restart.set_status(Status(StatusCode.ERROR, f"{new}: {reason}"[:_MAX_VALUE_CHARS]))
                restart.end()
                del self._restarts[session_id]

    def forget(self, session_id: str) -> None:
        for table in (self._boots, self._booting, self._just_failed):
            table.pop(session_id, None)
        restart = self._restarts.pop(session_id, None)
        if restart is not None:
            restart.set_status(Status(StatusCode.ERROR, "the session was removed"))
            restart.end()

    # ---------------------------------------------------------------- the operator's view

    def _at_exit(self) -> None:
        """The last spans go out as the daemon exits, for at most
        `_EXIT_FLUSH_SECS`: a collector that is down does not hold the
        exit (its exporter is stopped, which ends its retries)."""
        stop = threading.Timer(_EXIT_FLUSH_SECS, self._exporter.shutdown)
        stop.daemon = True
        stop.start()
        try:
            self._provider.shutdown()
        finally:
            stop.cancel()
        log.info("tracing: %s", ", ".join(f"{k} {v}" for k, v in self.stats().items() if k != "endpoint"))

    def stats(self) -> dict[str, Any]:
        processor, exporter = self._processor, self._exporter
        return {
            "exporter": "otlp", "endpoint": self.endpoint, "spans": processor.handed + processor.dropped,
            "exported": exporter.exported, "failed": exporter.failed, "dropped": processor.dropped,
            "queued": processor.handed - exporter.handed,
            "exporting": exporter.handed - exporter.exported - exporter.failed,
        }


def _text(value: Any, limit: int) -> str:
    return value[:limit] if isinstance(value, str) else ""


def _value(key: str, value: Any) -> Any:
    """An attribute value OpenTelemetry takes, cut to size; None: dropped."""
    limit = _MAX_CONTENT_CHARS if key in _CONTENT_KEYS else _MAX_VALUE_CHARS
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, bool) or isinstance(value, float):
        return value
    if isinstance(value, int):
        return value if -(1 << 63) <= value < (1 << 63) else None
    if isinstance(value, list) and value:
        kind = type(value[0])
        if kind in (str, bool, int, float) and all(type(v) is kind for v in value[:_MAX_LIST]):
            items = value[:_MAX_LIST]
            return [v[:_MAX_VALUE_CHARS] for v in items] if kind is str else (
                None if kind is int and any(not -(1 << 63) <= v < (1 << 63) for v in items) else items)
    return None


def _clean(attributes: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not isinstance(attributes, dict):
        return out
    for key, value in list(attributes.items())[:_MAX_ATTRIBUTES]:
        if isinstance(key, str) and 0 < len(key) <= _MAX_NAME:
            cleaned = _value(key, value)
            if cleaned is not None:
                out[key] = cleaned
    return out
