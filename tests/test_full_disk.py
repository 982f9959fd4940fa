"""A full disk (issue 23): the journal keeps a second copy of every record
until its checkpoint; running out of space checkpoints it at once, frees
that copy and says so, and input is accepted again without a restart.  A
real daemon whose state directory is a small tmpfs the test mounts."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import Daemon, wait_for
from supervisor.ctl.client import Client, RequestError


@contextlib.contextmanager
def _small_disk(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "sessiond-test-full", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(path: Path) -> None:
    """Write until the disk is full."""
    block = b"\0" * 65536
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                os.write(fd, block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                if len(block) == 1:
                    return
                block = block[: len(block) // 2]
    finally:
        os.close(fd)


def _accepted(c: Client, sid: str, text: str) -> bool:
    try:
        return c.send_text(sid, text).endswith(f": {text}")
    except RequestError as exc:
        assert exc.code == "no_space", exc.message
        return False


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
@pytest.mark.process
def test_running_out_of_space_checkpoints_the_journal_and_input_is_accepted_again(make_daemon) -> None:
    d: Daemon = make_daemon(start=False)
    with _small_disk(d.state_dir, "8m"):
        try:
            d.start()
            with d.client() as c:
                sid = c.create().id
                chunk = "x" * (200 * 1024)
                for i in range(1, 6):  # 2 MiB in the log (input and reply), as much again in the journal
                    assert c.send_text(sid, chunk) == f"{i}: {chunk}"
                _fill(d.state_dir / "filler")
                with pytest.raises(RequestError) as err:
                    c.send_text(sid, chunk)
                assert err.value.code == "no_space", err.value.message
                # Freed by the writer thread once the logs are fsync'd: no restart.
                wait_for(lambda: _accepted(c, sid, chunk), 10, "input to be accepted again")
                assert "journal checkpoint was started to free" in err.value.message, err.value.message
                assert c.status(sid).turns == 6
            wait_for(lambda: "the journal checkpoint freed" in d.log, 5, "the log to say what was freed")
        finally:
            d.kill()
