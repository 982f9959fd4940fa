"""The span exporter: a process of its own, started by the daemon when tracing
is on (`python -P -m supervisor.ops.otel_export SETTINGS`), the one place
that talks to the collector.

Runs in that process, not in the daemon: OpenTelemetry's OTLP encoding costs
tens of µs of Python a span, which under the daemon's GIL would slow every
turn (bench/tracing.py).  It reads length-prefixed msgpack batches of
`ExportSpan` on stdin (the daemon writes them without blocking), turns each
into the SDK's `ReadableSpan` and hands it to the SDK's batch processor and
OTLP/HTTP exporter, configured by the [tracing] keys (SETTINGS, as JSON)
and the standard OTEL_* variables.  At most `queue_size` spans wait for the
collector; past that one more is dropped and counted.  Its counts go back
on stdout, one JSON line whenever they changed (at most twice a second).

It logs as the daemon does (its stderr is the daemon's): JSON lines with
`[daemon] log_format = "json"`, the journal's fields and priorities under
journald, timestamped lines otherwise; only errors (a failed export), each
under the name of the exporter's logger that said it.

It runs in the SCHED_IDLE class, below the daemon and the sessions.  It ends when its stdin does (the daemon stopped or died): the last spans get
at most `_EXIT_FLUSH_SECS` to go out, so a collector that is down does not
keep it.  It is not dumpable: the exporter's headers may hold a collector's
key.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from ipc.linux import set_dumpable
from ipc.logfields import PriorityFormatter, configure_zygote, on_journal
from supervisor import __version__
from supervisor.config import TracingSettings
from supervisor.ops.otel import ExportSpan

__all__ = ["main"]

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_KINDS = {k.value: k for k in SpanKind}
_EXIT_FLUSH_SECS = 2.0
_REPORT_SECS = 0.5
_MAX_FRAME = 64 << 20


class _Counted(SpanExporter):
    """The OTLP exporter, counting what it was handed and how it went."""

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
        if not self._stopped:  # (the exit's timer, then the processor's shutdown)
            self._stopped = True
            self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class Pipeline:
    """Spans in, OTLP out, through a bounded queue with its drops counted:
    a span is dropped here when `limit` already wait, rather than pushing
    out one the processor holds, so the count is exact."""

    def __init__(self, settings: TracingSettings, exporter: SpanExporter | None = None) -> None:
        attributes: dict[str, Any] = {"service.version": __version__}
        if settings.service_name:
            attributes["service.name"] = settings.service_name
        elif not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
                "OTEL_RESOURCE_ATTRIBUTES", ""):
            attributes["service.name"] = "sessiond"
        self.resource = Resource.create(attributes)
        self.exporter = _Counted(exporter or _otlp(settings))
        self.limit = settings.queue_size
        self.received = 0
        self.taken = 0
        self.dropped = 0
        self.processor = BatchSpanProcessor(self.exporter, max_queue_size=self.limit,
                                            max_export_batch_size=min(512, self.limit),
                                            export_timeout_millis=settings.export_timeout_secs * 1000)
        self.scopes = {False: InstrumentationScope("sessiond", __version__),
                       True: InstrumentationScope("sessiond.worker", __version__)}

    def take(self, span: ExportSpan) -> None:
        self.received += 1
        if self.taken - self.exporter.handed >= self.limit:
            self.dropped += 1
            return
        self.taken += 1
        self.processor.on_end(self.readable(span))

    def readable(self, span: ExportSpan) -> ReadableSpan:
        trace_id = int.from_bytes(span.trace_id, "big")
        parent = None
        if span.parent_id:
            parent = SpanContext(trace_id, span.parent_id, is_remote=span.parent_remote, trace_flags=_SAMPLED)
        status = Status(StatusCode.ERROR, span.error) if span.error else Status(StatusCode.UNSET)
        return ReadableSpan(
            name=span.name, context=SpanContext(trace_id, span.span_id, is_remote=False, trace_flags=_SAMPLED),
            parent=parent, resource=self.resource, attributes=span.attributes,
            events=[Event(name, attrs, at) for name, at, attrs in span.events],
            kind=_KINDS.get(span.kind, SpanKind.INTERNAL), status=status,
            start_time=span.start_ns, end_time=span.end_ns, instrumentation_scope=self.scopes[span.worker],
        )

    def counts(self) -> dict[str, int]:
        exporter = self.exporter
        return {"received": self.received, "dropped": self.dropped, "queued": self.taken - exporter.handed,
                "exporting": exporter.handed - exporter.exported - exporter.failed,
                "exported": exporter.exported, "failed": exporter.failed}

    def close(self) -> None:
        """Flush for at most _EXIT_FLUSH_SECS: then the exporter is stopped,
        which ends its retries against a collector that is down."""
        stop = threading.Timer(_EXIT_FLUSH_SECS, self.exporter.shutdown)
        stop.daemon = True
        stop.start()
        try:
            self.processor.shutdown()  # type: ignore[no-untyped-call]
        finally:
            stop.cancel()
            stop.join()  # (gone with the call: no thread of ours outlives close)


def _otlp(settings: TracingSettings) -> SpanExporter:
    """The SDK's OTLP exporter for the protocol (its package imported only
    for the one in use: gRPC's is heavy)."""
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=settings.endpoint or None, timeout=settings.export_timeout_secs)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=settings.endpoint or None, timeout=settings.export_timeout_secs)


_LINE = "sessiond.otel-export: %(name)s: %(message)s"


def _configure_logging() -> None:
    """As the daemon logs ($SESSIOND_LOG_FORMAT, which the daemon sets, and
    the journal: ipc.logfields); errors only: a failed export, not each
    retry."""
    root = logging.getLogger()
    if not configure_zygote(_LINE):
        handler = logging.StreamHandler(sys.stderr)
        # journald's stream without its socket: each line's priority as <N>.
        handler.setFormatter(PriorityFormatter(_LINE) if on_journal(2)
                             else logging.Formatter("%(asctime)s %(levelname)s " + _LINE))
        root.addHandler(handler)
    root.setLevel(logging.ERROR)


def _read_exactly(stream: Any, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    set_dumpable(False)
    # A stop (systemd's SIGTERM to the unit's processes, Ctrl-C on a
    # foreground daemon's group) is the daemon's to handle: this process
    # ends when the daemon has, and its pipe with it, having sent the rest.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    # Telemetry comes after the turns it describes: SCHED_IDLE (the kernel's
    # class for background work: it runs on a CPU nothing else wants, and
    # yields at once to a waking turn), else nice 19.  When CPUs are short
    # its export lags (the queue bounds what waits, drops are counted), not
    # the sessions.
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(OSError):
            os.nice(19)
    _configure_logging()
    settings = msgspec.convert(json.loads(args[0]) if args else {}, TracingSettings)
    pipeline = Pipeline(settings)
    decode = msgspec.msgpack.Decoder(list[ExportSpan]).decode
    stdin, stdout = sys.stdin.buffer, sys.stdout
    said: dict[str, int] = {}
    lock = threading.Lock()

    def report() -> None:
        nonlocal said
        with lock:
            counts = pipeline.counts()
            if counts != said:
                stdout.write(json.dumps(counts) + "\n")
                stdout.flush()
                said = counts

    # The counts also change while no batch comes (exports finish): a
    # reporter thread says them too.
    def reporter() -> None:
        while True:
            time.sleep(_REPORT_SECS)
            try:
                report()
            except (OSError, ValueError):
                return

    report()  # the first: the exporter is ready
    threading.Thread(target=reporter, name="sessiond-otel-report", daemon=True).start()
    try:
        while True:
            header = _read_exactly(stdin, 4)
            if header is None:
                break
            size = int.from_bytes(header, "big")
            if size > _MAX_FRAME:
                break
            body = _read_exactly(stdin, size)
            if body is None:
                break
            try:
                spans = decode(body)
            except msgspec.DecodeError:
                continue
            for span in spans:
                pipeline.take(span)
    finally:
        pipeline.close()
        try:
            report()
        except (OSError, ValueError):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
