"""Pure parts of issue 25: which sessions a bulk command selects and acts
on, `ls --sort`, limit lines with units, plain config errors, the reload's
list of changes, and the CPU figures the sweep reads."""

from __future__ import annotations

import os
import time

import pytest

from ipc.contract import SESSION_STATES, LimitKind, figure_past, limit_text
from ipc.messages import SessionInfo
from supervisor.config import Config, plain_error
from supervisor.core.limits import SessionMemory
from supervisor.host.proctable import ProcTable
from supervisor.core.states import State
from supervisor.ctl.bulk import Selector, applies, select, sort_sessions, usage_problem
from supervisor.ops.reload import changes

def _s(sid: str, state: str = "idle", owner: int = 0, handler: str = "echo", **kw: object) -> SessionInfo:
    return SessionInfo(id=sid, state=state, handler=handler, owner_uid=owner, **kw)  # type: ignore[arg-type]


@pytest.mark.pure
def test_the_states_sessionctl_accepts_are_the_daemons() -> None:
    assert SESSION_STATES == tuple(s.value for s in State)


@pytest.mark.pure
def test_a_selection_matches_every_given_option_and_any_of_its_values() -> None:
    sessions = [_s("a"), _s("b", "stopped"), _s("c", owner=1000), _s("d", handler="agent")]
    assert [s.id for s in select(sessions, Selector())] == ["a", "b", "c", "d"]
    assert [s.id for s in select(sessions, Selector(states=["idle"], owners=[0]))] == ["a", "d"]
    assert [s.id for s in select(sessions, Selector(states=["stopped", "idle"], handlers=["echo"],
                                                    owners=[0]))] == ["a", "b"]
    assert select(sessions, Selector(owners=[7])) == []


@pytest.mark.pure
def test_what_each_command_skips() -> None:
    assert [st for st in SESSION_STATES if applies("interrupt", st)] == ["running"]
    assert not applies("stop", "stopped") and not applies("stop", "damaged") and applies("stop", "hibernated")
    assert applies("restart", "failed") and not applies("restart", "damaged")
    assert applies("rm", "damaged") and not applies("rm", "deleted")


@pytest.mark.pure
def test_a_command_line_names_one_session_or_a_selection() -> None:
    assert usage_problem(True, False, Selector()) is None
    assert usage_problem(False, True, Selector()) is None
    assert usage_problem(False, False, Selector(states=["idle"])) is None
    assert "not both" in (usage_problem(True, True, Selector()) or "")
    assert "--all" in (usage_problem(False, False, Selector()) or "")


@pytest.mark.pure
def test_ls_sorts_as_top_does() -> None:
    now = time.time()
    sessions = [_s("b", cpu_percent=5.0, rss_bytes=10, created_at=now - 10, turns=3),
                _s("a", cpu_percent=None, rss_bytes=30, created_at=now - 100, turns=3),
                _s("c", "failed", cpu_percent=50.0, rss_bytes=None, created_at=now - 1, restarts=2)]
    order = {key: [s.id for s in sort_sessions(sessions, key, now)] for key in
             ("cpu", "rss", "turns", "restarts", "age", "id", "state")}
    assert order == {"cpu": ["c", "b", "a"], "rss": ["a", "b", "c"], "turns": ["a", "b", "c"],
                     "restarts": ["c", "a", "b"], "age": ["a", "b", "c"], "id": ["a", "b", "c"],
                     "state": ["c", "a", "b"]}


@pytest.mark.pure
def test_limit_lines_carry_units() -> None:
    assert limit_text(LimitKind.MEMORY, 117.672, 96) == "117.7 MiB > 96 MiB"
    assert limit_text(LimitKind.PROCESSES, 65, 64) == "65 > 64 processes"
    assert limit_text("a_kind_from_later", 2.5, 2) == "2.5 > 2"  # an old client, a newer daemon


@pytest.mark.pure
def test_a_limit_line_at_the_limit_says_reached_not_past() -> None:
    """The words agree with the comparison: a figure that shows as the
    limit (a cgroup's usage stops at its cap; the last model call allowed;
    a timeout's deadline) was reached, not exceeded (`64.0 MiB > 64 MiB`)."""
    assert limit_text(LimitKind.MEMORY, 64.0, 64) == "64 MiB reached"
    assert limit_text(LimitKind.MEMORY, 64.02, 64) == "64 MiB reached"
    assert limit_text(LimitKind.MEMORY, 64.06, 64) == "64.1 MiB > 64 MiB"
    assert limit_text(LimitKind.TURN_TIMEOUT, 1.0004, 1) == "1 s reached"
    assert limit_text(LimitKind.TURNS, 3, 3) == "3 model calls reached"
    assert limit_text(LimitKind.TURNS, 1, 1) == "1 model call reached"
    assert limit_text(LimitKind.MEMORY_HIGH, 40.0, 48) == "40.0 MiB of 48 MiB"  # (never sent so)
    # A kill's reason: "exceeded at" a figure that reads past the cap.
    assert (figure_past(131.2, 96), figure_past(96.3, 96), figure_past(96.04, 96)) == ("131", "96.3", "96.04")


@pytest.mark.pure
def test_counts_agree_with_their_nouns() -> None:
    import io
    from contextlib import redirect_stdout

    from supervisor.ctl.render import print_stats

    out = io.StringIO()
    with redirect_stdout(out):
        print_stats({"version": "1", "pid": 1, "uptime_secs": 3, "rss_bytes": 1 << 20, "sessions": 1,
                     "by_state": {"idle": 1}, "live_workers": 1, "clients": 1, "sandbox": {}})
    assert out.getvalue().splitlines()[1] == "1 session (1 idle), 1 live worker, 1 client"


@pytest.mark.pure
def test_config_errors_say_the_allowed_values_and_the_toml_type() -> None:
    assert plain_error("Invalid enum value 'x'", Config, "sandbox.mode", "x") == \
        '"x" is not one of: auto, required, off'
    assert plain_error("Invalid enum value 'maybe'", Config, "permissions[0].action", "maybe") == \
        '"maybe" is not one of: allow, deny, ask'
    assert plain_error("Expected `int`, got `str`", Config, "agent.max_turns", "abc") == \
        'expected a whole number, got "abc"'
    assert plain_error("Expected `float`, got `bool`", Config, "agent.turn_timeout_secs", True) == \
        "expected a number, got true"
    assert plain_error("Expected `int`, got `str`", Config, "agent.max_turns") == "expected a whole number, got a string"
    assert plain_error("Expected `int` >= 1", Config, "agent.max_turns", 0) == "Expected `int` >= 1"


@pytest.mark.pure
def test_a_reload_lists_what_changed() -> None:
    old = Config()
    new = Config(agent=msgspec_replace(old.agent, max_turns=7), tools=msgspec_replace(old.tools, enabled=["bash"]))
    assert changes(old, old) == []
    assert changes(old, new) == [
        f"agent.max_turns: {old.agent.max_turns} -> 7",
        'tools.enabled: ["bash","read_file","write_file","list_dir","spawn_agent"] -> ["bash"]',
    ]


def msgspec_replace(obj: object, **kw: object) -> object:
    import msgspec

    return msgspec.structs.replace(obj, **kw)  # type: ignore[type-var]


@pytest.mark.component
def test_the_sweep_reads_cpu_time_of_the_tree_it_measured() -> None:
    table = ProcTable()
    try:
        mem = SessionMemory()
        mem.measure(table, os.getpid())
        mem.sample_cpu(table, time.monotonic())
        assert mem.cpu_percent is None and mem.cpu_ticks is not None  # one sample: no rate yet
        deadline = time.process_time() + 0.2
        while time.process_time() < deadline:  # burn CPU, this process is the "worker"
            pass
        mem.measure(table, os.getpid())
        mem.sample_cpu(table, time.monotonic())
        assert mem.cpu_percent is not None and mem.cpu_percent > 0
    finally:
        table.close()
