"""The OpenTelemetry tracer's daemon side: the daemon's spans, the workers'
spans placed in their turns' traces, all handed to the span exporter process
(`supervisor.ops.otel_export`), which alone talks to the collector.

Runs in the daemon's loop (the exporter process is started from here, by
exec).  Why the shape (docs/tracing.md):

* Only the daemon's side exports.  Workers and their tools run sandboxed,
  maybe without network, maybe on another node: they record their spans and
  send them over the socket they already have (`m.WorkerSpans`), and learn
  neither the collector nor the trace id.  What a worker sends is untrusted:
  it is placed in the trace of the turn it runs (no other), its ids, times,
  names, attributes and events are checked and cut to size, and a turn
  keeps at most `max_spans_per_turn` of them.
* The OTLP encoding (the SDK's: ~30-60 µs of Python a span) and the HTTP
  posts run in a process of their own, never on the daemon's loop nor
  under its GIL: here a span costs a small struct, and a batch of them one
  msgpack frame written to a pipe.
* Export never blocks a turn and memory stays bounded when the collector
  is down: the pipe is written without blocking; what does not fit waits in
  a buffer of at most `_MAX_PENDING_BYTES`, past which spans are dropped
  and counted; the exporter holds at most `queue_size` spans and drops (and
  counts) past that.  The exporter reports its counts back on its stdout.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import json
import logging
import os
import random
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from ipc import messages as m
from ipc.traceparent import TraceParent
from supervisor.config import TracingSettings
from supervisor import logtag
from supervisor.ops import genai
from supervisor.ops.labels import failure_kind
from supervisor.core.tracer import SubagentTrace, TurnTrace, UntracedSubagent

__all__ = ["ExportSpan", "OtelTracer", "clean_attributes"]

log = logging.getLogger("sessiond")

_MAX_ID = (1 << 64) - 1
_MAX_NAME = 128
_MAX_ATTRIBUTES = 64
_MAX_EVENTS = 64
_MAX_VALUE_CHARS = 4096
_MAX_CONTENT_CHARS = 64 * 1024
_MAX_LIST = 64
# OpenTelemetry's SpanKind numbers (internal, server, client, producer, consumer).
INTERNAL, SERVER, CLIENT = 0, 1, 2
_KINDS = range(5)
# Live states a restart span ends in (the worker is back), and the ones
# that end it otherwise.
_BACK = frozenset({"idle", "running"})
_GAVE_UP = frozenset({"failed", "stopped", "stopping", "deleted", "hibernated", "damaged"})
# States a session rests in between turns: its lines name no trace there.
_AT_REST = frozenset({"idle", "failed", "stopped", "deleted", "hibernated", "damaged"})
# Spans waiting for the pipe (bytes of encoded frames), past which new ones are dropped.
_MAX_PENDING_BYTES = 4 << 20
_PIPE_BYTES = 1 << 20
# A batch goes out this long after its first span, or at this many spans:
# one write for many turns' spans, not a few for each.
_BATCH = 256
_BATCH_SECS = 0.05
_RESTART_EXPORTER_SECS = 10.0
_CODE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ExportSpan(msgspec.Struct, array_like=True):
    """One finished span, as the daemon hands it to the exporter process."""

    trace_id: bytes  # 16 bytes
    span_id: int
    parent_id: int  # 0: a root span
    parent_remote: bool  # the parent is the caller's (a client's traceparent)
    name: str
    kind: int
    start_ns: int
    end_ns: int
    error: str  # not "": status ERROR with this description
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]
    worker: bool  # recorded by a session's worker (its instrumentation scope)


class _Span:
    """An open span of the daemon's own."""

    __slots__ = ("tracer", "trace_id", "span_id", "parent_id", "remote", "name", "kind", "start_ns",
                 "attributes", "events", "error", "ended")

    def __init__(self, tracer: OtelTracer, trace_id: bytes, parent_id: int, name: str, *,
                 remote: bool = False, kind: int = INTERNAL, start_ns: int = 0,
                 attributes: dict[str, Any] | None = None) -> None:
        self.tracer = tracer
        self.trace_id = trace_id
        self.span_id = random.getrandbits(64) or 1
        self.parent_id = parent_id
        self.remote = remote
        self.name = name
        self.kind = kind
        self.start_ns = start_ns or time.time_ns()
        self.attributes = attributes if attributes is not None else {}
        self.events: list[tuple[str, int, dict[str, Any]]] = []
        self.error = ""
        self.ended = False

    def child(self, name: str, start_ns: int = 0, attributes: dict[str, Any] | None = None) -> _Span:
        return _Span(self.tracer, self.trace_id, self.span_id, name, start_ns=start_ns, attributes=attributes)

    def event(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        if len(self.events) < _MAX_EVENTS:
            self.events.append((name, time.time_ns(), attributes or {}))

    def end(self, end_ns: int = 0, error: str = "", error_type: str = "") -> None:
        """`error`: the span failed, saying this; `error_type`, its kind
        (`error.type`: a word from a fixed set; "_OTHER" when not given)."""
        if self.ended:
            return
        self.ended = True
        self.error = (error or self.error)[:_MAX_VALUE_CHARS]
        if self.error and "error.type" not in self.attributes:
            self.attributes["error.type"] = error_type or "_OTHER"
        self.tracer.emit(ExportSpan(
            self.trace_id, self.span_id, self.parent_id, self.remote, self.name, self.kind, self.start_ns,
            max(end_ns or time.time_ns(), self.start_ns), self.error, self.attributes, self.events, False))


class _Spans:
    """A traced turn's open spans (TurnTrace.spans)."""

    __slots__ = ("turn", "input", "commit", "worker_spans", "dropped", "session", "tools")

    def __init__(self, turn: _Span, session: str) -> None:
        self.turn = turn
        self.input: _Span | None = None
        self.commit: _Span | None = None
        self.worker_spans = 0
        self.dropped = 0
        self.session = session
        # The tool calls running now, by step number: (step key, start): a
        # worker that dies takes their spans with it; the daemon makes them.
        self.tools: dict[int, tuple[str, int]] = {}


class _Subagent:
    def __init__(self, span: _Span) -> None:
        self._span = span

    def turn(self, received_ns: int) -> TurnTrace | None:
        span = self._span
        return TurnTrace(received_ns, TraceParent(int.from_bytes(span.trace_id, "big"), span.span_id, 1),
                         spans=_LOCAL)

    def child(self, session_id: str) -> None:
        self._span.attributes["sessiond.session.id"] = session_id
        self._span.name = f"sessiond.subagent {session_id}"

    def end(self, error: str = "") -> None:
        self._span.end(error=error, error_type=failure_kind(error) if error else "")


# TurnTrace.spans of an input whose parent is a span of ours (a sub-agent's):
# not a remote parent.
_LOCAL = object()


class _Unsampled(UntracedSubagent):
    """A sub-agent of a turn that is not sampled: its turn is not either."""

    def turn(self, received_ns: int) -> TurnTrace | None:
        return TurnTrace(received_ns, TraceParent(random.getrandbits(128) or 1, random.getrandbits(64) or 1, 0))


_UNSAMPLED = _Unsampled()


class _Sampler:
    """OTEL_TRACES_SAMPLER (and _ARG) as the SDK reads them: always_on,
    always_off, traceidratio, and parentbased_* of each (the default:
    parentbased_always_on: a caller's sampled flag decides, else record)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
        self.parent_based = name.startswith("parentbased_")
        kind = name.removeprefix("parentbased_")
        ratio = 1.0
        if kind == "traceidratio":
            try:
                ratio = min(1.0, max(0.0, float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))))
            except ValueError:
                ratio = 1.0
        elif kind == "always_off":
            ratio = 0.0
        elif kind != "always_on":
            log.warning("OTEL_TRACES_SAMPLER=%s is not one sessiond knows: parentbased_always_on", name)
            self.parent_based = True
        self._bound = round(ratio * (1 << 64))

    def sample(self, trace_id: int, parent: TraceParent | None) -> bool:
        if parent is not None and self.parent_based:
            return parent.sampled
        return (trace_id & _MAX_ID) < self._bound


class OtelTracer:
    enabled = True

    def __init__(self, settings: TracingSettings, environ: Mapping[str, str] = os.environ,
                 *, start: bool = True) -> None:
        self._settings = settings
        self._content = settings.capture_content or environ.get(
            "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "").strip().lower() in ("true", "1")
        self._sampler = _Sampler(environ)
        self._encode = msgspec.msgpack.Encoder().encode
        self._batch: list[ExportSpan] = []
        self._flush_soon = False
        self._pending = bytearray()
        # The frames in _pending: (bytes, spans), oldest first.
        self._frames: collections.deque[tuple[int, int]] = collections.deque()
        self._writing = False
        self.made = 0
        self.dropped = 0  # here: the pipe and the buffer were full, or the exporter gone
        self._exporter_counts: dict[str, Any] = {}
        # What the exporter processes before this one counted (each starts
        # from 0): the counts stay totals across its restarts.
        self._past_counts: collections.Counter[str] = collections.Counter()
        self._proc: subprocess.Popen[bytes] | None = None
        self._fd = -1
        self._started_at = 0.0
        self._stats_buf = b""
        # Per session: the open restart span; the last worker boot (to show
        # in the turn it was made for); the turn a worker's exit just failed.
        self._restarts: dict[str, _Span] = {}
        self._boots: dict[str, tuple[int, int]] = {}
        self._booting: dict[str, int] = {}
        self._just_failed: dict[str, _Span] = {}
        self.endpoint = settings.endpoint or _endpoint_from(environ, settings.protocol)
        if start:
            self._start_exporter()
        log.info("tracing: turns are traced and exported over OTLP/%s to %s ([tracing])",
                 "gRPC" if settings.protocol == "grpc" else "HTTP", self.endpoint)

    # ---------------------------------------------------------------- the exporter process

    def _start_exporter(self) -> None:
        """Start `supervisor.ops.otel_export` (by exec: the daemon may have
        threads by now), its stdin a pipe of span batches, its stdout one
        of its counts."""
        self._started_at = time.monotonic()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_CODE_ROOT, env.get("PYTHONPATH")) if p)
        settings = json.dumps(msgspec.to_builtins(self._settings))
        try:
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "supervisor.ops.otel_export", settings],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, env=env,
            )
        except OSError as exc:
            log.error("tracing: cannot start the span exporter (%s); spans are dropped", exc)
            return
        assert proc.stdin is not None and proc.stdout is not None
        self._proc = proc
        self._fd = proc.stdin.fileno()
        os.set_blocking(self._fd, False)
        with contextlib.suppress(OSError):
            fcntl.fcntl(self._fd, 1031, _PIPE_BYTES)  # F_SETPIPE_SZ: room for bursts
        os.set_blocking(proc.stdout.fileno(), False)
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().add_reader(proc.stdout.fileno(), self._read_counts, proc)

    def _read_counts(self, proc: subprocess.Popen[bytes]) -> None:
        """The exporter's counts: one JSON line each time they change."""
        assert proc.stdout is not None
        try:
            data = os.read(proc.stdout.fileno(), 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(proc.stdout.fileno())
            self._exporter_gone(proc)
            return
        lines = (self._stats_buf + data).split(b"\n")
        self._stats_buf = lines.pop()[-4096:]
        for line in reversed(lines):
            with contextlib.suppress(ValueError):
                counts = json.loads(line)
                if isinstance(counts, dict):
                    self._exporter_counts = counts
                    break

    def _exporter_gone(self, proc: subprocess.Popen[bytes]) -> None:
        if self._proc is not proc:
            return
        _reap(proc)
        # (what it held, queued or being exported, is lost with it: dropped)
        counts = {k: int(self._exporter_counts.get(k, 0)) for k in ("received", "exported", "failed", "dropped",
                                                                    "queued", "exporting")}
        counts["dropped"] += counts.pop("queued") + counts.pop("exporting")
        self._past_counts.update(counts)
        self._exporter_counts = {}
        log.error("tracing: the span exporter (pid %d) is gone; spans are dropped until it is started again",
                  proc.pid)
        self._close_pipe()
        self._proc = None

    def _close_pipe(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_writer(self._fd)
            with contextlib.suppress(OSError):
                assert self._proc.stdin is not None
                self._proc.stdin.close()
        self._fd = -1
        self.dropped += sum(count for _, count in self._frames)
        self._frames.clear()
        self._pending.clear()
        self._writing = False

    def emit(self, span: ExportSpan) -> None:
        self.made += 1
        self._batch.append(span)
        if len(self._batch) >= _BATCH:
            self._flush()
        elif not self._flush_soon:
            self._flush_soon = True
            try:
                asyncio.get_running_loop().call_later(_BATCH_SECS, self._flush)
            except RuntimeError:  # no loop (tests of the parts): at once
                self._flush()

    def _flush(self) -> None:
        self._flush_soon = False
        batch, self._batch = self._batch, []
        if not batch:
            return
        if self._proc is None and time.monotonic() - self._started_at > _RESTART_EXPORTER_SECS:
            self._start_exporter()
        if self._fd < 0 or len(self._pending) > _MAX_PENDING_BYTES:
            self.dropped += len(batch)
            return
        body = self._encode(batch)
        self._pending += len(body).to_bytes(4, "big") + body
        self._frames.append((len(body) + 4, len(batch)))
        if not self._writing:
            self._write()

    def _write(self) -> None:
        try:
            written = os.write(self._fd, self._pending)
        except BlockingIOError:
            written = 0
        except OSError:  # the exporter is gone (EPIPE)
            if self._proc is not None:
                self._exporter_gone(self._proc)
            return
        del self._pending[:written]
        while self._frames and written >= self._frames[0][0]:
            written -= self._frames.popleft()[0]
        if self._frames and written:
            size, count = self._frames[0]
            self._frames[0] = (size - written, count)
        loop = asyncio.get_running_loop() if self._pending or self._writing else None
        if self._pending and not self._writing and loop is not None:
            self._writing = True
            loop.add_writer(self._fd, self._write)
        elif not self._pending and self._writing and loop is not None:
            self._writing = False
            loop.remove_writer(self._fd)

    # ---------------------------------------------------------------- turns

    def request(self, parent: TraceParent | None, received_ns: int) -> TurnTrace | None:
        return TurnTrace(received_ns, parent)

    def begin(self, session_id: str, turn: int, handler: str, trace: TurnTrace | None, *, text: str = "",
              owner_uid: int | None = None) -> TurnTrace | None:
        now = time.time_ns()
        if trace is None:
            trace = TurnTrace(now)
        parent = trace.parent
        trace_id = parent.trace_id if parent is not None else (random.getrandbits(128) or 1)
        self._just_failed.pop(session_id, None)
        if not self._sampler.sample(trace_id, parent):
            return None
        span = _Span(self, trace_id.to_bytes(16, "big"), parent.span_id if parent is not None else 0,
                     genai.turn_name(handler), remote=parent is not None and trace.spans is not _LOCAL, kind=SERVER,
                     start_ns=trace.received_ns,
                     attributes=genai.turn_attributes(session_id, turn, handler, owner_uid, text, self._content))
        spans = _Spans(span, session_id)
        # The daemon's log lines about this session carry the turn's ids now.
        logtag.traced(session_id, span.trace_id.hex(), f"{span.span_id:016x}")
        queue = span.child("sessiond.queue", trace.received_ns)
        boot = self._boots.pop(session_id, None)
        if boot is not None and boot[1] >= trace.received_ns:  # a worker started for this input
            queue.child("sessiond.worker.start", max(boot[0], trace.received_ns)).end(boot[1])
        queue.end(now)
        spans.input = span.child("sessiond.input.durable", now)
        trace.spans = spans
        trace.recording = True
        trace.content = self._content
        trace.trace_id = f"{trace_id:032x}"
        return trace

    def input_durable(self, trace: TurnTrace, error: str = "") -> None:
        spans: _Spans = trace.spans
        if spans.input is not None:
            spans.input.end(error=error, error_type="store")
            spans.input = None

    def step(self, trace: TurnTrace, msg: m.StepBegun | m.StepDone) -> None:
        if msg.kind != "tool":
            return
        tools = trace.spans.tools
        if isinstance(msg, m.StepBegun):
            tools[msg.n] = (msg.key, time.time_ns())  # (the ledger bounds the steps in flight)
        else:
            tools.pop(msg.n, None)

    def worker_lost(self, trace: TurnTrace, failure: str) -> None:
        self._tools_died(trace.spans, failure)

    def _tools_died(self, spans: _Spans, failure: str) -> None:
        """The tool calls in flight died with the worker (the memory cap, a
        timeout, a crash): the worker never sent their spans, so they are
        made here, their status saying why."""
        for key, started in spans.tools.values():
            name, attributes = genai.killed_tool(key, failure)
            attributes["sessiond.session.id"] = spans.session
            tool = spans.turn.child(name, started, attributes)
            tool.end(error=failure or "the worker died", error_type=attributes["error.type"])
        spans.tools.clear()

    def commit_started(self, trace: TurnTrace) -> None:
        spans: _Spans = trace.spans
        spans.commit = spans.turn.child("sessiond.commit.durable")

    def ended(self, session_id: str, trace: TurnTrace, failed: str = "", done: m.Done | None = None) -> None:
        spans: _Spans = trace.spans
        if spans.input is not None:  # the flush that covered it was the commit's
            spans.input.end()
            spans.input = None
        if spans.commit is not None:
            spans.commit.end(error=failed, error_type="store")
            spans.commit = None
        if spans.tools:  # it failed while they ran (its worker died, or was stopped)
            self._tools_died(spans, failed)
        turn = spans.turn
        if spans.dropped:
            turn.attributes["sessiond.worker_spans.dropped"] = spans.dropped
        genai.turn_ended(turn.attributes, done, failed, trace.content)
        if done is not None:
            turn.end()
            return
        turn.end(error=failed or "failed")
        self._just_failed[session_id] = turn
        # Only the exit being handled now may take it as the turn it ended.
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().call_soon(self._just_failed.pop, session_id, None)

    def resumed(self, trace: TurnTrace | None, detail: str = "") -> None:
        if trace is not None and isinstance(trace.spans, _Spans):
            trace.spans.turn.event("sessiond.turn.resumed", {"sessiond.detail": detail} if detail else None)

    # ---------------------------------------------------------------- the worker's spans

    def worker_spans(self, trace: TurnTrace, msg: m.WorkerSpans) -> None:
        spans: _Spans = trace.spans
        limit = self._settings.max_spans_per_turn
        for record in msg.spans:
            if spans.worker_spans >= limit:
                spans.dropped += 1
                continue
            span = worker_span(record, spans.turn.trace_id, spans.turn.span_id, spans.session)
            if span is None:
                spans.dropped += 1
                continue
            spans.worker_spans += 1
            self.emit(span)

    # ---------------------------------------------------------------- sub-agents, restarts

    def subagent(self, trace: TurnTrace | None, span_id: int, handler: str) -> SubagentTrace | None:
        if trace is None or not isinstance(trace.spans, _Spans):
            return _UNSAMPLED  # the parent's turn was not sampled: nor is the child's
        turn = trace.spans.turn
        parent = span_id if 0 < span_id <= _MAX_ID else turn.span_id  # under the worker's spawn_agent call
        span = _Span(self, turn.trace_id, parent, "sessiond.subagent", attributes={"sessiond.handler": handler})
        return _Subagent(span)

    def state_changed(self, session_id: str, old: str, new: str, reason: str, trace: TurnTrace | None) -> None:
        if trace is None and new in _AT_REST:
            self._untraced_soon(session_id)
        if new == "starting":
            self._booting[session_id] = time.time_ns()
        elif old == "starting":
            # (A new session is registered as starting: its boot's start is
            # the input's arrival, for a sub-agent created for its task.)
            started = self._booting.pop(session_id, 0)
            if new == "idle":
                self._boots[session_id] = (started, time.time_ns())
        restart = self._restarts.get(session_id)
        if restart is None and new in ("crashed", "restarting"):
            turn = trace.spans.turn if trace is not None and isinstance(trace.spans, _Spans) else (
                self._just_failed.get(session_id))
            attributes = {"sessiond.session.id": session_id, "sessiond.exit.reason": reason}
            if turn is not None:
                self._restarts[session_id] = turn.child("sessiond.restart", attributes=attributes)
            else:
                self._restarts[session_id] = _Span(self, random.getrandbits(128).to_bytes(16, "big"), 0,
                                                   "sessiond.restart", attributes=attributes)
        elif restart is not None:
            restart.event(f"sessiond.state.{new}", {"sessiond.reason": reason} if reason else None)
            if new in _BACK or new in _GAVE_UP:
                restart.end(error="" if new in _BACK else f"{new}: {reason}", error_type=new)
                del self._restarts[session_id]

    def _untraced_soon(self, session_id: str) -> None:
        """The session is at rest after its turn: its log lines stop naming
        the turn's trace once this state's own line is written (it is
        logged after this call), unless a new turn has begun by then."""
        ids = logtag.trace_of(session_id)
        if ids is None:
            return
        try:
            asyncio.get_running_loop().call_soon(logtag.untraced, session_id, ids)
        except RuntimeError:  # no loop (tests of the parts)
            logtag.untraced(session_id, ids)

    def forget(self, session_id: str) -> None:
        logtag.untraced(session_id)
        for table in (self._boots, self._booting, self._just_failed):
            table.pop(session_id, None)
        restart = self._restarts.pop(session_id, None)
        if restart is not None:
            restart.end(error="the session was removed")

    # ---------------------------------------------------------------- the operator's view

    def stats(self) -> dict[str, Any]:
        """Spans made here; what the exporter process says of those it got
        (its counts lag by up to half a second)."""
        counts, past = self._exporter_counts, self._past_counts
        got = int(counts.get("received", 0)) + past["received"]
        return {
            "exporter": "otlp", "protocol": self._settings.protocol or "http/protobuf", "endpoint": self.endpoint,
            "ready": bool(counts), "spans": self.made,
            "exported": int(counts.get("exported", 0)) + past["exported"],
            "failed": int(counts.get("failed", 0)) + past["failed"],
            "dropped": self.dropped + int(counts.get("dropped", 0)) + past["dropped"],
            "queued": counts.get("queued", 0), "exporting": counts.get("exporting", 0),
            "in_transit": max(0, self.made - self.dropped - got),
        }


def _reap(proc: subprocess.Popen[bytes], tries: int = 20) -> None:
    """Collect the exporter's exit without waiting on the loop for it."""
    if proc.poll() is None and tries:
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().call_later(0.5, _reap, proc, tries - 1)


def _endpoint_from(environ: Mapping[str, str], protocol: str) -> str:
    """Where the exporter will send, as it resolves it (for the log line):
    over HTTP a URL with the signal's path, over gRPC the collector's address."""
    traces = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if traces:
        return traces
    if protocol == "grpc":
        return environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or "http://localhost:4317"
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or "http://localhost:4318"
    return base.rstrip("/") + "/v1/traces"


def worker_span(record: m.SpanRecord, trace_id: bytes, turn_span: int, session: str) -> ExportSpan | None:
    """A worker's span placed in its turn's trace, or None when it is not one."""
    if not 0 < record.id <= _MAX_ID or not 0 <= record.parent <= _MAX_ID:
        return None
    if not 0 < record.start_ns < (1 << 63) or not 0 < record.end_ns < (1 << 63):
        return None
    attributes = clean_attributes(record.attributes)
    attributes["sessiond.session.id"] = session
    events = [(_text(e.name, _MAX_NAME), e.at_ns, clean_attributes(e.attributes))
              for e in record.events[:_MAX_EVENTS] if 0 < e.at_ns < (1 << 63)]
    return ExportSpan(
        trace_id, record.id, record.parent or turn_span, False, _text(record.name, _MAX_NAME) or "worker",
        record.kind if record.kind in _KINDS else INTERNAL, record.start_ns, max(record.start_ns, record.end_ns),
        _text(record.error, _MAX_VALUE_CHARS), attributes, events, True,
    )


def _text(value: Any, limit: int) -> str:
    return value[:limit] if isinstance(value, str) else ""


def _value(key: str, value: Any) -> Any:
    """An attribute value OpenTelemetry takes, cut to size; None: dropped."""
    limit = _MAX_CONTENT_CHARS if key in genai.CONTENT_KEYS else _MAX_VALUE_CHARS
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
            if kind is str:
                return [v[:_MAX_VALUE_CHARS] for v in items]
            if kind is int and any(not -(1 << 63) <= v < (1 << 63) for v in items):
                return None
            return items
    return None


def clean_attributes(attributes: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not isinstance(attributes, dict):
        return out
    for key, value in list(attributes.items())[:_MAX_ATTRIBUTES]:
        if isinstance(key, str) and 0 < len(key) <= _MAX_NAME:
            cleaned = _value(key, value)
            if cleaned is not None:
                out[key] = cleaned
    return out
