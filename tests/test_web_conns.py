"""The web console's HTTP connections before a request's head is in
(supervisor/ctl/web/conns.py): a deadline and a cap, on a real uvicorn
server on loopback in this process."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness import wait_for
from supervisor.ctl.web.conns import bounded_h11

pytestmark = pytest.mark.component


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _serve(head_timeout_secs: float, max_waiting: int) -> Iterator[int]:
    import uvicorn

    listener = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_app, http=bounded_h11(head_timeout_secs, max_waiting), ws="none",
                                           lifespan="off", log_config=None, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[listener])), daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, "uvicorn started")
    try:
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        listener.close()


@pytest.fixture
def quick() -> Iterator[int]:
    yield from _serve(0.3, 100)


@pytest.fixture
def capped() -> Iterator[int]:
    yield from _serve(600, 3)


def _half_open(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    return s


def closed_by_peer(s: socket.socket) -> bool:
    """Whether the other end closed `s` (polled: False while it is open)."""
    s.settimeout(0.05)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_head_not_in_by_its_deadline_is_closed(quick: int) -> None:
    silent = socket.create_connection(("127.0.0.1", quick))  # not a byte
    trickle = _half_open(quick)
    wait_for(lambda: closed_by_peer(silent) and closed_by_peer(trickle), 10, "both closed at their deadline")
    # A kept-alive connection whose next head never ends: closed as well.
    with httpx.Client() as client:
        assert client.get(f"http://127.0.0.1:{quick}/").text == "ok"
    s = socket.create_connection(("127.0.0.1", quick))
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(5)
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
    wait_for(lambda: closed_by_peer(s), 10, "the second head's deadline")
    for sock in (silent, trickle, s):
        sock.close()


def test_past_the_cap_the_longest_waiting_is_closed_and_requests_still_pass(capped: int) -> None:
    held = [_half_open(capped) for _ in range(5)]
    wait_for(lambda: closed_by_peer(held[0]) and closed_by_peer(held[1]), 10, "the two oldest closed")
    assert not any(closed_by_peer(s) for s in held[2:])
    assert httpx.get(f"http://127.0.0.1:{capped}/", timeout=10).text == "ok"
    for s in held:
        s.close()
