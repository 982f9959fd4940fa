"""Steps that overlap, through the real daemon: three tool calls of one
response run at once and end in reverse order.

The agent (`[tools] parallel = ["bash"]`) against a scripted LLM on
loopback whose answer follows from the conversation: one response with
three `bash` calls, each appending `start X` to a counter file in the
workspace, waiting for its gate file, then appending `end X`; then a final
answer.  The test opens the gates in reverse order and SIGKILLs the worker
while all three are in flight, while one has ended and two are in flight,
and during the next LLM call; then the daemon, with one ended and during
the next LLM call.  Each time the client's one `send` ends in `turn_done`
and exits 0, no journaled LLM request is made again, no tool that ended
runs again, and the ones in flight reach the model as killed.  A custom handler's three `ctx.step`s at
once (asyncio.gather) the same way."""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import Any

import pytest

from fakellm import FakeLLM, Hang, Response, Stream, text_stream, tool_call_stream
from harness import Daemon, wait_for
from supervisor.store.logscan import read_scan
from supervisor.store.state_store import Step
from test_agent_e2e import agent_config, tool_results
from test_steps_e2e import kill_worker, resumed_after_daemon_kill, send_in_background

pytestmark = pytest.mark.process

KILLED = "error: the worker crashed (signal SIGKILL) while this tool ran; it may or may not have completed"
DAEMON = "error: the daemon stopped while this tool was starting or running; it may or may not have completed"
CONFIG = """
[tools]
parallel = ["bash"]
rerun_after_crash = []
"""


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test-secret-123")


class Model:
    """For input TEXT: three bash calls TEXT0..TEXT2 (each waits for its
    gate `go-TEXTi`), then "done TEXT".  Inputs in `hold` have their second
    request hang the first time (to be killed in).  `seen` counts the
    requests by (input, tool results so far)."""

    def __init__(self, llm: FakeLLM, hold: frozenset[str] = frozenset()) -> None:
        self.seen: collections.Counter[tuple[str, int]] = collections.Counter()
        self.hold = hold
        self.lock = threading.Lock()
        llm.respond = self

    def __call__(self, request: dict[str, Any]) -> Response:
        messages = request["messages"]
        last_user = max(i for i, msg in enumerate(messages) if msg["role"] == "user")
        text = messages[last_user]["content"]
        t = sum(1 for msg in messages[last_user:] if msg["role"] == "tool")
        with self.lock:
            self.seen[(text, t)] += 1
            first = self.seen[(text, t)] == 1
        if t == 0:
            return tool_call_stream(*[(f"{text}{i}", "bash", {"command": _command(f"{text}{i}")}) for i in range(3)])
        if text in self.hold and first:
            return Stream([Hang()])
        return text_stream(f"done {text}")


def _command(name: str) -> str:
    return (f"echo 'start {name}' >> counter; while [ ! -e go-{name} ]; do sleep 0.01; done; "
            f"echo 'end {name}' >> counter; echo ran {name}")


def ran(name: str) -> str:
    return f"ran {name}\n[exit code: 0]"


def counter(ws: Path) -> list[str]:
    return (ws / "counter").read_text().splitlines() if (ws / "counter").exists() else []


def journaled(d: Daemon, sid: str, key: str) -> bool:
    """Whether the daemon has appended step `key`'s end (what a worker that
    dies now has handed over)."""
    return any(isinstance(rec, Step) and rec.key == key
               for log in (d.state_dir / "sessions" / sid).glob("log.*") for _, _, rec in read_scan(log).records)


def end_in_reverse(d: Daemon, sid: str, ws: Path, text: str, count: int = 3) -> None:
    """Open the gates of TEXT2, TEXT1, TEXT0 (the first `count`), each once
    the one before has ended and been handed to the daemon."""
    for i in (2, 1, 0)[:count]:
        (ws / f"go-{text}{i}").touch()
        wait_for(lambda: journaled(d, sid, f"tool:bash:{text}{i}"), 15, f"tool {text}{i} to end")


def started(ws: Path, text: str) -> bool:
    return all(f"start {text}{i}" in counter(ws) for i in range(3))


def finish(send: Any) -> str:
    out, err = send.communicate(timeout=60)
    assert send.returncode == 0, err
    return out


def test_three_tool_calls_at_once_survive_their_worker_killed_at_each_point(make_daemon, llm: FakeLLM) -> None:
    d = make_daemon(agent_config(llm, CONFIG))
    model = Model(llm, hold=frozenset({"next"}))
    with d.client() as c:
        sid = c.create().id
    ws = d.workspace(sid)

    # No kill: they run at once, end in reverse order, the model reads the results in call order.
    send = send_in_background(d, sid, "calm")
    wait_for(lambda: started(ws, "calm"), 15, "three tools in flight")
    end_in_reverse(d, sid, ws, "calm")
    assert finish(send).rstrip().endswith("done calm")
    # (Three processes at once: they start in any order.)
    assert sorted(counter(ws)[:3]) == ["start calm0", "start calm1", "start calm2"]
    assert counter(ws)[3:] == ["end calm2", "end calm1", "end calm0"]
    assert tool_results(llm.requests[-1].json) == [ran("calm0"), ran("calm1"), ran("calm2")]

    # Killed with all three in flight: none runs again; each is reported killed.
    send = send_in_background(d, sid, "all")
    wait_for(lambda: started(ws, "all"), 15, "three tools in flight")
    kill_worker(d, sid)
    assert finish(send).rstrip().endswith("done all")
    assert tool_results(llm.requests[-1].json)[-3:] == [KILLED] * 3

    # Killed with one ended, two in flight: the ended one replays.
    send = send_in_background(d, sid, "one")
    wait_for(lambda: started(ws, "one"), 15, "three tools in flight")
    end_in_reverse(d, sid, ws, "one", count=1)
    kill_worker(d, sid)
    assert finish(send).rstrip().endswith("done one")
    assert tool_results(llm.requests[-1].json)[-3:] == [KILLED, KILLED, ran("one2")]

    # Killed during the next LLM call: the three replay, that call is made again.
    send = send_in_background(d, sid, "next")
    wait_for(lambda: started(ws, "next"), 15, "three tools in flight")
    end_in_reverse(d, sid, ws, "next")
    wait_for(lambda: model.seen[("next", 3)] == 1, 15, "the next LLM call")
    kill_worker(d, sid)
    assert finish(send).rstrip().endswith("done next")
    assert tool_results(llm.requests[-1].json)[-3:] == [ran("next0"), ran("next1"), ran("next2")]

    # Each tool started once; none that ended ran again; no journaled request was made again.
    for text, ended in (("all", []), ("one", [2]), ("next", [2, 1, 0])):
        of = [x for x in counter(ws) if x.endswith(tuple(f"{text}{i}" for i in range(3)))]
        assert sorted(of[:3]) == [f"start {text}{i}" for i in range(3)]
        assert of[3:] == [f"end {text}{i}" for i in ended]
    assert model.seen == {**{(t, 0): 1 for t in ("calm", "all", "one", "next")},
                          **{(t, 3): 1 for t in ("calm", "all", "one")}, ("next", 3): 2}
    with d.client() as c:
        turns = c.history(sid).turns
        assert [t.outcome for t in turns] == ["done"] * 4
        assert [[r["reason"] for r in t.resumed] for t in turns] == [[], ["crashed"], ["crashed"], ["crashed"]]


def test_three_tool_calls_at_once_survive_a_daemon_kill(make_daemon, llm: FakeLLM) -> None:
    d = make_daemon(agent_config(llm, CONFIG))
    model = Model(llm, hold=frozenset({"later"}))
    with d.client() as c:
        sid = c.create().id
    ws = d.workspace(sid)
    send = send_in_background(d, sid, "gone")
    wait_for(lambda: started(ws, "gone"), 15, "three tools in flight")
    end_in_reverse(d, sid, ws, "gone", count=1)
    turn = resumed_after_daemon_kill(d, sid, send)
    assert turn.reply.endswith("done gone") and [r["reason"] for r in turn.resumed] == ["daemon_stopped"]
    assert tool_results(llm.requests[-1].json) == [DAEMON, DAEMON, ran("gone2")]
    assert sorted(counter(ws)[:3]) == ["start gone0", "start gone1", "start gone2"]
    assert counter(ws)[3:] == ["end gone2"]
    # Killed during the next LLM call: the three replay, the call is made again.
    send = send_in_background(d, sid, "later")
    wait_for(lambda: started(ws, "later"), 15, "three tools in flight")
    end_in_reverse(d, sid, ws, "later")
    wait_for(lambda: model.seen[("later", 3)] == 1, 15, "the next LLM call")
    assert resumed_after_daemon_kill(d, sid, send).reply.endswith("done later")
    assert tool_results(llm.requests[-1].json)[-3:] == [ran("later0"), ran("later1"), ran("later2")]
    assert counter(ws)[7:] == ["end later2", "end later1", "end later0"]
    assert model.seen == {("gone", 0): 1, ("gone", 3): 1, ("later", 0): 1, ("later", 3): 2}


def test_a_custom_handler_s_steps_at_once_survive_worker_and_daemon_kills(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:parallel_steps").id
    ws = d.workspace(sid)

    def gate(name: str) -> None:
        (ws / f"go-{name}").touch()
        wait_for(lambda: f"end {name}" in counter(ws), 15, f"step {name} to end")

    # One ended (c), two in flight: c replays, a and b are answered, "last" runs.
    send = send_in_background(d, sid, "w")
    wait_for(lambda: all(f"start w{x}" in counter(ws) for x in "abc"), 15, "three steps in flight")
    gate("wc")
    wait_for(lambda: journaled(d, sid, "c"), 15, "step c handed over")
    kill_worker(d, sid)
    wait_for(lambda: "start wlast" in counter(ws), 15, "the step after them")
    (ws / "go-wlast").touch()
    assert finish(send).strip() == "a:crashed b:crashed C LAST"
    # The daemon killed with all three in flight: each answered, none run again.
    send = send_in_background(d, sid, "d")
    wait_for(lambda: all(f"start d{x}" in counter(ws) for x in "abc"), 15, "three steps in flight")
    (ws / "go-dlast").touch()  # (the step after them: it cannot start before they end)
    turn = resumed_after_daemon_kill(d, sid, send)
    assert turn.reply == "a:daemon_stopped b:daemon_stopped c:daemon_stopped LAST"
    assert counter(ws) == ["start wa", "start wb", "start wc", "end wc", "start wlast", "end wlast",
                           "start da", "start db", "start dc", "start dlast", "end dlast"]
