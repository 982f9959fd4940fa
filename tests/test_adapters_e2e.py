"""The framework adapters through the real daemon: the real `openai-agents`
and `langgraph` packages (tests/framework_handlers.py), preloaded by the
zygote, against the scripted LLM server on loopback, which counts the
requests by how many tool results they carry (a redone request gets the
same answer).

A response with three parallel tool calls that finish in reverse order;
the worker SIGKILLed while all three run, then while one has finished and
two run, then during the next LLM call; the daemon SIGKILLed while they
run; a graph of three nodes (two side by side) killed after each; a memory
bomb through `ctx.run`.  Each time the turn completes, no journaled LLM
request is made again, no finished tool or node runs again, and the
interrupted tools are reported to the model as killed.  One daemon serves
the module: a session of a preloaded framework is cheap to create."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakellm import FakeLLM, Hang, Response, Stream, text_stream, tool_call_stream
from harness import Daemon, wait_for
from ipc import messages as m
from test_agent_e2e import agent_config
from test_steps_e2e import kill_worker
from supervisor.ctl.errors import DaemonUnavailable

pytestmark = pytest.mark.process

KILLED = "error: the worker crashed (signal SIGKILL) while this tool ran; it may or may not have completed"


def tool_results(request: dict[str, Any]) -> dict[str, str]:
    return {msg["tool_call_id"]: msg["content"] for msg in request["messages"] if msg["role"] == "tool"}


class Model:
    """Three parallel `slow` calls (ids c0..c2, `secs[i]` each), then "all
    done".  `hang` answers the request after the tools by hanging, the
    first time (for the test to kill the worker in it)."""

    def __init__(self, llm: FakeLLM, secs: tuple[float, float, float], hang: bool = False) -> None:
        self.secs, self.hang = secs, hang
        self.seen: collections.Counter[int] = collections.Counter()
        self.lock = threading.Lock()
        llm.respond = self

    def __call__(self, request: dict[str, Any]) -> Response:
        t = len(tool_results(request))
        with self.lock:
            self.seen[t] += 1
            first = self.seen[t] == 1
        if t == 0:
            return tool_call_stream(*((f"c{i}", "slow", {"n": i, "secs": s}) for i, s in enumerate(self.secs)))
        if self.hang and first:
            return Stream([Hang()])
        return text_stream("all ", "done")


class Turn:
    """A `send` whose events a thread collects, as a client watching."""

    def __init__(self, d: Daemon, sid: str, text: str) -> None:
        self.events: list[Any] = []
        self.thread = threading.Thread(target=self._run, args=(d, sid, text), daemon=True)
        self.thread.start()

    def _run(self, d: Daemon, sid: str, text: str) -> None:
        with contextlib.suppress(DaemonUnavailable):  # (a test that kills the daemon)
            with d.client() as c:
                self.events.extend(c.send(sid, text))

    def notices(self, kind: str) -> list[dict[str, Any]]:
        return [e.data for e in list(self.events) if isinstance(e, m.Notice) and e.kind == kind]

    def done(self, timeout: float = 60) -> m.TurnDone:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the turn did not end"
        last = self.events[-1]
        assert isinstance(last, m.TurnDone), last
        return last


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    with FakeLLM() as server:
        yield server


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, llm: FakeLLM) -> Iterator[Daemon]:
    config = agent_config(llm, "[agent.limits]\nmemory_poll_interval_ms = 50\n", key_env=None).replace(
        'handler = "agent"', 'handler = "framework_handlers:openai_make"\n'
        'allowed_handlers = ["framework_handlers:*", "echo"]').replace(
        "restart_backoff_initial_ms = 20", "restart_backoff_initial_ms = 20\nrestart_backoff_max_ms = 40\n"
        "max_restart_attempts = 20")
    d = Daemon(tmp_path_factory.mktemp("adapters"), config)
    d.start(timeout=60)
    yield d
    d.cleanup()
    d.assert_no_leftovers()


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def three_running(d: Daemon, llm: FakeLLM) -> tuple[Model, str, Path, Turn]:
    """A session's turn with its three tools started, and running for good."""
    model = Model(llm, (-1, -1, -1))
    with d.client() as c:
        sid = c.create().id
    ws = d.workspace(sid)
    turn = Turn(d, sid, "count")
    wait_for(lambda: len(lines(ws / "counter")) == 3, 30, "the three tools to start")
    return model, sid, ws, turn


def test_the_framework_is_preloaded_by_the_zygote(daemon: Daemon) -> None:
    assert "the zygote preloaded framework_handlers" in daemon.log


def test_three_parallel_tool_calls_finishing_in_reverse_order_each_run_once(daemon: Daemon, llm: FakeLLM) -> None:
    model = Model(llm, (0.3, 0.2, 0.1))
    with daemon.client() as c:
        sid = c.create().id
    turn = Turn(daemon, sid, "count")
    assert turn.done().reply.endswith("all done")
    counter = lines(daemon.workspace(sid) / "counter")
    assert sorted(counter) == sorted(f"{w} {i}" for w in ("start", "end") for i in range(3))
    assert [x for x in counter if x.startswith("end")] == ["end 2", "end 1", "end 0"]
    assert model.seen == {0: 1, 3: 1}
    assert tool_results(llm.requests[-1].json) == {f"c{i}": f"counted {i}" for i in range(3)}
    assert [n["id"] for n in turn.notices("tool_call")] and len(turn.notices("tool_result")) == 3
    with daemon.client() as c:
        [history] = c.history(sid).turns
        assert [call["name"] for call in history.tool_calls] == ["slow"] * 3
        assert sorted(r["output"] for r in history.tool_results) == [f"counted {i}" for i in range(3)]


def test_a_worker_killed_while_three_tools_run_answers_them_killed(daemon: Daemon, llm: FakeLLM) -> None:
    model, sid, ws, turn = three_running(daemon, llm)
    kill_worker(daemon, sid)
    assert turn.done().reply.endswith("all done")
    assert sorted(lines(ws / "counter")) == ["start 0", "start 1", "start 2"]  # none ran again
    assert model.seen == {0: 1, 3: 1}
    assert tool_results(llm.requests[-1].json) == {f"c{i}": KILLED for i in range(3)}


def test_a_worker_killed_with_one_tool_done_then_during_the_next_llm_call(daemon: Daemon, llm: FakeLLM) -> None:
    model = Model(llm, (0, -1, -1), hang=True)
    with daemon.client() as c:
        sid = c.create().id
    ws = daemon.workspace(sid)
    turn = Turn(daemon, sid, "count")
    # Its result went to the daemon before its notice went to the client.
    wait_for(lambda: [n["id"] for n in turn.notices("tool_result")] == ["c0"]
             and {"start 1", "start 2"} <= set(lines(ws / "counter")), 30, "tool 0 done, tools 1 and 2 running")
    kill_worker(daemon, sid)
    wait_for(lambda: model.seen[3] == 1, 30, "the LLM call after the tools")
    kill_worker(daemon, sid)
    assert turn.done().reply.endswith("all done")
    assert sorted(lines(ws / "counter")) == ["end 0", "start 0", "start 1", "start 2"]
    assert model.seen == {0: 1, 3: 2}  # only the call in flight was made again
    assert tool_results(llm.requests[-1].json) == {"c0": "counted 0", "c1": KILLED, "c2": KILLED}
    resumed = turn.notices("turn_resumed")
    assert [r["reason"] for r in resumed] == ["crashed", "crashed"]


def test_a_daemon_killed_while_three_tools_run_resumes_the_turn(daemon: Daemon, llm: FakeLLM) -> None:
    model, sid, ws, turn = three_running(daemon, llm)
    daemon.kill()
    daemon.start(timeout=60)
    with daemon.client() as c:
        wait_for(lambda: c.history(sid).turns[-1].outcome == "done", 60, "the turn to resume and end")
        done = c.history(sid).turns[-1]
    turn.thread.join(30)  # its client followed the turn across the restart
    assert done.reply.endswith("all done") and [r["reason"] for r in done.resumed] == ["daemon_stopped"]
    assert sorted(lines(ws / "counter")) == ["start 0", "start 1", "start 2"]
    assert model.seen == {0: 1, 3: 1}
    assert all(r.startswith("error: the daemon stopped while this tool")
               for r in tool_results(llm.requests[-1].json).values())


def test_a_memory_bomb_run_through_ctx_run_becomes_the_tools_result(daemon: Daemon, llm: FakeLLM) -> None:
    bomb = "python3 -c 'import signal; b = bytearray(400 << 20); signal.pause()'"
    llm.respond = lambda request: (text_stream("survived") if tool_results(request)
                                   else tool_call_stream(("b1", "shell", {"command": bomb})))
    with daemon.client() as c:
        sid = c.create(settings={"agent.limits.max_memory_mb": 200}).id
        events = list(c.send(sid, "blow up"))
        assert isinstance(events[-1], m.TurnDone) and events[-1].reply.endswith("survived")
        assert c.status(sid).last_exit.reason == "killed_memory"
    assert tool_results(llm.requests[-1].json) == {"b1": "error: the tool was killed: memory cap of 200 MiB reached"}


def test_a_graph_killed_after_each_node_runs_each_node_once(daemon: Daemon) -> None:
    with daemon.client() as c:
        sid = c.create(handler="framework_handlers:graph_make").id
    ws = daemon.workspace(sid)
    turn = Turn(daemon, sid, "go")
    wait_for(lambda: (ws / "paused-a").exists(), 30, "node a")
    kill_worker(daemon, sid)  # before a's work
    wait_for(lambda: (ws / "paused-b").exists() and (ws / "paused-c").exists(), 30, "nodes b and c")
    kill_worker(daemon, sid)  # after a, b and c side by side
    assert turn.done().reply in ("in:go a b c", "in:go a c b")
    counter = lines(ws / "counter")
    assert counter[0] == "a" and sorted(counter) == ["a", "b", "c"]  # each node's work once
