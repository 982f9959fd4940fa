"""The agent handler through the real daemon, against a scripted LLM server
on loopback: tools, permissions, compaction across a worker crash,
sub-agents, interrupts."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from fakellm import Delay, FakeLLM, Hang, Stream, chunk, text_stream, tool_call_stream
from harness import wait_for
from ipc import messages as m

pytestmark = pytest.mark.process


def agent_config(llm: FakeLLM, extra: str = "", key_env: str | None = "SESSIOND_TEST_KEY") -> str:
    """A daemon whose sessions run the agent against `llm`; `extra` is TOML
    appended at the end (tables of its own)."""
    key = f'api_key_env = "{key_env}"' if key_env else ""
    return f"""
[agent]
handler = "agent"
[agent.worker]
heartbeat_interval_secs = 0.2
restart_backoff_initial_ms = 20
[provider]
base_url = "{llm.base_url}"
model = "test-model"
{key}
retry_backoff_initial_ms = 1
[daemon]
stop_grace_secs = 1.0
{extra}
"""


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test-secret-123")


def tool_results(request_json: dict) -> list[str]:
    return [msg["content"] for msg in request_json["messages"] if msg["role"] == "tool"]


def test_write_then_read_then_answer(make_daemon, llm: FakeLLM) -> None:
    d = make_daemon(agent_config(llm))
    llm.script(
        tool_call_stream(("c1", "write_file", {"path": "notes/a.txt", "content": "forty-two"})),
        tool_call_stream(("c2", "read_file", {"path": "notes/a.txt"})),
        text_stream("The file says ", "forty-two."),
    )
    with d.client() as c:
        info = c.create()
        assert info.handler == "agent"
        events = list(c.send(info.id, "store and read back"))
        done = events[-1]
        assert isinstance(done, m.TurnDone) and done.reply == "The file says forty-two."
        notices = [e.kind for e in events if isinstance(e, m.Notice)]
        assert notices.count("tool_call") == 2 and notices.count("tool_result") == 2
    reqs = llm.requests
    assert len(reqs) == 3
    assert "forty-two" in tool_results(reqs[2].json)[-1]
    headers = {k.lower(): v for k, v in reqs[0].headers.items()}
    assert headers["authorization"] == "Bearer sk-test-secret-123"
    assert (d.workspace(info.id) / "notes" / "a.txt").read_text() == "forty-two"
    # The key is nowhere in the session's state on disk.
    for path in (d.state_dir / "sessions" / info.id).iterdir():
        assert b"sk-test-secret-123" not in path.read_bytes()


def test_bash_denied_and_asked_then_approved(make_daemon, llm: FakeLLM) -> None:
    extra = """
[[permissions]]
tool = "bash"
match = "rm *"
action = "deny"
[[permissions]]
tool = "bash"
match = "*"
action = "ask"
"""
    d = make_daemon(agent_config(llm, extra))
    llm.script(
        tool_call_stream(("c1", "bash", {"command": "rm -rf /"})),
        tool_call_stream(("c2", "bash", {"command": "echo approved-$((6*7))"})),
        text_stream("done"),
    )
    with d.client() as c, d.client() as approver:
        sid = c.create().id
        answered = []
        for ev in c.send(sid, "go"):
            if isinstance(ev, m.PermissionRequest):
                assert ev.tool == "bash" and ev.arguments["command"].startswith("echo")
                approver.answer(sid, ev.request_id, True)
                answered.append(ev.request_id)
            last = ev
        assert isinstance(last, m.TurnDone) and last.reply == "done"
        assert len(answered) == 1
        with pytest.raises(Exception):
            approver.answer(sid, answered[0], True)  # no longer pending
    results = tool_results(llm.requests[2].json)
    assert "denied" in results[0].lower()
    assert "approved-42" in results[1]


def test_interrupt_mid_stream_keeps_partial_text_and_a_valid_history(make_daemon, llm: FakeLLM) -> None:
    d = make_daemon(agent_config(llm))
    llm.script(
        Stream([chunk({"content": "partial "}), chunk({"content": "answer"}), Hang()]),
        text_stream("next reply"),
    )
    with d.client() as c, d.client() as c2:
        sid = c.create().id
        stream = c.send(sid, "start")
        got = ""
        for ev in stream:
            if isinstance(ev, m.TextDelta):
                got += ev.text
                if got == "partial answer":
                    c2.interrupt(sid)
            if isinstance(ev, m.TurnDone):
                assert ev.interrupted and ev.reply.startswith("partial answer")
                break
        assert c.send_text(sid, "continue") == "next reply"
    second = llm.requests[1].json["messages"]
    assert any(msg["role"] == "assistant" and "partial answer" in (msg.get("content") or "") for msg in second)


def test_provider_errors_fail_the_turn_readably(make_daemon, llm: FakeLLM) -> None:
    from fakellm import Reply

    d = make_daemon(agent_config(llm))
    llm.script(Reply(400, {"error": {"message": "model does not exist"}}))
    with d.client() as c:
        sid = c.create().id
        events = list(c.send(sid, "hi"))
        assert isinstance(events[-1], m.TurnFailed) and "model does not exist" in events[-1].reason
        assert "sk-test" not in events[-1].reason


def test_compaction_survives_a_worker_crash(make_daemon, llm: FakeLLM) -> None:
    extra = "[agent.loop]\ncompaction_threshold_tokens = 1000\ncompaction_keep_recent_turns = 1\n[tools]\nenabled = []\n"
    d = make_daemon(agent_config(llm, extra))
    long = "lorem ipsum " * 60  # ~180 tokens a message
    with d.client() as c:
        sid = c.create().id
        for i in range(3):
            llm.script(text_stream(f"reply {i} " + long))
            c.send_text(sid, f"question {i} " + long)
        # The next call crosses the threshold: a summary request, then the answer.
        llm.script(text_stream("SUMMARY-OF-EARLIER-TURNS"), text_stream("after compaction"))
        events = list(c.send(sid, "question 3"))
        assert any(isinstance(e, m.Notice) and e.kind == "compaction" for e in events)
        assert events[-1].reply == "after compaction"
        compacted = llm.requests[-1].json["messages"]
        old = c.status(sid).pid
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: c.status(sid).state == "idle" and c.status(sid).pid != old, 10, "restart")
        llm.script(text_stream("restored"))
        assert c.send_text(sid, "question 4") == "restored"
    restored = llm.requests[-1].json["messages"]
    # Same compacted context as before the crash, plus the new turn.
    assert restored[: len(compacted)] == compacted
    assert [msg["role"] for msg in restored[len(compacted):]] == ["assistant", "user"]
    flat = json.dumps(restored)
    assert "SUMMARY-OF-EARLIER-TURNS" in flat and "question 0" not in flat


def test_subagents_two_deep_with_limits(make_daemon, llm: FakeLLM) -> None:
    extra = "[agent.subagents]\nmax_depth = 2\nmax_total_spawns = 2\n"
    d = make_daemon(agent_config(llm, extra))
    # Requests arrive in order: root, child, grandchild, ... each scripted below.
    llm.script(
        tool_call_stream(("r1", "spawn_agent", {"task": "child task"})),           # root
        tool_call_stream(("k1", "spawn_agent", {"task": "grandchild task"})),      # child
        text_stream("grandchild result"),                                           # grandchild
        text_stream("child saw: grandchild result"),                                # child
        tool_call_stream(("r2", "spawn_agent", {"task": "one too many"})),         # root again
        text_stream("root done"),                                                   # root
    )
    with d.client() as c:
        root = c.create(session="root").id
        events = list(c.send(root, "delegate"))
        assert isinstance(events[-1], m.TurnDone) and events[-1].reply == "root done"
        listed = {s.id: s for s in c.list()}
        child = next(s for s in listed.values() if s.parent == root)
        grandchild = next(s for s in listed.values() if s.parent == child.id)
        assert listed[root].children == [child.id] and child.children == [grandchild.id]
        ls = d.ctl("ls").stdout
        assert "└ " + grandchild.id in ls
    # The child's tool result carried the grandchild's reply; the third spawn was refused.
    assert "grandchild result" in tool_results(llm.requests[3].json)[-1]
    refused = tool_results(llm.requests[5].json)[-1]
    assert "max_total_spawns" in refused
    # The grandchild, at max depth, was not offered spawn_agent at all.
    offered = [t["function"]["name"] for t in llm.requests[2].json.get("tools", [])]
    assert "spawn_agent" not in offered
    # Deleting the parent deletes the tree.
    with d.client() as c:
        c.remove(root)
        assert c.list() == []


def test_no_provider_means_echo_and_a_log_line(make_daemon) -> None:
    d = make_daemon("[agent]\nhandler = \"agent\"\n")
    with d.client() as c:
        info = c.create()
        assert info.handler == "echo"
        assert c.send_text(info.id, "hi") == "1: hi"
    assert "no [provider] configured" in d.log


def test_a_crashing_subagent_is_a_clear_failure_for_its_parent(make_daemon, llm: FakeLLM) -> None:
    extra = '[agent.subagents]\nallowed_handlers = ["fixture_handlers:crash_mid_turn"]\n'
    d = make_daemon(agent_config(llm, extra))
    llm.script(
        tool_call_stream(("r0", "spawn_agent", {"task": "x", "handler": "os:system"})),
        tool_call_stream(("r1", "spawn_agent", {"task": "crash", "handler": "fixture_handlers:crash_mid_turn"})),
        text_stream("the helper died"),
    )
    with d.client() as c:
        root = c.create().id
        assert c.send_text(root, "delegate") == "the helper died"
        child = next(s for s in c.list() if s.parent == root)
        # The child was restarted by the usual rules and is usable.
        wait_for(lambda: c.status(child.id).state == "idle" and c.status(child.id).restarts == 1, 10)
        assert c.send_text(child.id, "ok") == "1: ok"
    refused = tool_results(llm.requests[1].json)[-1]
    assert "not allowed" in refused and "os:system" in refused
    result = tool_results(llm.requests[2].json)[-1]
    assert "failed" in result and "crashed" in result and "SIGKILL" in result


def test_sessionctl_send_asks_on_the_terminal(make_daemon, llm: FakeLLM) -> None:
    import pty
    import select
    import sys
    import time

    from harness import env_for_children

    extra = '[[permissions]]\ntool = "bash"\nmatch = "*"\naction = "ask"\n'
    d = make_daemon(agent_config(llm, extra))
    llm.script(tool_call_stream(("c1", "bash", {"command": "echo from-the-tool"})), text_stream("all done"))
    with d.client() as c:
        sid = c.create().id
    pid, fd = pty.fork()
    if pid == 0:  # sessionctl on a terminal
        env = env_for_children()
        os.execve(sys.executable, [sys.executable, "-m", "supervisor.ctl", "--socket", str(d.socket),
                                   "send", sid, "run it"], env)
    out = b""
    answered = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if not ready:
            continue
        try:
            data = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        out += data
        if not answered and b"[y/N]" in out:
            os.write(fd, b"y\n")
            answered = True
    _, status = os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    assert answered, (text, d.log[-2000:], [r.json for r in llm.requests])
    assert "allow bash" in text and "echo from-the-tool" in text
    assert "all done" in text and os.waitstatus_to_exitcode(status) == 0
    assert "from-the-tool" in tool_results(llm.requests[1].json)[-1]


def test_subagent_timeout_and_concurrency_limits(make_daemon, llm: FakeLLM) -> None:
    extra = """
[agent.subagents]
allowed_handlers = ["fixture_handlers:deaf"]
child_timeout_secs = 0.5
max_concurrent = 1
"""
    d = make_daemon(agent_config(llm, extra))
    llm.script(
        # Two spawns in one response.  The first child ignores interrupts:
        # it times out for its parent but is still running when the second
        # spawn comes, which max_concurrent = 1 refuses.
        tool_call_stream(
            ("s1", "spawn_agent", {"task": "x", "handler": "fixture_handlers:deaf"}),
            ("s2", "spawn_agent", {"task": "y", "handler": "fixture_handlers:deaf"}),
        ),
        text_stream("gave up"),
    )
    with d.client() as c:
        # Children inherit the parent's overrides, this turn timeout included.
        root = c.create(settings={"agent.turn_timeout_secs": 3}).id
        assert c.send_text(root, "delegate") == "gave up"
        children = [s for s in c.list() if s.parent == root]
        assert len(children) == 1
        # Its own turn timeout then kills it, and it restarts as usual.
        wait_for(lambda: c.status(children[0].id).last_exit is not None, 15, "the deaf child's kill")
        assert c.status(children[0].id).last_exit.reason == "killed_turn_timeout"
    results = tool_results(llm.requests[1].json)
    assert "child_timeout_secs=0.5" in results[0]
    assert "max_concurrent 1" in results[1]
