"""The suite itself: a failed test that ran a daemon shows the daemon's log
in its report (tests/conftest.py; pytest runs a small file of its own in a
child process, so the failure it provokes is that child's), and the
suite's PostgreSQL listens on no network address (tests/pg_server.py; the
Ray cluster's namespace is checked in tests/test_cluster.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import env_for_children
from pg_server import PgServer

TESTS = Path(__file__).resolve().parent

INNER = textwrap.dedent(
    """\
    import pytest

    @pytest.mark.process
    def test_fails_after_the_daemon_said_something(make_daemon):
        d = make_daemon()
        with d.client() as c:
            c.create("marked", handler="echo")
        assert False, "the failure itself"

    @pytest.mark.process
    def test_passes_with_a_daemon(make_daemon):
        make_daemon()
    """
)


@pytest.mark.process
def test_a_failed_test_shows_the_tail_of_each_daemon_log(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {**env_for_children(), "PYTHONPATH": str(TESTS)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
         "--rootdir", str(tmp_path), "-o", "addopts=", str(tmp_path / "test_inner.py")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    # One log section, for the failed test's daemon, holding what it logged.
    assert out.count("sessiond log (call)") == 1, out
    failed = out[out.index("test_fails_after_the_daemon_said_something"):]
    section = failed[failed.index("sessiond log (call)"):]
    assert "marked" in section, out


@pytest.mark.component
def test_the_suite_s_postgresql_listens_on_its_unix_socket_only(pg_server: PgServer) -> None:
    """tests/pg_server.py starts PostgreSQL with no TCP address at all: only
    processes of this machine that can open its socket directory reach it."""
    import psycopg

    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        row = conn.execute("SHOW listen_addresses").fetchone()
        assert row is not None and row[0] == ""
        row = conn.execute("SELECT inet_server_addr()").fetchone()
        assert row is not None and row[0] is None  # this very connection came over the Unix socket


@pytest.mark.process
def test_system_deps_names_each_missing_tool_as_debian_and_fedora_package_it(tmp_path: Path) -> None:
    """The finding: `make system-deps` told a Fedora user to `dnf install
    chromium-driver postgresql`, Debian's names (Fedora's are chromedriver
    and postgresql-server).  Here every tool is missing (a PATH with none of
    them, nor apt-get or dnf, and an `ls` that finds no PostgreSQL)."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "id").symlink_to(shutil.which("id") or "/usr/bin/id")
    (bin_dir / "ls").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "ls").chmod(0o755)
    done = subprocess.run([shutil.which("make") or "make", "-s", "-C", str(TESTS.parent), "system-deps"],
                          env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    said = done.stderr
    # (mkfs.ext4 is also looked for at its absolute paths, which this PATH does not hide.)
    debian = [p for p in said.split("apt-get install", 1)[1].split(";", 1)[0].split() if p != "e2fsprogs"]
    fedora = [p for p in said.split("dnf install", 1)[1].split(")", 1)[0].split() if p != "e2fsprogs"]
    assert debian == ["bubblewrap", "zsh", "btrfs-progs", "chromium", "chromium-driver", "util-linux", "nodejs",
                      "passwd", "postgresql"]
    assert fedora == ["bubblewrap", "zsh", "btrfs-progs", "chromium", "chromedriver", "util-linux", "nodejs",
                      "shadow-utils", "postgresql-server"]
