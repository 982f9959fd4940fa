"""The hostile-tool suite inside the shipped systemd unit.

The daemon is started as systemd/sessiond.service runs it (harness
`Daemon.run_as_unit`, read from the unit file): root with privilege
separation, the unit's capability bounding set, no_new_privs, a /proc with
hidepid=invisible, a read-only system and a private /tmp.  Its store is a
real PostgreSQL server on a Unix socket with peer authentication, the
daemon logging in as its OS user's role (root), as the README advised.

From inside a session's `bash` (the agent's tool, scripted by the fake LLM)
each attack of issue 21 is replayed: the store's socket, a planted
world-writable socket, a non-dumpable tool at the control socket, killing
the tool host with a setsid'd memory hog, memfd and /tmp, the workspace's
disk, inherited fds, every live slot, a fork bomb.  Each must fail or be
contained as documented, another session keeps answering, and nothing of the
session is left after `rm`.  Which mechanisms were active is printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import tomli_w

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import SERVICE, Daemon, UnitEmulation, run_as, wait_for
from ipc import messages as m
from pg_server import PgServer
# Imported here, not in the function run_as forks as nobody: a clean clone
# in a 0700 mktemp directory is out of that user's reach.
from supervisor.client import Client, RequestError
from test_access import NOBODY, open_root, root_only  # noqa: F401 (fixture)
from test_agent_e2e import agent_config, tool_results
from test_sandbox import DRIVE_DAEMON, mechanisms, shell_quote

pytestmark = [pytest.mark.process, root_only]

SECRET = "victim-secret-2121"
SESSION_UIDS = (1879048192, 1879113727)  # [daemon] session_uid_range default


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-operator-key-0021")
    assert shutil.which("bwrap") and shutil.which("setpriv") and shutil.which("psql")


class PeerPg:
    """A PostgreSQL server on a Unix socket only, with peer authentication:
    an OS user logs in as the role of its own name and no other.  The daemon
    (root) has a role `root` owning database `sessiond`."""

    def __init__(self) -> None:
        self.server = PgServer(flush=False)  # (tests/pg_server.py: what a crash keeps, unflushed)
        self.socket_dir = self.server.root
        # `nobody` stands in for the old unit's User=sessiond (the control test).
        for sql in ("CREATE ROLE root LOGIN", "CREATE DATABASE sessiond OWNER root", "CREATE ROLE nobody LOGIN",
                    "GRANT nobody TO root"):
            self.psql_as_postgres(sql)
        hba = self.server.data / "pg_hba.conf"
        hba.write_text("local all all peer\n")
        shutil.chown(hba, "postgres", "postgres")
        self.server._run("pg_ctl", "-D", str(self.server.data), "reload")
        wait_for(self._peer_only, 10, "peer authentication to be in force")

    def psql_as_postgres(self, sql: str) -> str:
        done = subprocess.run(
            ["runuser", "-u", "postgres", "--", "psql", "-h", str(self.socket_dir), "-d", "postgres",
             "-XAtc", sql], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def _peer_only(self) -> bool:
        # root may not claim to be postgres any more.
        done = subprocess.run(["psql", "-h", str(self.socket_dir), "-U", "postgres", "-d", "postgres",
                               "-XAtc", "select 1"], capture_output=True, text=True, timeout=60)
        return done.returncode != 0 and "Peer authentication failed" in done.stderr

    @property
    def dsn(self) -> str:
        return f"host={self.socket_dir} dbname=sessiond user=root"

    def query(self, sql: str) -> str:
        """As the daemon's role (root, peer-authenticated)."""
        done = subprocess.run(["psql", "-h", str(self.socket_dir), "-d", "sessiond", "-XAtc", sql],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def close(self) -> None:
        self.server.close()


@pytest.fixture(scope="module")
def peer_pg() -> Iterator[PeerPg]:
    pg = PeerPg()
    try:
        yield pg
    finally:
        pg.close()


def unit_config(llm: FakeLLM, pg: PeerPg, limits: str = "", daemon: str = "", role: str = "root") -> str:
    """The operator's config under the unit: defaults (a uid per session,
    sandbox auto) plus the fake provider, the PostgreSQL store and the test
    handlers; `root` is never allowed to run tools."""
    text = agent_config(llm, f"[agent.limits]\nmemory_poll_interval_ms = 50\n{limits}\n")
    data = tomllib.loads(text)
    data["agent"]["allowed_handlers"] = ["agent", "echo", "fixture_handlers:*"]
    data["daemon"].update(tomllib.loads(daemon) if daemon else {})
    # A schema per daemon, so runs do not see each other's sessions.
    schema = f"t{os.getpid()}_{next(_schemas)}"
    pg.query(f"CREATE SCHEMA {schema} AUTHORIZATION {role}")
    dsn = pg.dsn.replace("user=root", f"user={role}")
    data["store"] = {"backend": "postgres", "dsn": f"{dsn} options='-c search_path={schema}'"}
    return tomli_w.dumps(data)


_schemas = iter(range(1, 10**6))


def start_unit(make_daemon, llm: FakeLLM, pg: PeerPg, root: Path, limits: str = "",
               daemon: str = "") -> tuple[Daemon, UnitEmulation]:
    d = make_daemon(unit_config(llm, pg, limits, daemon), start=False, root=root / "d", trust=False)
    unit = d.run_as_unit(SERVICE, visible=(pg.socket_dir,))
    d.start(timeout=60)
    return d, unit


def session_procs(uid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["uids"]):
        with contextlib.suppress(psutil.Error):
            if p.info["uids"] and p.info["uids"].real == uid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def uid_of(pid: int) -> int:
    return psutil.Process(pid).uids().real


def tool(d: Daemon, llm: FakeLLM, sid: str, command: str) -> tuple[str, list[Any]]:
    """Run `command` in the session's bash; (its output, the turn's events)."""
    llm.script(tool_call_stream(("t", "bash", {"command": command})), text_stream("done"))
    with d.client() as c:
        events = list(c.send(sid, "go"))
    results = tool_results(llm.requests[-1].json) if llm.requests else []
    return (results[-1] if results else ""), events


def show(what: str, d: Daemon, sid: str, unit: UnitEmulation, capsys: pytest.CaptureFixture[str]) -> dict:
    """Print which mechanisms this unit's sessions have, and return them."""
    report = mechanisms(d, sid)
    stats = json.loads(d.ctl("--json", "stats").stdout).get("sandbox", {})
    with capsys.disabled():
        print(f"\n[unit {what}] {unit.describe()}\n  session: active {', '.join(report.get('active', []))}; "
              f"inactive {report.get('inactive') or 'none'}; network {report.get('network', '-')}\n"
              f"  daemon: {json.dumps(stats, sort_keys=True)}")
    return report


def assert_session_gone(d: Daemon, sid: str, uid: int) -> None:
    with d.client() as c:
        c.remove(sid)
    wait_for(lambda: not session_procs(uid), 15,
             f"every process of uid {uid} to be gone after rm: {session_procs(uid)}")


def victim(d: Daemon, llm: FakeLLM) -> str:
    llm.script(tool_call_stream(("w", "write_file", {"path": "secret.txt", "content": SECRET})),
               text_stream("stored"))
    with d.client() as c:
        sid = c.create(session="victim").id
        assert c.send_text(sid, f"remember {SECRET}") == "stored"
    return sid


def forget_script(llm: FakeLLM) -> None:
    """Drop what a killed turn left unserved."""
    with llm._lock:
        llm._script.clear()


def victim_answers(d: Daemon, llm: FakeLLM, sid: str) -> None:
    forget_script(llm)
    llm.script(text_stream("still here"))
    with d.client() as c:
        assert c.send_text(sid, "are you there?") == "still here"


# ---------------------------------------------------------------- 1. the store's socket


def test_the_store_is_out_of_a_tools_reach(make_daemon, llm: FakeLLM, peer_pg: PeerPg, open_root: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    d, unit = start_unit(make_daemon, llm, peer_pg, open_root)
    assert uid_of(d.pid) == 0
    vid = victim(d, llm)
    with d.client() as c:
        attacker = c.create(session="attacker").id
        auid = uid_of(c.status(attacker).pid)
    assert SESSION_UIDS[0] <= auid <= SESSION_UIDS[1]
    report = show("store", d, attacker, unit, capsys)
    assert {"namespaces", "landlock", "seccomp", "no_new_privs"} <= set(report["active"]), report
    owner_before = peer_pg.query(f"SET search_path={_schema(d)}; SELECT count(*) FROM sessiond_sessions")
    out, _ = tool(d, llm, attacker, store_probe(peer_pg, d, "root"))
    assert "PROBED" in out, out
    assert "LEAK:" not in out, out
    # Nothing was changed behind the daemon's back.
    assert peer_pg.query(f"SET search_path={_schema(d)}; SELECT count(*) FROM sessiond_sessions") == owner_before
    victim_answers(d, llm, vid)
    assert_session_gone(d, attacker, auid)


def store_probe(pg: PeerPg, d: Daemon, role: str) -> str:
    """Shell lines that print LEAK:... for each way into the store that works."""
    sock = f"{pg.socket_dir}/.s.PGSQL.5432"
    schema = _schema(d)
    return "\n".join([
        f"psql -h {pg.socket_dir} -d sessiond -U {role} -XAtc 'select id from {schema}.sessiond_sessions' "
        "&& echo LEAK:psql-read",
        f"psql -h {pg.socket_dir} -d sessiond -U {role} -XAtc 'update {schema}.sessiond_sessions set id=id' "
        "&& echo LEAK:psql-write",
        f"python3 -c 'import socket; s=socket.socket(socket.AF_UNIX); s.connect(\"{sock}\")' && echo LEAK:connect",
        "echo PROBED",
    ])


def test_control_with_the_sandbox_off_the_paths_are_in_reach_but_the_store_still_refuses(
        make_daemon, llm: FakeLLM, peer_pg: PeerPg, open_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The control: the same unit with `[sandbox] mode = "off"` (the
    operator's explicit choice of a weaker mode).  The probes must find the
    store's socket and a socket planted in /run there, or they would prove
    nothing above; and even then a tool is not the daemon to the store:
    peer authentication sees the session's own uid, which has no role."""
    config = unit_config(llm, peer_pg) + '\n[sandbox]\nmode = "off"\n'
    d = make_daemon(config, start=False, root=open_root / "d", trust=False)
    unit = d.run_as_unit(SERVICE, visible=(peer_pg.socket_dir,))
    d.start(timeout=60)
    with d.client() as c:
        attacker = c.create(session="attacker").id
        auid = uid_of(c.status(attacker).pid)
    # No sandbox mechanism; the session's cgroup (not the sandbox's) stays.
    report = show("sandbox off (control)", d, attacker, unit, capsys)
    assert [a for a in report.get("active", []) if not a.startswith("cgroup-")] == [], report
    out, _ = tool(d, llm, attacker, store_probe(peer_pg, d, "root"))
    assert "PROBED" in out and "LEAK:connect" in out, out
    assert "LEAK:psql" not in out and "Peer authentication failed" in out, out
    with planted_sockets() as (_, paths):
        out, _ = tool(d, llm, attacker, planted_probe(paths))
    assert f"LEAK:{paths[0]}" in out, out
    assert_session_gone(d, attacker, auid)


def _schema(d: Daemon) -> str:
    dsn = tomllib.loads(d.config_path.read_text())["store"]["dsn"]
    found = re.search(r"search_path=(\w+)", dsn)
    assert found
    return found.group(1)


# ---------------------------------------------------------------- 2. a planted socket


@contextlib.contextmanager
def planted_sockets() -> Iterator[tuple[list[socket.socket], list[str]]]:
    """World-writable listening sockets outside any workspace, as another
    local user (or service) could leave them: in /run, /var/tmp and /tmp."""
    planted: list[socket.socket] = []
    paths: list[str] = []
    try:
        for parent in ("/run", "/var/tmp", tempfile.gettempdir()):
            path = tempfile.mktemp(prefix="sd-planted-", suffix=".sock", dir=parent)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            os.chmod(path, 0o777)
            s.listen(8)
            s.setblocking(False)
            planted.append(s)
            paths.append(path)
        yield planted, paths
    finally:
        for s in planted:
            s.close()
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def planted_probe(paths: list[str]) -> str:
    return "\n".join(
        "python3 -c 'import socket; s=socket.socket(socket.AF_UNIX); s.settimeout(3); "
        f"s.connect(\"{p}\")' && echo LEAK:{p}" for p in paths) + "\necho PROBED"


def test_a_planted_world_writable_socket_is_unreachable(make_daemon, llm: FakeLLM, peer_pg: PeerPg,
                                                         open_root: Path) -> None:
    d, _ = start_unit(make_daemon, llm, peer_pg, open_root)
    with planted_sockets() as (planted, paths):
        with d.client() as c:
            sid = c.create(session="planter").id
            uid = uid_of(c.status(sid).pid)
        out, _ = tool(d, llm, sid, planted_probe(paths))
        assert "PROBED" in out and "LEAK:" not in out, out
        for s in planted:  # nobody knocked
            with pytest.raises(BlockingIOError):
                s.accept()
        assert_session_gone(d, sid, uid)


# ---------------------------------------------------------------- 3. non-dumpable at the control socket

# test_sandbox's client of the control protocol (Hello, then ls; exit 0
# only if the daemon lists sessions), made non-dumpable first.
NON_DUMPABLE_CLIENT = "import ctypes\nctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0\n" + DRIVE_DAEMON


def test_a_non_dumpable_tool_cannot_use_the_control_socket(make_daemon, llm: FakeLLM, peer_pg: PeerPg,
                                                           open_root: Path) -> None:
    d, _ = start_unit(make_daemon, llm, peer_pg, open_root)
    vid = victim(d, llm)
    os.chmod(d.sockdir, 0o755)  # as /run/sessiond is: the socket's mode is the gate
    with d.client() as c:
        sid = c.create(session="sneak").id
        uid = uid_of(c.status(sid).pid)
    llm.script(tool_call_stream(("w", "write_file", {"path": "nd.py", "content": NON_DUMPABLE_CLIENT})),
               text_stream("written"))
    with d.client() as c:
        assert c.send_text(sid, "prepare") == "written"
    out, _ = tool(d, llm, sid, f"python3 nd.py {d.socket} && echo LEAK:listed; echo PROBED")
    assert "PROBED" in out and "LEAK:" not in out, out
    # The same client from outside any session, as the daemon's own user,
    # is served: the refusal above is the sandbox's and the peer check's.
    done = subprocess.run(["python3", str(d.workspace(sid) / "nd.py"), str(d.socket)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done  # listed
    with d.client() as c:
        assert {s.id for s in c.list()} == {vid, sid}
    victim_answers(d, llm, vid)
    assert_session_gone(d, sid, uid)


# ---------------------------------------------------------------- 4. kill the tool host, keep a hog


def test_a_setsid_hog_of_a_killed_tool_host_is_capped_and_gone_after_rm(
        make_daemon, llm: FakeLLM, peer_pg: PeerPg, open_root: Path) -> None:
    d, _ = start_unit(make_daemon, llm, peer_pg, open_root, "max_memory_mb = 1024\n")
    vid = victim(d, llm)
    with d.client() as c:
        sid = c.create(session="hog", settings={"agent.limits.max_memory_mb": 64}).id
        uid = uid_of(c.status(sid).pid)
    hog = ("setsid python3 -c \"import signal; b = bytearray(400 << 20); b[::4096] = b'x' * (100 << 10); "
           "open('touched', 'w').close(); signal.pause()\" </dev/null >/dev/null 2>&1 & "
           "for i in $(seq 100); do [ -e touched ] && break; sleep 0.1; done; kill -9 $PPID; sleep infinity")
    tool(d, llm, sid, hog)
    # Whichever comes first, the sweep (the session is killed for its
    # memory) or the end of the tool host: no process of the session keeps
    # more than its cap for long, and the session is still the daemon's.
    wait_for(lambda: not [p for p in session_procs(uid) if _rss(p) > 128 << 20], 20,
             "no process of the session above its cap")
    with d.client() as c:
        last = c.status(sid).last_exit
        assert last is None or last.reason == "killed_memory", last
        assert (c.status(sid).rss_bytes or 0) < 128 << 20
    victim_answers(d, llm, vid)
    assert_session_gone(d, sid, uid)


def _rss(p: psutil.Process) -> int:
    try:
        return p.memory_info().rss
    except psutil.Error:
        return 0


# ---------------------------------------------------------------- 5. memfd and /tmp


@pytest.mark.parametrize("where", ["memfd", "tmp"])
def test_unmapped_memory_counts_against_the_cap(make_daemon, llm: FakeLLM, peer_pg: PeerPg, open_root: Path,
                                               where: str) -> None:
    d, _ = start_unit(make_daemon, llm, peer_pg, open_root, "max_memory_mb = 1024\n")
    vid = victim(d, llm)
    with d.client() as c:
        sid = c.create(session=f"fill{where}", settings={"agent.limits.max_memory_mb": 64}).id
        uid = uid_of(c.status(sid).pid)
    # Contained either way: the session is killed (killed_memory), or the
    # kernel's cap refuses the write itself (a write(2) past a cgroup's
    # memory limit fails with ENOMEM; only a page fault there waits for the
    # daemon's kill), and the session holds no more than its cap.
    if where == "memfd":
        fill = ("python3 -c \"import os, signal; fd = os.memfd_create('x'); chunk = b'x' * (1 << 20)\n"
                "try:\n    for _ in range(250): os.write(fd, chunk)\n"
                "except OSError as e: print('REFUSED', e, flush=True)\n"
                "else: print('FILLED', flush=True); signal.pause()\"")
    else:
        fill = ("if dd if=/dev/zero of=/tmp/fill bs=1M count=250 2>dd.err; then echo FILLED; sleep infinity; "
                "else echo REFUSED; cat dd.err; fi")
    out, _ = tool(d, llm, sid, fill)
    with d.client() as c:
        if "REFUSED" in out:
            assert "Cannot allocate memory" in out, out  # the cap, not some other failure
            info = c.status(sid)
            assert info.last_exit is None or info.last_exit.reason == "killed_memory", info
            assert (info.rss_bytes or 0) <= 64 << 20, info
        else:
            wait_for(lambda: c.status(sid).last_exit is not None, 30, f"the session to be killed ({where})")
            assert c.status(sid).last_exit.reason == "killed_memory", c.status(sid)
    victim_answers(d, llm, vid)
    assert_session_gone(d, sid, uid)


# ---------------------------------------------------------------- 6. the disk


def test_a_workspace_past_its_disk_quota_is_refused_by_the_kernel(make_daemon, llm: FakeLLM, peer_pg: PeerPg,
                                                                  open_root: Path) -> None:
    """Under the unit the workspace is an image of its own (CAP_SYS_ADMIN):
    the kernel refuses what passes the cap (tests/test_disk_images.py: files
    unlinked while held open, and inodes); the session goes on."""
    d, _ = start_unit(make_daemon, llm, peer_pg, open_root, "max_disk_mb = 64\n")
    vid = victim(d, llm)
    with d.client() as c:
        assert c.stats().sandbox["disk_quota"].startswith("kernel"), c.stats().sandbox
        sid = c.create(session="filler").id
        uid = uid_of(c.status(sid).pid)
    out, _ = tool(d, llm, sid, "fallocate -l 300M big; echo rc=$?; dd if=/dev/zero of=more bs=1M count=300 2>&1")
    assert "rc=1" in out and out.count("No space left on device") == 2, out
    with d.client() as c:
        info = c.status(sid)
        assert info.state == "idle" and info.last_exit is None, info
    victim_answers(d, llm, vid)
    assert_session_gone(d, sid, uid)


# ---------------------------------------------------------------- 7. inherited fds


def test_a_tool_starts_with_fds_0_1_2_only(make_daemon, llm: FakeLLM, peer_pg: PeerPg, open_root: Path,
                                          tmp_path: Path) -> None:
    secret = tmp_path / "root-only"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    fd = os.open(secret, os.O_RDONLY)
    try:
        d = make_daemon(unit_config(llm, peer_pg), start=False, root=open_root / "d", trust=False)
        d.run_as_unit(SERVICE, visible=(peer_pg.socket_dir,))
        d.pass_fds = (fd,)  # the daemon inherits it, as from a careless parent
        d.start(timeout=60)
    finally:
        os.close(fd)
    assert str(secret) in {os.readlink(f"/proc/{d.pid}/fd/{n}") for n in os.listdir(f"/proc/{d.pid}/fd")
                           if _is_link(f"/proc/{d.pid}/fd/{n}")}
    with d.client() as c:
        sid = c.create(session="fds").id
        uid = uid_of(c.status(sid).pid)
    # The shell's own descriptors (not ls's), then what each one reads.
    # (listed into a file first: a command substitution's own pipe would be
    # one of the shell's descriptors while it runs)
    out, _ = tool(d, llm, sid, "ls /proc/$$/fd > .fds; echo FDS $(sort -n .fds | tr '\\n' ' '); "
                               "for n in $(ls /proc/$$/fd); do [ $n -gt 2 ] && "
                               "timeout 1 head -c 200 /proc/$$/fd/$n 2>/dev/null; done </dev/null; echo PROBED")
    assert "PROBED" in out and SECRET not in out, out
    fds = re.search(r"FDS ([\d ]*)", out)
    assert fds and fds.group(1).split() == ["0", "1", "2"], out
    assert_session_gone(d, sid, uid)


def _is_link(path: str) -> bool:
    try:
        os.readlink(path)
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- 8. every live slot


def test_one_user_holding_every_live_slot_leaves_room_for_another(
        make_daemon, llm: FakeLLM, peer_pg: PeerPg, open_root: Path) -> None:
    live = 6
    d, _ = start_unit(make_daemon, llm, peer_pg, open_root, f"max_concurrent_sessions = {live}\n",
                      f'socket_mode = "0666"\nallowed_uids = [{NOBODY}]\nmax_live_sessions_per_uid = 4\n'
                      "spare_workers = 0\n")
    os.chmod(d.sockdir, 0o755)
    path = str(d.socket)

    def hog_all() -> list[str]:
        """As another user: a turn that never ends in as many sessions as
        the daemon lets it have; the connection goes, the turns stay."""
        got = []
        for i in range(live):
            try:
                with Client(path) as c:
                    sid = c.create(session=f"hold{i}", handler="fixture_handlers:slow").id
                    next(iter(c.send(sid, "100000")))  # the turn has begun
                    got.append(sid)
            except RequestError as exc:
                got.append(f"refused {exc.code}")
        return got

    held = run_as(NOBODY, hog_all)
    # The per-uid ceiling stopped it short of every slot (at its create or
    # at its send).
    assert held[:4] == [f"hold{i}" for i in range(4)], held
    assert all(h.startswith("refused ") for h in held[4:]), held
    # Root's (another user's) create and send still work.
    with d.client() as c:
        sid = c.create(session="other", handler="echo").id
        assert c.send_text(sid, "ping") == "1: ping"


# ---------------------------------------------------------------- 9. fork bomb


def test_a_fork_bomb_gets_eagain_at_max_processes(make_daemon, llm: FakeLLM, peer_pg: PeerPg,
                                                  open_root: Path) -> None:
    d, _ = start_unit(make_daemon, llm, peer_pg, open_root, "max_processes = 64\n")
    vid = victim(d, llm)
    with d.client() as c:
        sid = c.create(session="bomber").id
        uid = uid_of(c.status(sid).pid)
    bomb = (
        'python3 -c "\nimport os, signal\nn = 0\nfor _ in range(1500):\n'
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        signal.pause()\n        os._exit(0)\n    n += 1\n"
        "print('FORKED', n)\n\"; echo BOMB-DONE"
    )
    out, events = tool(d, llm, sid, bomb)
    assert isinstance(events[-1], m.TurnDone), events[-1]
    forked = int(re.search(r"FORKED (\d+)", out).group(1))
    assert forked < 64, out
    victim_answers(d, llm, vid)
    assert_session_gone(d, sid, uid)


# ---------------------------------------------------------------- the unit itself

_CAP_BITS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3, "CAP_KILL": 5,
             "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21}


def test_the_emulated_daemon_runs_as_the_unit_says(make_daemon, llm: FakeLLM, peer_pg: PeerPg,
                                                   open_root: Path) -> None:
    d, unit = start_unit(make_daemon, llm, peer_pg, open_root)
    status = Path(f"/proc/{d.pid}/status").read_text()
    field = lambda name: re.search(rf"^{name}:\s*(\S+)", status, re.M).group(1)  # noqa: E731
    wanted = sum(1 << _CAP_BITS[c] for c in unit.capabilities)
    assert int(field("CapBnd"), 16) == wanted and int(field("CapEff"), 16) == wanted, status
    assert int(field("CapInh"), 16) == 0 and int(field("CapAmb"), 16) == 0
    assert field("NoNewPrivs") == "1" and field("Seccomp") == "2"
    assert field("Uid") == "0"
    mounts = Path(f"/proc/{d.pid}/mountinfo").read_text().splitlines()
    by_point = {line.split()[4]: line for line in mounts}
    assert "hidepid=invisible" in by_point["/proc"], by_point["/proc"]
    assert " ro," in by_point["/"] or by_point["/"].split()[5].startswith("ro"), by_point["/"]
    assert by_point[str(d.root)].split()[5].startswith("rw"), by_point[str(d.root)]
    assert by_point["/tmp"].split()[8] == "tmpfs"


def _capability_scenario(make_daemon, llm: FakeLLM, root: Path, drop: tuple[str, ...]) -> str:
    """Everything the daemon does with root's powers, in order; the first
    step that fails, or '' when all did."""
    from supervisor.client import RequestError

    # Plain workspaces, walked: the deployment where removing one takes
    # CAP_DAC_OVERRIDE and CAP_FOWNER (an image is unmounted and deleted whole).
    config = agent_config(llm, "[agent.limits]\nmemory_poll_interval_ms = 50\nmax_memory_mb = 200\n"
                               '[tools]\ndisk_quota = "measured"\n')
    config = config.replace("[agent]\n", '[agent]\nallowed_handlers = ["agent", "echo"]\n', 1)
    d = make_daemon(config, start=False, root=root / "d", trust=False)
    d.run_as_unit(SERVICE, drop=drop)
    try:
        d.start(timeout=60)
        return _capability_steps(d, llm)
    except RequestError as exc:
        # Without CAP_SYS_PTRACE the daemon cannot read /proc of a client
        # with more capabilities than its own (root's sessionctl), so it
        # cannot tell that client is not a session's: it refuses it.
        return f"client: {exc}"


def _capability_steps(d: Daemon, llm: FakeLLM) -> str:
    from supervisor.client import RequestError

    with d.client() as c:
        try:
            sid = c.create(session="caps").id  # a worker that becomes its session's uid
        except RequestError as exc:
            return f"create: {exc}"
        try:
            uid = uid_of(c.status(sid).pid)
        except psutil.NoSuchProcess:
            return f"create: its worker is gone: {c.status(sid).last_exit}"
        # An IPC namespace made by each worker before it drops to its uid
        # (the same capability mounts the workspace images: test_disk_images.py).
        ipc = c.stats().sandbox.get("ipc", "")
        if not ipc.startswith("a namespace per session"):
            return f"ipc: {ipc}"
    # A tool host in a workspace handed to that uid; files it made hard to remove.
    out, _ = tool(d, llm, sid, "mkdir -p d/e s && echo x > d/e/f && chmod 0400 d/e/f && chmod 0500 d/e d "
                               "&& touch s/f && chmod 1777 s && echo MADE")
    if "MADE" not in out:
        return f"tool: {out}"
    # Forks sharing copy-on-write pages: 10 x 40 MiB of RSS, ~50 MiB of PSS.
    forker = ("import os, signal\nb = b'x' * (40 << 20)\nfor _ in range(9):\n"
              "    if os.fork() == 0:\n        break\nsignal.pause()")
    tool(d, llm, sid, f'(python3 -c "{forker}" > /dev/null 2>&1 &) ; echo STARTED')
    forks = lambda: [p for p in session_procs(uid) if "(40 << 20)" in _cmdline(p)]  # noqa: E731
    with d.client() as c:
        wait_for(lambda: len(forks()) == 10 or c.status(sid).last_exit is not None, 10, "ten forks")
        with contextlib.suppress(AssertionError):
            wait_for(lambda: c.status(sid).last_exit is not None, 3, "a wrong kill")
        if c.status(sid).last_exit is not None:
            return f"pss: killed on summed RSS: {c.status(sid).last_exit}"
        # Past the cap for real: the session's processes are killed.
        forget_script(llm)
        llm.script(tool_call_stream(("t", "bash", {"command": "python3 -c \"b = bytearray(300 << 20); "
                                                   "b[::4096] = b'x' * (75 << 10); import signal; signal.pause()\""})),
                   text_stream("done"))
        list(c.send(sid, "hog"))
        try:
            # (A kill that cannot land says so in the log at once.)
            wait_for(lambda: (c.status(sid).last_exit is not None and not forks())
                     or "processes outlived the kill" in d.log, 15, "the kill")
        except AssertionError:
            return "kill: the session's processes outlived its kill"
        if "processes outlived the kill" in d.log:
            # The daemon's SIGKILLs did not land; the kernel's OOM killer,
            # handed the cgroup back as the fallback, may have finished the
            # job (or not: it kills one process at a time, by its choice).
            return "kill: the daemon's kills did not land (the kernel's OOM killer was the fallback)"
        workspace = d.workspace(sid)
        try:
            c.remove(sid)
        except RequestError as exc:
            return f"rm: {exc}"
    if workspace.exists():
        return f"rm: {sorted(str(p) for p in workspace.rglob('*'))} left behind"
    return ""


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _unit_capabilities() -> list[str]:
    return UnitEmulation.from_file(SERVICE).capabilities


@pytest.mark.parametrize("drop", ["", *_unit_capabilities()], ids=lambda c: c or "none-dropped")
def test_every_capability_the_unit_keeps_is_needed(make_daemon, llm: FakeLLM, open_root: Path,
                                                   drop: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The bounding set is found, not guessed: with all of it the daemon does
    its job as root; without any one of it, something of that job fails."""
    failed = _capability_scenario(make_daemon, llm, open_root, (drop,) if drop else ())
    with capsys.disabled():
        print(f"\n[unit without {drop or 'nothing'}] {failed[:300] or 'all of the daemon job done'}")
    if drop:
        assert failed, f"{drop} is in CapabilityBoundingSet= but nothing needed it"
    else:
        assert failed == "", failed
