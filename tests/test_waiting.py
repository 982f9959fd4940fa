"""A session waiting on a person is visible everywhere (component tier: the
daemon's core over the in-process spawner and the in-memory store).

A worker asks a permission: `SessionInfo.waiting` names the request (tool,
since when, its id) while the state stays `running`; a client that attaches
afterwards, live or from a seq the ring no longer holds, gets the request
all the same; the answer says who gave it and when, as an event and as a
record for `history`; a request out of bounds is denied unasked."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fakespawner import FakeWorker
from ipc import messages as m
from supervisor.core.asks import MAX_PENDING
from supervisor.store.state_store import Answered, Asked
from polling import until
from test_core_component import FAST, Recorder, _core, _run, _worker

pytestmark = pytest.mark.component


def _asker(w: FakeWorker, msg: m.ToWorker) -> bool:
    """On an input: ask before running `bash`; on the answer: the turn ends."""
    match msg:
        case m.Input(turn=turn, text=text):
            w.send(m.AskPermission(turn=turn, request_id=f"r{turn}", tool="bash", arguments={"command": text}))
            return True
        case m.PermissionAnswer(request_id=rid, allow=allow):
            w.send(m.Done(turn=int(rid[1:]), reply="ran" if allow else "refused"))
            return True
    return False


def test_a_waiting_session_says_so_and_a_late_client_sees_the_request(tmp_path: Path) -> None:
    mgr, spawner, store = _core(tmp_path, {**FAST, "daemon": {**FAST["daemon"], "event_retention": 16}})

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        _worker(spawner, session).behaviour = _asker
        before = time.time()
        await mgr.send(session, "ls /", None)
        await until(lambda: mgr.info(session).waiting, "the request")
        info = mgr.info(session)
        assert info.state == "running"  # (scripts' states unchanged)
        [waiting] = info.waiting
        assert (waiting.request_id, waiting.tool, waiting.turn) == ("r1", "bash", 1)
        assert before <= waiting.since <= time.time() and waiting.seq > 0

        # Attached after the request: live only, and from before what the
        # ring still holds (events since pushed it out); one attached from
        # after it has seen it.
        for i in range(20):
            mgr.events.emit(session, m.Notice(session="s", seq=mgr.events.next_seq(session), turn=1, kind=f"n{i}"))
        live, late, seen = Recorder(), Recorder(), Recorder()
        mgr.attach(session, live, None)
        mgr.attach(session, late, 0)
        mgr.attach(session, seen, waiting.seq + 1)
        for client in (live, late):
            [request] = client.of(m.PermissionRequest)
            assert (request.request_id, request.seq, request.arguments) == ("r1", waiting.seq, {"command": "ls /"})
        assert isinstance(late.events[0], m.Gap) and late.events[1] == request  # (then the ring's)
        assert seen.of(m.PermissionRequest) == []

        mgr.answer(session, "r1", True, 1000, "sessionctl")
        await until(lambda: live.of(m.TurnDone), "the turn's end")
        assert live.of(m.TurnDone)[0].reply == "ran"
        [answered] = [n for n in live.of(m.Notice) if n.kind == "permission_answered"]
        assert answered.turn == 1
        data = answered.data
        assert (data["request_id"], data["tool"], data["allowed"], data["uid"], data["client"]) == (
            "r1", "bash", True, 1000, "sessionctl")
        assert before <= data["at"] <= time.time()
        assert mgr.info(session).waiting == []
        # Kept for history: the request and its answer, in the turn.
        _, records = store.load("s")[0].read_history()
        asked = [r for r in records if isinstance(r, Asked)]
        got = [r for r in records if isinstance(r, Answered)]
        assert [(r.turn, r.request_id, r.tool, r.arguments) for r in asked] == [(1, "r1", "bash", {"command": "ls /"})]
        assert [(r.turn, r.request_id, r.allowed, r.uid, r.client) for r in got] == [(1, "r1", True, 1000, "sessionctl")]

    _run(body)


def test_a_request_out_of_bounds_is_denied_unasked(tmp_path: Path) -> None:
    mgr, spawner, _ = _core(tmp_path)

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        worker = _worker(spawner, session)
        answers: list[m.PermissionAnswer] = []

        def flood(w: FakeWorker, msg: m.ToWorker) -> bool:
            if isinstance(msg, m.Input):
                for i in range(MAX_PENDING + 1):
                    w.send(m.AskPermission(turn=msg.turn, request_id=f"q{i}", tool="bash"))
                w.send(m.AskPermission(turn=msg.turn, request_id="q0", tool="bash"))  # a repeat
                w.send(m.AskPermission(turn=msg.turn, request_id="x" * 201, tool="bash"))
                w.send(m.AskPermission(turn=msg.turn, request_id="", tool="bash"))
                return True
            if isinstance(msg, m.PermissionAnswer):
                answers.append(msg)
                return True
            return False

        worker.behaviour = flood
        await mgr.send(session, "go", None)
        await until(lambda: len(answers) == 4, "the refusals")
        assert all(not a.allow for a in answers)
        assert [a.request_id for a in answers] == [f"q{MAX_PENDING}", "q0", "x" * 201, ""]
        assert len(mgr.info(session).waiting) == MAX_PENDING
        with pytest.raises(Exception, match=r"no pending permission request 'nope' \(pending: q0, q1"):
            mgr.answer(session, "nope", True)

    _run(body)


def test_a_turn_that_ends_leaves_nothing_waiting(tmp_path: Path) -> None:
    mgr, spawner, _ = _core(tmp_path, FAST)

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        worker = _worker(spawner, session)
        worker.behaviour = _asker
        await mgr.send(session, "ls", None)
        await until(lambda: mgr.info(session).waiting, "the request")
        worker.exit(sig=9)  # its worker dies while it waits: the turn fails (echo keeps no steps)
        await until(lambda: session.current_turn is None, "the turn's end")
        assert mgr.info(session).waiting == []

    _run(body)


def test_the_metrics_count_the_sessions_waiting_on_a_person(tmp_path: Path) -> None:
    from supervisor.ops.metrics import PrometheusRecorder

    mgr, spawner, _ = _core(tmp_path)

    def gauges() -> dict[str, float]:
        text = PrometheusRecorder(lambda: mgr.sessions.values(), lambda: 0).exposition()[0].decode()
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith(("sessiond_sessions_waiting", "sessiond_permission_wait_seconds"))}

    async def body() -> None:
        asking, quiet = [await mgr.create(1000, sid, "echo", {}) for sid in ("a", "b")]
        assert gauges() == {"sessiond_sessions_waiting": 0, "sessiond_permission_wait_seconds": 0}
        _worker(spawner, asking).behaviour = _asker
        await mgr.send(asking, "ls", None)
        await mgr.send(quiet, "hi", None)
        await until(lambda: mgr.info(asking).waiting, "the request")
        got = gauges()
        assert got["sessiond_sessions_waiting"] == 1 and got["sessiond_permission_wait_seconds"] >= 0
        mgr.answer(asking, "r1", False)
        assert gauges()["sessiond_sessions_waiting"] == 0

    _run(body)
