"""Budgets ([agent.budget]): ceilings on LLM calls and tokens per turn,
session and uid, checked before each LLM call; the scripted LLM server
counts the requests, so "no request after the crossing" is what it saw."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from fakellm import FakeLLM, Hang, Stream, chunk, fake_llm, text_stream, tool_call_stream
from ipc import messages as m
from ipc.budget import first_reached, standings
from ipc.settings import BudgetSettings
from session_worker.handler import TurnResult
from supervisor.core.overrides import OverrideError, resolve_overrides
from ipc.settings import SessionSettings
from test_agent_e2e import agent_config
from test_agent_support import AgentSettings, FakeCtx, make_handler, make_settings, run
from harness import wait_for
from test_metrics import parse, tcp_metrics_url, value

__all__ = ["fake_llm"]


def spending(stream: Stream, **usage: int) -> Stream:
    """`stream` with a usage chunk at its end, as OpenAI sends it."""
    stream.events.append({"choices": [], "usage": usage})
    return stream


def write(n: int, tokens: int) -> Stream:
    return spending(tool_call_stream((f"c{n}", "write_file", {"path": f"f{n}", "content": "x"})),
                    prompt_tokens=100, completion_tokens=tokens)


class BudgetCtx(FakeCtx):
    """FakeCtx with the daemon's figures (what the session and the uid's
    other sessions spent before this turn) and what it was told."""

    def __init__(self, *args: Any, spent: dict[str, int] | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.spent = spent or {}
        self.reports: list[dict[str, int]] = []
        self.budget: list[tuple[str, int, int, str]] = []

    def budget_spent(self) -> tuple[dict[str, int], dict[str, int]]:
        return self.spent, {}

    def report_spend(self, spend: dict[str, int]) -> None:
        self.reports.append(spend)

    def budget_exceeded(self, ceiling: str, used: int, limit: int, unit: str) -> None:
        self.budget.append((ceiling, used, limit, unit))


def agent_turn(llm: FakeLLM, ws: Path, budget: BudgetSettings, spent: dict[str, int] | None = None
               ) -> tuple[TurnResult, BudgetCtx]:
    settings = make_settings(llm, agent=AgentSettings(budget=budget))

    async def go() -> tuple[TurnResult, BudgetCtx]:
        handler = make_handler(settings, ws)
        ctx = BudgetCtx(settings, ws, spent=spent)
        try:
            return await handler.handle("go", ctx), ctx
        finally:
            await handler.aclose()

    return run(go())


@pytest.mark.pure
def test_what_counts_against_each_ceiling() -> None:
    budget = BudgetSettings(turn_max_llm_calls=3, session_max_output_tokens=50, uid_max_input_tokens=1000)
    turn, session, others = {"llm_calls": 2, "completion_tokens": 20}, {"completion_tokens": 29}, \
        {"prompt_tokens": 900}
    assert [(s.ceiling.rpartition(".")[2], s.used, s.limit) for s in standings(budget, turn, session, others)] == [
        ("turn_max_llm_calls", 2, 3), ("session_max_output_tokens", 49, 50), ("uid_max_input_tokens", 900, 1000)]
    assert first_reached(budget, turn, session, others) is None
    reached = first_reached(budget, turn, {"completion_tokens": 30}, others)
    assert reached is not None and reached.describe() == \
        "agent.budget.session_max_output_tokens = 50 tokens: 50 tokens spent"


@pytest.mark.pure
def test_an_override_may_lower_a_ceiling_never_raise_or_lift_it() -> None:
    base = SessionSettings(agent=AgentSettings(budget=BudgetSettings(session_max_output_tokens=1000)))
    lowered = resolve_overrides(base, {"agent.budget.session_max_output_tokens": 10,
                                       "agent.budget.turn_max_llm_calls": 4})
    assert lowered.settings.agent.budget.session_max_output_tokens == 10
    assert lowered.settings.agent.budget.turn_max_llm_calls == 4  # the operator set none: any tightens
    with pytest.raises(OverrideError, match="above the operator's limit of 1000"):
        resolve_overrides(base, {"agent.budget.session_max_output_tokens": 1001})
    with pytest.raises(OverrideError, match="cannot lift"):
        resolve_overrides(base, {"agent.budget.session_max_output_tokens": None})
    with pytest.raises(OverrideError, match="daemon-wide"):
        resolve_overrides(base, {"agent.budget.uid_max_input_tokens": 5})
    # A stored override above a lowered ceiling is pulled back at reload.
    clamped = resolve_overrides(base, {"agent.budget.session_max_output_tokens": 5000}, strict=False)
    assert clamped.settings.agent.budget.session_max_output_tokens == 1000


@pytest.mark.component
def test_a_token_ceiling_crossed_mid_turn_stops_at_the_next_llm_call(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(write(1, 20), write(2, 20))
    result, ctx = agent_turn(fake_llm, tmp_path / "ws", BudgetSettings(session_max_output_tokens=35),
                             spent={"completion_tokens": 5, "llm_calls": 1})
    assert len(fake_llm.requests) == 2  # 5 + 20 < 35 allowed the second; 5 + 40 >= 35 stops the third
    assert ctx.budget == [("agent.budget.session_max_output_tokens", 45, 35, "tokens")]
    assert result.record["limit"] == "budget" and "session_max_output_tokens" in result.reply
    assert (tmp_path / "ws" / "f2").exists()  # the second call's tool ran: the history stays whole
    assert ctx.reports == [{"prompt_tokens": 100, "completion_tokens": 20, "llm_calls": 1},
                           {"prompt_tokens": 200, "completion_tokens": 40, "llm_calls": 2}]
    assert result.usage == {"prompt_tokens": 200, "completion_tokens": 40}


@pytest.mark.component
def test_llm_call_ceilings_per_turn_and_per_session(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(write(1, 1), write(2, 1))
    _, ctx = agent_turn(fake_llm, tmp_path / "a", BudgetSettings(turn_max_llm_calls=2))
    assert len(fake_llm.requests) == 2 and ctx.budget == [("agent.budget.turn_max_llm_calls", 2, 2, "LLM calls")]
    # The session's earlier calls, as the daemon counts them, leave room for one.
    fake_llm.script(write(3, 1))
    _, ctx = agent_turn(fake_llm, tmp_path / "b", BudgetSettings(session_max_llm_calls=10), spent={"llm_calls": 9})
    assert len(fake_llm.requests) == 3 and ctx.budget == [("agent.budget.session_max_llm_calls", 10, 10, "LLM calls")]


@pytest.mark.process
def test_a_session_ceiling_through_the_daemon_status_and_metrics(make_daemon, llm: FakeLLM,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test")
    d = make_daemon(agent_config(llm, 'metrics_listen = "127.0.0.1:0"\n'
                                      "[agent.budget]\nsession_max_output_tokens = 25\n"))
    url = tcp_metrics_url(d)
    refused = d.ctl("create", "--set", "agent.budget.session_max_output_tokens=26")
    assert refused.returncode == 2 and "above the operator's limit of 25" in refused.stderr
    llm.script(write(1, 20), write(2, 10))
    sid = d.ctl("create").stdout.strip()
    sent = d.ctl("send", sid, "go")
    assert sent.returncode == 1, sent  # a turn a limit cut short, as max_turns
    assert "cut short by a limit: agent.budget.session_max_output_tokens" in sent.stderr
    assert len(llm.requests) == 2  # none after the crossing
    assert "limit budget: agent.budget.session_max_output_tokens = 25 tokens: 30 tokens spent" \
        in sent.stderr
    budget = json.loads(d.ctl("--json", "status", sid).stdout)["budget"]
    assert budget["spent"] == {"llm_calls": 2, "input_tokens": 200, "output_tokens": 30, "reasoning_tokens": 0}
    assert budget["ceilings"] == [{"ceiling": "agent.budget.session_max_output_tokens", "used": 30, "limit": 25,
                                   "unit": "tokens"}]
    assert "budget:    session_max_output_tokens 30 of 25 tokens" in d.ctl("status", sid).stdout
    assert "limit budget: agent.budget.session_max_output_tokens = 25 tokens: 30 tokens spent" \
        in d.ctl("logs", sid).stdout
    # The session is spent: its next input makes no request at all.
    assert d.ctl("send", sid, "again").returncode == 1 and len(llm.requests) == 2
    # A narrower ceiling a creator sets holds too: one call per turn.
    llm.script(write(3, 1))
    narrow = d.ctl("create", "--set", "agent.budget.turn_max_llm_calls=1").stdout.strip()
    assert d.ctl("send", narrow, "go").returncode == 1 and len(llm.requests) == 3
    samples = parse(httpx.get(url, timeout=5).text)
    assert value(samples, "sessiond_llm_calls_total") == 3
    assert value(samples, "sessiond_llm_tokens_total", kind="output") == 31
    assert value(samples, "sessiond_budget_exceeded_total", ceiling="session_max_output_tokens") == 2
    assert value(samples, "sessiond_budget_exceeded_total", ceiling="turn_max_llm_calls") == 1


@pytest.mark.process
def test_a_uid_ceiling_holds_across_sessions_running_at_once(make_daemon, llm: FakeLLM,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test")
    d = make_daemon(agent_config(llm, '[agent.budget]\nuid_max_llm_calls = 3\n'
                                      '[[permissions]]\ntool = "write_file"\naction = "ask"\n'))
    with d.client() as c, d.client() as other:
        a, b = c.create().id, c.create().id
        llm.script(write(1, 1))
        for ev in c.send(a, "go"):
            if isinstance(ev, m.PermissionRequest):
                # a's turn waits between its calls while b, same uid, spends the rest.
                llm.script(text_stream("b one"), text_stream("b two"))
                assert other.send_text(b, "one") == "b one" and other.send_text(b, "two") == "b two"
                other.answer(a, ev.request_id, True)
            last = ev
        assert isinstance(last, m.TurnDone) and "uid_max_llm_calls" in last.reply
        assert len(llm.requests) == 3  # a's second call was never made
        status = c.status(a).budget
        assert status["uid_spent"]["llm_calls"] == 3 and status["spent"]["llm_calls"] == 1
    # And a new session of the uid starts with nothing left.
    with d.client() as c:
        fresh = c.create().id
        events = list(c.send(fresh, "hello"))
        limit = next(e for e in events if isinstance(e, m.LimitExceeded))
        assert (limit.kind, limit.ceiling, limit.value, limit.limit) == ("budget", "agent.budget.uid_max_llm_calls", 3, 3)
        assert len(llm.requests) == 3


@pytest.mark.process
def test_a_resumed_turn_does_not_count_from_zero_nor_does_a_restarted_daemon(make_daemon, llm: FakeLLM,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker dies after two journaled LLM calls: the resumed turn
    replays them (no request) and counts them, so `turn_max_llm_calls = 3`
    leaves it one more; after a daemon SIGKILL the session's figure is
    what its turns spent, and `session_max_llm_calls = 4` one call more."""
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test")
    d = make_daemon(agent_config(llm, '[agent.budget]\nturn_max_llm_calls = 3\nsession_max_llm_calls = 4\n'
                                      '[[permissions]]\ntool = "write_file"\naction = "ask"\n'))
    llm.script(write(1, 7), write(2, 7), write(3, 7))
    with d.client() as c:
        sid = c.create().id
        asked = 0
        for ev in c.send(sid, "go"):
            if isinstance(ev, m.PermissionRequest):
                asked += 1
                if asked == 2:  # two paid calls journaled, the second's tool waiting
                    os.kill(c.status(sid).pid or 0, signal.SIGKILL)
                else:
                    c.answer(sid, ev.request_id, True)
            last = ev
        assert isinstance(last, m.TurnDone), last
        assert len(llm.requests) == 3  # calls 1 and 2 replayed, not made again; the 4th refused
        assert c.status(sid).budget["spent"]["llm_calls"] == 3
    d.kill()
    d.start()
    with d.client() as c:
        assert c.status(sid).budget["spent"]["llm_calls"] == 3
        llm.script(text_stream("the one call left"))
        assert c.send_text(sid, "again") == "the one call left"
        events = list(c.send(sid, "and again"))
        assert any(isinstance(e, m.LimitExceeded) and e.kind == "budget" for e in events)
    assert len(llm.requests) == 4


@pytest.mark.process
def test_workers_killed_during_llm_calls_never_push_requests_past_a_ceiling(make_daemon, llm: FakeLLM,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A chaos run: every LLM call hangs, and its worker is SIGKILLed while
    the request is in flight; the session restarts and its resumed turn
    calls again.  With `session_max_llm_calls = 10` the provider receives
    10 requests, not one more per kill: a call is counted durably as it
    begins, before its request goes out."""
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test")
    config = agent_config(llm, "[agent.budget]\nsession_max_llm_calls = 10\n").replace(
        "restart_backoff_initial_ms = 20",
        "restart_backoff_initial_ms = 20\nrestart_backoff_max_ms = 50\nmax_restart_attempts = 14")
    d = make_daemon(config)
    llm.respond = lambda body: Stream([chunk({"content": "x"}), Hang()])
    kills = 0
    with d.client() as c, d.client() as other:
        sid = c.create().id
        for ev in c.send(sid, "go"):
            if isinstance(ev, m.TextDelta) and ev.text == "x":  # a request is in flight: kill its worker
                pid = other.status(sid).pid
                assert pid, "a call in flight and no worker?"
                os.kill(pid, signal.SIGKILL)
                kills += 1
            last = ev
        assert len(llm.requests) == 10, f"the provider received {len(llm.requests)} requests"
        assert isinstance(last, m.TurnDone) and "session_max_llm_calls" in last.reply, last
        assert kills == 10
        assert other.status(sid).budget["spent"]["llm_calls"] == 10


@pytest.mark.process
def test_a_daemon_killed_during_an_llm_call_has_counted_it(make_daemon, llm: FakeLLM,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`session_max_llm_calls = 2`: the first call's worker is SIGKILLed,
    then the daemon itself during the second call.  Both were counted as
    they began: the turn the restarted daemon resumes makes no third."""
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test")
    d = make_daemon(agent_config(llm, "[agent.budget]\nsession_max_llm_calls = 2\n"))
    answered = iter([Stream([chunk({"content": "x"}), Hang()]), Stream([chunk({"content": "x"}), Hang()])])
    llm.respond = lambda body: next(answered, text_stream("a third call"))
    with d.client() as c, d.client() as other:
        sid = c.create().id
        deltas = 0
        for ev in c.send(sid, "go"):
            if isinstance(ev, m.TextDelta) and ev.text == "x":
                deltas += 1
                if deltas == 1:
                    pid = other.status(sid).pid
                    assert pid, "a call in flight and no worker?"
                    os.kill(pid, signal.SIGKILL)
                else:
                    break
    d.kill()  # during the second call
    d.start()
    with d.client() as c:
        wait_for(lambda: c.status(sid).state == "idle", 15, f"the resumed turn ended: {c.status(sid)}")
        assert c.status(sid).budget["spent"]["llm_calls"] == 2
    assert len(llm.requests) == 2, f"the provider received {len(llm.requests)} requests"


def _strip_figures(document: bytes) -> bytes:
    """The export as a client may edit it: no `spent`, no usage anywhere."""
    doc = json.loads(document)
    doc.pop("spent", None)
    for rec in [*doc.get("records", []), doc.get("snapshot") or {}]:
        rec.pop("usage", None)
    return json.dumps(doc).encode()


@pytest.mark.process
def test_export_strip_import_and_rm_then_create_do_not_reset_spend(make_daemon, llm: FakeLLM,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The spend is a ledger: an import counts what its document says was
    spent, or, when it says nothing, does not know (a session ceiling then
    refuses every call); no import or `rm` lowers the uid's total."""
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test")
    d = make_daemon(agent_config(llm, "[agent.budget]\nsession_max_llm_calls = 2\nuid_max_llm_calls = 4\n"))
    with d.client() as c:
        a = c.create().id
        llm.script(text_stream("one"), text_stream("two"))
        assert c.send_text(a, "1") == "one" and c.send_text(a, "2") == "two"
        document = c.export(a)
        assert json.loads(document)["spent"]["llm_calls"] == 2
        # Stripped of its figures: the spend before the import is unknown, not zero.
        stripped = c.import_session(_strip_figures(document), "stripped").id
        status = c.status(stripped).budget
        assert status["unknown_before_import"] and status["ceilings"][0]["unknown"]
        assert "session_max_llm_calls 0 of 2 LLM calls (and unknown before its import)" \
            in d.ctl("status", stripped).stdout
        events = list(c.send(stripped, "3"))
        limit = next(e for e in events if isinstance(e, m.LimitExceeded))
        assert limit.ceiling == "agent.budget.session_max_llm_calls" and len(llm.requests) == 2
        assert "did not say what it spent" in next(e for e in events if isinstance(e, m.TurnDone)).reply
        # As exported: the figures come along, the session ceiling is reached.
        honest = c.import_session(document, "honest").id
        assert c.status(honest).budget["spent"]["llm_calls"] == 2
        assert any(isinstance(e, m.LimitExceeded) for e in c.send(honest, "3")) and len(llm.requests) == 2
        # Figures forged to zero pass the session ceiling; the uid's total is
        # the daemon's own count, which no document lowers: 2 calls left.
        forged = json.loads(_strip_figures(document))
        forged["spent"] = {}
        zero = c.import_session(json.dumps(forged).encode(), "zero").id
        llm.script(text_stream("three"), text_stream("four"))
        assert c.send_text(zero, "3") == "three" and c.send_text(zero, "4") == "four"
        assert c.status(zero).budget["uid_spent"]["llm_calls"] == 4
        # rm takes nothing off the uid's total: a new session has no call left.
        for sid in (a, zero, stripped, honest):
            c.remove(sid)
        fresh = c.create().id
        assert c.status(fresh).budget["uid_spent"]["llm_calls"] == 4
        limit = next(e for e in c.send(fresh, "5") if isinstance(e, m.LimitExceeded))
        assert limit.ceiling == "agent.budget.uid_max_llm_calls" and len(llm.requests) == 4
    d.kill()
    d.start()  # and the ledger is durable
    with d.client() as c:
        assert c.status(fresh).budget["uid_spent"]["llm_calls"] == 4


@pytest.mark.pure
def test_top_shows_the_most_used_ceiling_once_a_session_has_one() -> None:
    from ipc import operator as op
    from supervisor.ctl.top import render, rows_from

    def entry(sid: str, budget: dict[str, Any]) -> op.TopEntry:
        return op.TopEntry(session=m.SessionInfo(id=sid, state="idle", handler="agent", budget=budget))

    ceilings = [{"ceiling": "agent.budget.turn_max_llm_calls", "used": 1, "limit": 4, "unit": "LLM calls"},
                {"ceiling": "agent.budget.session_max_output_tokens", "used": 75, "limit": 100, "unit": "tokens"}]
    reply = op.TopReply(id=1, at=10.0, uptime_secs=5, rss_bytes=1, clients=1,
                        entries=[entry("spender", {"ceilings": ceilings}), entry("free", {})])
    lines = render(rows_from(reply, None), reply, "budget", 80, 24)
    assert "BUDGET" in lines[5] and lines[6].startswith("spender") and lines[6].endswith("75%")
    assert lines[7].startswith("free") and lines[7].endswith("-")
    plain = op.TopReply(id=1, at=10.0, uptime_secs=5, rss_bytes=1, clients=1, entries=[entry("free", {})])
    assert "BUDGET" not in "".join(render(rows_from(plain, None), plain, "cpu", 80, 24))
