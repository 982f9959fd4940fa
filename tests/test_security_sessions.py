"""The audit of issue 9, replayed through sessionctl and the client against a
real daemon: what a session's creator may set, who its worker runs as, what
a reused id inherits, what a reload does to live sessions, and the per-uid
quota.  Each test is an attack that used to work."""

from __future__ import annotations

import json
import shutil
import signal
import stat
from pathlib import Path

import pytest

from conftest import FAST_CONFIG
from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import wait_for
from ipc import messages as m
from test_access import NOBODY, as_user, open_root, open_up, root_only  # noqa: F401 (fixture)
from test_agent_e2e import agent_config, tool_results

pytestmark = pytest.mark.process

SECRET = "U1-secret-4711"


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-operator-key-0001")


def _uid_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Uid:"):
                return int(line.split()[1])
    raise AssertionError("no Uid line")


# ---------------------------------------------------------------- 1, 4, 7: --set


def test_parent_tables_cannot_smuggle_operator_only_keys(make_daemon, llm: FakeLLM, tmp_path: Path) -> None:
    d = make_daemon(agent_config(llm))
    attacker = FakeLLM().start()
    try:
        stolen = (f'provider={{base_url="{attacker.base_url}",model="m",'
                  'api_key_env="SESSIOND_TEST_KEY"}')
        r = d.ctl("create", "--set", stolen)
        assert r.returncode == 2 and "a table, not a key" in r.stderr, r
        r = d.ctl("create", "--set", 'provider.api_key_env="PATH"')
        assert r.returncode == 2 and "only the operator" in r.stderr, r
        victim_dir = tmp_path / "victim"
        victim_dir.mkdir(mode=0o755)
        before = victim_dir.stat()
        r = d.ctl("create", "--id", "etc", "--set", f'tools={{workspace_dir="{victim_dir}"}}')
        assert r.returncode == 2 and "a table" in r.stderr, r
        assert list(victim_dir.iterdir()) == [] and victim_dir.stat().st_uid == before.st_uid
        with d.client() as c:
            assert c.list() == []
        assert attacker.requests == []  # the key never left for the attacker's server
    finally:
        attacker.stop()


def test_an_echo_only_daemon_gives_no_provider_and_no_bash(make_daemon, llm: FakeLLM) -> None:
    d = make_daemon()
    r = d.ctl("create", "--handler", "agent", "--set", f'provider.base_url="{llm.base_url}"',
              "--set", 'provider.model="m"')
    assert r.returncode == 2 and "provider.base_url" in r.stderr, r
    assert llm.requests == []


def test_limits_without_ceilings_of_the_audit_are_refused(make_daemon) -> None:
    # (Resuming turns is on by default: a creator may not turn it on where the operator did not.)
    d = make_daemon(FAST_CONFIG.replace("[agent.worker]\n", "[agent.worker]\nretry_aborted_turn = false\n"))
    for item, word in [
        ("agent.worker.restart_backoff_initial_ms=1", "minimum"),
        ("agent.worker.restart_window_secs=0.001", "minimum"),
        ("agent.worker.retry_aborted_turn=true", "above"),
        ("agent.worker.max_step_kb=1000000", "above"),
        ("agent.worker.heartbeat_interval_secs=3600", "above"),
        ("provider.max_retries=1000000", "above"),
        ("provider.model=\"gpt-expensive\"", "not a model the operator allows"),
        ("agent.limits.max_concurrent_sessions=1", "daemon-wide"),
        ("agent.limits.memory_poll_interval_ms=60000", "daemon-wide"),
        ("agent.stream_buffer_size=100000", "daemon-wide"),
    ]:
        r = d.ctl("create", "--set", item)
        key = item.partition("=")[0]
        assert r.returncode == 2 and key in r.stderr and word in r.stderr, (item, r.stderr)
    with d.client() as c:
        assert c.list() == []


def test_a_session_cannot_lift_the_operators_rules_or_tools(make_daemon, llm: FakeLLM) -> None:
    extra = '[[permissions]]\ntool = "bash"\nmatch = "rm *"\naction = "deny"\n'
    d = make_daemon(agent_config(llm, extra))
    r = d.ctl("create", "--set", 'permissions=[{tool="bash", match="rm *", action="allow"}]')
    assert r.returncode == 2 and "deny or ask" in r.stderr, r
    r = d.ctl("create", "--set", 'tools.enabled=["bash", "read_file", "rogue"]')
    assert r.returncode == 2 and "not enabled by the operator" in r.stderr, r
    # permissions=[] is accepted but removes nothing: the operator's deny stays first.
    r = d.ctl("--json", "create", "--set", "permissions=[]", "--set", 'tools.enabled=["bash"]')
    assert r.returncode == 0, r
    sid = json.loads(r.stdout)["id"]
    llm.script(tool_call_stream(("c1", "bash", {"command": "rm -rf notes"})), text_stream("ok"))
    with d.client() as c:
        assert c.send_text(sid, "clean up") == "ok"
    assert "permission denied" in tool_results(llm.requests[1].json)[0]
    offered = [t["function"]["name"] for t in llm.requests[0].json["tools"]]
    assert offered == ["bash"]


# ---------------------------------------------------------------- 3: who tools run as


@root_only
def test_root_without_an_identity_for_tools_refuses_to_start(make_daemon) -> None:
    d = make_daemon('[daemon]\nsession_uid_range = ""\n', start=False, trust=False)
    with pytest.raises(AssertionError, match="allow_root_tools"):
        d.start()
    d2 = make_daemon('[daemon]\nsession_uid_range = ""\nallow_root_tools = true\n', trust=False)
    with d2.client() as c:
        sid = c.create(handler="echo").id
        assert _uid_of(c.status(sid).pid) == 0  # what the operator asked for, and logged
    assert "allow_root_tools = true" in d2.log


@root_only
def test_root_on_defaults_runs_each_session_as_its_own_uid(make_daemon, open_root: Path, llm: FakeLLM) -> None:
    d = make_daemon(agent_config(llm), root=open_root / "d", trust=False)
    llm.script(
        tool_call_stream(("w", "write_file", {"path": "secret.txt", "content": SECRET})),
        text_stream("stored"),
    )
    with d.client() as c:
        one = c.create(session="one").id
        two = c.create(session="two").id
        assert c.send_text(one, "keep this") == "stored"
        uids = {_uid_of(c.status(s).pid) for s in (one, two)}
    assert len(uids) == 2 and all(1879048192 <= u <= 1879113727 for u in uids), uids
    for sid in (one, two):
        st = d.workspace(sid).stat()
        assert st.st_uid in uids and stat.S_IMODE(st.st_mode) == 0o700
    secret = d.workspace(one) / "secret.txt"
    assert secret.read_text() == SECRET
    # Session two's tools cannot reach session one's workspace.
    llm.script(
        tool_call_stream(("r", "bash", {"command": f"cat {secret}; id -u"})),
        text_stream("tried"),
    )
    with d.client() as c:
        assert c.send_text(two, "steal") == "tried"
    result = tool_results(llm.requests[-1].json)[-1]
    # Out of view in the sandbox's mount namespace, refused by file modes without it.
    assert SECRET not in result and ("Permission denied" in result or "No such file" in result), result


@root_only
def test_a_workspace_root_the_session_uids_cannot_reach_is_refused_at_start(make_daemon, tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    d = make_daemon(f'[tools]\nworkspace_dir = "{private / "ws"}"\n', start=False, trust=False)
    with pytest.raises(AssertionError, match=r"cannot be reached by the sessions' uids.*chmod o\+x"):
        d.start()


# ---------------------------------------------------------------- 5: reused ids


def test_a_reused_id_never_sees_the_old_workspace(make_daemon, llm: FakeLLM) -> None:
    d = make_daemon(agent_config(llm))
    llm.script(
        tool_call_stream(("w", "write_file", {"path": "secret.txt", "content": SECRET})),
        text_stream("stored"),
        tool_call_stream(("l", "bash", {"command": "ls -a; cat secret.txt"})),
        text_stream("looked"),
    )
    with d.client() as c:
        c.create(session="shared")
        assert c.send_text("shared", "keep this") == "stored"
        old = d.workspace("shared")
        c.remove("shared")
        assert not old.exists()
        c.create(session="shared")
        assert c.send_text("shared", "what is here?") == "looked"
        assert d.workspace("shared") != old
    assert SECRET not in tool_results(llm.requests[-1].json)[-1]


def test_the_workspace_of_a_session_removed_while_the_daemon_was_down_is_swept(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        c.create(session="gone", handler="echo")
    workspace = d.workspace("gone")
    (workspace / "left").write_text("x")
    d.kill()
    # As if the daemon died between removing the session and its workspace.
    shutil.rmtree(d.state_dir / "sessions" / "gone")
    d.start()
    wait_for(lambda: not workspace.exists(), 5, "the orphaned workspace to be removed")


# ---------------------------------------------------------------- 9: quota


@root_only
def test_sessions_per_uid_are_capped(make_daemon) -> None:
    d = make_daemon(f'[daemon]\nsocket_mode = "0666"\nallowed_uids = [{NOBODY}]\nmax_sessions_per_uid = 2\n')
    open_up(d)
    replies = as_user(NOBODY, str(d.socket), [
        m.Create(id=1, handler="echo"), m.Create(id=2, handler="echo"), m.Create(id=3, handler="echo"),
    ])
    assert [type(r).__name__ for r in replies] == ["Welcome", "Created", "Created", "Error"]
    error = replies[3]
    assert isinstance(error, m.Error) and error.code == "capacity"
    assert "max_sessions_per_uid = 2" in error.message and str(NOBODY) in error.message
    with d.client() as c:  # root is not held to it
        for _ in range(3):
            c.create(handler="echo")
        assert len(c.list()) == 5


# ---------------------------------------------------------------- 11: reload


def test_a_reloaded_deny_rule_binds_live_sessions_at_their_next_tool_call(make_daemon, llm: FakeLLM) -> None:
    d = make_daemon(agent_config(llm))
    llm.script(
        tool_call_stream(("a", "bash", {"command": "echo before-$((2*3))"})),
        text_stream("ran"),
        tool_call_stream(("b", "bash", {"command": "echo after-$((2*3))"})),
        text_stream("refused"),
    )
    with d.client() as c:
        sid = c.create().id
        pid = c.status(sid).pid
        assert c.send_text(sid, "first") == "ran"
        d.config_path.write_text(
            d.config_path.read_text()
            + '\n[[permissions]]\ntool = "bash"\nmatch = "*"\naction = "deny"\n'
        )
        d.signal(signal.SIGHUP)
        wait_for(lambda: "config reloaded" in d.log, 10, "the reload")
        assert c.send_text(sid, "second") == "refused"
        assert c.status(sid).pid == pid  # the same worker: no restart was needed
    assert "before-6" in tool_results(llm.requests[1].json)[-1]
    after = tool_results(llm.requests[3].json)[-1]
    assert "permission denied" in after and "after-6" not in after


def test_a_lowered_memory_cap_applies_to_live_sessions_at_once(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        # A child holding 24 MiB of its own (the cap counts PSS: an idle
        # worker's pages, shared with the zygote, do not reach even 16 MiB).
        sid = c.create(handler="fixture_handlers:child_hog").id
        stream = c.send(sid, "24")
        next(e for e in stream if isinstance(e, m.TextDelta) and e.text.startswith("child"))
        pid = c.status(sid).pid
        assert pid is not None
        d.config_path.write_text(d.config_path.read_text().replace(
            "[daemon]", "[agent.limits]\nmax_memory_mb = 16\n[daemon]", 1))
        d.signal(signal.SIGHUP)
        wait_for(lambda: (s := c.status(sid)).last_exit is not None and s.last_exit.reason == "killed_memory",
                 10, "the worker to be killed under the new cap")


# ---------------------------------------------------------------- 14: quick sub-agents


def test_sub_agents_that_finish_at_once_are_not_reported_as_timed_out(make_daemon, llm: FakeLLM) -> None:
    extra = "[agent.subagents]\nchild_timeout_secs = 30\nmax_concurrent = 8\nmax_total_spawns = 8\n"
    d = make_daemon(agent_config(llm, extra))
    calls = [(f"s{i}", "spawn_agent", {"task": f"task {i}", "handler": "echo"}) for i in range(8)]
    llm.script(tool_call_stream(*calls), text_stream("all back"))
    with d.client() as c:
        sid = c.create().id
        assert c.send_text(sid, "fan out") == "all back"
    results = tool_results(llm.requests[1].json)
    assert results == [f"1: task {i}" for i in range(8)], results


# ---------------------------------------------------------------- 8: retained events, all sessions together


def _retained_text(c, sid: str) -> int:
    replayed = 0
    for ev in c.attach(sid, from_seq=1):
        if isinstance(ev, m.TextDelta):
            replayed += len(ev.text)
        if isinstance(ev, m.TurnDone):
            return replayed
    raise AssertionError("no TurnDone replayed")


def test_retained_events_of_all_sessions_together_are_bounded(make_daemon) -> None:
    # Audit: ~1.4 MiB of retained events per session with no overall bound.
    d = make_daemon("[daemon]\nevent_retention_total_bytes = 65536\n")
    with d.client() as c:
        sids = [c.create(handler="fixture_handlers:big_reply").id for _ in range(4)]
        for sid in sids:
            assert c.send_text(sid, str(256 * 1024)) == "big"

        def within_budget() -> bool:
            # Each session still replays up to its TurnDone (its newest
            # events are kept); what all of them hold stays in the budget.
            with d.client() as reader:
                held = [_retained_text(reader, sid) for sid in sids]
            return sum(held) <= 65536

        wait_for(within_budget, 5, "the sessions' rings to fit event_retention_total_bytes")
