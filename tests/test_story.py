"""A stored turn told as it was seen live (supervisor/api/story.py): the
records of one agent turn read back as the events its clients got, in
their order, markers where they happened (pure)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from ipc import messages as m
from supervisor.api.story import tell
from supervisor.store.state_store import Abort, Answered, Asked, Commit, LifeEvent, Resume, Step

pytestmark = pytest.mark.pure

_enc = msgspec.msgpack.Encoder()


def _record(ops: list[dict[str, Any]], **extra: Any) -> bytes:
    return _enc.encode({"v": 1, "ops": [{"op": "append", "message": msg} for msg in ops], **extra})


def _call(cid: str, name: str, args: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


OPS = [
    {"role": "user", "content": "go"},
    {"role": "assistant", "content": "Looking.", "tool_calls": [_call("c1", "bash", '{"command": "ls"}')]},
    {"role": "tool", "tool_call_id": "c1", "content": "a\nb"},
    {"role": "assistant", "content": None, "tool_calls": [_call("c2", "list_dir", '{"path": "/x"}')]},
    {"role": "tool", "tool_call_id": "c2", "content": "error: outside the workspace"},
    {"role": "assistant", "content": "done"},
]


def _life(event: Any) -> LifeEvent:
    return LifeEvent(at=1.0, seq=event.seq, event=_enc.encode(event))


def _shape(events: list[m.Event]) -> list[str]:
    out = []
    for e in events:
        match e:
            case m.TextDelta(text=text):
                out.append(f"text {text!r}")
            case m.Notice(kind="tool_result", data=data):
                out.append(f"result {data['id']} {data.get('ok', 'unknown')}")
            case m.Notice(kind="tool_call", data=data):
                out.append(f"call {data['id']}")
            case m.Notice(kind=kind):
                out.append(kind)
            case m.PermissionRequest(request_id=rid):
                out.append(f"ask {rid}")
            case m.StateChanged(new=new):
                out.append(f"state {new}")
            case _:
                out.append(type(e).__name__)
    return out


def test_a_turn_with_an_ask_a_failed_tool_and_a_crash_in_a_tool_reads_as_it_ran() -> None:
    crashed = m.StateChanged(session="s", seq=9, old="running", new="crashed", reason="signal 9")
    restarting = m.StateChanged(session="s", seq=10, old="crashed", new="restarting")
    between = [
        Step(turn=1, n=0, key="llm:1"),
        Asked(turn=1, request_id="r1", tool="bash", arguments={"command": "ls"}, at=2.0),
        Answered(turn=1, request_id="r1", allowed=True, at=3.0, uid=1000, client="sessionctl-web"),
        Step(turn=1, n=1, key="tool:bash:c1"),
        Step(turn=1, n=2, key="llm:2"),
        _life(crashed), _life(restarting),  # the worker died in list_dir
        Resume(turn=1, step=3, reason="crashed", cause="the worker crashed", running="tool:list_dir:c2"),
        Step(turn=1, n=3, key="tool:list_dir:c2"),
        Step(turn=1, n=4, key="llm:3"),
    ]
    end = Commit(turn=1, reply="Looking.\n\ndone", record=_record(OPS, tool_ok={"c1": True, "c2": False}))
    events = tell("s", 1, between, end)
    assert _shape(events) == [
        "text 'Looking.'", "call c1", "ask r1", "permission_answered", "result c1 True",
        "call c2", "state crashed", "state restarting", "turn_resumed", "result c2 False", "text '\\n\\ndone'",
    ]
    assert "".join(e.text for e in events if isinstance(e, m.TextDelta)) == end.reply
    answered = next(e for e in events if isinstance(e, m.Notice) and e.kind == "permission_answered")
    assert answered.data == {"request_id": "r1", "tool": "bash", "allowed": True, "uid": 1000,
                             "client": "sessionctl-web", "at": 3.0}
    resumed = next(e for e in events if isinstance(e, m.Notice) and e.kind == "turn_resumed")
    assert resumed.data == {"reason": "crashed", "cause": "the worker crashed", "step": 3,
                            "running": "tool:list_dir:c2"}
    assert [e.seq for e in events if isinstance(e, m.StateChanged)] == [9, 10]  # (kept: the logs' entries)
    assert all(e.session == "s" and getattr(e, "turn", 1) == 1 for e in events)


def test_a_crash_between_steps_is_marked_before_the_next_one() -> None:
    crashed = m.StateChanged(session="s", seq=5, old="running", new="crashed")
    between = [Step(turn=1, n=0, key="llm:1"), Step(turn=1, n=1, key="tool:bash:c1"), _life(crashed),
               Resume(turn=1, step=2, reason="crashed", running="llm:2")]
    ops = OPS[:3] + [{"role": "assistant", "content": "done"}]
    events = tell("s", 1, between, Commit(turn=1, reply="Looking.\n\ndone", record=_record(ops)))
    assert _shape(events) == ["text 'Looking.'", "call c1", "result c1 unknown", "state crashed", "turn_resumed",
                              "text '\\n\\ndone'"]


def test_an_old_record_says_no_outcome_and_another_handler_s_turn_is_its_reply() -> None:
    events = tell("s", 2, [], Commit(turn=2, reply="x", record=_record(OPS[:3])))
    [result] = [e for e in events if isinstance(e, m.Notice) and e.kind == "tool_result"]
    assert "ok" not in result.data  # unknown, not a success
    echo = tell("s", 2, [Step(turn=2, n=0, key="mine"), _life(m.LimitExceeded(session="s", seq=3, kind="memory",
                                                                              value=70, limit=64))],
                Commit(turn=2, reply="2: hi", record=_enc.encode(2)))
    assert _shape(echo) == ["LimitExceeded", "text '2: hi'"]  # (its reply came at its end)
    aborted = tell("s", 3, [Asked(turn=3, request_id="r9", tool="bash")], Abort(turn=3, reason="killed"))
    assert _shape(aborted) == ["ask r9"]  # asked, never answered: the turn's end says the rest


def test_a_limit_that_ends_the_turn_comes_before_its_closing_note() -> None:
    """max_turns: the calls the last response asked for are answered as not
    run, the limit is hit, then the note closes the reply (as it came live)."""
    ops = [*OPS[:2], {"role": "tool", "tool_call_id": "c1", "content": "error: not run: at most 1 model calls"},
           {"role": "assistant", "content": "[Stopped: reached the limit]"}]
    limit = m.LimitExceeded(session="s", seq=4, kind="turns", value=1, limit=1)
    events = tell("s", 1, [Step(turn=1, n=0, key="llm:1"), _life(limit)],
                  Commit(turn=1, reply="Looking.\n\n[Stopped: reached the limit]", record=_record(ops)))
    assert _shape(events) == ["text 'Looking.'", "call c1", "result c1 unknown", "LimitExceeded",
                              "text '\\n\\n[Stopped: reached the limit]'"]
