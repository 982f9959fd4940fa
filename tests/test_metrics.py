"""Prometheus metrics ([daemon] metrics_listen), scraped from a real daemon:
the counters follow a scripted run, and the endpoint shrugs off junk and
slow clients without holding up the control socket."""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import FAST_SWEEP, Daemon, wait_for
from ipc import messages as m
from supervisor.ctl.client import RequestError

pytestmark = pytest.mark.process

FAST = FAST_SWEEP

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """{(sample name, sorted labels): value} of an exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def tcp_metrics_url(d: Daemon) -> str:
    found = wait_for(lambda: re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", d.log), 10,
                     "the metrics address in the log")
    return found.group(1)


def test_counters_follow_a_scripted_run(make_daemon) -> None:
    d = make_daemon(FAST + 'metrics_listen = "127.0.0.1:0"\nmetrics_per_session = true\n')
    url = tcp_metrics_url(d)
    with d.client() as c:
        echo = c.create().id
        for word in ("one", "two", "three"):
            assert c.send_text(echo, word).endswith(word)
        leaky = c.create(handler="fixture_handlers:leaky",
                         settings={"agent.limits.max_memory_mb": 96}).id
        events = list(c.send(leaky, "400"))
        assert isinstance(events[-1], m.TurnFailed) and "killed_memory" in events[-1].reason
        wait_for(lambda: c.status(leaky).state == "idle" and c.status(leaky).restarts == 1, 10,
                 "the restart after the memory kill")
        with pytest.raises(RequestError) as bad:
            c.status("no-such-session")
        assert bad.value.code == "not_found"

        def swept() -> Samples | None:
            got = parse(httpx.get(url, timeout=5).text)
            # Both workers measured by a sweep after the restart.
            rss = {k[1] for k in got if k[0] == "sessiond_session_rss_bytes"}
            return got if len(rss) == 2 else None

        response = httpx.get(url, timeout=5)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain; version=")
        s = wait_for(swept, 10, "both sessions' RSS in the scrape")

        assert value(s, "sessiond_turns_total", outcome="started") == 4
        assert value(s, "sessiond_turns_total", outcome="done") == 3
        assert value(s, "sessiond_turns_total", outcome="failed") == 1
        assert value(s, "sessiond_turn_duration_seconds_count") == 4
        # Every one of the four streamed something (the leaky one a dot per 8 MiB).
        assert value(s, "sessiond_turn_first_token_seconds_count") == 4
        assert value(s, "sessiond_turns_failed_total", reason="killed_memory") == 1
        assert value(s, "sessiond_commit_batch_records_count") == 3
        assert value(s, "sessiond_commit_batch_records_sum") == 3
        assert value(s, "sessiond_workers_rss_bytes") >= value(s, "sessiond_session_rss_bytes", session=leaky)
        assert value(s, "sessiond_commit_seconds_count") == 3
        assert value(s, "sessiond_commit_seconds_sum") > 0
        assert value(s, "sessiond_worker_exits_total", reason="killed_memory") == 1
        assert value(s, "sessiond_restarts_total") == 1
        assert value(s, "sessiond_sweep_duration_seconds_count") > 0
        assert value(s, "sessiond_sessions", state="idle") == 2
        assert value(s, "sessiond_sessions", state="failed") == 0
        assert value(s, "sessiond_clients") == 1
        assert value(s, "sessiond_session_rss_bytes", session=leaky) > 1 << 20
        assert value(s, "sessiond_control_requests_total", type="create", code="ok") == 2
        assert value(s, "sessiond_control_requests_total", type="send", code="ok") == 4
        assert value(s, "sessiond_control_requests_total", type="status", code="not_found") == 1
        assert value(s, "sessiond_control_requests_total", type="hello", code="ok") >= 1

        # Stopping a session is an exit too, classified as such.
        c.stop(echo)
    s = parse(httpx.get(url, timeout=5).text)
    assert value(s, "sessiond_worker_exits_total", reason="stopped") == 1
    assert value(s, "sessiond_sessions", state="stopped") == 1
    assert value(s, "sessiond_clients") == 0


@contextlib.contextmanager
def short_dir() -> Iterator[Path]:
    # A Unix socket path must be short: not under pytest's long tmp path.
    path = Path(tempfile.mkdtemp(prefix="sdm-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    return s


def exchange(path: Path, request: bytes) -> bytes:
    with connect(path) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data


def closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_the_endpoint_refuses_junk_and_slow_clients_without_hurting_the_daemon(make_daemon) -> None:
    with short_dir() as where:
        path = where / "metrics.sock"
        d = make_daemon(f'[daemon]\nmetrics_listen = "{path}"\n')
        assert exchange(path, b"GET /metrics HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 200 OK\r\n")
        assert exchange(path, b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n").startswith(b"HTTP/1.0 200 ")
        assert exchange(path, b"GET / HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 404 ")
        assert exchange(path, b"POST /metrics HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 405 ")
        assert exchange(path, b"\x00\xff\xfe junk\r\n\r\n").startswith(b"HTTP/1.0 400 ")
        assert exchange(path, b"GET /metrics\r\n\r\n").startswith(b"HTTP/1.0 400 ")
        assert exchange(path, b"GET /" + b"a" * 20000).startswith(b"HTTP/1.0 431 ")
        assert exchange(path, b"") == b""  # a client that says nothing and leaves

        # Slowloris: more connections than the endpoint serves at once, each
        # sending a byte of its request head and then nothing.
        slow = [connect(path) for _ in range(40)]
        for s in slow:
            # (past the cap a new connection takes the slot of the longest
            # silent one, which may be closed already: its byte goes nowhere)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                s.sendall(b"G")
        # The control socket still answers meanwhile (the ctl's own timeout
        # is the bound: no timing assertion of ours).
        ping = d.ctl("ping", timeout=10)
        assert ping.returncode == 0, ping.stderr
        # Past the cap, a connection is closed at once; the others once their
        # head is overdue (the read timeout), and then a scrape is served again.
        wait_for(lambda: sum(map(closed_by_peer, slow)) >= 8, 3, "connections past the cap to be closed")
        wait_for(lambda: all(map(closed_by_peer, slow)), 15, "slow clients to be timed out")
        for s in slow:
            s.close()
        assert exchange(path, b"GET /metrics HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 200 ")
        assert d.ctl("ping").returncode == 0
        d.stop()
    assert not path.exists()  # the socket file goes with the daemon


def test_with_metrics_off_the_library_is_not_even_imported() -> None:
    # The parts hold the no-op recorder; prometheus_client (~70 ms to import)
    # is imported only when [daemon] metrics_listen is set.
    import subprocess
    import sys

    from harness import env_for_children

    code = ("import sys, supervisor.daemon, supervisor.core.manager, supervisor.api.server\n"
            "from supervisor.core.recorder import NO_METRICS, NoMetrics as Recorder\n"
            "assert type(NO_METRICS) is Recorder\n"
            "assert 'prometheus_client' not in sys.modules, 'imported'\n")
    done = subprocess.run([sys.executable, "-c", code], env=env_for_children(),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_provider_errors_are_counted_by_status(make_daemon, llm, monkeypatch) -> None:
    from fakellm import Reply, text_stream
    from test_agent_e2e import agent_config

    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test")
    # With metrics_top_sessions = 0 the endpoint names no session.
    d = make_daemon(agent_config(llm, extra='metrics_listen = "127.0.0.1:0"\nmetrics_top_sessions = 0'))
    url = tcp_metrics_url(d)
    llm.script(
        Reply(429, {"error": {"message": "slow down"}}, {"Retry-After": "0"}),  # retried
        text_stream("fine"),
        Reply(401, {"error": {"message": "bad key"}}),  # not retried: the turn fails
    )
    with d.client() as c:
        sid = c.create().id
        assert c.send_text(sid, "hello") == "fine"
        events = list(c.send(sid, "again"))
        assert isinstance(events[-1], m.TurnFailed) and "401" in events[-1].reason
    s = wait_for(lambda: (got := parse(httpx.get(url, timeout=5).text))
                 and value(got, "sessiond_workers_rss_bytes") > 0 and got, 10, "a sweep of the worker")
    assert not [k for k in s if k[0] == "sessiond_session_rss_bytes"]
    assert sid not in httpx.get(url, timeout=5).text
    assert value(s, "sessiond_provider_errors_total", status="429") == 1
    assert value(s, "sessiond_provider_errors_total", status="401") == 1
    assert value(s, "sessiond_turns_failed_total", reason="provider") == 1
    assert value(s, "sessiond_turns_total", outcome="done") == 1


def test_tool_calls_and_exported_spans_are_counted(make_daemon, llm, monkeypatch) -> None:
    from fakellm import text_stream, tool_call_stream
    from otlp_receiver import OtlpReceiver
    from test_agent_e2e import agent_config

    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test")
    with OtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        d = make_daemon(agent_config(llm, extra='metrics_listen = "127.0.0.1:0"'))
        url = tcp_metrics_url(d)
        before = parse(httpx.get(url, timeout=5).text)
        assert before[("sessiond_tool_calls_total", (("kind", "bash"), ("outcome", "ok")))] == 0
        assert value(before, "process_open_fds") > 0
        llm.script(tool_call_stream(("c1", "bash", {"command": "echo hi"})), text_stream("done"))
        with d.client() as c:
            sid = c.create().id
            assert c.send_text(sid, "go").endswith("done")
        # The turn's seven spans (the turn, queue, input, two LLM calls, the
        # tool, the commit), once the exporter's counts come back.
        s = wait_for(lambda: (got := parse(httpx.get(url, timeout=5).text))
                     and value(got, "sessiond_trace_spans_total", outcome="exported") >= 7 and got, 20,
                     "the turn's spans counted as exported")
    assert value(s, "sessiond_tool_calls_total", kind="bash", outcome="ok") == 1
    assert sum(v for (name, _), v in s.items() if name == "sessiond_tool_calls_total") == 1
    assert value(s, "sessiond_trace_spans_total", outcome="dropped") == 0
