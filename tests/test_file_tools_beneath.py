"""Security audit (issue 9): the file tools cannot be led out of the
workspace, even by a session's own tools racing them.

The attacker owns the workspace (its `bash` tool can rename anything in it)
and wants `read_file` / `write_file` / `list_dir` to touch a file outside.
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import wait_for
from ipc import messages as m
from session_worker.agent import _beneath
from session_worker.agent._builtins import builtin_tools
from session_worker.agent._errors import ToolError
from session_worker.agent._tools import ToolEnv
from ipc.settings import SessionSettings
from test_agent_support import FakeCtx, run

SECRET = "top-secret-outside-the-workspace"

# Swaps two names atomically (RENAME_EXCHANGE) as fast as it can until
# killed or until its deadline; prints "swapping" once it has started.
SWAPPER = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
a, b, secs = os.fsencode(sys.argv[1]), os.fsencode(sys.argv[2]), float(sys.argv[3])
AT_FDCWD, RENAME_EXCHANGE = -100, 2
if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0:
    sys.exit("renameat2: " + os.strerror(ctypes.get_errno()))
print("swapping", flush=True)
end = time.monotonic() + secs
while time.monotonic() < end:
    for _ in range(1000):
        libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)
"""


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "f").write_text(SECRET)
    (tmp_path / "secret.txt").write_text(SECRET)
    w = tmp_path / "ws"
    (w / "sub").mkdir(parents=True)
    (w / "sub" / "f").write_text("harmless")
    (w / "a").write_text("harmless")
    return w.resolve()


@pytest.fixture(params=["openat2", "walk"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both the openat2 path and the O_NOFOLLOW walk used without it."""
    monkeypatch.setattr(_beneath, "use_openat2", None if request.param == "openat2" else False)
    return str(request.param)


@pytest.fixture
def swapper() -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []

    def start(a: Path, b: Path, secs: float = 60.0) -> None:
        proc = subprocess.Popen([sys.executable, "-c", SWAPPER, str(a), str(b), str(secs)],
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "swapping\n"

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


def env_for(ws: Path) -> ToolEnv:
    settings = SessionSettings()
    return ToolEnv(ws, settings, FakeCtx(settings, ws))


def calls(tool: str, args: dict[str, Any], ws: Path, n: int) -> list[str]:
    """`n` calls of one tool in one loop: each result, or the ToolError's text."""
    fn = builtin_tools()[tool]
    env = env_for(ws)

    async def go() -> list[str]:
        out = []
        for _ in range(n):
            try:
                out.append(await fn.run(args, env))
            except ToolError as exc:
                out.append(f"ToolError: {exc}")
        return out

    return run(go())


def calls_until(tool: str, args: dict[str, Any], ws: Path, n: int, seen: Any, rounds: int = 20) -> list[str]:
    """Rounds of `n` calls until one result satisfies `seen` (or `rounds`
    ran out): on a loaded machine the swapper may win every call of a round."""
    out: list[str] = []
    for _ in range(rounds):
        out += calls(tool, args, ws, n)
        if any(seen(r) for r in out):
            break
    return out


def _naive_read(ws: Path, raw: str) -> str | None:
    """What read_file did before: resolve, check, then open again."""
    try:
        real = (ws / raw).resolve()
        if not real.is_relative_to(ws):
            return None
        return real.read_text()
    except OSError:
        return None


@pytest.mark.process
def test_a_swapped_symlink_never_leads_read_or_write_outside(ws: Path, mode: str, swapper) -> None:
    # `a` (a file inside) and `b` (a symlink to a secret outside) swap places
    # all the time; between the friendly check and the open, `a` is often
    # the symlink.
    (ws / "b").symlink_to(ws.parent / "secret.txt")
    swapper(ws / "a", ws / "b")
    # The race is real on this machine: the old check-then-open leaks.
    assert any(_naive_read(ws, "a") == SECRET for _ in range(20000)), "the swapper never won"
    results = calls_until("read_file", {"path": "a"}, ws, 400, lambda r: r == "harmless")
    assert not [r for r in results if SECRET in r]
    assert "harmless" in results
    refused = [r for r in results if r.startswith("ToolError")]
    # Refused by the kernel layer, or by the friendly check that met the
    # swap halfway (readlink of a name that just stopped being a symlink).
    assert all("outside the workspace" in r or "cannot resolve 'a'" in r for r in refused), set(refused)
    results = calls_until("write_file", {"path": "a", "content": "pwned"}, ws, 400, lambda r: r.startswith("wrote"))
    assert (ws.parent / "secret.txt").read_text() == SECRET
    assert any(r.startswith("wrote") for r in results)


@pytest.mark.process
def test_a_swapped_directory_never_leads_read_or_list_outside(ws: Path, mode: str, swapper) -> None:
    (ws / "dlink").symlink_to(ws.parent / "outside")
    swapper(ws / "sub", ws / "dlink")
    for r in calls("read_file", {"path": "sub/f"}, ws, 300):
        assert SECRET not in r
        assert r == "harmless" or r.startswith("ToolError"), r
    (ws.parent / "outside" / "only-outside").write_text("x")
    for r in calls("list_dir", {"path": "sub"}, ws, 300):
        assert "only-outside" not in r
    results = calls("write_file", {"path": "sub/new", "content": "pwned"}, ws, 300)
    assert not (ws.parent / "outside" / "new").exists(), results[:5]


@pytest.mark.component
def test_planted_symlinks_dotdot_and_proc_root_are_refused(ws: Path, mode: str) -> None:
    outside = ws.parent / "secret.txt"
    (ws / "abs_link").symlink_to(outside)
    (ws / "rel_link").symlink_to("../secret.txt")
    (ws / "dir_link").symlink_to(ws.parent / "outside")
    (ws / "proc_link").symlink_to(f"/proc/self/root{outside}")
    (ws / "new_link").symlink_to(ws.parent / "created-outside")
    bad = ["abs_link", "rel_link", "dir_link/f", "proc_link", "../secret.txt",
           "sub/../../secret.txt", "sub/../sub/../../secret.txt", "./../ws/../secret.txt",
           str(ws / "sub" / ".." / ".." / "secret.txt"), f"/proc/self/root{outside}",
           f"/proc/{os.getpid()}/root{outside}", "/proc/self/cwd/secret.txt"]
    for raw in bad:
        for tool in ("read_file", "list_dir"):
            (result,) = calls(tool, {"path": raw}, ws, 1)
            assert SECRET not in result and "outside the workspace" in result, (tool, raw, result)
    for raw in ["new_link", "dir_link/new", "rel_link"]:
        (result,) = calls("write_file", {"path": raw, "content": "pwned"}, ws, 1)
        assert "outside the workspace" in result, (raw, result)
    assert outside.read_text() == SECRET
    assert not (ws.parent / "created-outside").exists() and not (ws.parent / "outside" / "new").exists()
    # Absolute paths inside the workspace still work.
    (result,) = calls("read_file", {"path": str(ws / "sub" / "f")}, ws, 1)
    assert result == "harmless"
    (result,) = calls("write_file", {"path": str(ws / "x" / "y" / "z.txt"), "content": "ok"}, ws, 1)
    assert result == "wrote 2 bytes to x/y/z.txt" and (ws / "x" / "y" / "z.txt").read_text() == "ok"
    (result,) = calls("list_dir", {"path": str(ws)}, ws, 1)
    assert "abs_link@" in result and "sub/" in result and "a\t8 bytes" in result


@pytest.mark.component
def test_the_kernel_layer_alone_refuses_escapes(ws: Path, mode: str) -> None:
    """Without the friendly check (as when a symlink appears after it)."""
    outside = ws.parent / "secret.txt"
    (ws / "abs_link").symlink_to(outside)
    (ws / "rel_link").symlink_to("../secret.txt")
    (ws / "proc_link").symlink_to(f"/proc/self/root{outside}")
    with _beneath.root_fd(ws) as root:
        for rel in ["abs_link", "rel_link", "proc_link", "../secret.txt", "sub/../../secret.txt",
                    "/etc/passwd", str(outside)]:
            with pytest.raises(OSError) as err:
                os.close(_beneath.open_beneath(root, rel, os.O_RDONLY))
            assert err.value.errno in _beneath.ESCAPE_ERRNOS, (rel, err.value)
        with pytest.raises(OSError) as err:
            _beneath.write_beneath(root, "rel_link", b"pwned")
        assert err.value.errno in _beneath.ESCAPE_ERRNOS
        assert _beneath.read_beneath(root, "sub/f", 100) == (b"harmless", 8)
    assert outside.read_text() == SECRET


@pytest.mark.component
def test_proc_magic_links_are_refused_by_openat2() -> None:
    """RESOLVE_NO_MAGICLINKS: even from a directory where they lie beneath."""
    fd = os.open("/proc/self", os.O_PATH | os.O_DIRECTORY)
    try:
        for rel in ["root/etc/passwd", "cwd", f"fd/{fd}"]:
            with pytest.raises(OSError) as err:
                os.close(_beneath.open_beneath(fd, rel, os.O_RDONLY))
            assert err.value.errno == errno.ELOOP, (rel, err.value)
    finally:
        os.close(fd)


@pytest.mark.component
def test_the_walk_refuses_every_symlink_and_follows_plain_paths(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_beneath, "use_openat2", False)
    (ws / "inner").symlink_to("sub")
    with _beneath.root_fd(ws) as root:
        with pytest.raises(OSError) as err:
            _beneath.read_beneath(root, "inner/f", 100)
        assert err.value.errno == errno.ELOOP
        _beneath.write_beneath(root, "p/q/r", b"deep")
        assert _beneath.read_beneath(root, "p/q/r", 100) == (b"deep", 4)
        assert [e.name for e in _beneath.list_beneath(root, "p")] == ["q"]


@pytest.mark.component
def test_a_fifo_does_not_hang_read_file(ws: Path) -> None:
    os.mkfifo(ws / "pipe")
    (result,) = calls("read_file", {"path": "pipe"}, ws, 1)
    assert "not a regular file" in result


@pytest.mark.component
def test_file_io_runs_off_the_event_loop(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow read must not stop the worker's loop (its heartbeats)."""
    import threading
    import time

    loop_thread: list[int] = []
    io_thread: list[int] = []
    real = _beneath.read_beneath

    def slow(*args: Any) -> tuple[bytes, int]:
        io_thread.append(threading.get_ident())
        time.sleep(0.3)
        return real(*args)

    monkeypatch.setattr(_beneath, "read_beneath", slow)
    fn = builtin_tools()["read_file"]
    ticks = 0

    async def go() -> str:
        nonlocal ticks
        loop_thread.append(threading.get_ident())
        task = asyncio.ensure_future(fn.run({"path": "a"}, env_for(ws)))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.01)
        return await task

    assert run(go()) == "harmless"
    assert io_thread and io_thread != loop_thread and ticks >= 10


# --- through the daemon: the session's own bash tool runs the swapper ---------


@pytest.mark.process
def test_a_sessions_swapper_cannot_make_read_file_leak(make_daemon, tmp_path: Path) -> None:
    with FakeLLM() as llm:
        d = make_daemon(f"""
[agent]
handler = "agent"
max_tool_calls_per_turn = 64
[provider]
base_url = "{llm.base_url}"
model = "test-model"
[daemon]
stop_grace_secs = 1.0
""")
        secret = d.root / "secret.txt"
        secret.write_text(SECRET)
        script = SWAPPER.replace('print("swapping", flush=True)\n', "")
        start = (f"ln -s {secret} b && echo harmless > a && "
                 f"(python3 -c '{script}' a b 30 >/dev/null 2>&1 &) ; echo started")
        reads = [(f"r{i}", "read_file", {"path": "a"}) for i in range(60)]
        llm.script(
            tool_call_stream(("c0", "bash", {"command": start})),
            tool_call_stream(*reads),
            tool_call_stream(*reads),
            text_stream("done"),
        )
        with d.client() as c:
            sid = c.create().id
            events = list(c.send(sid, "race"))
            assert isinstance(events[-1], m.TurnDone) and events[-1].reply == "done"
            results = [msg["content"] for msg in llm.requests[-1].json["messages"] if msg["role"] == "tool"]
            assert "started" in results[0]
            assert len(results) == 121
            assert not [r for r in results if SECRET in r]
            assert any("harmless" in r for r in results[1:])
            c.remove(sid)
        wait_for(lambda: not d.descendants() or all(p.name() != "python3" for p in d.descendants()),
                 10, "the swapper to be killed with its session")
