"""A session's cost is everything it holds (issue 21), on the fallback path
(`[daemon] cgroups = "off"`: no kernel memory controller, the sweep counts):

- a memfd filled with write() (in no process's RSS) and the private /tmp
  tmpfs count towards max_memory_mb;
- a workspace past max_disk_mb stops the session (killed_disk), which a
  restart does not cure until files are removed;
- a session of 300 forked children, over its cap by RSS and under it by
  PSS, is read by the measuring thread, not the loop, and left alone.

Real sessions with the sandbox (a root daemon, a uid and namespaces per
session), their bash driven through the scripted LLM.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil
import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import wait_for
from ipc import messages as m
from supervisor.host.measure import THREAD_NAME
from test_access import NOBODY, open_root, root_only  # noqa: F401 (fixture)
from test_agent_e2e import agent_config

pytestmark = [pytest.mark.process, root_only]


@pytest.fixture(autouse=True)
def _key_and_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-operator-key-0001")
    assert shutil.which("bwrap"), "bubblewrap is missing: apt-get install bubblewrap (make test does, as root)"


def make(make_daemon, llm: FakeLLM, open_root: Path, limits: str, setup: str = "root-uid-per-session"):
    """As test_sandbox's set-ups: a root daemon (a uid and namespaces per
    session), or the shipped unit's emulation (an ordinary user's daemon,
    no namespaces: Landlock and seccomp)."""
    # `cgroups = "off"` lands in the [daemon] table agent_config ends with:
    # these test the sweep's own counting, whatever the kernel offers (the
    # disk's too: the walk, not a workspace image, tests/test_disk_images.py).
    sandbox = 'namespaces = "off"' if setup == "landlock-only" else ""
    extra = (f'cgroups = "off"\n[sandbox]\n{sandbox}\n[tools]\ndisk_quota = "measured"\n'
             f'[agent.limits]\nmemory_poll_interval_ms = 50\n{limits}')
    d = make_daemon(agent_config(llm, extra), start=False, root=open_root / "d", trust=False)
    if setup == "landlock-only":
        d.run_as_user(NOBODY, NOBODY)
    d.start()
    return d


def run_tool(d, llm: FakeLLM, sid: str, command: str) -> list[m.Event]:
    llm.script(tool_call_stream(("t1", "bash", {"command": command})), text_stream("done"))
    with d.client() as c:
        return list(c.send(sid, "go"))


def _gone(marker: str) -> bool:
    return not [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]


@pytest.mark.parametrize("setup", ["root-uid-per-session", "landlock-only"])
def test_a_memfd_filled_with_write_counts_against_the_cap(
    make_daemon, llm: FakeLLM, open_root: Path, setup: str
) -> None:
    """1 GiB held in a 64 MiB session with no kill, status 59 MiB: a memfd's
    pages are in no RSS when written with write() and never mapped."""
    d = make(make_daemon, llm, open_root, "max_memory_mb = 64\n", setup)
    with d.client() as c:
        other = c.create(session="other", handler="echo").id
        sid = c.create(session="memfd").id
    fill = ('python3 -c "import os, signal; fd = os.memfd_create(\'memfd-hog\'); b = b\'x\' * (1 << 20)\n'
            'for _ in range(256): os.write(fd, b)\nsignal.pause()"; echo UNREACHED')
    events = run_tool(d, llm, sid, fill)
    assert any(isinstance(e, m.LimitExceeded) and e.kind == "memory" for e in events), events
    with d.client() as c:
        wait_for(lambda: c.status(sid).last_exit is not None, 10, "the session to be killed")
        assert c.status(sid).last_exit.reason == "killed_memory"
        assert c.send_text(other, "ping") == "1: ping"
        c.remove(sid)
    wait_for(lambda: _gone("memfd-hog"), 10, "the hog to be gone")


def test_the_private_tmp_counts_against_the_cap(make_daemon, llm: FakeLLM, open_root: Path) -> None:
    """250 MiB written to the session's /tmp tmpfs, no kill: a tmpfs's
    pages are in nobody's RSS.  Here the files stay after the command ends:
    the session is idle, holding them, and is killed all the same."""
    d = make(make_daemon, llm, open_root, "max_memory_mb = 64\n")
    with d.client() as c:
        sid = c.create(session="tmpfill").id
    events = run_tool(d, llm, sid, "dd if=/dev/zero of=/tmp/fill bs=1M count=200 2>&1; echo FILLED")
    with d.client() as c:
        wait_for(lambda: c.status(sid).last_exit is not None, 15, "the session to be killed")
        assert c.status(sid).last_exit.reason == "killed_memory", c.status(sid).last_exit
        wait_for(lambda: c.status(sid).state == "idle", 15, "its restart")
        # Its restart gets a new sandbox, and a new, empty /tmp.
        assert c.status(sid).rss_bytes < 64 << 20
    assert events


@pytest.mark.parametrize("setup", ["root-uid-per-session", "landlock-only"])
def test_a_workspace_past_its_quota_stops_the_session_until_files_are_removed(
    make_daemon, llm: FakeLLM, open_root: Path, setup: str
) -> None:
    d = make(make_daemon, llm, open_root, "max_disk_mb = 100\n", setup)
    with d.client() as c:
        sid = c.create(session="filler").id
        wait_for(lambda: c.status(sid).disk_bytes is not None, 10, "the first walk")
        assert c.status(sid).disk_bytes < 1 << 20
        # stats names how the quota is enforced here (a workspace root that is not btrfs with quotas).
        assert c.stats().sandbox["disk_quota"].startswith("measured"), c.stats().sandbox
    llm.script(tool_call_stream(("t1", "bash", {"command": "fallocate -l 300M big && echo ALLOCATED; sleep infinity"})),
               text_stream("done"))
    with d.client() as c:
        events = list(c.send(sid, "go"))
        limits = [e for e in events if isinstance(e, m.LimitExceeded)]
        assert limits and limits[0].kind == "disk" and limits[0].limit == 100, events
        wait_for(lambda: c.status(sid).state == "stopped", 15, "the session to be stopped")
        info = c.status(sid)
        assert info.last_exit is not None and info.last_exit.reason == "killed_disk", info.last_exit
        assert "max_disk_mb = 100" in info.last_exit.detail
        assert info.disk_bytes is not None and info.disk_bytes >= 300 << 20
        assert info.pid is None
        # Stopped, not restarted in a loop (no automatic restart).
        assert info.restarts == 0
        # A restart over the quota is stopped again at its first walk.
        c.restart(sid)
        wait_for(lambda: c.status(sid).state == "stopped", 15, "the restart to be stopped again")
        assert c.status(sid).last_exit.reason == "killed_disk"
    # Removed from outside (the operator, or the user where the workspace is theirs to reach).
    (big,) = (open_root / "d").rglob("filler@*/big")
    os.unlink(big)
    with d.client() as c:
        c.restart(sid)
        wait_for(lambda: c.status(sid).disk_bytes is not None, 10, "the restarted worker's first walk")
        info = c.status(sid)
        assert info.state == "idle" and info.disk_bytes < 100 << 20, info
        llm.script(text_stream("back"))
        # ("done" if the stopped turn never got as far as asking for it)
        assert c.send_text(sid, "hello") in ("back", "done")


def _measuring_thread_cpu(pid: int) -> int:
    """Clock ticks the daemon's measuring thread has used (0 if none)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() != THREAD_NAME:
                    continue
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])
        except OSError:
            continue
    return 0


def test_300_forks_over_the_cap_by_rss_are_read_off_the_loop_and_spared(
    make_daemon, llm: FakeLLM, open_root: Path
) -> None:
    """300 children of a 20 MiB process: ~6 GiB of RSS summed, ~30 MiB of
    PSS.  Their smaps_rollup are read by the measuring thread, a budget a
    sweep (the daemon's loop read all of them every poll: 262 ms a pass
    with 511), and the session, under its cap by PSS, is never killed."""
    d = make(make_daemon, llm, open_root, "max_memory_mb = 512\n")
    with d.client() as c:
        other = c.create(session="other", handler="echo").id
        sid = c.create(session="forker").id
        pid = c.status(sid).pid
    forker = ("import os, signal\nb = b'y' * (20 << 20)\nfor _ in range(299):\n"
              "    if os.fork() == 0:\n        break\nsignal.pause()")
    events = run_tool(d, llm, sid, f'(python3 -c "{forker}" > /dev/null 2>&1 &) ; echo STARTED')
    assert isinstance(events[-1], m.TurnDone), events[-1]

    def forks() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if "(20 << 20)" in " ".join(p.info["cmdline"] or [])]

    cap = 512 << 20
    wait_for(lambda: len(forks()) == 300, 20, "300 forks")
    assert sum(p.memory_info().rss for p in forks()) > 4 * cap
    with d.client() as c:
        wait_for(lambda: (c.status(sid).rss_bytes or 0) < cap, 20, "the sweep to count their PSS")
        # The reads are the thread's (a clock tick is 10 ms: it may take a
        # few sweeps of these 300 reads to show one).
        wait_for(lambda: _measuring_thread_cpu(d.pid) > 0, 20, "the measuring thread to have read")
        assert c.send_text(other, "ping") == "1: ping"
        assert c.status(sid).last_exit is None and c.status(sid).pid == pid
        c.remove(sid)
    wait_for(lambda: not forks(), 15, "the forks to go with their session")
