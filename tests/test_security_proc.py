"""Security audit (issue 9), the process side: what a session's own tools,
or any process of the daemon's uid, can reach of the daemon and its workers.

Each test plays the attack through the public surface (a session's `bash`
tool driven by the fake LLM, or a plain process of the same uid) and checks
that it now does no harm.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import FAST_SWEEP, Daemon, env_for_children, run_as, wait_for
from test_agent_e2e import agent_config as e2e_agent_config
from ipc import messages as m

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="running a daemon as another user needs root")
SECRET = "sk-audit-canary-0123456789"


@pytest.fixture
def shared_root(reachable_dir: Callable[..., Path]) -> Path:
    """A daemon root another user can reach (pytest's temp dirs are root's
    alone), as /var/lib would be."""
    return reachable_dir("sd-proc-") / "d"


FAST_STOP = """
[agent.worker]
heartbeat_interval_secs = 0.2
restart_backoff_initial_ms = 20
[daemon]
stop_grace_secs = 3.0
"""


def agent_config(llm: FakeLLM, sandbox: str = "auto") -> str:
    return e2e_agent_config(
        llm, f"[agent.limits]\nmemory_poll_interval_ms = 50\n[sandbox]\nmode = \"{sandbox}\"\n",
        key_env="SESSIOND_API_KEY",
    )


def _open_as(uid: int, paths: list[str]) -> dict[str, int]:
    """Fork, become `uid`, try to open each path; errno per path (0: opened)."""

    def try_all() -> dict[str, int]:
        out: dict[str, int] = {}
        for path in paths:
            try:
                os.close(os.open(path, os.O_RDONLY))
                out[path] = 0
            except OSError as exc:
                out[path] = exc.errno or -1
        return out

    result: dict[str, int] = run_as(uid, try_all)
    return result


@pytest.mark.process
@root_only
@pytest.mark.parametrize("sandbox", ["off", "auto"])
def test_same_uid_tools_cannot_read_the_daemons_or_a_workers_secrets(
    make_daemon, llm: FakeLLM, shared_root: Path, monkeypatch: pytest.MonkeyPatch, sandbox: str
) -> None:
    """Daemon and workers run as one unprivileged user, as they do without
    root.  Before PR_SET_DUMPABLE=0 the session's own `bash` tool (same
    uid) read the provider key from /proc/<daemon or worker>/environ.  With
    the sandbox off, non-dumpable processes are the only layer; with it on,
    the daemon and the worker are not even in the tool's /proc."""
    monkeypatch.setenv("SESSIOND_API_KEY", SECRET)
    d = make_daemon(agent_config(llm, sandbox), start=False, root=shared_root)
    d.run_as_user(NOBODY, NOBODY)
    d.start()
    with d.client() as c:
        sid = c.create().id
        worker = c.status(sid).pid
        assert psutil.Process(d.pid).uids().real == NOBODY
        assert psutil.Process(worker).uids().real == NOBODY
        targets = [f"/proc/{d.pid}/environ", f"/proc/{worker}/environ",
                   f"/proc/{d.pid}/mem", f"/proc/{worker}/mem"]
        probe = "; ".join(
            f"if (exec 3<{t}) 2>/dev/null; then echo OPENED {t}; else echo DENIED {t}; fi"
            for t in targets
        )
        command = (
            f"echo PARENT $PPID UID $(id -u); {probe}; "
            f"ls /proc/{d.pid}/fd >/dev/null 2>&1 && echo OPENED fd || echo DENIED fd; "
            f"cat /proc/{d.pid}/environ /proc/{worker}/environ /proc/$PPID/environ 2>/dev/null "
            "| tr '\\0' '\\n'; echo ENV; env"
        )
        llm.script(tool_call_stream(("c1", "bash", {"command": command})), text_stream("done"))
        events = list(c.send(sid, "look around"))
        assert isinstance(events[-1], m.TurnDone) and events[-1].reply == "done"
    result = next(msg["content"] for msg in llm.requests[1].json["messages"] if msg["role"] == "tool")
    if sandbox == "off":
        assert f"PARENT {worker} UID {NOBODY}" in result
    else:  # started by the session's tool host, as the same user
        assert f"UID {NOBODY}" in result and f"PARENT {worker} " not in result
    for t in targets:
        assert f"DENIED {t}" in result, result
    assert "DENIED fd" in result and "OPENED" not in result, result
    # Nothing of the daemon's environment reached the tool: not the key, not its name.
    assert SECRET not in result and "SESSIOND_API_KEY" not in result, result
    assert "SESSIOND" not in result.split("ENV", 1)[1]
    # The LLM did get the key: the worker holds it, it just cannot be read.
    headers = {k.lower(): v for k, v in llm.requests[0].headers.items()}
    assert headers["authorization"] == f"Bearer {SECRET}"

    # A plain process of the same uid fares no better.
    opened = _open_as(NOBODY, targets)
    assert opened == dict.fromkeys(targets, errno.EACCES), opened


@pytest.mark.process
@root_only
def test_an_unprivileged_daemon_still_measures_non_dumpable_workers(
    make_daemon, shared_root: Path
) -> None:
    """Non-dumpable workers' /proc files belong to root: the daemon, not
    root, must still read their statm and task/children (mode 0444), or
    memory caps would silently stop working."""
    d = make_daemon(FAST_SWEEP, start=False, root=shared_root)
    d.run_as_user(NOBODY, NOBODY)
    d.start()
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:leaky",
                       settings={"agent.limits.max_memory_mb": 64}).id
        worker = c.status(sid).pid
        assert os.stat(f"/proc/{worker}/statm").st_uid == 0  # non-dumpable
        events = list(c.send(sid, "400"))
        assert isinstance(events[-1], m.TurnFailed) and "killed_memory" in events[-1].reason
        # A descendant's memory is found through the worker's task/children.
        hog = c.create(handler="fixture_handlers:child_hog",
                       settings={"agent.limits.max_memory_mb": 96}).id
        events = list(c.send(hog, "300"))
        assert isinstance(events[-1], m.TurnFailed) and "killed_memory" in events[-1].reason
        wait_for(lambda: c.status(sid).state == "idle", 10, "the restart")


# --- the zygote's re-exec ------------------------------------------------------


def _zygote(d: Daemon) -> psutil.Process | None:
    """The daemon's one child process, if it has one right now."""
    try:
        kids = psutil.Process(d.pid).children()
        return kids[0] if len(kids) == 1 and kids[0].status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


@pytest.mark.process
def test_a_new_zygote_does_not_import_from_the_daemons_cwd(daemon: Daemon) -> None:
    """`python -m <package>.zygote` used to put the daemon's working
    directory first on sys.path: a package planted there ran as the
    daemon's user (root) at the next zygote restart."""
    marker = daemon.root / "planted-code-ran"
    assert Path(psutil.Process(daemon.pid).cwd()) == daemon.root
    payload = f"open({str(marker)!r}, 'w').write('pwned')\n"
    for package in ("supervisor", "session_worker", "ipc"):
        planted = daemon.root / package
        planted.mkdir()
        (planted / "__init__.py").write_text(payload)
        (planted / "zygote.py").write_text(payload)
    first = _zygote(daemon)
    assert first is not None
    first.kill()
    new = wait_for(lambda: (z := _zygote(daemon)) is not None and z.pid != first.pid and z,
                   10, "a new zygote")
    with daemon.client() as c:
        sid = wait_for(lambda: marker.exists() or _try_create(c), 10, "a session on the new zygote")
        assert not marker.exists()
        assert c.send_text(str(sid), "hi") == "1: hi"
    # The title (sessiond: zygote (CMDLINE)) keeps the exec'd command line.
    assert "-P" in " ".join(new.cmdline()).split()


def _try_create(c: Any) -> str | None:
    from supervisor.ctl.client import RequestError

    try:
        return str(c.create().id)
    except RequestError:
        return None


@pytest.mark.process
def test_a_zygote_that_keeps_dying_is_restarted_with_backoff(daemon: Daemon) -> None:
    """Before: 84 zygotes in 2.5 s.  Now the delay doubles after each quick
    death; meanwhile creating a session fails with a clear error and the
    daemon answers everything else."""
    from supervisor.ctl.client import RequestError

    seen: set[int] = set()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        z = _zygote(daemon)
        if z is not None:
            seen.add(z.pid)
            with contextlib.suppress(psutil.Error):
                z.kill()
        time.sleep(0.002)
    # Kill the current one, if any, so the next restart is surely far off.
    z = _zygote(daemon)
    if z is not None:
        seen.add(z.pid)
        z.kill()
    assert 3 <= len(seen) <= 10, len(seen)
    # The create below must find no zygote: kill each new one until the
    # daemon's backoff says the next is at least 3.2 s off (on a busy
    # machine fewer die in the 3 s above, and a short delay had run out
    # before the create came: DID NOT RAISE).
    while (delay := _last_restart_delay(daemon)) < 3.2:
        deaths = daemon.log.count("starting a new one")
        z = wait_for(lambda: _zygote(daemon), 30, f"a new zygote (the last delay was {delay}s)")
        with contextlib.suppress(psutil.Error):
            z.kill()
        wait_for(lambda: daemon.log.count("starting a new one") > deaths, 30, "the daemon to see it die")
    with daemon.client() as c:
        with pytest.raises(RequestError) as err:
            c.create()
        assert err.value.code == "internal" and "zygote" in err.value.message
        assert c.ping().pid == daemon.pid
        # Once the backoff has run out, a new zygote serves again.
        sid = wait_for(lambda: _try_create(c), 30, "a zygote to be back")
        assert c.send_text(sid, "hi") == "1: hi"
    assert "starting a new one in" in daemon.log


def _last_restart_delay(daemon: Daemon) -> float:
    """The delay the daemon gave its last zygote's restart (0: at once)."""
    said = [line for line in daemon.log.splitlines() if "starting a new one" in line]
    if not said or " in " not in said[-1].rsplit("starting a new one", 1)[1]:
        return 0.0
    return float(said[-1].rsplit(" in ", 1)[1].rstrip().removesuffix("s"))


@pytest.mark.pure
def test_zygote_backoff_policy() -> None:
    from supervisor.spawn.spawner import ZygoteBackoff

    b = ZygoteBackoff(initial_secs=0.1, max_secs=1.0, stable_secs=10.0)
    assert [b.delay_after_death(0.5) for _ in range(7)] == [0.0, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert b.delay_after_death(10.0) == 0.0  # it had been running fine: at once
    assert b.delay_after_death(0.1) == 0.1


# --- every ancestor of the socket and of the state dir -------------------------


def _run_daemon_briefly(state: Path, sock: Path) -> subprocess.CompletedProcess[str]:
    """Start a daemon that should refuse to start; if it starts anyway (the
    attack worked), stop it so the test fails instead of hanging."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "run", "--state-dir", str(state), "--socket", str(sock)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for_children(),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.process
@root_only
@pytest.mark.parametrize("which", ["state", "socket"])
def test_a_squatted_ancestor_is_refused(tmp_path: Path, which: str) -> None:
    """Someone else's directory between / and ours: they can rename our
    directory away and put their own (a fake socket, forged state) in its
    place, even though our directory itself is ours."""
    squat = tmp_path / "squat"
    squat.mkdir(mode=0o755)
    os.chown(squat, NOBODY, NOBODY)
    mine = squat / "mine"
    mine.mkdir(mode=0o700)  # ours (root's), and its parent is not
    safe = tmp_path / "safe"
    safe.mkdir()
    state, sock = (mine / "state", safe / "s.sock") if which == "state" else (safe / "state", mine / "s.sock")
    r = _run_daemon_briefly(state, sock)
    assert r.returncode == 1, r.stderr
    assert f"{squat} belongs to uid {NOBODY} (nobody)" in r.stderr and "Traceback" not in r.stderr
    assert ("state directory" if which == "state" else "socket directory") in r.stderr
    assert not sock.exists()


@pytest.mark.process
@root_only
@pytest.mark.parametrize("which", ["state", "socket"])
def test_a_group_writable_ancestor_is_refused(tmp_path: Path, which: str) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    (shared / "deeper").mkdir(mode=0o755)
    safe = tmp_path / "safe"
    safe.mkdir()
    inside = shared / "deeper" / "sessiond"
    state, sock = (inside, safe / "s.sock") if which == "state" else (safe / "state", inside / "s.sock")
    r = _run_daemon_briefly(state, sock)
    assert r.returncode == 1, r.stderr
    assert f"{shared} is writable by its group (mode 0775, owner uid 0) without the sticky bit" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.process
def test_a_sticky_world_writable_parent_is_fine(make_daemon, reachable_dir: Callable[..., Path]) -> None:
    """Like /tmp: others may write, but not rename what is ours."""
    sticky = reachable_dir("sd-sticky-", 0o1777)
    d = make_daemon(start=False)
    d.state_dir = sticky / "state"
    d.start()
    with d.client() as c:
        assert c.send_text(c.create().id, "hi") == "1: hi"
    assert (sticky / "state" / "sessions").is_dir()


# --- kills by pidfd ----------------------------------------------------------


class _Stranger:
    """A `sleep 60` started by posix_spawn, with Popen's poll/kill/wait."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def _process_with_pid(target: int, timeout: float = 15.0) -> _Stranger:
    """An unrelated process that has the number `target`, made by steering
    the kernel's next pid (root only).  Other tests fork meanwhile, and one
    of theirs may hold the number a while: keep trying until the deadline,
    each try a posix_spawn right after the write (a window of microseconds),
    and fail, not skip, if the number never comes back."""
    sleep = shutil.which("sleep") or "/bin/sleep"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(target - 1))
        proc = _Stranger(os.posix_spawn(sleep, ["sleep", "60"], os.environ))
        if proc.pid == target:
            return proc
        proc.kill()
        proc.wait()
        if os.path.exists(f"/proc/{target}"):
            time.sleep(0.01)  # another process holds it now: let it end
    raise AssertionError(f"pid {target} never came back within {timeout:.0f} s (held by another process)")


@pytest.mark.process
@root_only
def test_a_reused_pid_is_not_killed_at_the_end_of_a_stop(make_daemon) -> None:
    """Stop remembered the session's escaped tools by number and killed
    them `stop_grace_secs` later; one that exited in between could have its
    number reused by an unrelated process, which then got the SIGKILL."""
    # The grace period the stubborn tool holds the stop for is the time the
    # stranger has to take the escapee's number.
    d = make_daemon(FAST_STOP.replace("stop_grace_secs = 3.0", "stop_grace_secs = 8.0"))
    stranger = None
    with d.client() as c, d.client() as c2:
        sid = c.create(handler="fixture_handlers:tools").id
        worker = c.status(sid).pid
        stream = c.send(sid, "go")
        pids = next([int(x) for x in ev.text.split()[1:]] for ev in stream
                    if isinstance(ev, m.TextDelta) and ev.text.startswith("pids"))
        escapee = pids[2]
        wait_for(lambda: os.getpgid(escapee) != worker, 5, "the escapee to leave the group")
        stopper = threading.Thread(target=c2.stop, args=(sid,))
        stopper.start()
        try:
            # SIGTERM ends the escapee (a plain sleep) at once; the stubborn
            # tool keeps the stop waiting for its grace period.
            wait_for(lambda: not os.path.exists(f"/proc/{escapee}"), 5, "the escapee to be reaped")
            stranger = _process_with_pid(escapee, timeout=6.0)
            assert stopper.is_alive(), "the stop ended before the stranger existed"
        finally:
            stopper.join(20)
        try:
            assert stranger.poll() is None, "an unrelated process with a reused pid was killed"
        finally:
            stranger.kill()
            stranger.wait()
        wait_for(lambda: not any(psutil.pid_exists(p) and _alive(p) for p in [worker, *pids[:2]]),
                 5, "the session's processes to be gone")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.process
@root_only
def test_proc_table_pidfd_refuses_a_reused_number() -> None:
    from supervisor.host.proctable import ProcTable

    table = ProcTable()
    first = subprocess.Popen(["sleep", "60"])
    try:
        assert table.rss(first.pid)  # statm opened: bound to this process
        first.kill()
        first.wait()
        second = _process_with_pid(first.pid)
        try:
            assert table.pidfd(first.pid) is None
        finally:
            second.kill()
            second.wait()
        third = subprocess.Popen(["sleep", "60"])
        assert table.rss(third.pid)
        handle = table.pidfd(third.pid)
        assert handle is not None and handle.send(0)
        third.kill()
        third.wait()
        assert not handle.send(0) and handle.exited()
        handle.close()
    finally:
        table.close()


@pytest.mark.process
def test_daemon_fds_stay_flat_across_create_and_remove(make_daemon) -> None:
    # No spare workers: then the zygote is the daemon's only descendant at rest.
    # Each remove of a `tools` session waits out the grace its stubborn tool
    # ignores SIGTERM for: 1 s of it is as good as 3 s for counting fds.
    daemon = make_daemon(FAST_STOP.replace("[daemon]", "[daemon]\nspare_workers = 0")
                         .replace("stop_grace_secs = 3.0", "stop_grace_secs = 1.0"))
    fds = lambda: len(os.listdir(f"/proc/{daemon.pid}/fd"))  # noqa: E731
    with daemon.client() as c:
        for _ in range(2):  # warm up: lazily opened files, the first worker
            sid = c.create().id
            c.send_text(sid, "hi")
            c.remove(sid)
        wait_for(lambda: len(daemon.descendants()) <= 1, 10, "workers to go")
        baseline = fds()
        for i in range(10):  # a leak of one fd a cycle (or one in five) shows
            sid = c.create(handler="fixture_handlers:tools" if i % 5 == 0 else "echo").id
            if i % 5 == 0:
                stream = c.send(sid, "go")
                next(ev for ev in stream if isinstance(ev, m.TextDelta))
            else:
                assert c.send_text(sid, "hi") == "1: hi"
            c.remove(sid)
        wait_for(lambda: fds() <= baseline, 10, f"the daemon's fds to come back to {baseline} (now {fds()})")
        wait_for(lambda: len(daemon.descendants()) <= 1, 10, "every worker and tool to be gone")
