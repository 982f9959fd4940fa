"""A full disk (issue 23): the journal keeps a second copy of every record
until its checkpoint; running out of space checkpoints it at once, frees
that copy and says so, and input is accepted again without a restart.  A
real daemon whose state directory is a small tmpfs the test mounts."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import Daemon, wait_for
from supervisor.ctl.client import Client, RequestError, TurnFailedError


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


_TURNS_WHILE_FULL = 8  # past max_restart_attempts (5): the old code failed every busy session


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
@pytest.mark.process
def test_sessions_busy_when_the_disk_fills_refuse_turns_clearly_and_carry_on_once_it_is_freed(
    make_daemon,
) -> None:
    """Issue 32: each turn whose commit could not be saved killed its
    worker as a crash, so the restart intensity (5 within 60 s) sent every
    busy session to `failed`, refusing input after the space was back until
    an operator's `restart`.  A commit much larger than its input (big_echo)
    makes the disk's last bytes take inputs and refuse commits."""
    d: Daemon = make_daemon(start=False)
    with _small_disk(d.state_dir, "8m"):
        try:
            d.start()
            with d.client() as c:
                sids = [c.create(handler="fixture_handlers:big_echo").id for _ in range(3)]
            done: dict[str, list[int]] = {sid: [] for sid in sids}  # the N of each reply, in order
            refused: dict[str, list[str]] = {sid: [] for sid in sids}
            full = threading.Event()

            def traffic(sid: str) -> None:
                with d.client() as c:
                    for i in itertools.count():
                        if full.is_set() and len(refused[sid]) >= _TURNS_WHILE_FULL:
                            return
                        try:
                            reply = c.send_text(sid, f"t{i}")
                        except RequestError as exc:
                            refused[sid].append(f"{exc.code}: {exc.message}")
                            continue
                        except TurnFailedError as exc:
                            refused[sid].append(f"turn_failed: {exc.event.reason}")
                            continue
                        n, _, rest = reply.partition(": ")
                        if rest != f"t{i}" + "." * 32768:
                            refused[sid].append(f"a wrong reply: {reply[:40]}")
                        done[sid].append(int(n))

            threads = [threading.Thread(target=traffic, args=(sid,)) for sid in sids]
            for t in threads:
                t.start()
            wait_for(lambda: all(len(done[s]) >= 2 for s in sids), 20, "turns before the disk fills")
            _fill(d.state_dir / "filler")  # mid-traffic
            full.set()
            for t in threads:
                t.join(120)
            assert not any(t.is_alive() for t in threads)
            with d.client() as c:
                for sid in sids:
                    st = c.status(sid)
                    assert st.state != "failed", (sid, st.last_exit)
                    # Every refusal names the disk, where it is and what to do.
                    for why in refused[sid]:
                        assert "No space left on device" in why, why
                        assert f"free some space in the state directory ({d.state_dir}" in why, why
                    # What the client was told was done is the history, once each, in order.
                    assert done[sid] == list(range(1, len(done[sid]) + 1)), done[sid]
            assert "giving up restarting" not in d.log
            (d.state_dir / "filler").unlink()
            with d.client() as c:
                for sid in sids:
                    n = len(done[sid]) + 1
                    assert c.send_text(sid, "after") == f"{n}: after" + "." * 32768
                    assert c.status(sid).state == "idle"
        finally:
            d.kill()
