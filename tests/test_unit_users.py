"""The shipped deployment under many users (issue 29): the daemon as
systemd/sessiond.service runs it (harness `Daemon.run_as_unit`), with what
the host gives it besides (tests/unit_host.py): its socket made by the
activator as sessiond.socket says (`SocketGroup=`), handed over in
LISTEN_FDS and kept across restarts; install.sh's default config; its
`TasksMax=` and `MemoryMax=` as cgroups around it, scaled down; users of
the socket's group with real passwd entries.

- a restart (three: SIGTERM, a crash, SIGTERM) restores every user's sessions;
- a config whose socket_group is not the handed-over socket's group is
  refused at start, naming both;
- one user filling the task table harms no other user's running tool, and
  is refused (capacity) naming the ceiling it met: its own share, or, where
  the operator gave one user the whole table, the unit's;
- one user's sessions under the unit's MemoryMax cannot get another user's
  process OOM-killed: the user's share is met first, and its own largest
  session goes, told so;
- an unprivileged daemon on a hidepid=invisible /proc, which cannot read its
  workers and has no cgroup, refuses tools and says why, and shows no
  memory figure rather than 0.
"""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import tomli_w

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import SERVICE, TESTS, Daemon, env_for_children, run_as, wait_for
from supervisor.client import Client, RequestError
from test_access import open_root, root_only  # noqa: F401 (fixture)
from test_agent_e2e import agent_config, tool_results
from unit_host import ActivatedSocket, SocketUsers, UnitCgroups, default_config, socket_users

pytestmark = [pytest.mark.process, root_only]


@pytest.fixture(scope="module")
def users() -> Iterator[SocketUsers]:
    """Two users of the socket's group (one by a supplementary group, one
    by its primary group), as `usermod -aG sessiond` makes them."""
    with socket_users(2) as made:
        yield made


@pytest.fixture
def lib(open_root: Path) -> Path:
    """The handlers these tests run, where session uids can import them."""
    for name in ("share_handlers.py", "cgroup_handlers.py"):
        shutil.copy(TESTS / name, open_root / "lib" / name)
        (open_root / "lib" / name).chmod(0o644)
    return open_root


def start(make_daemon: Any, root: Path, config: str, users: SocketUsers,
          cgroups: UnitCgroups | None = None, service: Path = SERVICE, user: str | None = None) -> Daemon:
    """The unit, its socket handed over by the activator."""
    d = make_daemon(config, start=False, root=root / "d", trust=False)
    d.run_as_unit(service, user=user)
    ActivatedSocket(d.socket, users.gid).hand_to(d)
    d.sockdir.chmod(0o755)
    if cgroups is not None:
        d.preexec = cgroups.enter
    d.start(timeout=60)
    return d


def as_user(users: SocketUsers, i: int, d: Daemon, **create: Any) -> str:
    """User i creates a session; its id, or "refused CODE: MESSAGE"."""
    path = str(d.socket)

    def go() -> str:
        try:
            with Client(path) as c:
                return c.create(**create).id
        except RequestError as exc:
            return f"refused {exc.code}: {exc.message}"

    return str(run_as(users.uids[i], go, (users.gid,)))


def with_handlers(config: str, **daemon: Any) -> str:
    data = tomllib.loads(config)
    data.setdefault("agent", {})["allowed_handlers"] = ["agent", "echo", "share_handlers:*", "cgroup_handlers:*"]
    data.setdefault("daemon", {}).update(daemon)
    return tomli_w.dumps(data)


# ---------------------------------------------------------------- who is admitted, across restarts


def test_every_restart_of_the_unit_restores_every_users_sessions(make_daemon, open_root: Path,
                                                                 users: SocketUsers) -> None:
    d = start(make_daemon, open_root, default_config(), users)
    path = str(d.socket)
    for i in range(len(users.uids)):
        assert as_user(users, i, d, session=f"user{i}", handler="echo") == f"user{i}"

    def mine_and_a_turn(i: int) -> Any:
        def go() -> Any:
            with Client(path) as c:
                listed = [[s.id, s.state, s.error] for s in c.list()]
                return [listed, c.send_text(f"user{i}", "again")]
        return go

    for turn, how in enumerate(("stop", "kill", "stop"), start=1):
        d.stop() if how == "stop" else d.kill()
        d.start(timeout=60)
        for i, uid in enumerate(users.uids):
            listed, reply = run_as(uid, mine_and_a_turn(i), (users.gid,))
            assert listed == [[f"user{i}", "hibernated", None]], (how, listed, d.log[-3000:])
            assert reply == f"{turn}: again"
    assert "may not own sessions here" not in d.log


def test_a_socket_group_unlike_the_handed_over_sockets_is_refused_at_start(make_daemon, users: SocketUsers) -> None:
    other = 65534 if users.gid != 65534 else 65533
    d = make_daemon(f'[daemon]\nsocket_group = "{other}"\n', start=False)
    ActivatedSocket(d.socket, users.gid).hand_to(d)
    done = subprocess.run([*d.cmd_prefix, *d.cmd], pass_fds=d.pass_fds, env=env_for_children(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stderr
    assert f"socket_group = '{other}'" in done.stderr and f"(gid {users.gid})" in done.stderr, done.stderr


# ---------------------------------------------------------------- the task table


def _zygote(d: Daemon) -> int:
    (z,) = [p.pid for p in d.descendants() if "sessiond: zygote" in " ".join(p.cmdline())]
    return z


def test_one_user_filling_the_task_table_harms_no_other_users_session(
        make_daemon, lib: Path, users: SocketUsers, llm: FakeLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-unit")
    tasks = 200  # the unit's TasksMax=, scaled
    cgroups = UnitCgroups(tasks=tasks)
    try:
        config = with_handlers(agent_config(llm), spare_workers=0)
        d = start(make_daemon, lib, config, users, cgroups)
        bob = as_user(users, 1, d, session="bob")
        hog = as_user(users, 0, d, session="hog", handler="share_handlers:taker")
        zygote = _zygote(d)

        def bobs_tool_runs(flag: str) -> None:
            """Bob's turn: a tool that waits for `flag` in its workspace."""
            # No fork while it waits (the table may be full): bash builtins
            # on a FIFO it holds open.
            cmd = (f"mkfifo .wait-{flag}; exec 3<> .wait-{flag}; touch started-{flag}; "
                   f"until [ -e {flag} ]; do read -t 0.1 -u 3; done; echo finished-{flag}")
            llm.script(tool_call_stream(("t", "bash", {"command": cmd})), text_stream(f"bob {flag}"))
            with d.client() as c:
                c.send_input(bob, "go")
            wait_for(lambda: (d.workspace(bob) / f"started-{flag}").exists(), 30, "bob's tool to run")

        def bobs_tool_finishes(flag: str, turns: int) -> None:
            (d.workspace(bob) / flag).touch()
            with d.client() as c:
                wait_for(lambda: c.status(bob).turns == turns and c.status(bob).state == "idle", 30,
                         "bob's turn to end")
                assert c.status(bob).last_exit is None, c.status(bob).last_exit
            assert f"finished-{flag}" in tool_results(llm.requests[-1].json)[-1]

        # Each user's share (the default: half of TasksMax): the hog stops at its own.
        bobs_tool_runs("go1")
        with d.client() as c:
            forked = int(c.send_text(hog, f"fork {tasks * 2}").split()[1])
        assert 30 < forked < tasks // 2, forked
        refused = as_user(users, 0, d, handler="echo")
        assert refused.startswith("refused capacity") and "max_processes_per_uid" in refused, refused
        assert not as_user(users, 1, d, handler="echo").startswith("refused"), "bob has room"
        bobs_tool_finishes("go1", 1)

        # The operator lets one user have the whole table: the hog (still
        # trying) fills the unit's, and the zygote lives through it.
        bobs_tool_runs("go2")
        data = tomllib.loads(d.config_path.read_text())
        data["daemon"]["max_processes_per_uid"] = tasks * 4
        d.config_path.write_text(tomli_w.dumps(data))
        assert d.ctl("reload").returncode == 0
        wait_for(lambda: cgroups.full() and cgroups.full(), 20, "the hog to fill the unit's task table")
        refused = as_user(users, 1, d, handler="echo")
        assert refused.startswith("refused capacity") and "task ceiling" in refused, refused
        assert str(cgroups.dirs["pids"]) in refused, refused  # names where TasksMax is
        assert _zygote(d) == zygote
        with d.client() as c:
            c.remove(hog)
        bobs_tool_finishes("go2", 2)
        assert not as_user(users, 1, d, handler="echo").startswith("refused")
        assert _zygote(d) == zygote
    finally:
        cgroups.close()


# ---------------------------------------------------------------- memory


def test_one_users_sessions_cannot_get_another_users_process_oom_killed(make_daemon, lib: Path,
                                                                       users: SocketUsers) -> None:
    memory_mb = 1024  # the unit's MemoryMax=, scaled: each user's share is half
    cgroups = UnitCgroups(memory_mb=memory_mb)
    try:
        d = start(make_daemon, lib, with_handlers(default_config()), users, cgroups)
        alice = as_user(users, 0, d, session="alice", handler="share_handlers:taker")
        with d.client() as c:
            held = c.send_text(alice, "hog 300").split()
        assert held[2] == "held", held
        hog = psutil.Process(int(held[1]))
        bobs = [as_user(users, 1, d, session=f"bob{i}", handler="share_handlers:taker") for i in range(4)]
        with d.client() as c:
            for sid in bobs:
                list(c.send(sid, "hog 220"))  # (killed or not: bob's share decides)
            assert c.status(alice).last_exit is None, c.status(alice).last_exit
            killed = wait_for(lambda: [s for s in bobs if (e := c.status(s).last_exit) is not None
                                       and e.reason == "killed_memory"], 20, "bob's share to be met")
            detail = c.status(killed[0]).last_exit.detail
            assert "max_memory_mb_per_uid" in detail and f"uid {users.uids[1]}" in detail, detail
        assert hog.is_running() and hog.status() != psutil.STATUS_ZOMBIE
        assert hog.memory_info().rss > 290 << 20
    finally:
        cgroups.close()


# ---------------------------------------------------------------- a daemon blind to its workers


def test_an_unprivileged_daemon_on_a_hidepid_proc_refuses_tools_and_says_why(
        make_daemon, open_root: Path, users: SocketUsers, llm: FakeLLM, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The old unprivileged unit (User=, no capabilities) on its ProtectProc=
    invisible /proc, namespaces off: no cgroup counts the sessions and the
    daemon cannot read its non-dumpable workers."""
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-unit")
    unit = tmp_path / "unprivileged.service"
    text = SERVICE.read_text().replace("[Service]\n", "[Service]\nUser=nobody\n", 1)
    unit.write_text(text.replace("CapabilityBoundingSet=CAP_", "CapabilityBoundingSet=\n#", 1))
    config = agent_config(llm, '[agent.limits]\nmax_memory_mb = 64\n[sandbox]\nnamespaces = "off"\n')
    d = start(make_daemon, open_root, config, users, service=unit, user="nobody")
    with d.client() as c:
        sid = c.create(session="blind").id
        stats = c.stats().sandbox
        assert stats["tools"] == "refused" and "/proc" in stats["refused"], stats
        assert c.status(sid).rss_bytes is None  # unknown, never 0
    llm.script(tool_call_stream(("t", "bash", {"command": "echo RAN"})), text_stream("done"))
    with d.client() as c:
        assert c.send_text(sid, "go") == "done"
    (out,) = tool_results(llm.requests[-1].json)
    assert "RAN" not in out and "tools do not run" in out and "hidden" in out, out
