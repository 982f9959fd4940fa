"""A scripted, OpenAI-compatible LLM server on loopback, for tests.

A real HTTP/1.1 server (stdlib `ThreadingHTTPServer` in a background thread,
bound to 127.0.0.1 on a free port), so clients under test go through their
real network stack: connection reuse, chunked streaming, timeouts, resets.

Each `POST /v1/chat/completions` pops the next scripted response and records
the request.  Usage::

    with FakeLLM() as llm:                     # or the `fake_llm` fixture
        llm.script(
            text_stream("Hel", "lo"),           # SSE chunks, then [DONE]
            Reply(429, {"error": {"message": "slow down"}}, {"Retry-After": "0.1"}),
            Stream([chunk({"content": "x"}), Hang()]),   # stalls until the client leaves
            Stream([chunk({"content": "x"})], cut=True), # connection dropped mid-stream
        )
        client.base_url = llm.base_url          # "http://127.0.0.1:PORT/v1"
        ...
        assert llm.requests[0].json["model"] == "m"

Stream items: a dict is sent as one `data: <json>` event; a `str` or `bytes`
is written verbatim (for `: ping` comments, `\\r\\n` line endings, chunks
split mid-line); `Delay(secs)` pauses; `Hang()` waits until the client
disconnects or the server stops (then `RecordedRequest.client_gone` is set
if it was the client).  Each item goes out as its own HTTP chunk.

`llm.check = fn` makes the server strict the way some real ones are: `fn`
gets each request's JSON and returns None, or the message of a 400 answer
given instead of the next scripted response (which stays queued).
`llm.respond = fn` answers each request with `fn(request_json)` instead of
the script: a model whose next move follows from the conversation.
`shredded(stream, seed)` re-cuts a stream's bytes into random small pieces,
each its own HTTP chunk, as a slow or fragmenting network would deliver them.

With no scripted response left the server answers 400 with the message
"fakellm: no scripted response left", so a test that makes one call too many
fails with a readable reason instead of hanging.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections import deque
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

__all__ = [
    "Delay",
    "FakeLLM",
    "Hang",
    "RecordedRequest",
    "Reply",
    "Stream",
    "chunk",
    "fake_llm",
    "shredded",
    "text_stream",
    "tool_call_stream",
]


@dataclass(frozen=True)
class Delay:
    secs: float


@dataclass(frozen=True)
class Hang:
    """Send nothing more until the client disconnects or the server stops."""


StreamItem = dict[str, Any] | str | bytes | Delay | Hang


@dataclass
class Stream:
    """A `text/event-stream` response, sent with chunked encoding."""

    events: Sequence[StreamItem]
    # Send `data: [DONE]` after the events.
    done: bool = True
    # Close the connection after the events without ending the chunked body.
    cut: bool = False
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Reply:
    """A whole response: an error with its body, or a non-streamed JSON answer."""

    status: int
    body: dict[str, Any] | str = ""
    headers: dict[str, str] = field(default_factory=dict)


Response = Stream | Reply


@dataclass
class RecordedRequest:
    path: str
    headers: dict[str, str]
    json: Any
    received_at: float
    # Set when a `Hang()` saw the client close its end.
    client_gone: threading.Event = field(default_factory=threading.Event)


def chunk(
    delta: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One OpenAI-style `chat.completion.chunk` with a single choice."""
    body: dict[str, Any] = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "fake-model",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish_reason}],
    }
    body.update(extra)
    return body


def text_stream(*pieces: str, finish_reason: str = "stop") -> Stream:
    """A plain text answer streamed as one chunk per piece."""
    events: list[StreamItem] = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": piece}) for piece in pieces]
    events.append(chunk({}, finish_reason))
    return Stream(events)


def tool_call_stream(
    *calls: tuple[str, str, dict[str, Any] | str],
    text: str = "",
    piece_chars: int = 7,
) -> Stream:
    """Tool calls `(id, name, arguments)` the way OpenAI streams them: id and
    name in the first delta of each call, the JSON arguments split every
    `piece_chars` characters, calls one after the other."""
    events: list[StreamItem] = [chunk({"role": "assistant", "content": None})]
    if text:
        events.append(chunk({"content": text}))
    for index, (call_id, name, arguments) in enumerate(calls):
        raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
        events.append(
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }
                    ]
                }
            )
        )
        for start in range(0, len(raw), piece_chars):
            piece = raw[start : start + piece_chars]
            events.append(
                chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
            )
    events.append(chunk({}, "tool_calls"))
    return Stream(events)


def shredded(stream: Stream, seed: int, max_piece: int = 7) -> Stream:
    """The same bytes as `stream` (its [DONE] included), cut at random
    places into pieces of 1..max_piece bytes, so that events, lines, JSON
    and UTF-8 sequences are all split somewhere."""
    data = b"".join(_encode(item) for item in stream.events if not isinstance(item, (Delay, Hang)))
    if stream.done and not stream.cut:
        data += b"data: [DONE]\n\n"
    rng = random.Random(seed)
    pieces: list[StreamItem] = []
    at = 0
    while at < len(data):
        n = rng.randint(1, max_piece)
        pieces.append(data[at : at + n])
        at += n
    return Stream(pieces, done=False, cut=stream.cut, headers=stream.headers)


class FakeLLM:
    """The server.  `start()`/`stop()` or use it as a context manager."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._script: deque[Response] = deque()
        self._requests: list[RecordedRequest] = []
        self._connections = 0
        self._stopping = threading.Event()
        # Connections open now: ended by stop(), so that no handler thread
        # outlives the server (a client's pool keeps them alive otherwise,
        # and a test process that forks next must have no other thread).
        self._open: set[socket.socket] = set()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.check: Callable[[Any], str | None] | None = None
        # When set, answers each request from its JSON instead of the script
        # (a model whose next move follows from the conversation so far).
        self.respond: Callable[[Any], Response] | None = None

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> FakeLLM:
        fake = self

        class Handler(_Handler):
            owner = fake

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            conns = list(self._open)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with self._lock:
                if not self._open:
                    break
            time.sleep(0.005)

    def __enter__(self) -> FakeLLM:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the API tests use ----------------------------------------------------

    @property
    def base_url(self) -> str:
        assert self._server is not None, "FakeLLM not started"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    def script(self, *responses: Response) -> None:
        """Queue responses, served in order, one per request."""
        with self._lock:
            self._script.extend(responses)

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    @property
    def connections(self) -> int:
        """TCP connections accepted so far (to check connection reuse)."""
        with self._lock:
            return self._connections

    @property
    def pending(self) -> int:
        """Scripted responses not served yet."""
        with self._lock:
            return len(self._script)

    def wait_for_requests(self, n: int, timeout: float = 10.0) -> list[RecordedRequest]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.requests
            if len(got) >= n:
                return got
            time.sleep(0.005)
        raise AssertionError(f"expected {n} requests, got {len(self.requests)}")

    # -- called from handler threads ------------------------------------------

    def _accepted(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections += 1
            self._open.add(conn)

    def _closed(self, conn: socket.socket) -> None:
        with self._lock:
            self._open.discard(conn)

    def _take(self, request: RecordedRequest) -> Response | None:
        with self._lock:
            self._requests.append(request)
            problem = self.check(request.json) if self.check is not None else None
            if problem is not None:
                return Reply(400, {"error": {"message": problem, "type": "invalid_request_error"}})
            if self.respond is not None:
                return self.respond(request.json)
            return self._script.popleft() if self._script else None


class _Handler(BaseHTTPRequestHandler):
    owner: FakeLLM
    protocol_version = "HTTP/1.1"
    # Each event is its own small write: without TCP_NODELAY, Nagle holds one
    # back until the client's delayed ACK (~40 ms on loopback), per request.
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        self.owner._accepted(self.connection)

    def finish(self) -> None:
        self.owner._closed(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def handle(self) -> None:
        # Clients under test drop connections on purpose (interrupts, cuts).
        try:
            super().handle()
        except (ConnectionError, OSError):
            self.close_connection = True

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        # /v1/messages: Anthropic's Messages API, scripted the same way.
        if self.path.rstrip("/") not in ("/v1/chat/completions", "/v1/messages"):
            self._reply(Reply(404, {"error": {"message": f"no route {self.path}"}}))
            return
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        request = RecordedRequest(
            path=self.path,
            headers={k.lower(): v for k, v in self.headers.items()},
            json=body,
            received_at=time.monotonic(),
        )
        response = self.owner._take(request)
        if response is None:
            response = Reply(400, {"error": {"message": "fakellm: no scripted response left"}})
        try:
            if isinstance(response, Reply):
                self._reply(response)
            else:
                self._stream(response, request)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _reply(self, reply: Reply) -> None:
        if isinstance(reply.body, str):
            data = reply.body.encode()
            content_type = "text/plain"
        else:
            data = json.dumps(reply.body).encode()
            content_type = "application/json"
        self.send_response(reply.status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in reply.headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _stream(self, stream: Stream, request: RecordedRequest) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        for key, value in stream.headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.flush()
        items: list[StreamItem] = list(stream.events)
        if stream.done and not stream.cut:
            items.append("data: [DONE]\n\n")
        for item in items:
            if isinstance(item, Delay):
                self._pause(item.secs)
            elif isinstance(item, Hang):
                if self._hang():
                    request.client_gone.set()
                self.close_connection = True
                return
            else:
                self._chunk(_encode(item))
        if stream.cut:
            # Close without the terminating zero-length chunk: the client
            # sees the connection drop in the middle of the body.
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    def _pause(self, secs: float) -> None:
        deadline = time.monotonic() + secs
        while not self.owner._stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.02))

    def _hang(self) -> bool:
        """Wait; True if the client closed the connection, False on stop."""
        sock = self.connection
        while not self.owner._stopping.is_set():
            readable, _, _ = select.select([sock], [], [], 0.02)
            if readable:
                try:
                    if not sock.recv(1, socket.MSG_PEEK):
                        return True
                except OSError:
                    return True
        return False


def _encode(item: dict[str, Any] | str | bytes) -> bytes:
    if isinstance(item, dict):
        return b"data: " + json.dumps(item).encode() + b"\n\n"
    if isinstance(item, str):
        return item.encode()
    return item


@pytest.fixture
def fake_llm() -> Iterator[FakeLLM]:
    with FakeLLM() as llm:
        yield llm
