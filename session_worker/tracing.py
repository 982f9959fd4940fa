"""Spans of a traced turn, recorded where the work happens: in the worker.

Runs in the worker's event loop.  The daemon decides whether a turn is
traced (`Input.trace`); when it is, the worker records a span around each
LLM call and each tool call and sends each one, once it ends, to the daemon
as a `WorkerSpans` frame over the socket it already has.  The daemon checks
them as untrusted data, places them in the turn's trace and alone exports
them: the worker (and the tools under it, sandboxed, maybe without network,
maybe on another machine) never learns the collector's address, and a
collector that is down costs the worker nothing.  It learns the trace's id,
only to pass W3C trace context on to the MCP servers its tools call
(`traceparent`): where its spans go is still the daemon's to decide.

Untraced, `span()` hands back one shared do-nothing object: the cost of a
hook is a context-variable read.  The current span lives in a context
variable, so a span opened while another is open (a tool call's sub-agent,
the bash tool's process) nests under it without being passed around, and
two turns never share one.

    with tracing.span("execute_tool bash", attributes={...}) as span:
        span.set("process.exit.code", 0)
"""

from __future__ import annotations

import contextvars
import random
import time
from collections.abc import Callable
from typing import Any

from ipc import messages as m

__all__ = ["CLIENT", "INTERNAL", "Span", "active", "annotate", "begin_turn", "capturing", "current_span_id", "log_ids", "span",
           "traceparent"]

INTERNAL = 0
CLIENT = 2
# A turn sends at most this many spans (the daemon keeps fewer if its
# [tracing] max_spans_per_turn says so).
_MAX_SPANS = 4096


class _Turn:
    __slots__ = ("turn", "send", "content", "sent", "trace_id")

    def __init__(self, turn: int, send: Callable[[Any], None], content: bool, trace_id: str) -> None:
        self.turn = turn
        self.send = send
        self.content = content
        self.sent = 0
        self.trace_id = trace_id


class Span:
    """An open span: attributes and events until it ends."""

    __slots__ = ("_turn", "id", "parent", "name", "kind", "start_ns", "attributes", "events",
                 "error", "_token")

    def __init__(self, turn: _Turn, parent: int, name: str, kind: int, attributes: dict[str, Any]) -> None:
        self._turn = turn
        # (random is reseeded in each forked worker: CPython's after-fork hook.)
        self.id = random.getrandbits(64) or 1
        self.parent = parent
        self.name = name
        self.kind = kind
        self.start_ns = time.time_ns()
        self.attributes = attributes
        self.events: list[m.SpanEvent] = []
        self.error = ""
        self._token: contextvars.Token[Span | _Turn | None] | None = None

    @property
    def recording(self) -> bool:
        return True

    def set(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def event(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        if len(self.events) < 64:
            self.events.append(m.SpanEvent(name=name, at_ns=time.time_ns(), attributes=attributes or {}))

    def fail(self, reason: str, error_type: str = "") -> None:
        """The span's work failed: `reason` in words, `error_type` its kind
        (`error.type`, a word from a small set; the exception's class when
        one ends the span, "_OTHER" when none is given)."""
        self.error = reason or "error"
        self.attributes.setdefault("error.type", error_type or "_OTHER")

    def __enter__(self) -> Span:
        self._token = _current.set(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self._token is not None:
            _current.reset(self._token)
        if exc is not None and not self.error:
            # A cancellation is the turn's interrupt (or the worker stopping).
            self.error = f"{type(exc).__name__}: {exc}"[:500] if isinstance(exc, Exception) else "interrupted"
            self.attributes.setdefault("error.type", _error_type(exc))
        turn = self._turn
        if turn.sent >= _MAX_SPANS:
            return
        turn.sent += 1
        turn.send(m.WorkerSpans(turn=turn.turn, spans=[m.SpanRecord(
            id=self.id, parent=self.parent, name=self.name, kind=self.kind,
            start_ns=self.start_ns, end_ns=time.time_ns(), error=self.error,
            attributes=self.attributes, events=self.events,
        )]))


def _error_type(exc: BaseException) -> str:
    """`error.type` of an exception: an HTTP error's status (the semantic
    conventions' choice for HTTP clients; the provider's errors carry it
    as `status`), else its class; "cancelled" for an interrupt."""
    if not isinstance(exc, Exception):
        return "cancelled"
    status = getattr(exc, "status", None)
    if isinstance(status, int) and 100 <= status <= 599:
        return str(status)
    return type(exc).__qualname__


class _NoSpan:
    """What `span()` gives when the turn is not traced."""

    __slots__ = ()
    id = 0
    recording = False

    def set(self, key: str, value: Any) -> None:
        pass

    def event(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        pass

    def fail(self, reason: str, error_type: str = "") -> None:
        pass

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        pass


_NO_SPAN = _NoSpan()
# The open span, or the traced turn itself when no span is open; None: untraced.
_current: contextvars.ContextVar[Span | _Turn | None] = contextvars.ContextVar(
    "sessiond_trace", default=None)


def begin_turn(turn: int, send: Callable[[Any], None], content: bool = False, trace_id: str = "") -> None:
    """This task runs a traced turn (the worker calls it as the turn's task
    starts; tasks the turn creates inherit it).  `trace_id`: the turn's
    trace, as the daemon said it (32 hex digits), for `traceparent`."""
    valid = len(trace_id) == 32 and all(c in "0123456789abcdef" for c in trace_id) and trace_id != "0" * 32
    _current.set(_Turn(turn, send, content, trace_id if valid else ""))


def span(name: str, kind: int = INTERNAL, attributes: dict[str, Any] | None = None) -> Span | _NoSpan:
    """A span to open with `with`: a child of the open one, or of the turn."""
    current = _current.get()
    if current is None:
        return _NO_SPAN
    if isinstance(current, Span):
        return Span(current._turn, current.id, name, kind, attributes if attributes is not None else {})
    return Span(current, 0, name, kind, attributes if attributes is not None else {})


def annotate(attributes: dict[str, Any]) -> None:
    """Add to the open span, if any (e.g. a tool's exit code, from inside it)."""
    current = _current.get()
    if isinstance(current, Span):
        current.attributes.update(attributes)


def current_span_id() -> int:
    """The open span's id (0: none, or untraced)."""
    current = _current.get()
    return current.id if isinstance(current, Span) else 0


def traceparent() -> str:
    """W3C trace context naming the open span ('' when untraced, no span
    is open, or the daemon gave no trace id): what a tool passes on to the
    service it calls (an MCP server), whose spans then join the turn's."""
    current = _current.get()
    if not isinstance(current, Span) or not current._turn.trace_id:
        return ""
    return f"00-{current._turn.trace_id}-{current.id:016x}-01"


def log_ids() -> tuple[str, str] | None:
    """(trace id, span id), in hex, for a log line written during a traced
    turn (the span id of the open span, "" outside one); None when the
    turn is not traced or the daemon gave no trace id."""
    current = _current.get()
    turn = current._turn if isinstance(current, Span) else current
    if turn is None or not turn.trace_id:
        return None
    return turn.trace_id, f"{current.id:016x}" if isinstance(current, Span) else ""


def active() -> bool:
    """This turn is traced."""
    return _current.get() is not None


def capturing() -> bool:
    """The operator asked for prompts and completions in the spans."""
    current = _current.get()
    if current is None:
        return False
    return current._turn.content if isinstance(current, Span) else current.content
