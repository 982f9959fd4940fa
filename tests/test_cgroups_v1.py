"""A cgroup per session on cgroup v1, as a root daemon finds it on this host
(memory, pids, cpu and freezer hierarchies, no delegated cgroup v2): the
kill is complete and the cap is the kernel's for every process of the
session, the worker and what its handler starts included, whatever they do
to leave its tree; and one session's crash kills nothing of another's.

The escapees are started by a handler's own code (tests/cgroup_handlers.py):
no tool host and no sandbox stand between them and the machine, only the
session's cgroup.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
from pathlib import Path

import psutil
import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import FAST_SWEEP, TEST_HANDLERS, wait_for
from ipc import messages as m
from test_access import open_root, root_only  # noqa: F401 (open_root: a fixture)
from test_agent_e2e import agent_config

pytestmark = [pytest.mark.process, root_only]

HANDLER = "cgroup_handlers:escaper"


def _config(limits: str = "") -> str:
    handlers = ", ".join(f'"{h}"' for h in [*TEST_HANDLERS, "cgroup_handlers:*"])
    sweep = FAST_SWEEP.replace("[agent.limits]\n", "[agent.limits]\n" + limits)
    return sweep + f"\n[agent]\nallowed_handlers = [{handlers}]\n"


def _escapees(tag: str) -> list[psutil.Process]:
    """Every process started for `tag` (the unshare around a namespaced one too)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmdline = p.info["cmdline"] or []
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(f"sessiond-esc-{tag}-" in a for a in cmdline):
            out.append(p)
    return out


def _v1_dirs(sid: str) -> list[Path]:
    roots = [Path("/sys/fs/cgroup") / c / "sessiond" for c in ("pids", "cpu", "freezer")]
    return [d for root in roots if root.exists() for d in root.glob(f"d-*/u-*/s-{sid}")]


def test_a_session_and_everything_its_handler_started_die_whole(make_daemon) -> None:
    d = make_daemon(_config())
    assert "a cgroup v1 per session" in d.log, d.log
    with d.client() as c:
        sid = c.create(handler=HANDLER).id
        info = c.status(sid)
        active = info.sandbox["active"]
        assert "cgroup-memory" in active and "cgroup-pids" in active and "cgroup-kill" in active, info.sandbox
        dirs = _v1_dirs(sid)
        assert {d.parent.name for d in dirs} == {"u-0"}, dirs  # its owner's (root's) level
        # All sessions of the daemon together weigh one task at nice 10.
        (cpu,) = [d for d in dirs if "/cpu/" in str(d)]
        assert (cpu.parent.parent / "cpu.shares").read_text().strip() == "110"
        for kind in ("setsid", "daemon", "userns"):
            assert c.send_text(sid, f"{kind} one") == f"started {kind}"
        worker = info.pid
    found = wait_for(lambda: len(_escapees("one")) >= 4 and _escapees("one"), 10, "the escapees to start")
    # They left the worker's tree: re-parented to the zygote, the subreaper.
    assert all(worker not in [a.pid for a in p.parents()] for p in found)
    assert psutil.Process(worker).nice() > psutil.Process(d.pid).nice()  # [daemon] session_nice
    with d.client() as c:
        c.stop(sid)
    wait_for(lambda: not _escapees("one"), 10, "every escapee to die with its session's stop")
    # And again on a restart and on rm.
    with d.client() as c:
        c.restart(sid)
        assert c.send_text(sid, "setsid two") == "started setsid"
        wait_for(lambda: _escapees("two"), 10, "the escapee to start")
        c.restart(sid)
        wait_for(lambda: not _escapees("two"), 10, "the escapee to die with the restart")
        assert c.send_text(sid, "daemon three") == "started daemon"
        wait_for(lambda: _escapees("three"), 10, "the escapee to start")
        c.remove(sid)
    wait_for(lambda: not _escapees("three"), 10, "the escapee to die with rm")
    wait_for(lambda: not _v1_dirs(sid), 10, "the session's cgroups to be removed")


def test_a_memory_escapee_is_killed_by_the_kernel_cap(make_daemon) -> None:
    d = make_daemon(_config("max_memory_mb = 256\n"))
    with d.client() as c:
        sid = c.create(handler=HANDLER).id
        assert c.send_text(sid, "hog big 408") == "started hog"
        # The hog is in no process tree the sweep looks at; the kernel holds
        # it at the cap, and the daemon kills the whole session.
        st = wait_for(lambda: (s := c.status(sid)).last_exit is not None and s, 20,
                      "the session to be killed for memory")
        assert st.last_exit.reason == "killed_memory", st.last_exit
        assert "the kernel's cgroup limit" in st.last_exit.detail, st.last_exit
    wait_for(lambda: not _escapees("big"), 10, "the hog to be gone")
    # (The kernel holds its usage at the cap: reached, not past it.)
    assert "memory cap 256 MiB reached (the kernel's cgroup limit)" in d.log or \
        "memory cap 256 MiB exceeded at " in d.log, d.log


def test_the_memory_shown_is_at_least_the_workers_own(make_daemon) -> None:
    """The kernel charges a page to the cgroup that first touched it: the
    pages a worker shares with the zygote it was forked from are charged
    to the zygote's, and the session's cgroup counts only what the worker
    touched since (656 KiB for a 30 MB worker).  `status` shows at least
    the worker's own RSS."""
    d = make_daemon(_config())
    with d.client() as c:
        sid = c.create(handler="echo").id
        c.send_text(sid, "hi")
        pid = c.status(sid).pid
        rss = psutil.Process(pid).memory_info().rss
        # Its memory cgroup as the kernel names it (a walk of the hierarchy
        # races other tests' cgroups coming and going).
        [rel] = [line.split(":", 2)[2].strip() for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                 if line.split(":")[1] == "memory"]
        mem = Path("/sys/fs/cgroup/memory" + rel)
        assert mem.name == f"s-{sid}", mem
        charged = int((mem / "memory.usage_in_bytes").read_text())
        assert charged < rss // 2, (charged, rss)  # (what made the column wrong)
        # Once the sweep has measured it (its CPU figure takes two samples):
        wait_for(lambda: c.status(sid).cpu_percent is not None, 15, "the sweep's figures")
        assert (c.status(sid).rss_bytes or 0) >= rss * 0.9, (c.status(sid).rss_bytes, rss)


def _refused(tag: str) -> str:
    """The refusal a memfd holder of `tag` names itself by ("ENOMEM 63":
    tests/cgroup_handlers.py), or ''."""
    for p in _escapees(tag):
        try:
            name = Path(f"/proc/{p.pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.split()[0] in errno.errorcode.values():
            return name
    return ""


def test_unmapped_memory_counts_against_the_kernel_cap(make_daemon) -> None:
    """A memfd filled with write() is in no process's RSS; the kernel
    charges its pages to the session that wrote them, so they cannot pass
    its cap.  On v1, with the session's OOM killer off, the charge that
    meets the cap decides how: the write(2)'s own fails with ENOMEM (no
    OOM: nothing for the daemon to act on, the session lives on); a page
    fault waits at the cap, and the daemon, told, kills the session whole.
    The kill this test once waited for alone came from a page fault of the
    writer's own traceback after its ENOMEM, the memfd still held: not what
    the cap promises, and gone whenever the writer faults no page there."""
    d = make_daemon(_config("max_memory_mb = 64\n"))
    with d.client() as c:
        sid = c.create(handler=HANDLER).id
        assert c.send_text(sid, "memfd held 256") == "started memfd"
        # Either way it waits on the writer's 64 MiB and the daemon's kill,
        # never on all 256: were the cap not held, neither would come.
        st = wait_for(lambda: (s := c.status(sid)).last_exit is not None and s or _refused("held"), 20,
                      "the session to be killed for memory, or its write refused")
        if isinstance(st, str):
            why, held = st.split()
            assert why == "ENOMEM" and int(held) <= 64, st  # refused at the cap, not past it
            last = c.status(sid).last_exit  # (a fault elsewhere may have met the cap meanwhile)
            assert last is None or last.reason == "killed_memory", last
            c.stop(sid)
        else:
            assert st.last_exit.reason == "killed_memory", st.last_exit
            assert "memory cap 64 MiB" in st.last_exit.detail, st.last_exit
            assert "(the kernel's cgroup limit)" in st.last_exit.detail, st.last_exit
    wait_for(lambda: not _escapees("held"), 10, "the memfd's holder to be gone")


def test_kernel_memory_counts_against_the_kernel_cap(make_daemon) -> None:
    """Pipe and socket buffers are kernel memory, in no process's RSS; the
    session's memory cgroup charges them to it (v1 counts kmem in
    memory.usage_in_bytes), so they cannot pass its cap: a write past it
    fails (ENOMEM, ENOBUFS), or the session is killed whole."""
    config = _config("max_memory_mb = 64\n").replace('cgroup_handlers:*"', 'cgroup_handlers:*", "share_handlers:*"')
    d = make_daemon(config)
    with d.client() as c:
        sid = c.create(handler="share_handlers:taker").id
        done = list(c.send(sid, "buffers 256"))[-1]
        if isinstance(done, m.TurnDone):  # the write past the cap failed
            _, held, why = done.reply.split()
            assert int(held) < 64 and why in ("ENOMEM", "ENOBUFS", "EAGAIN", "MemoryError"), done.reply
        else:  # or the session met its cap and went whole
            last = c.status(sid).last_exit
            assert last.reason == "killed_memory" and "memory cap 64 MiB" in last.detail, last
            # At the cap ("64 MiB reached": a cgroup's usage stops there) or
            # just past it ("exceeded at 64.5 MiB"), never far past.
            assert "64 MiB reached" in last.detail or float(last.detail.split(" at ")[1].split()[0]) <= 64 + 1, last


@pytest.mark.parametrize("worker_user", ["", "nobody"], ids=["as-root", "shared-worker-user"])
def test_one_sessions_crash_kills_nothing_of_anothers(make_daemon, open_root: Path, worker_user: str) -> None:
    """Also where every session runs as one `worker_user`: the zygote's hunt
    for a crashed worker's strays must not take that uid for the session's
    mark (another session's escapee, re-parented to the zygote, has it too)."""
    config = _config()
    if worker_user:
        shutil.copy(Path(__file__).with_name("cgroup_handlers.py"), open_root / "lib" / "cgroup_handlers.py")
        config = config.replace("[daemon]\n", f'[daemon]\nworker_user = "{worker_user}"\n')
    d = make_daemon(config, root=open_root / "d")
    with d.client() as c:
        a = c.create(handler=HANDLER).id
        b = c.create(handler=HANDLER).id
        assert c.send_text(a, "setsid alpha") == "started setsid"
        assert c.send_text(b, "setsid beta") == "started setsid"
        (beta,) = wait_for(lambda: _escapees("beta"), 10, "b's escapee to start")
        wait_for(lambda: _escapees("alpha"), 10, "a's escapee to start")
        if worker_user:
            assert beta.uids().real == psutil.Process(c.status(a).pid).uids().real != 0
        os.kill(c.status(a).pid, signal.SIGKILL)  # a crash of a's worker
        wait_for(lambda: not _escapees("alpha"), 10, "a's escapee to die with its worker")
        # The zygote hunts a killed worker's orphans for a second: b's is none of them.
        with pytest.raises(AssertionError, match="timed out"):
            wait_for(lambda: not beta.is_running() or beta.status() == psutil.STATUS_ZOMBIE, 1.5,
                     "b's escapee to die (it must not)")
        c.stop(b)
        wait_for(lambda: not _escapees("beta"), 10, "b's escapee to die with b's own stop")


def test_without_a_cgroup_a_root_daemon_kills_a_session_by_its_uid(
    make_daemon, llm: FakeLLM, open_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cgroups = "off", each session its own uid: a setsid'd escapee the
    daemon never saw still dies with its session's stop, and not with
    another session's crash."""
    monkeypatch.setenv("SESSIOND_TEST_KEY", "k")
    extra = '[sandbox]\nmode = "off"\n'
    d = make_daemon(agent_config(llm, extra).replace("[daemon]\n", '[daemon]\ncgroups = "off"\n'),
                    root=open_root / "d", trust=False)
    assert "no cgroup per session" in d.log, d.log
    with d.client() as c:
        a = c.create(session="a").id
        b = c.create(session="b").id
    for sid in (a, b):
        cmd = f"(setsid bash -c 'exec -a sessiond-esc-{sid}-setsid sleep infinity' &) ; echo LAUNCHED"
        llm.script(tool_call_stream(("t", "bash", {"command": cmd})), text_stream("done"))
        with d.client() as c:
            assert c.send_text(sid, "go") == "done"
    (escapee_b,) = wait_for(lambda: _escapees(b), 10, "b's escapee to start")
    wait_for(lambda: _escapees(a), 10, "a's escapee to start")
    assert escapee_b.uids().real != 0
    with d.client() as c:
        os.kill(c.status(a).pid, signal.SIGKILL)
        wait_for(lambda: not _escapees(a), 10, "a's escapee to die with its worker (its uid)")
        assert escapee_b.is_running() and escapee_b.status() != psutil.STATUS_ZOMBIE
        c.stop(b)
    wait_for(lambda: not _escapees(b), 10, "b's escapee to die with b's own stop")


def test_a_dead_daemons_cgroups_are_removed_by_the_next(make_daemon) -> None:
    first = make_daemon(_config())
    with first.client() as c:
        sid = c.create(handler=HANDLER).id
    (old,) = {d.parent.parent for d in _v1_dirs(sid) if "/pids/" in str(d)}
    assert old.name.startswith(f"d-{first.pid}-")
    first.kill()  # SIGKILL: no shutdown tidies anything
    second = make_daemon(_config())
    assert "a cgroup v1 per session" in second.log, second.log
    wait_for(lambda: not old.exists(), 10, "the dead daemon's cgroups to be removed")
