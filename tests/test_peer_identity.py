"""Who counts as a session's process (supervisor.api.peer.in_session), with real
processes: by what a tool cannot shed (its uid, its PID namespace, its
cgroup, its ancestry read through pidfds), not by what /proc shows.

The hidepid cases run the daemon's side in a mount namespace of its own
whose /proc is mounted `hidepid=invisible` (what `ProtectProc=invisible`
gives the shipped unit), as root without CAP_SYS_PTRACE: a non-dumpable
process is then invisible to it, as a tool's is to an unprivileged daemon.

Each case calls the check through `_check`, which also speaks the old
signature, so that the same test shows what the old check answered.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.api import peer

REPO = Path(__file__).resolve().parent.parent
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces, mounts and other uids need root")
SESSION_UIDS = range(1879048192, 1879113728)  # the default [daemon] session_uid_range


def _check(conn: Any, cred: Any, roots: frozenset[int], daemon_uid: int, span: range | None = None) -> str:
    """The check as the daemon makes it: a reason to refuse, '' to admit."""
    if len(inspect.signature(peer.in_session).parameters) == 4:
        return str(peer.in_session(conn, cred, roots, peer.SessionUids(daemon_uid, None, span)))
    try:  # the old check: ancestry through /proc only
        return "inside" if peer.in_session(conn, cred.pid, roots) else ""  # type: ignore[arg-type]
    except peer.AncestryChanged as exc:
        return f"refused: {exc}"


# The daemon's side, run in the hidepid=invisible namespace.  Prints one
# JSON object: scenario -> the check's answer.
_HIDDEN = r"""
import ctypes, json, os, socket, sys
sys.path.insert(0, sys.argv[2])
from test_peer_identity import _check
from supervisor.api import peer

libc = ctypes.CDLL(None, use_errno=True)
path = os.path.join(sys.argv[1], "ctl.sock")
srv = socket.socket(socket.AF_UNIX)
srv.bind(path)
os.chmod(path, 0o777)  # for the other uid's peer
srv.listen(8)
srv.settimeout(20)

def fork(fn):
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        except BaseException:
            import traceback; traceback.print_exc()
        os._exit(0)
    return pid

def connect():
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.recv(1)  # until the daemon's side is done with us

def non_dumpable(then):
    def run():
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
        then()
    return run

def dumpable(then):
    # What an exec does to a non-dumpable parent's child.
    def run():
        libc.prctl(4, 1, 0, 0, 0)
        then()
    return run

def as_uid(uid, then):
    def run():
        os.setgroups([]); os.setgid(uid); os.setuid(uid)
        then()
    return run

def spawner(child):
    # A zygote (or any parent): starts `child` and waits for it.
    def run():
        fork(child)
        os.wait()
    return run

def ask(top, roots_of):
    pid = fork(top)
    conn, _ = srv.accept()
    cred = peer.credentials(conn)
    try:
        visible = os.path.exists(f"/proc/{cred.pid}/stat")
        parent_visible = os.path.exists(f"/proc/{pid}/stat")
        return {"answer": _check(conn, cred, roots_of(pid), os.geteuid()),
                "visible": visible, "parent_visible": parent_visible}
    finally:
        conn.close()
        os.waitpid(pid, 0)

out = {}
unrelated = lambda pid: frozenset({10**7})
# A tool that made itself non-dumpable, under the zygote.
out["hidden_tool"] = ask(spawner(non_dumpable(connect)), lambda pid: frozenset({pid}))
# The daemon user's own sessionctl, whose parent is hidden (non-dumpable):
# not under the zygote, and every ancestor readable through its pidfd.
out["legit_hidden_parent"] = ask(non_dumpable(spawner(dumpable(connect))), unrelated)
# A peer of a uid that can never run sessions, itself hidden: never
# refused for what cannot be read.
out["other_uid_hidden"] = ask(as_uid(65534, non_dumpable(connect)), unrelated)
# The daemon's uid, hidden, not under the zygote: ambiguous, so inside.
out["daemon_uid_hidden"] = ask(non_dumpable(connect), unrelated)
if hasattr(peer, "_info_supported"):
    # A kernel without PIDFD_GET_INFO: the walk through /proc cannot see
    # the tool, and that counts as inside for the daemon's uid.
    peer._info_supported = False
    out["hidden_tool_old_kernel"] = ask(spawner(non_dumpable(connect)), lambda pid: frozenset({pid}))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hidden() -> dict[str, dict[str, Any]]:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        pytest.skip("needs root, unshare and setpriv")
    tmp = Path(tempfile.mkdtemp(prefix="sd-peer-"))  # reachable by the other uid, unlike tmp_path
    os.chmod(tmp, 0o755)
    script = tmp / "side.py"
    script.write_text(_HIDDEN)
    # gid=: the members of that group see every process (the default, 0, is ours)
    mount = "mount -t proc -o hidepid=invisible,gid=4242424 proc /proc"
    run = (f"exec setpriv --bounding-set -sys_ptrace --inh-caps -sys_ptrace "
           f"{sys.executable} {script} {tmp} {REPO / 'tests'}")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", f"{mount} && {run}"],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    shutil.rmtree(tmp)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.process
def test_a_non_dumpable_tool_under_hidepid_is_inside(hidden: dict[str, dict[str, Any]]) -> None:
    """The issue's bypass: the tool is invisible in /proc, and the old walk
    answered "not in a session" for it."""
    case = hidden["hidden_tool"]
    assert not case["visible"], "the setup must hide the tool"
    assert "zygote" in case["answer"], case


@pytest.mark.process
def test_the_daemon_users_own_client_with_a_hidden_ancestor_is_admitted(
        hidden: dict[str, dict[str, Any]]) -> None:
    """The old walk refused it ("kept changing") when an ancestor was hidden."""
    case = hidden["legit_hidden_parent"]
    assert case["visible"] and not case["parent_visible"], "the setup must hide its parent only"
    assert case["answer"] == "", case


@pytest.mark.process
def test_what_cannot_be_read_refuses_the_daemons_uid_and_no_other(hidden: dict[str, dict[str, Any]]) -> None:
    assert not hidden["other_uid_hidden"]["visible"]
    assert hidden["other_uid_hidden"]["answer"] == "", hidden["other_uid_hidden"]
    assert not hidden["daemon_uid_hidden"]["visible"]
    assert "may be a session's" in hidden["daemon_uid_hidden"]["answer"], hidden["daemon_uid_hidden"]
    assert "may be a session's" in hidden.get("hidden_tool_old_kernel", {}).get("answer", ""), hidden


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every uid can reach (tmp_path's parents are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="sd-peer-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


def _listener(tmp_path: Path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "ctl.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(4)
    return srv, path


def _connect_code(path: str) -> str:
    return f"import socket; s=socket.socket(socket.AF_UNIX); s.connect({path!r}); s.recv(1)"


def _ask(srv: socket.socket, proc: subprocess.Popen[bytes] | int, span: range | None = None) -> tuple[str, Any]:
    conn, _ = srv.accept()
    try:
        cred = peer.credentials(conn)
        return _check(conn, cred, frozenset({10**7}), os.geteuid(), span), cred
    finally:
        conn.close()
        if isinstance(proc, int):
            os.waitpid(proc, 0)
        else:
            proc.wait(timeout=30)


@pytest.mark.process
@root_only
def test_a_process_with_a_uid_of_the_session_range_is_inside(open_dir: Path) -> None:
    srv, path = _listener(open_dir)
    uid = SESSION_UIDS.start + 4242
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.recv(1)
        finally:
            os._exit(0)
    with srv:
        answer, cred = _ask(srv, pid, SESSION_UIDS)
    assert cred.uid == uid
    assert "session_uid_range" in answer, answer


@pytest.mark.process
@root_only
def test_a_process_in_a_pid_namespace_of_its_own_is_inside(open_dir: Path) -> None:
    """Not under the zygote (a namespace's init re-parents nothing to us),
    and still a session's: sessions are what run in namespaces here."""
    srv, path = _listener(open_dir)
    proc = subprocess.Popen(["unshare", "-p", "-f", "--kill-child", sys.executable, "-c", _connect_code(path)])
    with srv:
        answer, _ = _ask(srv, proc)
    assert "PID namespace" in answer, answer


@pytest.mark.process
@root_only
def test_a_process_in_a_sessions_cgroup_is_inside(open_dir: Path) -> None:
    hierarchy = Path("/sys/fs/cgroup/pids")
    if not (hierarchy / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 pids hierarchy")
    top = hierarchy / f"peer-test-{uuid.uuid4().hex[:8]}"
    cgroup = top / "sessions" / "s-tool"
    cgroup.mkdir(parents=True)
    srv, path = _listener(open_dir)
    try:
        code = f"open({str(cgroup / 'cgroup.procs')!r}, 'w').write('0'); " + _connect_code(path)
        proc = subprocess.Popen([sys.executable, "-c", code])
        with srv:
            answer, _ = _ask(srv, proc)
        assert "is a session's" in answer and "sessions/s-tool" in answer, answer
    finally:
        for d in (cgroup, cgroup.parent, top):
            d.rmdir()


@pytest.mark.process
def test_an_ordinary_client_is_admitted(open_dir: Path) -> None:
    srv, path = _listener(open_dir)
    proc = subprocess.Popen([sys.executable, "-c", _connect_code(path)])
    with srv:
        answer, _ = _ask(srv, proc, SESSION_UIDS)
    assert answer == ""


@pytest.mark.pure
def test_session_cgroup_paths() -> None:
    assert peer.session_cgroup(["/system.slice/sessiond.service/sessions/s-abc"])
    assert peer.session_cgroup(["/", "/sessiond/s-abc/tools"])
    assert not peer.session_cgroup(["/system.slice/sessiond.service/daemon", "/user.slice/s-x"])
    assert not peer.session_cgroup(["/sessions", "/sessiond.service/s-1"])



# ---------------------------------------------------------------- the daemon, as the unit runs it


@pytest.fixture
def unit_daemon(make_daemon: Any, reachable_dir: Any, llm: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The shipped unit emulated: an ordinary-user daemon (nobody), tools of
    its uid with no sandbox, and a /proc mounted hidepid=invisible
    (`ProtectProc=invisible`) in the daemon's mount namespace."""
    from test_security_proc import NOBODY, agent_config

    if os.geteuid() != 0:
        pytest.skip("running a daemon as another user needs root")
    base = reachable_dir("sd-unit-")
    monkeypatch.setenv("SESSIOND_API_KEY", "sk-unit")
    d = make_daemon(agent_config(llm, "off"), start=False, root=base / "d")
    d.run_as_user(NOBODY, NOBODY)
    at = next(i for i, part in enumerate(d.cmd_prefix) if "exec setpriv" in part)
    script = d.cmd_prefix[at]
    d.cmd_prefix[at] = script.replace("exec setpriv", "mount -t proc -o hidepid=invisible proc /proc && exec setpriv", 1)
    d.start()
    return d


@pytest.mark.process
def test_a_non_dumpable_tool_cannot_drive_the_unit_daemon(unit_daemon: Any, llm: Any) -> None:
    """The issue's attack: with ProtectProc=invisible, a tool that made
    itself non-dumpable got `ls` (and `create`) as the daemon's uid."""
    from fakellm import text_stream, tool_call_stream

    d = unit_daemon
    with d.client() as c:
        sid = c.create().id
    code = ("import ctypes, sys; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); "
            "from supervisor.ctl import cli as ctl; sys.exit(ctl.main(['--socket', sys.argv[1], 'ls']))")
    command = f"{sys.executable} -c \"{code}\" {d.socket}; echo rc=$?; grep -c hidepid /proc/mounts"
    llm.script(tool_call_stream(("c1", "bash", {"command": command})), text_stream("done"))
    with d.client() as c:
        assert c.send_text(sid, "go") == "done"
    out = [msg["content"] for msg in llm.requests[1].json["messages"] if msg["role"] == "tool"][0]
    assert "rc=1" in out and "connections from inside a session" in out, out
    assert sid not in out.split("rc=")[0]  # no listing


@pytest.mark.process
def test_the_unit_daemons_own_user_with_a_hidden_parent_is_served(unit_daemon: Any) -> None:
    """The same walk refused the daemon user's own sessionctl when an
    ancestor was invisible to the daemon."""
    from harness import run_as
    from test_security_proc import NOBODY

    d = unit_daemon

    def hidden_parent() -> Any:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(4, 0, 0, 0, 0)  # this process: invisible to the daemon
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the client, dumpable again (as after an exec)
            code = 1
            try:
                libc.prctl(4, 1, 0, 0, 0)
                from supervisor.ctl.client import Client

                with Client(d.socket) as c:
                    os.write(w, str(len(c.list())).encode())
                code = 0
            except BaseException as exc:
                os.write(w, f"error: {exc}".encode())
            finally:
                os._exit(code)
        os.close(w)
        os.waitpid(pid, 0)
        return os.read(r, 4096).decode()

    answer = run_as(NOBODY, hidden_parent)
    assert answer == "0", answer
