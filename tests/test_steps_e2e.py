"""Durable steps through the real daemon: a turn survives its worker.

An agent turn of five tools (each appends to a counter file in the
workspace) against a scripted LLM on loopback whose answer follows from the
conversation, so a redone request gets the same answer; the worker is
SIGKILLed during LLM calls, during tools and between them, then the daemon
itself; a memory bomb in the 5th tool of a 64 MiB session; a custom handler
killed after each of its three `ctx.step`s.  Each time: the client's one
`send` ends in `turn_done` with the final reply and exits 0, no journaled
LLM call is requested again, no tool runs twice, and the interrupted tool
is reported to the model."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from fakellm import FakeLLM, Hang, Response, Stream, chunk, text_stream, tool_call_stream
from harness import Daemon, env_for_children, wait_for
from ipc import messages as m
from test_agent_e2e import agent_config, tool_results

pytestmark = pytest.mark.process

TOOLS = 5
KILLED = "error: the worker crashed (signal SIGKILL) while this tool ran; it may or may not have completed"


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test-secret-123")


class Model:
    """The scripted model: with t tool results so far, call tool t (a bash
    command appending t to `counter`), or answer "all done" after the last.
    `hold` names the requests (by t) answered the first time with a stream
    that stops and hangs, `quiet` those not answered at all the first time,
    for the test to kill the worker in; `slow` the tools whose command waits
    to be killed; `bomb` the tool that blows the memory cap."""

    def __init__(self, llm: FakeLLM, hold: frozenset[int] = frozenset(), quiet: frozenset[int] = frozenset(),
                 slow: frozenset[int] = frozenset(), bomb: int | None = None) -> None:
        self.seen: collections.Counter[int] = collections.Counter()
        self.hold, self.quiet, self.slow, self.bomb = hold, quiet, slow, bomb
        self.lock = threading.Lock()
        llm.respond = self

    def command(self, t: int) -> str:
        if t == self.bomb:
            # Holds the memory until the cap's kill comes (no time of its own).
            return "echo 4 >> started; python3 -c 'import signal; b = b\"x\" * (256 << 20); signal.pause()'"
        wait = "sleep infinity; " if t in self.slow else ""  # until the test kills the worker
        return f"echo {t} >> started; {wait}echo {t} >> counter"

    def __call__(self, request: dict[str, Any]) -> Response:
        t = len(tool_results(request))
        with self.lock:
            self.seen[t] += 1
            first = self.seen[t] == 1
        if t in self.hold and first:
            return Stream([chunk({"role": "assistant", "content": ""}), chunk({"content": f"step {t}."}), Hang()])
        if t in self.quiet and first:
            return Stream([Hang()])
        if t < TOOLS:
            return tool_call_stream((f"c{t}", "bash", {"command": self.command(t)}), text=f"step {t}.")
        return text_stream("all ", "done")


def send_in_background(d: Daemon, sid: str, text: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "supervisor.ctl", "--socket", str(d.socket), "send", sid, text],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for_children(),
    )


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def kill_worker(d: Daemon, sid: str) -> None:
    with d.client() as c:
        pid = c.status(sid).pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


def test_an_agent_turn_survives_its_worker_killed_at_each_kind_of_step(make_daemon, llm: FakeLLM) -> None:
    d = make_daemon(agent_config(llm).replace(
        "restart_backoff_initial_ms = 20",
        "restart_backoff_initial_ms = 20\nrestart_backoff_max_ms = 40\nmax_restart_attempts = 20"))
    # Killed: during every LLM call (streaming), but between tool 2 and LLM
    # call 3 (the request made, nothing answered yet), and during tools 1 and 3.
    model = Model(llm, hold=frozenset({0, 1, 2, 4, 5}), quiet=frozenset({3}), slow=frozenset({1, 3}))
    with d.client() as c:
        sid = c.create().id
    ws = d.workspace(sid)
    send = send_in_background(d, sid, "count to five")
    kills = 0
    for t in range(TOOLS + 1):
        if t in model.hold or t in model.quiet:
            wait_for(lambda: model.seen[t] >= 1 and len(llm.requests) >= sum(model.seen.values()), 15,
                     f"LLM request {t}")
            kill_worker(d, sid)
            kills += 1
        if t in model.slow:
            wait_for(lambda: str(t) in lines(ws / "started"), 15, f"tool {t} to start")
            kill_worker(d, sid)
            kills += 1
    out, err = send.communicate(timeout=60)
    assert send.returncode == 0, err
    assert out.rstrip().endswith("all done")
    # Each tool started once; the killed ones were not run again (nor finished).
    assert lines(ws / "started") == ["0", "1", "2", "3", "4"]
    assert lines(ws / "counter") == ["0", "2", "4"]
    # Only the requests in flight at a kill were made twice; no journaled one again.
    assert model.seen == {t: 2 for t in range(TOOLS + 1)}
    last = llm.requests[-1].json
    results = tool_results(last)
    assert results[1] == results[3] == KILLED
    with d.client() as c:
        history = c.history(sid).turns
        assert len(history) == 1 and history[0].outcome == "done" and history[0].reply.endswith("all done")
        assert [r["reason"] for r in history[0].resumed] == ["crashed"] * kills
        reasons = [e.event.reason for e in c.logs(sid).entries if isinstance(e.event, m.StateChanged)]
        assert sum("turn 1 resumed after crashed" in r for r in reasons) == kills
        st = c.status(sid)
        assert st.turns == 1 and st.state == "idle"


def resumed_after_daemon_kill(d: Daemon, sid: str, send: subprocess.Popen[str]) -> Any:
    """SIGKILL the daemon during `send`'s turn and start it again: the turn
    resumes by itself, and `send` waits for the daemon, attaches again and
    sees its turn end, exit 0 (README, "What a crash costs"); the turn's
    entry in `history`."""
    d.kill()
    d.start()
    out, err = send.communicate(timeout=60)
    assert send.returncode == 0, err
    assert "turn resumed" in err, err
    with d.client() as c:
        wait_for(lambda: c.history(sid).turns[-1].outcome == "done", 30, "the turn to resume and end")
        return c.history(sid).turns[-1]


def test_a_daemon_killed_mid_tool_resumes_the_turn_by_itself(make_daemon, llm: FakeLLM) -> None:
    d = make_daemon(agent_config(llm))
    model = Model(llm, slow=frozenset({2}))
    with d.client() as c:
        sid = c.create().id
    send = send_in_background(d, sid, "count to five")
    ws = d.workspace(sid)
    wait_for(lambda: "2" in lines(ws / "started"), 15, "tool 2 to start")
    turn = resumed_after_daemon_kill(d, sid, send)
    assert turn.turn == 1 and turn.reply.endswith("all done")
    assert [r["reason"] for r in turn.resumed] == ["daemon_stopped"]
    assert lines(ws / "counter") == ["0", "1", "3", "4"]
    assert lines(ws / "started") == ["0", "1", "2", "3", "4"]
    assert all(n == 1 for n in model.seen.values()), model.seen
    assert tool_results(llm.requests[-1].json)[2].startswith("error: the daemon stopped while this tool")


def test_a_memory_bomb_in_a_tool_becomes_that_tools_result(make_daemon, llm: FakeLLM) -> None:
    d = make_daemon(agent_config(llm))
    Model(llm, bomb=4)
    with d.client() as c:
        sid = c.create(settings={"agent.limits.max_memory_mb": 64}).id
        events = list(c.send(sid, "count to five"))
        done = events[-1]
        assert isinstance(done, m.TurnDone) and done.turn == 1 and done.reply.endswith("all done")
        resumed = [e for e in events if isinstance(e, m.Notice) and e.kind == "turn_resumed"]
        assert [(e.data["reason"], e.data["running"]) for e in resumed] == [("killed_memory", "tool:bash:c4")]
        assert c.status(sid).last_exit.reason == "killed_memory"
    assert tool_results(llm.requests[-1].json)[4] == "error: the tool was killed: memory cap of 64 MiB reached"
    assert lines(d.workspace(sid) / "counter") == ["0", "1", "2", "3"]


def test_a_custom_handler_killed_after_each_of_its_steps(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:three_steps").id
    ws = d.workspace(sid)
    send = send_in_background(d, sid, "hello")
    for n in range(3):
        wait_for(lambda: (ws / f"after-{n}").exists(), 15, f"step {n}")
        kill_worker(d, sid)
    out, err = send.communicate(timeout=30)
    assert send.returncode == 0, err
    assert out.strip() == "1: ABC hello"
    assert lines(ws / "counter") == ["a", "b", "c"]  # each step ran once
    # A step over the operator's cap fails the turn, naming the key.
    with d.client() as c:
        big = c.create(handler="fixture_handlers:big_step", settings={"agent.worker.max_step_kb": 1}).id
        assert c.send_text(big, "100") == "100"
        failed = list(c.send(big, "5000"))[-1]
        assert isinstance(failed, m.TurnFailed) and "agent.worker.max_step_kb" in failed.reason
