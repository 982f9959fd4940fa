"""A session's System V IPC goes with it (issue 29): with `[sandbox]
namespaces = "off"` (the deployment it was found in), shared memory a tool
made outlived the session, 400 MiB in 25 segments after `rm`, until reboot.

Now a root worker makes an IPC namespace of its own before it drops to its
uid (CAP_SYS_ADMIN, which the shipped unit keeps), an unprivileged daemon's
tool host makes one in a user namespace of its own, and where neither can
(the unit without CAP_SYS_ADMIN) the daemon removes what the session's own
uid left in the host's namespace when its worker ends, as systemd's
RemoveIPC= does.  Each segment has a size no other process here uses, so
the host's /proc/sysvipc tells it apart.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import psutil
import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import SERVICE, Daemon, wait_for
from test_access import NOBODY, open_root, root_only  # noqa: F401 (fixture)
from test_agent_e2e import agent_config, tool_results

pytestmark = [pytest.mark.process, root_only]

SIZE = 3_141_592  # bytes of the tool's segment: no one else's
HANDLER_SIZE = 2_718_281  # the handler code's
MAKE = f"ipcmk -M {SIZE} && ipcmk -S 2 && ipcmk -Q && echo MADE"


@pytest.fixture(autouse=True)
def _tools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-operator-key-0029")
    assert shutil.which("ipcmk") and shutil.which("bwrap"), "util-linux (ipcmk) and bubblewrap are needed"


def segments(size: int = SIZE) -> list[int]:
    """Owner uids of the host's shared memory segments of `size` bytes."""
    with open("/proc/sysvipc/shm") as f:
        header = f.readline().split()
        at, uid = header.index("size"), header.index("uid")
        return [int(row[uid]) for row in (line.split() for line in f) if int(row[at]) == size]


def _make(d: Daemon, llm: FakeLLM, sid: str) -> str:
    llm.script(tool_call_stream(("t", "bash", {"command": MAKE})), text_stream("done"))
    with d.client() as c:
        list(c.send(sid, "go"))
    return tool_results(llm.requests[-1].json)[-1]


def _config(llm: FakeLLM) -> str:
    config = agent_config(llm, '[sandbox]\nnamespaces = "off"\n')
    return config.replace("[agent]\n", '[agent]\nallowed_handlers = ["agent", "fixture_handlers:*"]\n', 1)


@pytest.mark.parametrize("drop", ["", "CAP_SYS_ADMIN"], ids=["unit", "unit-without-cap-sys-admin"])
def test_under_the_unit_without_namespaces_a_sessions_sysv_ipc_goes_with_rm(
        make_daemon, llm: FakeLLM, open_root: Path, drop: str) -> None:
    """A tool's segment (from bash) and a handler's (its own code, in the
    worker) in each of two sessions."""
    assert segments(SIZE) == segments(HANDLER_SIZE) == []
    d = make_daemon(_config(llm), start=False, root=open_root / "d", trust=False)
    d.run_as_unit(SERVICE, drop=(drop,) if drop else ())
    d.start(timeout=60)
    with d.client() as c:
        tool_sid = c.create(session="tool").id
        report = dict(c.status(tool_sid).sandbox)
        code_sid = c.create(session="code", handler="fixture_handlers:whoami").id
        code_uid = psutil.Process(c.status(code_sid).pid).uids().real
        assert c.send_text(code_sid, f"shm {HANDLER_SIZE}").startswith("shm "), "shmget failed"
    out = _make(d, llm, tool_sid)
    assert "MADE" in out, out
    # The tool's segment is in a namespace of the session's own: its
    # worker's, or (without CAP_SYS_ADMIN) its tool host's user namespace.
    assert segments(SIZE) == []
    if drop:
        # The handler's code runs in the worker, with no namespace of its
        # own: its segment is in the host's, under the session's uid.
        assert "ipc-namespace" in report["inactive"], report
        assert segments(HANDLER_SIZE) == [code_uid]
    else:
        assert "ipc-namespace" in report["active"], report
        assert segments(HANDLER_SIZE) == []
    with d.client() as c:
        c.remove(tool_sid)
        c.remove(code_sid)
    wait_for(lambda: segments(SIZE) == segments(HANDLER_SIZE) == [], 10, "the sessions' SysV IPC to be gone")


def test_an_unprivileged_daemons_tool_host_makes_its_own_ipc_namespace(
        make_daemon, llm: FakeLLM, open_root: Path) -> None:
    assert SIZE not in segments()
    d = make_daemon(_config(llm), start=False, root=open_root / "d", trust=False)
    d.run_as_user(NOBODY, NOBODY)
    d.start()
    with d.client() as c:
        assert "tool host" in c.stats().sandbox["ipc"], c.stats().sandbox
        sid = c.create(session="ipc").id
    assert "MADE" in _make(d, llm, sid)
    assert segments() == [], "the segment is in the host's namespace, where nobody's sessions share a uid"
    with d.client() as c:
        c.remove(sid)
