"""sessionctl and the Python client check the socket before they send
anything (OpenSSH's StrictModes, on the client's side): a socket another
user planted, or one in a directory anyone may write, gets a clear error
naming the path and its owner, exit 3, and the squatter receives nothing,
on the one-shot path (supervisor.ctl.fast), the full path (supervisor.ctl.cli)
and the library (supervisor.ctl.client)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import Daemon, env_for_children, run_as

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="other owners need root")
SQUATTER = 4321  # an ordinary user's uid: not root, not a system user, not us
VICTIM = 4322


class Squatter:
    """A listening socket that notes whether anyone connected."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        os.chmod(path, 0o777)
        self.sock.listen(8)
        self.sock.setblocking(False)

    def received(self) -> bytes:
        got = b""
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return got
            conn.settimeout(5)
            with conn:
                got += conn.recv(65536) or b"(connected)"


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="sd-trust-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


def _squatted_dir(base: Path) -> Squatter:
    directory = base / "squatted"
    directory.mkdir(mode=0o755)
    squatter = Squatter(directory / "sessiond.sock")
    os.chown(directory, SQUATTER, SQUATTER)
    os.chown(squatter.path, SQUATTER, SQUATTER)
    return squatter


def _world_writable_dir(base: Path) -> Squatter:
    directory = base / "open"
    directory.mkdir()
    os.chmod(directory, 0o777)  # no sticky bit: anyone may replace the socket
    return Squatter(directory / "sessiond.sock")


def _sessionctl(argv: list[str], fast: bool) -> subprocess.CompletedProcess[str]:
    code = "import sys; from supervisor.ctl import fast as ctl_fast, cli as ctl; sys.exit((ctl_fast if {} else ctl).main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code.format(fast), *argv], capture_output=True, text=True,
                          timeout=60, env=env_for_children(), stdin=subprocess.DEVNULL)


@pytest.mark.process
@root_only
@pytest.mark.parametrize("setup", ["squatted_dir", "world_writable_dir"])
def test_sessionctl_refuses_an_untrusted_socket_and_sends_nothing(base: Path, setup: str) -> None:
    squatter = _squatted_dir(base) if setup == "squatted_dir" else _world_writable_dir(base)
    with squatter.sock:
        for argv, fast in ((["--socket", str(squatter.path), "ls"], True),
                           (["--socket", str(squatter.path), "send", "s1", "my secret prompt"], False),
                           (["--socket", str(squatter.path), "create"], False)):
            done = _sessionctl(argv, fast)
            assert done.returncode == 3, (argv, done.stdout, done.stderr)
            assert str(squatter.path) in done.stderr and "refusing to connect" in done.stderr, done.stderr
            if setup == "squatted_dir":
                assert f"uid {SQUATTER}" in done.stderr, done.stderr
            else:
                assert "writable by its group and others" in done.stderr, done.stderr
        # Through $SESSIOND_SOCKET as well, and the library.
        env = {**env_for_children(), "SESSIOND_SOCKET": str(squatter.path)}
        done = subprocess.run([sys.executable, "-m", "supervisor.ctl", "ls"], capture_output=True, text=True,
                              timeout=60, env=env)
        assert done.returncode == 3 and "refusing to connect" in done.stderr, done.stderr
        from supervisor.ctl.client import Client, DaemonUnavailable

        with pytest.raises(DaemonUnavailable, match="refusing to connect"):
            Client(squatter.path)
        assert squatter.received() == b""


@pytest.mark.process
@root_only
def test_a_squatted_default_path_gets_nothing_from_its_user(base: Path) -> None:
    """The default for a user without $XDG_RUNTIME_DIR is under /tmp, where
    another user can make the directory first."""
    runtime = base / "runtime"  # stands for /tmp: the squatter made sessiond/ there first
    runtime.mkdir()
    os.chmod(runtime, 0o1777)
    squatted = runtime / "sessiond"
    squatted.mkdir()
    squatter = Squatter(squatted / "sessiond.sock")
    os.chown(squatted, SQUATTER, SQUATTER)
    os.chown(squatter.path, SQUATTER, SQUATTER)

    def victim() -> list[object]:
        import io
        import contextlib

        from supervisor.ctl import cli as ctl, fast as ctl_fast

        os.environ.pop("SESSIOND_SOCKET", None)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)
        out = []
        for main, argv in ((ctl_fast.main, ["ls"]), (ctl.main, ["send", "s1", "my secret prompt"])):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = main(argv)
            out.append([code, err.getvalue()])
        return out

    with squatter.sock:
        results = run_as(VICTIM, victim)
        for code, err in results:
            assert code == 3, err
            assert str(squatter.path) in err and f"uid {SQUATTER}" in err, err
        assert squatter.received() == b""


@pytest.mark.process
def test_the_harness_daemon_socket_is_trusted(daemon: Daemon) -> None:
    from ipc.paths import socket_trust_problem

    assert socket_trust_problem(str(daemon.socket)) == ""
    done = _sessionctl(["--socket", str(daemon.socket), "ls"], True)
    assert done.returncode == 0, done.stderr


@pytest.mark.process
@root_only
def test_the_daemons_own_user_may_be_named(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that a person runs as themselves, used by another user:
    $SESSIOND_SOCKET_OWNER says whose socket it is."""
    from ipc.paths import socket_trust_problem

    squatter = _squatted_dir(base)
    with squatter.sock:
        assert "uid 4321" in socket_trust_problem(str(squatter.path))
        monkeypatch.setenv("SESSIOND_SOCKET_OWNER", str(SQUATTER))
        assert socket_trust_problem(str(squatter.path)) == ""
        monkeypatch.setenv("SESSIOND_SOCKET_OWNER", "no-such-user-here")
        assert "names no user" in socket_trust_problem(str(squatter.path))


@pytest.mark.process
@root_only
def test_a_symlink_to_an_untrusted_socket_is_refused(base: Path) -> None:
    from ipc.paths import socket_trust_problem

    squatter = _squatted_dir(base)
    link = base / "link.sock"
    link.symlink_to(squatter.path)
    with squatter.sock:
        assert f"uid {SQUATTER}" in socket_trust_problem(str(link))
