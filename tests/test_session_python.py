"""Whatever Python the daemon runs on, its sessions can use it.

A root daemon runs each session as a uid of its own, and a worker imports
what the zygote did not preload as that uid.  Here the daemon's Python path
has a directory only root can read (a module of our own in a 0700 tree,
as a pyenv under /root is on this machine): a handler importing at its
turn a standard-library module and that module, and an agent whose MCP
server's SDK is imported at its first turn, all work (session_worker/worker/_reach.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import TEST_HANDLERS
from ipc import messages as m
from session_worker.worker import _reach

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="sessions of their own uid need a root daemon")
SERVER = str(Path(__file__).with_name("mcp_servers.py"))


@pytest.mark.pure
def test_the_closed_directories_on_the_way_to_a_path_are_found(tmp_path: Path) -> None:
    lib = tmp_path / "closed" / "inner" / "lib"
    lib.mkdir(parents=True)
    (lib / "mod.py").write_text("")
    (tmp_path / "cwd").mkdir(mode=0o700)
    os.chmod(tmp_path / "closed", 0o700)
    os.chmod(lib, 0o700)
    needs = _reach.closed_dirs([str(lib), str(tmp_path / "missing"), str(tmp_path / "cwd")], str(tmp_path / "cwd"))
    assert needs[str(tmp_path / "closed")] == {"inner"}  # only the way: nothing else of it
    assert str(lib) not in needs  # a closed path itself stays closed: opening it would show all of it
    assert str(tmp_path / "closed" / "inner") not in needs


@pytest.fixture
def open_root(reachable_dir: Callable[..., Path]) -> Path:
    """The daemon's root where the sessions' uids can pass (pytest's temp
    dirs are private to root)."""
    return reachable_dir("sd-python-")


@root_only
@pytest.mark.process
def test_a_root_daemons_sessions_import_what_the_zygote_did_not_preload(
        open_root: Path, make_daemon, llm: FakeLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    root = open_root
    closed = root / "closed"  # the module's tree, closed to the sessions' uids
    (closed / "lib").mkdir(parents=True)
    (closed / "lib" / "closed_mod.py").write_text("import wave  # a standard module nobody preloads\n")
    os.chmod(closed, 0o700)
    monkeypatch.setenv("PYTHONPATH", str(closed / "lib"))
    import mcp

    site = str(Path(mcp.__file__).resolve().parent.parent)
    # No allow_root_tools: each session runs as a uid of its own.
    d = make_daemon(f"""
[agent]
handler = "agent"
allowed_handlers = {[*TEST_HANDLERS, 'python_handlers:*']!r}
[provider]
base_url = "{llm.base_url}"
model = "test-model"
[sandbox]
read_paths = [{site!r}, {str(Path(SERVER).parent)!r}]
[[mcp.servers]]
name = "loc"
command = [{os.path.realpath(sys.executable)!r}, {SERVER!r}, "stdio", {site!r}]
[daemon]
session_uid_range = "61000-61999"
stop_grace_secs = 1.0
""", root=root / "d", trust=False)
    llm.script(tool_call_stream(("c1", "mcp__loc__whoami", {})), text_stream("done"))
    with d.client() as c:
        sid = c.create(handler="python_handlers:imports_at_turn").id
        for module in ("fractions", "closed_mod"):
            reply = c.send_text(sid, module)
            assert reply.startswith(f"imported {module} as uid 61"), reply
        agent = c.create().id
        events = list(c.send(agent, "where are you?"))
        assert isinstance(events[-1], m.TurnDone) and events[-1].reply == "done"
        assert not [e for e in events if isinstance(e, m.Notice) and e.kind == "mcp_server_unavailable"]
    [result] = [msg["content"] for msg in llm.requests[1].json["messages"] if msg["role"] == "tool"]
    assert result.startswith("uid=61"), result  # the server ran, as the session's uid
