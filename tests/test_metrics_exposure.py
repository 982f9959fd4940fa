"""What the metrics endpoint exposes, and to how many: no series naming
sessions unless `[daemon] metrics_per_session = true`, and clients that
connect and stay silent cannot hold its slots against a scrape (issue 21)."""

from __future__ import annotations

import socket

import httpx
import pytest

from harness import FAST_SWEEP, Daemon, wait_for
from supervisor.ops.metrics import _MAX_CONNECTIONS
from test_metrics import parse, tcp_metrics_url, value

pytestmark = pytest.mark.process


def _swept(url: str) -> str:
    def measured() -> str | None:
        text = httpx.get(url, timeout=5).text
        return text if value(parse(text), "sessiond_workers_rss_bytes") > 0 else None
    return wait_for(measured, 10, "a sweep of the live session")


def test_no_series_names_a_session_by_default(make_daemon) -> None:
    d: Daemon = make_daemon(FAST_SWEEP + 'metrics_listen = "127.0.0.1:0"\n')
    url = tcp_metrics_url(d)
    with d.client() as c:
        sid = c.create(session="someones-secret-project").id
    text = _swept(url)
    assert sid not in text and 'session="' not in text
    assert value(parse(text), "sessiond_sessions", state="idle") == 1


def test_per_session_series_when_asked(make_daemon) -> None:
    d: Daemon = make_daemon(FAST_SWEEP + 'metrics_listen = "127.0.0.1:0"\nmetrics_per_session = true\n')
    url = tcp_metrics_url(d)
    with d.client() as c:
        sid = c.create(session="shown").id
    wait_for(lambda: value(parse(httpx.get(url, timeout=5).text), "sessiond_session_rss_bytes",
                           session=sid) > 0, 10, "the session's own series")


def test_silent_connections_cannot_hold_the_scrape_slots(make_daemon) -> None:
    d: Daemon = make_daemon(FAST_SWEEP + 'metrics_listen = "127.0.0.1:0"\n')
    url = tcp_metrics_url(d)
    host, port = url.removeprefix("http://").removesuffix("/metrics").split(":")
    holders = [socket.create_connection((host, int(port)), timeout=10)
               for _ in range(_MAX_CONNECTIONS)]
    try:
        # Every slot is held by a client that says nothing; a scrape is
        # still answered (it takes the longest-waiting silent one's slot).
        reply = httpx.get(url, timeout=10)
        assert reply.status_code == 200 and "sessiond_sessions" in reply.text
        # And silence is not kept for ever: the daemon closes the others.
        for s in holders:
            wait_for(lambda s=s: _closed(s), 20, "a silent metrics connection to be closed")
    finally:
        for s in holders:
            s.close()
    with d.client() as c:
        assert c.ping().pid == d.pid


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
