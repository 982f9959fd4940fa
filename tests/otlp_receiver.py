"""Real OTLP trace receivers on loopback, for tests and bench/tracing.py.

`OtlpReceiver`: a stdlib `ThreadingHTTPServer` on 127.0.0.1 (a free port)
that takes `POST /v1/traces`, decodes the body with OpenTelemetry's own
protobuf classes (`ExportTraceServiceRequest`, opentelemetry-proto), gzip or
not, and keeps every span as a `Received` (ids as hex, attributes as Python
values)::

    with OtlpReceiver() as rx:
        ... OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=rx.endpoint ...
        spans = rx.wait_for(lambda spans: any(s.name == "invoke_agent agent" for s in spans))

`OtlpReceiver(keep=False)` only counts the spans (`rx.count`).
`rx.status = 503` makes it answer errors (a collector that is up but refusing).

`OtlpGrpcReceiver`: the same over OTLP/gRPC, a grpcio server of the
`TraceService` opentelemetry-proto defines (its `trace_service_pb2_grpc`),
`rx.endpoint` the address a gRPC exporter takes ("http://127.0.0.1:PORT").
"""

from __future__ import annotations

import concurrent.futures
import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ["OtlpGrpcReceiver", "OtlpReceiver", "Received", "tree"]


@dataclass
class Received:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    service: str
    scope: str
    children: list[Received] = field(default_factory=list)


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class _Receiver:
    """What both receivers keep, and how a test waits for it."""

    def __init__(self, keep: bool = True) -> None:
        self.spans: list[Received] = []
        self.keep = keep  # False: only count them (a bench's many turns)
        self.count = 0
        self.requests = 0
        self.status = 200
        self._lock = threading.Lock()

    def _take(self, request: ExportTraceServiceRequest) -> None:
        if not self.keep:
            with self._lock:
                self.requests += 1
                self.count += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return
        spans = []
        for rs in request.resource_spans:
            service = _attrs(rs.resource.attributes).get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(Received(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                        name=s.name, kind=s.kind, start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        events=[(e.name, _attrs(e.attributes)) for e in s.events],
                        status_code=s.status.code, status_message=s.status.message,
                        service=service, scope=ss.scope.name,
                    ))
        with self._lock:
            self.requests += 1
            if self.status == 200:
                self.spans.extend(spans)

    def wait_for(self, done: Callable[[list[Received]], bool], timeout: float = 20.0) -> list[Received]:
        """The spans so far, once `done(spans)` holds (polled; AssertionError at the deadline)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted(s.name for s in spans)
                raise AssertionError(f"spans never arrived as expected; received: {names}")
            time.sleep(0.05)


class OtlpReceiver(_Receiver):
    def __init__(self, keep: bool = True) -> None:
        super().__init__(keep)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._take(request)
                status = receiver.status
                out = ExportTraceServiceResponse().SerializeToString() if status == 200 else b"unavailable"
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()


class OtlpGrpcReceiver(_Receiver):
    def __init__(self, keep: bool = True) -> None:
        # (grpcio comes with the `otel` extra's gRPC exporter)
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        super().__init__(keep)
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
            def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:
                receiver._take(request)
                if receiver.status != 200:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "unavailable")
                return ExportTraceServiceResponse()

        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
        self._server = grpc.server(self._pool)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpGrpcReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        # Its threads end here: a test process that forks next must have none.
        self._server.stop(grace=None).wait(10)
        self._pool.shutdown(wait=True)


def tree(spans: list[Received], trace_id: str) -> list[Received]:
    """The roots of one trace, each with its `children` (sorted by start)."""
    mine = [s for s in spans if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in mine}
    for s in mine:
        s.children = []
    roots = []
    for s in sorted(mine, key=lambda s: s.start_ns):
        parent = by_id.get(s.parent_id)
        (parent.children if parent is not None else roots).append(s)
    return roots
