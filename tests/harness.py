"""Run a real sessiond as a child process for tests.

The daemon runs in its own session (process group); teardown kills that
group and then checks that every process the daemon had made (zygote,
workers, tools) is gone, so a test that leaks processes fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil
import tomli_w

from supervisor.ctl.client import Client

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy, or fail."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def env_for_children() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("NOTIFY_SOCKET", None)
    env.pop("LISTEN_FDS", None)
    env.pop("LISTEN_PID", None)
    return env


TEST_HANDLERS = ["agent", "echo", "fixture_handlers:*"]


def trusting(config: str) -> str:
    """`config` as the tests' operator would write it: the fixture handlers
    allowed, and as root (unless the test says who workers run as) tools
    run as root, since they import fixture code from a checkout that the
    per-session uids cannot read.  Tests of those defaults pass trust=False."""
    data = tomllib.loads(config)
    data.setdefault("agent", {}).setdefault("allowed_handlers", TEST_HANDLERS)
    daemon = data.setdefault("daemon", {})
    if os.geteuid() == 0 and not {"worker_user", "session_uid_range"} & set(daemon):
        daemon.setdefault("allow_root_tools", True)
    return tomli_w.dumps(data)


# A daemon that notices quickly: heartbeats, restarts, the memory sweep, stops.
FAST_SWEEP = """
[agent.worker]
heartbeat_interval_secs = 0.2
restart_backoff_initial_ms = 20
[agent.limits]
memory_poll_interval_ms = 50
[daemon]
stop_grace_secs = 1.0
"""


class Daemon:
    def __init__(
        self, root: Path, config: str = "", extra_args: list[str] | None = None, trust: bool = True
    ) -> None:
        self.root = root
        # Unix socket paths are short (108 bytes): keep it out of pytest's long tmp path.
        self.sockdir = Path(tempfile.mkdtemp(prefix="sd-"))
        self.socket = self.sockdir / "sessiond.sock"
        self.state_dir = root / "state"
        self.config_path = root / "config.toml"
        root.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(trusting(config) if trust else config)
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = root / "sessiond.log"
        self.known_pids: set[int] = set()
        self.preexec: Callable[[], None] | None = None
        # Put before `cmd` when starting (e.g. `run_as_user`'s wrapper).
        self.cmd_prefix: list[str] = []
        self._exposed: list[Path] = []

    @property
    def cmd(self) -> list[str]:
        return [
            sys.executable, "-m", "supervisor.cli", "run", "--config", str(self.config_path),
            "--socket", str(self.socket), "--state-dir", str(self.state_dir), *self.extra_args,
        ]

    def start(self, timeout: float = 15.0) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*self.cmd_prefix, *self.cmd], stdout=log, stderr=subprocess.STDOUT, env=env_for_children(),
            start_new_session=True, cwd=str(self.root), preexec_fn=self.preexec,
        )
        log.close()
        wait_for(self._answers, timeout, f"sessiond to listen (log: {self.log})")
        self.known_pids.add(self.proc.pid)

    def run_as_user(self, uid: int, gid: int) -> None:
        """Start the daemon as `uid`:`gid` (from root) instead of as root.

        The daemon's directories are handed to that user.  The interpreter,
        the venv and this checkout may live where the user cannot reach them
        (pyenv under a 0700 /root, a clone in a 0700 mktemp dir): the daemon
        then runs in its own mount namespace where each closed directory on
        those paths is covered by a 0755 directory holding bind mounts of
        just the children it needs; nothing changes for the rest of the
        machine.  (Listable, not just 0711: the checkout itself is on
        sys.path, through the install's .pth line, and Python's path finder
        lists a directory on sys.path to find a module in it.)"""
        for path in (self.root, self.sockdir):
            os.chown(path, uid, gid)
        needs: dict[Path, set[str]] = {}
        code = {"supervisor", "session_worker", "ipc", "tests"}
        for target, children in ((Path(sys.base_prefix).resolve(), set()),
                                 (Path(sys.prefix).resolve(), set()), (REPO, code)):
            chain = [*reversed(target.parents), target]
            for here, below in zip(chain, [*chain[1:], None]):
                if os.stat(here).st_mode & 0o001:
                    continue
                needs.setdefault(here, set()).update({below.name} if below is not None else children)
        mounts = ""
        # Deepest first, children bound recursively: a cover made below is
        # carried along when its parent is covered in turn.
        for closed in sorted(needs, key=lambda p: len(p.parts), reverse=True):
            cover = Path(tempfile.mkdtemp(prefix="sd-expose-"))
            os.chmod(cover, 0o755)
            self._exposed.append(cover)
            for child in sorted(needs[closed]):
                (cover / child).mkdir()
                mounts += f"mount --rbind {closed / child} {cover / child} && "
            mounts += f"mount --rbind {cover} {closed} && "
        self.cmd_prefix = [
            "unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'{mounts}exec setpriv --reuid={uid} --regid={gid} --clear-groups -- "$@"', "sh",
        ]

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"sessiond exited with {self.proc.returncode}:\n{self.log}")
        try:
            with Client(self.socket) as c:
                c.ping()
            return True
        except OSError:
            return False

    @property
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def workspace(self, session_id: str) -> Path:
        """The session's workspace: workspaces/ID@TOKEN (a new TOKEN for
        every session that reuses an id)."""
        found = list((self.state_dir / "workspaces").glob(f"{session_id}@*"))
        assert len(found) == 1, f"workspaces of {session_id}: {found}"
        return found[0]

    def client(self) -> Client:
        return Client(self.socket)

    def ctl(self, *args: str, input: str | None = None, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "supervisor.ctl", "--socket", str(self.socket), *args],
            capture_output=True, text=True, env=env_for_children(), timeout=timeout, input=input,
        )

    def descendants(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.pid).children(recursive=True)
        return []

    def remember_processes(self) -> None:
        self.known_pids.update(p.pid for p in self.descendants())

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait: the graceful path."""
        assert self.proc is not None
        self.remember_processes()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the daemon alone (not its group): its children must die by themselves."""
        assert self.proc is not None
        self.remember_processes()
        self.proc.kill()
        self.proc.wait(10)

    def assert_no_leftovers(self, timeout: float = 5.0) -> None:
        def gone() -> bool:
            return not [p for p in self.known_pids if _alive(p)]
        wait_for(gone, timeout, f"processes {sorted(p for p in self.known_pids if _alive(p))} to exit")

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.remember_processes()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in self.known_pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            for p in self.sockdir.iterdir():
                p.unlink()
            self.sockdir.rmdir()
        for cover in self._exposed:
            with contextlib.suppress(OSError):
                for p in cover.iterdir():
                    p.rmdir()
                cover.rmdir()


def _alive(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_as(uid: int, fn: Callable[[], Any], groups: tuple[int, ...] = ()) -> Any:
    """Fork, become `uid` (primary gid = uid, plus `groups`), run `fn`,
    return what it returned (msgpack-able)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user
        code = 1
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, msgspec.msgpack.encode(fn()))
            code = 0
        except BaseException as exc:
            os.write(2, f"run_as({uid}) failed: {exc!r}\n".encode())
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the other user's client failed (see stderr)"
    return msgspec.msgpack.decode(data)


def raw_connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    return s


@contextlib.contextmanager
def running_daemon(root: Path, config: str = "") -> Iterator[Daemon]:
    d = Daemon(root, config)
    try:
        d.start()
        yield d
    finally:
        d.cleanup()
