"""Security audit (issue 9), the process side: what a session's own tools,
or any process of the daemon's uid, can reach of the daemon and its workers.

Each test plays the attack through the public surface (a session's `bash`
tool driven by the fake LLM, or a plain process of the same uid) and checks
that it now does no harm.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import psutil
import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import Daemon, wait_for
from ipc import messages as m

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="running a daemon as another user needs root")
SECRET = "sk-audit-canary-0123456789"


@pytest.fixture
def llm() -> Iterator[FakeLLM]:
    with FakeLLM() as server:
        yield server


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A daemon root another user can reach (pytest's temp dirs are root's
    alone), as /var/lib would be."""
    base = Path(tempfile.mkdtemp(prefix="sd-proc-"))
    os.chmod(base, 0o711)
    yield base / "d"
    shutil.rmtree(base, ignore_errors=True)


def agent_config(llm: FakeLLM) -> str:
    return f"""
[agent]
handler = "agent"
[agent.worker]
heartbeat_interval_secs = 0.2
restart_backoff_initial_ms = 20
[agent.limits]
memory_poll_interval_ms = 50
[provider]
base_url = "{llm.base_url}"
model = "test-model"
api_key_env = "SESSIOND_API_KEY"
retry_backoff_initial_ms = 1
[daemon]
stop_grace_secs = 1.0
"""


def _open_as(uid: int, paths: list[str]) -> dict[str, int]:
    """Fork, become `uid`, try to open each path; errno per path (0: opened)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out: dict[str, int] = {}
            for path in paths:
                try:
                    os.close(os.open(path, os.O_RDONLY))
                    out[path] = 0
                except OSError as exc:
                    out[path] = exc.errno or -1
            os.write(w, msgspec.msgpack.encode(out))
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    result: dict[str, int] = msgspec.msgpack.decode(data)
    return result


@root_only
def test_same_uid_tools_cannot_read_the_daemons_or_a_workers_secrets(
    make_daemon, llm: FakeLLM, shared_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Daemon and workers run as one unprivileged user, as they do without
    root.  Before PR_SET_DUMPABLE=0 the session's own `bash` tool (same
    uid) read the provider key from /proc/<daemon or worker>/environ."""
    monkeypatch.setenv("SESSIOND_API_KEY", SECRET)
    d = make_daemon(agent_config(llm), start=False, root=shared_root)
    d.run_as_user(NOBODY, NOBODY)
    d.start()
    with d.client() as c:
        sid = c.create().id
        worker = c.status(sid).pid
        assert psutil.Process(d.pid).uids().real == NOBODY
        assert psutil.Process(worker).uids().real == NOBODY
        targets = [f"/proc/{d.pid}/environ", f"/proc/{worker}/environ",
                   f"/proc/{d.pid}/mem", f"/proc/{worker}/mem"]
        probe = "; ".join(
            f"if (exec 3<{t}) 2>/dev/null; then echo OPENED {t}; else echo DENIED {t}; fi"
            for t in targets
        )
        command = (
            f"echo PARENT $PPID UID $(id -u); {probe}; "
            f"ls /proc/{d.pid}/fd >/dev/null 2>&1 && echo OPENED fd || echo DENIED fd; "
            f"cat /proc/{d.pid}/environ /proc/{worker}/environ /proc/$PPID/environ 2>/dev/null "
            "| tr '\\0' '\\n'; echo ENV; env"
        )
        llm.script(tool_call_stream(("c1", "bash", {"command": command})), text_stream("done"))
        events = list(c.send(sid, "look around"))
        assert isinstance(events[-1], m.TurnDone) and events[-1].reply == "done"
    result = next(msg["content"] for msg in llm.requests[1].json["messages"] if msg["role"] == "tool")
    assert f"PARENT {worker} UID {NOBODY}" in result
    for t in targets:
        assert f"DENIED {t}" in result, result
    assert "DENIED fd" in result and "OPENED" not in result, result
    # Nothing of the daemon's environment reached the tool: not the key, not its name.
    assert SECRET not in result and "SESSIOND_API_KEY" not in result, result
    assert "SESSIOND" not in result.split("ENV", 1)[1]
    # The LLM did get the key: the worker holds it, it just cannot be read.
    headers = {k.lower(): v for k, v in llm.requests[0].headers.items()}
    assert headers["authorization"] == f"Bearer {SECRET}"

    # A plain process of the same uid fares no better.
    opened = _open_as(NOBODY, targets)
    assert opened == dict.fromkeys(targets, errno.EACCES), opened


@root_only
def test_an_unprivileged_daemon_still_measures_non_dumpable_workers(
    make_daemon, shared_root: Path
) -> None:
    """Non-dumpable workers' /proc files belong to root: the daemon, not
    root, must still read their statm and task/children (mode 0444), or
    memory caps would silently stop working."""
    config = """
[agent.worker]
heartbeat_interval_secs = 0.2
restart_backoff_initial_ms = 20
[agent.limits]
memory_poll_interval_ms = 50
[daemon]
stop_grace_secs = 1.0
"""
    d = make_daemon(config, start=False, root=shared_root)
    d.run_as_user(NOBODY, NOBODY)
    d.start()
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:leaky",
                       settings={"agent.limits.max_memory_mb": 64}).id
        worker = c.status(sid).pid
        assert os.stat(f"/proc/{worker}/statm").st_uid == 0  # non-dumpable
        events = list(c.send(sid, "400"))
        assert isinstance(events[-1], m.TurnFailed) and "killed_memory" in events[-1].reason
        # A descendant's memory is found through the worker's task/children.
        hog = c.create(handler="fixture_handlers:child_hog",
                       settings={"agent.limits.max_memory_mb": 96}).id
        events = list(c.send(hog, "300"))
        assert isinstance(events[-1], m.TurnFailed) and "killed_memory" in events[-1].reason
        wait_for(lambda: c.status(sid).state == "idle", 10, "the restart")
