"""Prometheus metrics: what the daemon's parts count, and `/metrics`.

Runs in the daemon's loop.  The parts (WorkerOwner, TurnLedger, Sweeper,
the control server) call a `Recorder` (supervisor.core.recorder: the
protocol, with the core that calls it); with `[daemon] metrics_listen = ""`
(the default) that is `NO_METRICS`, whose methods do nothing, and
`prometheus_client` is never imported (importing it costs ~70 ms), so a
turn pays one call of an empty method per event counted.

With metrics on, `PrometheusRecorder` (which implements it) keeps counters
and histograms in a registry of its own (not the library's global one, which would add its GC
collector and anything an import registered), with the library's process
collector (the daemon's `process_*`) and a build info.  Every series of a
known label value exists from the start, at 0.  Gauges that describe the daemon's state (sessions by state, clients, the
largest sessions' RSS) are not updated as things happen: a custom
collector reads the manager's dicts when a scrape comes, so the hot path
pays nothing for them.

The endpoint is served from the daemon's own loop, not from the library's
threaded HTTP server: the collectors read dicts only the loop may touch,
the daemon's loop needs no thread beside it for this, and a thread would hold
the GIL for as long as the formatting takes anyway (~1 ms for ~210
samples; bench/metrics.py measures turns with and without scrapes).
Failure reasons, provider statuses, tool kinds and outcomes become labels
from fixed sets (supervisor.ops.labels), so no label grows with the input.
`serve` is a small
HTTP/1.0-style responder: one request per connection, the request head
capped at `_MAX_HEAD_BYTES` and due within `_READ_TIMEOUT_SECS`, at most
`_MAX_CONNECTIONS` at once; a slow or hostile client holds a coroutine and
a socket for a few seconds, never the loop.  Slots are not first come,
first served: when all are taken, a new connection takes the slot of the
one that has waited longest without sending its request, so clients that
connect and stay silent (reconnecting as they are timed out) cannot deny
scrapes; only connections being answered, each for at most
`_WRITE_TIMEOUT_SECS`, are never displaced.

Who can read what: the endpoint has no authentication.  Whoever can
connect (any local user for a loopback address; for a Unix socket, whoever
its mode and directory let in) reads the daemon-wide figures: sessions by
state, turns, failures, requests, provider errors, memory totals.  Series
naming sessions (`sessiond_session_rss_bytes{session=...}`) exist only
with `[daemon] metrics_per_session = true`, as they tell every reader
other users' session ids and sizes.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import platform
import socket
import time
import typing
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ipc import operator as op
from ipc.contract import ExitReason
from ipc.settings import BudgetSettings
from supervisor import __version__
from supervisor.core.session import Session
from supervisor.core.states import State
from supervisor.ops.labels import (
    FAILURE_KINDS, PROVIDER_STATUSES, TOOL_KINDS, TOOL_OUTCOMES, failure_kind, provider_status, tool_kind,
    tool_outcome,
)

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

__all__ = [
    "PrometheusRecorder",
    "FAILURE_KINDS",
    "TOP_RSS_SESSIONS",
    "failure_kind",
    "provider_status",
    "address_of",
    "bind_listener",
    "serve",
]

log = logging.getLogger("sessiond.metrics")

# sessiond_session_rss_bytes carries only this many sessions (the largest
# at the last sweep; [daemon] metrics_top_sessions): a series per session
# would grow without bound.
TOP_RSS_SESSIONS = 20

_READ_TIMEOUT_SECS = 5.0
_WRITE_TIMEOUT_SECS = 10.0
_MAX_HEAD_BYTES = 8192
_MAX_CONNECTIONS = 32

# Turns of an echo or a cached answer take 5-15 ms, an agent's seconds to
# minutes: buckets from 1 ms (the old boundaries kept, for the dashboards).
_TURN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0, 120.0, 300.0, 900.0)
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class PrometheusRecorder:
    """Metrics on: counters and histograms, plus the scrape-time gauges
    read from `sessions()` and `clients()`."""

    def __init__(self, sessions: Callable[[], Iterable[Session]], clients: Callable[[], int],
                 top_sessions: int = TOP_RSS_SESSIONS, tracing: Callable[[], dict[str, Any]] = dict,
                 loading: Callable[[], tuple[int, int] | None] = lambda: None) -> None:
        # Here, not at the top: a daemon without metrics never pays the import.
        from prometheus_client import (
            CollectorRegistry, Counter, Histogram, Info, ProcessCollector, disable_created_metrics,
        )

        # The `_created` series: in the text format each is a gauge family of
        # its own that nobody queries, and a third of a scrape's samples
        # (a scrape's cost is per sample).  Process-wide; the daemon has no
        # other registry.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry: CollectorRegistry = CollectorRegistry()
        r = self.registry
        # The daemon's own process_* series (memory, CPU, open fds, start
        # time), read from /proc at each scrape; and which build it is.
        ProcessCollector(registry=r)
        Info("sessiond_build", "The running daemon's version.", registry=r).info(
            {"version": __version__, "python": platform.python_version()})
        self._exits = Counter("sessiond_worker_exits", "Worker exits, by how they were classified.",
                              ["reason"], registry=r)
        self._restarts = Counter("sessiond_restarts", "Automatic restarts of a session's worker.",
                                 registry=r)
        self._turns = Counter("sessiond_turns", "Turns started, and ended (done: committed; failed: aborted).",
                              ["outcome"], registry=r)
        self._failed = Counter("sessiond_turns_failed", "Turns that failed, by why.", ["reason"],
                               registry=r)
        self._turn_secs = Histogram("sessiond_turn_duration_seconds",
                                    "Turns from input to commit or abort.", registry=r,
                                    buckets=_TURN_BUCKETS)
        self._ttft = Histogram("sessiond_turn_first_token_seconds",
                               "From a turn's input to its first piece of reply text.", registry=r,
                               buckets=_TURN_BUCKETS)
        self._commit_secs = Histogram("sessiond_commit_seconds",
                                      "A durable append (write and fsync) of turn commits.",
                                      registry=r, buckets=_FAST_BUCKETS)
        self._commit_batch = Histogram("sessiond_commit_batch_records",
                                       "Records made durable by one fsync.", registry=r,
                                       buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self._sweep_secs = Histogram("sessiond_sweep_duration_seconds",
                                     "One supervision sweep (memory, heartbeats, idleness).",
                                     registry=r, buckets=_FAST_BUCKETS)
        self._stalls = Counter("sessiond_loop_stalled_seconds",
                               "Time the daemon's own event loop was stalled (a sweep woke more than "
                               "one poll interval late); discounted from workers' heartbeats.", registry=r)
        self._starved = Counter("sessiond_workers_starved",
                                "Looks at a worker silent past its heartbeats that found it waiting for a CPU "
                                "(starved by the machine's load) and let it live.", registry=r)
        self._requests = Counter("sessiond_control_requests",
                                 "Control socket requests, by type and outcome (ok or the error code).",
                                 ["type", "code"], registry=r)
        self._provider = Counter("sessiond_provider_errors",
                                 "LLM provider errors seen by agents (retried or failing a turn), "
                                 "by HTTP status (none: no HTTP answer).", ["status"], registry=r)
        self._llm_calls = Counter("sessiond_llm_calls", "LLM calls agents made (as their workers report "
                                  "them after each call).", registry=r)
        self._llm_tokens = Counter("sessiond_llm_tokens", "Tokens agents' LLM calls spent, by kind "
                                   "(input, output, reasoning; output includes reasoning).", ["kind"], registry=r)
        self._budget = Counter("sessiond_budget_exceeded", "Turns ended at an [agent.budget] ceiling, by "
                               "ceiling.", ["ceiling"], registry=r)
        self._tool_calls = Counter("sessiond_tool_calls", "Tool calls agents ran, by kind (bash, file, spawn_agent, "
                                   "mcp, custom) and outcome (ok, error, denied), as their workers report each "
                                   "result.", ["kind", "outcome"], registry=r)
        self._mcp_starts = Counter("sessiond_mcp_server_starts", "MCP servers a session's worker started "
                                   "(ok) or could not start (failed).", ["outcome"], registry=r)
        self._token_kinds = {key: self._llm_tokens.labels(kind) for kind, key in (
            ("input", "prompt_tokens"), ("output", "completion_tokens"), ("reasoning", "reasoning_tokens"))}
        self._llm_calls.inc(0)
        # Every series of a known label value created up front, at 0: one
        # that is 0 says "none yet", where a missing one says nothing (and
        # `increase()` cannot see its first event: it has no value before).
        # (kept: `labels()` takes a lock and a dict lookup; a turn counts
        # into these without either).
        self._started, self._done, self._failed_turns = (
            self._turns.labels(outcome) for outcome in ("started", "done", "failed"))
        self._request_children: dict[tuple[str, str], Any] = {
            (tag, "ok"): self._requests.labels(tag, "ok") for tag in _request_tags()}
        self._tool_children = {(kind, outcome): self._tool_calls.labels(kind, outcome)
                               for kind in TOOL_KINDS for outcome in TOOL_OUTCOMES}
        self._mcp_children = {outcome: self._mcp_starts.labels(outcome) for outcome in ("ok", "failed")}
        for reason in ExitReason:
            self._exits.labels(reason)
        for kind in FAILURE_KINDS:
            self._failed.labels(kind)
        for status in PROVIDER_STATUSES:
            self._provider.labels(status)
        for ceiling in BudgetSettings.__struct_fields__:
            self._budget.labels(ceiling)
        self._restarts.inc(0)
        self._awaiting_first: set[str] = set()  # sessions whose turn has streamed nothing yet
        r.register(_StateCollector(sessions, clients, top_sessions, loading))
        r.register(_TracingCollector(tracing))

    def worker_exit(self, reason: str) -> None:
        self._exits.labels(reason).inc()

    def restart(self) -> None:
        self._restarts.inc()

    def turn_started(self, session: Session) -> None:
        self._started.inc()
        self._awaiting_first.add(session.id)

    def delta(self, session: Session) -> None:
        if session.id in self._awaiting_first:
            self._awaiting_first.discard(session.id)
            self._ttft.observe(time.monotonic() - session.turn_started)

    def turn_ended(self, session: Session, done: bool, reason: str, secs: float) -> None:
        self._awaiting_first.discard(session.id)
        if done:
            self._done.inc()
        else:
            self._failed_turns.inc()
            kind = failure_kind(reason)
            self._failed.labels(kind).inc()
            if kind == "provider":
                self._provider.labels(provider_status(reason)).inc()
        self._turn_secs.observe(secs)

    def commit(self, secs: float, records: int = 1) -> None:
        self._commit_secs.observe(secs)
        self._commit_batch.observe(records)

    def sweep(self, secs: float) -> None:
        self._sweep_secs.observe(secs)

    def loop_stall(self, secs: float) -> None:
        self._stalls.inc(secs)

    def worker_starved(self) -> None:
        self._starved.inc()

    def request(self, kind: str, code: str) -> None:
        child = self._request_children.get((kind, code))
        if child is None:
            # Bounded: kinds are the Request tags (and "invalid"), codes ErrorCode.
            child = self._request_children[(kind, code)] = self._requests.labels(kind, code)
        child.inc()

    def notice(self, kind: str, data: dict[str, Any]) -> None:
        # (data is the worker's: hostile; every label below is from a fixed set)
        if kind == "tool_result":
            if data.get("replayed") is True:
                return  # a resumed turn's journaled result: counted when it ran
            name, output = data.get("name"), data.get("output")
            self._tool_children[(tool_kind(name if isinstance(name, str) else ""),
                                 tool_outcome(data.get("ok") is True, output if isinstance(output, str) else ""))].inc()
        elif kind in _MCP_NOTICES:
            self._mcp_children[_MCP_NOTICES[kind]].inc()
        elif kind == "provider_retry":
            self._provider.labels(provider_status(str(data.get("error", "")))).inc()

    def llm_spent(self, spend: dict[str, int]) -> None:
        self._llm_calls.inc(spend.get("llm_calls", 0))
        for key, child in self._token_kinds.items():
            if spend.get(key):
                child.inc(spend[key])

    def budget_reached(self, ceiling: str) -> None:
        # Bounded: the ceilings are the fields of ipc.settings.BudgetSettings.
        self._budget.labels(ceiling.rpartition(".")[2]).inc()

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# The worker's notices about its MCP servers, by the outcome they count as:
# `mcp_server_unavailable` (session_worker/agent/_mcp.py) is sent for each
# server that could not be started or listed; `mcp_server_started` for a
# session's copy of a server started (at its first call, or a lazy=false
# server at the session's first turn).
_MCP_NOTICES = {"mcp_server_started": "ok", "mcp_server_unavailable": "failed"}


def _request_tags() -> list[str]:
    """The control protocol's request types (the `type` label's values)."""
    return [str(kind.__struct_config__.tag) for kind in typing.get_args(op.AnyRequest)]


class _TracingCollector:
    """The spans of turn traces, as the tracer counts them (`Tracer.stats`),
    when scraped; 0 with tracing off."""

    def __init__(self, tracing: Callable[[], dict[str, Any]]) -> None:
        self._tracing = tracing

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._tracing()
        spans = CounterMetricFamily(
            "sessiond_trace_spans", "Spans of turn traces by how they ended: exported to the collector, failed "
            "(refused by it, or not through within the export timeout), dropped (a queue full, the exporter "
            "down).", labels=["outcome"])
        for outcome in ("exported", "failed", "dropped"):
            spans.add_metric([outcome], float(stats.get(outcome, 0)))
        yield spans
        yield GaugeMetricFamily("sessiond_trace_spans_pending", "Spans made and not yet exported, failed or "
                                "dropped: on their way to the exporter, queued there, being exported.",
                                value=sum(float(stats.get(k, 0)) for k in ("queued", "exporting", "in_transit")))


class _StateCollector:
    """Gauges computed when scraped, from the manager's own dicts."""

    def __init__(self, sessions: Callable[[], Iterable[Session]], clients: Callable[[], int],
                 top_sessions: int, loading: Callable[[], tuple[int, int] | None]) -> None:
        self._sessions = sessions
        self._clients = clients
        self._top = top_sessions
        self._loading = loading

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        counts = dict.fromkeys((s.value for s in State), 0)
        live: list[tuple[int, str]] = []
        waiting, oldest = 0, None
        for session in self._sessions():
            counts[session.state.value] += 1
            if session.worker is not None:
                live.append((session.memory.rss_bytes, session.id))
            if session.pending_asks:
                waiting += 1
                since = min(p.since for p in session.pending_asks.values())
                oldest = since if oldest is None else min(oldest, since)
        states = GaugeMetricFamily("sessiond_sessions", "Sessions, by state (those loaded so far, while "
                                   "sessiond_sessions_loading is not 0).", labels=["state"])
        for state, n in counts.items():
            states.add_metric([state], n)
        yield states
        loading = self._loading()
        yield GaugeMetricFamily("sessiond_sessions_loading", "Sessions on disk a daemon just started has not "
                                "loaded yet (it serves meanwhile; 0 once all are).",
                                value=loading[1] - loading[0] if loading else 0)
        rss = GaugeMetricFamily(
            "sessiond_session_rss_bytes",
            f"RSS of a session's processes at the last sweep; the {self._top} largest only.",
            labels=["session"],
        )
        for value, sid in heapq.nlargest(self._top, live):
            rss.add_metric([sid], value)
        yield rss
        yield GaugeMetricFamily("sessiond_workers_rss_bytes",
                                "RSS of all live sessions' processes together, at the last sweep.",
                                value=sum(value for value, _ in live))
        yield GaugeMetricFamily("sessiond_clients", "Connected control clients.", value=self._clients())
        yield GaugeMetricFamily("sessiond_sessions_waiting",
                                "Sessions whose running turn waits on a person (a permission request).",
                                value=waiting)
        yield GaugeMetricFamily("sessiond_permission_wait_seconds",
                                "How long the oldest unanswered permission request has waited (0: none).",
                                value=0.0 if oldest is None else max(0.0, time.time() - oldest))


# ---------------------------------------------------------------- the endpoint


def bind_listener(where: tuple[str, int] | str) -> socket.socket:
    """A listening socket for `[daemon] metrics_listen`, as
    `config.metrics_address` parsed it: (host, port) or a Unix socket path.
    Raises OSError."""
    if isinstance(where, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        addr: str | tuple[Any, ...] = where
    else:
        host, port = where
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def address_of(sock: socket.socket) -> str:
    """Where a bound listener is, for the log: "http://127.0.0.1:9464/metrics"."""
    name = sock.getsockname()
    if isinstance(name, str):
        return name
    host, port = name[0], name[1]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


async def serve(sock: socket.socket, recorder: PrometheusRecorder) -> asyncio.AbstractServer:
    """Answer `GET /metrics` on `sock` from this loop until the server is closed."""
    silent: dict[asyncio.StreamWriter, None] = {}  # not yet sent a request, oldest first
    answering = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answering
        if len(silent) + answering >= _MAX_CONNECTIONS and silent:
            oldest = next(iter(silent))
            del silent[oldest]
            oldest.transport.abort()  # its read ends; its handler lets go
        counted = len(silent) + answering < _MAX_CONNECTIONS
        try:
            if counted:
                silent[writer] = None
                head = await _read_head(reader, writer)
                silent.pop(writer, None)  # (gone already if displaced meanwhile)
                answering += 1
                try:
                    if head is not None:
                        await _answer(head, writer, recorder)
                finally:
                    answering -= 1
            writer.close()
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            # Gone, too slow to send its request or to read the reply:
            # drop it with whatever is still queued for it.
            writer.transport.abort()
        except Exception:
            log.exception("answering a metrics request failed")
            writer.transport.abort()
        except BaseException:
            writer.transport.abort()
            raise
        finally:
            silent.pop(writer, None)

    if sock.family == socket.AF_UNIX:
        return await asyncio.start_unix_server(handle, sock=sock, limit=_MAX_HEAD_BYTES)
    return await asyncio.start_server(handle, sock=sock, limit=_MAX_HEAD_BYTES)


async def _read_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes | None:
    """The request head, or None once a too-large one was answered."""
    try:
        async with asyncio.timeout(_READ_TIMEOUT_SECS):
            return await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        await _reply(writer, 431, b"request head too large\n", "text/plain")
        return None


async def _answer(head: bytes, writer: asyncio.StreamWriter, recorder: PrometheusRecorder) -> None:
    method, target, version = _request_line(head)
    if method is None:
        await _reply(writer, 400, b"bad request\n", "text/plain")
    elif method not in ("GET", "HEAD"):
        await _reply(writer, 405, b"only GET\n", "text/plain")
    elif target.partition("?")[0] != "/metrics":
        await _reply(writer, 404, b"not found; try /metrics\n", "text/plain")
    else:
        body, content_type = recorder.exposition()
        await _reply(writer, 200, body, content_type, head_only=method == "HEAD")


def _request_line(head: bytes) -> tuple[str | None, str, str]:
    line = head.split(b"\r\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return None, "", ""
    try:
        method, target, version = (p.decode("ascii") for p in parts)
    except UnicodeDecodeError:
        return None, "", ""
    return method, target, version


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large"}


async def _reply(writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str,
                 head_only: bool = False) -> None:
    head = (
        f"HTTP/1.0 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode("ascii")
    writer.write(head if head_only else head + body)
    async with asyncio.timeout(_WRITE_TIMEOUT_SECS):
        await writer.drain()
