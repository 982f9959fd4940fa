"""A real PostgreSQL server for the tests, from the distribution's binaries.

`initdb` and `pg_ctl` into a temporary directory; the server listens only on
a Unix socket in that directory (no TCP port).  PostgreSQL refuses to run as
root, so when the tests run as root the server runs as the `postgres` user
(via `runuser`) and the directory is handed to it.  No binaries: the test
fails saying what to install; it is never skipped.

`PG_BIN` overrides where the binaries are looked for.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["PgServer", "pg_server"]

_INSTALL_HINT = (
    "the PostgreSQL server binaries (initdb, pg_ctl) were not found: install them "
    "(Debian/Ubuntu: apt-get install postgresql; Fedora: dnf install postgresql-server) "
    "or point PG_BIN at their directory"
)
_DRIVER_HINT = "the PostgreSQL driver is not installed: pip install -e '.[cluster]' (make test does)"


def find_bin_dir() -> Path:
    candidates = [os.environ.get("PG_BIN", "")]
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]),
                         reverse=True)
    which = shutil.which("initdb")
    if which:
        candidates.append(str(Path(which).parent))
    for cand in candidates:
        if cand and (Path(cand) / "initdb").exists() and (Path(cand) / "pg_ctl").exists():
            return Path(cand)
    pytest.fail(_INSTALL_HINT, pytrace=False)


class PgServer:
    """One server; `fresh_dsn()` gives each test a schema of its own.

    `flush=False` (the tests' server): fsync=off, and initdb --no-sync.  A
    commit is still written to the WAL (write(2)) before the server
    acknowledges it, so a crash of the server's processes (`crash()`: an
    immediate stop, recovery from the WAL on start) loses nothing
    acknowledged; only the flush to the disk is skipped, which no test can
    observe (none cuts the machine's power).  The flushes were a quarter of
    the store tests' time (test_store_contract's postgres half: 4.6 s
    against 3.4 s, same machine, back to back).  The benches keep them: a
    batch's worth is measured against what a flush costs."""

    def __init__(self, flush: bool = True) -> None:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            pytest.fail(_DRIVER_HINT, pytrace=False)
        self.bin = find_bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="sessiond-pg-"))
        self.data = self.root / "data"
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self.root.chmod(0o755)  # we connect through the socket in it
        self._names = itertools.count(1)
        self._opts = "-c listen_addresses='' -c max_connections=50" + ("" if flush else " -c fsync=off")
        self._run("initdb", "-D", str(self.data), "-U", self.user, "--auth=trust",
                  "-E", "UTF8", "--locale=C", "--no-instructions", *(() if flush else ("--no-sync",)))
        self.start()

    def _cmd(self, tool: str, *args: str) -> list[str]:
        cmd = [str(self.bin / tool), *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return cmd

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(self._cmd(tool, *args), capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stdout}{done.stderr}")

    # pg_ctl's own wait (-w) looks every 100 ms; a crash test stops and
    # starts the server, so the waits are ours (-W), at 10 ms: the same
    # checks pg_ctl makes, on the server's pid file.
    _POLL_SECS = 0.01
    _WAIT_SECS = 60.0

    def start(self) -> None:
        """Returns once the server accepts connections, as `pg_ctl -w`:
        its pid file says `ready`.  Fails with the log's new lines if the
        server says FATAL before it has a pid file (a client refused while
        it starts says FATAL too, later) or its postmaster is gone."""
        opts = f"{self._opts} -k {self.root}"
        log = self.root / "log"
        seen = log.stat().st_size if log.exists() else 0
        self._run("pg_ctl", "-D", str(self.data), "-l", str(log), "-o", opts, "-W", "start")
        deadline = time.monotonic() + self._WAIT_SECS
        while (found := self._pid_file()) is None or found[1] != "ready":
            said = log.read_bytes()[seen:].decode(errors="replace") if log.exists() else ""
            failed = "FATAL:" in said if found is None else not _alive(found[0])
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"the PostgreSQL server did not start:\n{said[-3000:]}")
            time.sleep(self._POLL_SECS)

    def stop(self, mode: str = "fast") -> None:
        """Returns once the server is gone (its pid file removed), as `pg_ctl -w`."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-W", "stop")
        deadline = time.monotonic() + self._WAIT_SECS
        while (self.data / "postmaster.pid").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the PostgreSQL server did not stop ({mode}) in {self._WAIT_SECS:.0f} s")
            time.sleep(self._POLL_SECS)

    def crash(self) -> None:
        """What a crash does to the server: it stops without a checkpoint
        (immediate), and recovers from its WAL on start."""
        self.stop("immediate")
        self.start()

    def _pid_file(self) -> tuple[int, str] | None:
        """The postmaster's pid and status line (the pid file's 8th:
        `starting`, `ready`, `stopping`), None while it has not written them."""
        try:
            lines = (self.data / "postmaster.pid").read_text().splitlines()
        except FileNotFoundError:
            return None
        try:
            return (int(lines[0]), lines[7].strip()) if len(lines) > 7 else None
        except ValueError:  # read while being written
            return None

    @property
    def dsn(self) -> str:
        return f"host={self.root} dbname=postgres user={self.user}"

    def fresh_dsn(self) -> str:
        """A DSN whose tables land in a new, empty schema."""
        import psycopg

        name = f"t{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {name}".encode())
        return f"{self.dsn} options='-c search_path={name}'"

    def close(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # not ours (the postgres user's, seen by a non-root run): alive
        pass
    return True


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    server = PgServer(flush=False)
    try:
        yield server
    finally:
        server.close()
