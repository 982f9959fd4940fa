"""The decisions behind issue 29's fixes, without a daemon: one admission
policy for the socket and a stored owner; the listening socket's group and
a config that names another; each user's share of the daemon's ceilings;
which ceiling an OOM kill was for, on cgroup v1 and v2 trees (files in a
temporary directory standing for the kernel's); when the daemon is blind
to its workers; what a refused fork is answered."""

from __future__ import annotations

import errno
import grp
import os
import pwd
import socket
import tempfile
from pathlib import Path

import pytest

from supervisor.config import Config, DaemonSettings
from supervisor.core.admission import Admission, Identities
from supervisor.host.users import listening_group
from supervisor.errors import StartupError
from supervisor.spawn import sandbox
from supervisor.spawn.ceilings import Ceiling, Ceilings, fork_refusal, user_shares
from supervisor.spawn.cgroups import OomMark, Shares, room_left, within_share
from supervisor.spawn.cgroups_v1 import CgroupsV1
from supervisor.spawn.cgroups_v2 import CgroupsV2


def _someone() -> pwd.struct_passwd:
    """A passwd entry that is not root and not ours."""
    return next(p for p in pwd.getpwall() if p.pw_uid not in (0, os.geteuid()))


# ---------------------------------------------------------------- admission


@pytest.mark.component
def test_a_stored_owner_is_admitted_by_the_sockets_group_as_its_client_was() -> None:
    """The finding: the socket admitted the members of its (systemd-made)
    group, the re-check at load read the group from an empty socket_group."""
    user = _someone()
    cfg = Config()
    admission = Admission(lambda: cfg, Identities(socket_gid=user.pw_gid))
    groups = os.getgrouplist(user.pw_name, user.pw_gid)
    assert admission.admits(user.pw_uid, user.pw_gid, groups)
    assert admission.may_own(user.pw_uid)  # the same answer, from the passwd entry
    stranger = Admission(lambda: cfg, Identities(socket_gid=None))
    assert not stranger.admits(user.pw_uid, user.pw_gid, groups) and not stranger.may_own(user.pw_uid)
    # Root's group opens no door, on the socket nor at load.
    root_group = Admission(lambda: cfg, Identities(socket_gid=0))
    if 0 not in groups and user.pw_gid != 0:
        assert not root_group.may_own(user.pw_uid)
    # A session's own uid never owns a session, whatever its groups.
    span = range(user.pw_uid, user.pw_uid + 1)
    sessions = Admission(lambda: cfg, Identities(session_uids=span, socket_gid=user.pw_gid))
    assert not sessions.may_own(user.pw_uid)
    # A reload is read at each call.
    cfg2 = Config(daemon=DaemonSettings(allowed_uids=[user.pw_uid]))
    assert Admission(lambda: cfg2, Identities()).may_own(user.pw_uid)


@pytest.mark.component
def test_the_listening_sockets_group_and_a_config_that_names_another() -> None:
    where = Path(tempfile.mkdtemp(prefix="sd-grp-"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(where / "s"))
        gid = os.stat(where / "s").st_gid
        assert listening_group(sock, "") == gid
        assert listening_group(sock, str(gid)) == gid
        other = next(g.gr_gid for g in grp.getgrall() if g.gr_gid != gid)
        with pytest.raises(StartupError) as exc:
            listening_group(sock, str(other))
        assert f"(gid {other})" in str(exc.value) and f"gid {gid}" in str(exc.value), exc.value
        with pytest.raises(StartupError, match="no such group"):
            listening_group(sock, "no-such-group-29")
    finally:
        sock.close()
        (where / "s").unlink()
        where.rmdir()


# ---------------------------------------------------------------- shares


@pytest.mark.pure
def test_each_users_share_is_below_the_units_ceilings() -> None:
    unit = Ceilings(Ceiling(4096, "TasksMax"), Ceiling(8 << 30, "MemoryMax"))
    assert user_shares(0, 0, unit) == Shares(2048, 4096)  # half of each by default
    assert user_shares(300, 1000, unit) == Shares(300, 1000)  # the operator's
    tiny = Ceilings(Ceiling(16, "x"), Ceiling(1 << 20, "y"))
    assert user_shares(0, 0, tiny) == Shares(64, 64)  # one worker's worth at least
    # A session's pids.max never above its owner's share.
    assert within_share(512, Shares(2048, 1)) == 512
    assert within_share(512, Shares(100, 1)) == 100
    assert within_share(None, Shares(100, 1)) == 100
    assert within_share(None, None) is None
    # Room for one more worker, or why not, naming the key.
    assert room_left(10, 100, 7) == ""
    assert room_left(None, 100, 7) == "" and room_left(10, None, 7) == ""
    refused = room_left(95, 100, 7)
    assert "uid 7" in refused and "max_processes_per_uid" in refused and "95" in refused


@pytest.mark.pure
def test_a_refused_fork_is_answered_with_the_ceiling_it_met() -> None:
    unit = Ceilings(Ceiling(4096, "/sys/fs/cgroup/system.slice/sessiond.service/pids.max"),
                    Ceiling(6 << 30, "/sys/fs/cgroup/system.slice/sessiond.service/memory.max"))
    tasks = fork_refusal(errno.EAGAIN, "fork: Resource temporarily unavailable (for 1.5s)", unit)
    assert "task ceiling" in tasks and "4096" in tasks and "sessiond.service/pids.max" in tasks
    assert "TasksMax" in tasks and "running sessions are not affected" in tasks
    memory = fork_refusal(errno.ENOMEM, "fork: Cannot allocate memory", unit)
    assert "6144 MiB" in memory and "MemoryMax" in memory
    assert "Too many open files" in fork_refusal(errno.EMFILE, "fork: Too many open files", unit)


# ---------------------------------------------------------------- which ceiling an OOM was for


def _files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _oom_control(under: int, kills: int, disabled: int = 1) -> str:
    return f"oom_kill_disable {disabled}\nunder_oom {under}\noom_kill {kills}\n"


@pytest.mark.component
def test_v1_tells_the_sessions_cap_from_its_users_share_from_the_units(tmp_path: Path) -> None:
    v1 = CgroupsV1({"memory": tmp_path})
    user = v1.base["memory"] / "u-1000"
    v1._uid["s"] = 1000
    session = user / "s-s"
    _files(user, {"memory.oom_control": _oom_control(0, 0), "s-s/memory.oom_control": _oom_control(0, 2)})
    mark = v1.oom_mark("s")
    assert mark == OomMark(kills=2) and v1.oom_cause("s", mark) is None
    # Its own cap: the session alone under OOM (held: its killer is off).
    _files(session, {"memory.oom_control": _oom_control(1, 2)})
    assert v1.oom_cause("s", mark) == "own"
    # Its owner's share: the u-UID level under OOM (v1 marks its whole subtree).
    _files(user, {"memory.oom_control": _oom_control(1, 0)})
    assert v1.oom_cause("s", mark) == "user"
    # The unit's: the kernel killed in it, for a level above the daemon's.
    _files(user, {"memory.oom_control": _oom_control(0, 0), "s-s/memory.oom_control": _oom_control(0, 3)})
    assert v1.oom_cause("s", mark) == "unit"
    # ... unless the daemon had put the kernel's killer back on for it (a kill that did not land).
    _files(session, {"memory.oom_control": _oom_control(0, 3, disabled=0)})
    assert v1.oom_cause("s", mark) == "own"
    # The owner's level gets its share and its killer off (the daemon kills whole), the session its own.
    v1.attach("t", 12345, 1024, 512, uid=1000, share=Shares(100, 300))
    try:
        assert (user / "memory.limit_in_bytes").read_text() == str(300 << 20)
        assert (user / "memory.oom_control").read_text() == "1"
        assert (user / "s-t" / "memory.limit_in_bytes").read_text() == str(1024 << 20)
        assert v1.user_memory_bytes(1000) is None  # (no usage file in this tree)
    finally:
        v1.release("t", where={})  # (nothing to kill here)
        for fd in v1._oom.pop("t", ()):
            os.close(fd)


@pytest.mark.component
def test_v2_tells_the_sessions_cap_from_its_users_share_from_the_units(tmp_path: Path) -> None:
    v2 = CgroupsV2(tmp_path)
    v2.controllers = {"memory", "pids"}
    v2._uid["s"] = 1000
    user = v2.sessions / "u-1000"

    def events(session: tuple[int, int], owner: int) -> None:
        _files(user, {"memory.events": f"low 0\nhigh 0\nmax 3\noom {owner}\noom_kill 0\n",
                      "s-s/memory.events": f"low 0\nhigh 0\nmax 1\noom {session[0]}\noom_kill {session[1]}\n"})

    events((0, 0), 0)
    mark = v2.oom_mark("s")
    assert v2.oom_cause("s", mark) is None
    events((1, 1), 1)  # at its own memory.max (counted at its parent too)
    assert v2.oom_cause("s", mark) == "own"
    events((0, 1), 1)  # killed at its owner's memory.max
    assert v2.oom_cause("s", mark) == "user"
    events((0, 1), 0)  # killed for a level above: the unit's MemoryMax
    assert v2.oom_cause("s", mark) == "unit"
    # The share is written at the owner's level, the session's pids.max within it.
    _files(user / "s-s", {"cgroup.procs": ""})
    v2.limit("s", 64, 512, Shares(100, 300))
    assert (user / "pids.max").read_text() == "100" and (user / "memory.max").read_text() == str(300 << 20)
    assert (user / "s-s" / "pids.max").read_text() == "100"
    _files(user, {"pids.current": "95\n"})
    assert "max_processes_per_uid" in v2.user_room(1000)
    # A new session of the same owner: its level keeps (or gets) the share.
    v2.attach("t", 12345, 1024, None, uid=1000, share=Shares(80, 200))
    assert (user / "pids.max").read_text() == "80" and (user / "s-t" / "pids.max").read_text() == "80"
    assert (user / "s-t" / "memory.max").read_text() == str(1024 << 20)  # the owner's 200 MiB holds above it
    assert (user / "s-t" / "memory.oom.group").read_text() == "1"
    assert (user / "s-t" / "cgroup.procs").read_text() == "12345"
    assert v2.user_room(2000) == ""  # no such level yet: room


# ---------------------------------------------------------------- a daemon blind to its workers


@pytest.mark.pure
def test_a_blind_daemon_without_a_cgroup_is_unmeasured() -> None:
    hidden = "its workers' /proc entries are hidden from it (No such file or directory: ...)"
    assert sandbox.unmeasured("", set()) == ""
    assert sandbox.unmeasured(hidden, {"memory", "pids"}) == ""  # the kernel counts them instead
    why = sandbox.unmeasured(hidden, {"memory"})
    assert hidden in why and "max_memory_mb" in why and "Delegate=yes" in why
    refused = Config().sandbox.refusal(True, "", 7, "", why)
    assert refused.startswith("tools do not run") and "hidden" in refused


@pytest.mark.component
def test_the_daemon_can_read_a_non_dumpable_child_without_hidepid() -> None:
    """This process's /proc has no hidepid: the probe finds nothing hidden
    (the hidden case runs in tests/test_unit_users.py, on a hidepid /proc)."""
    assert sandbox.workers_hidden() == ""


@pytest.mark.pure
def test_a_tool_host_that_cannot_be_forked_is_told_which_ceilings_may_be_full() -> None:
    from session_worker.worker.sandbox import _fork_error

    eagain = _fork_error(BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"))
    assert "max_processes" in eagain and "max_processes_per_uid" in eagain and "TasksMax" in eagain
    assert "ENOMEM" in _fork_error(OSError(errno.ENOMEM, "Cannot allocate memory"))
