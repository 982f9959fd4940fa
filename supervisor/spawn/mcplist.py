"""Listing the lazy MCP servers' tools: the daemon's side of the lister.

Runs in the daemon, the blocking part on a thread (`McpLister.__call__`).  The
lister is `python -P -m session_worker.mcplist`, started by exec (the
daemon has threads: no fork of it), in a session and process group of its
own, and confined before it runs a line of ours:

* **as whom**: never the daemon's privileges.  A root daemon that gives
  each session a uid of its own lists as the last uid of
  `session_uid_range`, which no session is given (`Workspaces.
  allocate_uid`); one with `worker_user` as that user (the one every
  session's tools run as); one that allows root tools, and a daemon that
  is not root, as the daemon, as sessions' tools run then.  The lister
  makes the switch itself (`--as UID:GID`: no groups, then setresgid and
  setresuid) before it reads its order, after opening the daemon's
  Python to that uid where a directory on the way is closed to it, as
  the zygote does for sessions (session_worker.worker._reach).
* **where**: each stdio server is started by a tool host of its own
  sandbox (namespaces, Landlock, seccomp, as `[sandbox]` says), in an
  empty directory made for this listing under the state directory and
  removed after, with no network whatever sessions get.
* **with what**: an environment of PATH, LANG and only the variables the
  servers' tables name (`${VAR}`, `headers_env`), never the daemon's whole
  environment (the provider's key is in it).
* **how long**: `start_timeout_secs` and a margin; past it the lister's
  whole group is killed (through a pidfd: `PidFd.send_group`), and so is
  what is left of it when it has answered.

Its answer is hostile input: read up to `ipc.mcplist.MAX_ANSWER_BYTES`,
decoded with the bounds of `McpListing`; a server it does not answer for,
or an answer that does not decode, is unavailable with the reason and the
last words of the lister's stderr.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec

from ipc import messages as m
from ipc.mcp import McpListing, bounded, listing_key, variables
from ipc.mcplist import MAX_ANSWER_BYTES, McpListOrder, answer_decoder
from ipc.settings import SessionSettings
from supervisor.spawn.pidfd import PidFd

__all__ = ["McpLister", "lister_for"]

log = logging.getLogger("sessiond.mcp")

_CODE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MODULE = "session_worker.mcplist"
_MARGIN_SECS = 15.0
_STDERR_TAIL = 2048


class McpLister:
    """Lists servers' tools in a process confined as the module docstring says."""

    def __init__(self, state_dir: Path, run_as: tuple[int, int] | None, own_uid: bool,
                 sandbox: m.SandboxBoot | None) -> None:
        self._dir = state_dir / "mcp-list"
        self._run_as = run_as
        self._own_uid = own_uid
        self._sandbox = sandbox

    async def __call__(self, settings: SessionSettings) -> list[McpListing]:
        """The listings of `settings.mcp.servers` (one each, in order).  On
        a thread of its own, not the loop's executor: a daemon that stops
        does not wait for a listing (the lister dies with it: its death
        signal, and its servers' sandboxes with it)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[McpListing]] = loop.create_future()

        def work() -> None:
            try:
                result = self._list(settings)
            except BaseException as exc:  # (never expected: _list says why in its answer)
                loop.call_soon_threadsafe(_settle, done, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, done, result, None)

        threading.Thread(target=work, name="sd-mcp-list", daemon=True).start()
        return await done

    def _list(self, settings: SessionSettings) -> list[McpListing]:
        servers = settings.mcp.servers
        try:
            workspace = self._scratch()
        except OSError as exc:
            return _all_unavailable(settings, f"cannot make the listing's directory: {exc.strerror or exc}")
        try:
            answer, why = self._run(settings, workspace)
        finally:
            shutil.rmtree(workspace, ignore_errors=True)
        by_name = {x.name: x for x in answer}
        out = []
        for server in servers:
            found = by_name.get(server.name)
            key = listing_key(server)
            if found is None:
                found = McpListing(name=server.name, key=key, state="unavailable",
                                   error=f"MCP server {server.name!r} could not be listed: {why or 'no answer'}")
            out.append(bounded(msgspec.structs.replace(found, key=key)))  # never the lister's word for the key
        return out

    def _scratch(self) -> Path:
        self._dir.mkdir(mode=0o711, exist_ok=True)
        workspace = self._dir / secrets.token_hex(8)
        workspace.mkdir(mode=0o700)
        if self._run_as is not None:
            os.chown(workspace, *self._run_as)
        return workspace

    def _run(self, settings: SessionSettings, workspace: Path) -> tuple[list[McpListing], str]:
        """(the listings the lister answered, why not all of them)."""
        plain = msgspec.structs.replace(settings, mcp=msgspec.structs.replace(settings.mcp, listed=[]))
        order = McpListOrder(settings=msgspec.msgpack.encode(plain), sandbox=self._sandbox,
                             workspace=str(workspace), own_uid=self._own_uid)
        # Started as the daemon's user and told whom to become: it first
        # opens the daemon's Python to that uid where a directory on the way
        # is closed to it (session_worker.worker._reach, as the zygote does), then
        # drops to it before reading anything of the order.  (Exec'd as that
        # uid, a Python under a 0700 /root could not even start.)
        becomes = ["--as", f"{self._run_as[0]}:{self._run_as[1]}"] if self._run_as is not None else []
        try:
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", _MODULE, *becomes], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, cwd=workspace, env=_environment(settings), close_fds=True,
                start_new_session=True,
            )
        except OSError as exc:
            return [], f"the lister could not be started: {exc.strerror or exc}"
        pidfd = PidFd(os.pidfd_open(proc.pid), proc.pid)
        deadline = time.monotonic() + settings.mcp.start_timeout_secs + _MARGIN_SECS
        try:
            out, err, timed_out = _exchange(proc, msgspec.msgpack.encode(order), deadline)
        finally:
            pidfd.send_group(signal.SIGKILL)  # it, if it is late, and whatever it left in its group
            proc.wait()
            pidfd.close()
        tail = err[-_STDERR_TAIL:].decode("utf-8", "replace").strip()
        if timed_out:
            return [], f"the listing did not end within {settings.mcp.start_timeout_secs + _MARGIN_SECS:g} s"
        if len(out) > MAX_ANSWER_BYTES:
            return [], f"the lister's answer is over {MAX_ANSWER_BYTES} bytes"
        try:
            return answer_decoder.decode(out), ""
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            why = f"the lister's answer was not understood ({exc})" if out else "the lister gave no answer"
            code = proc.returncode
            return [], why + (f"; it exited with code {code}" if code else "") + (f": {tail[-500:]}" if tail else "")


def _settle(done: asyncio.Future[list[McpListing]], result: list[McpListing] | None,
            exc: BaseException | None) -> None:
    if done.done():
        return
    if exc is not None:
        done.set_exception(exc)
    else:
        assert result is not None
        done.set_result(result)


def _exchange(proc: subprocess.Popen[bytes], order: bytes, deadline: float) -> tuple[bytes, bytes, bool]:
    """Write the order, read the answer (up to its bound) and the stderr
    (its tail), until both end or the deadline: (stdout, stderr, timed out)."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(order)  # (small: it fits the pipe before the lister reads)
        proc.stdin.close()
    except OSError:
        pass
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), bytes(err), True
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf: bytearray = key.data
                buf += chunk
                if buf is err:
                    del buf[:-_STDERR_TAIL]
                elif len(buf) > MAX_ANSWER_BYTES:
                    return bytes(out), bytes(err), False
    return bytes(out), bytes(err), False


def _environment(settings: SessionSettings) -> dict[str, str]:
    """PATH, LANG, our code, and the variables the servers' tables name."""
    env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "LANG": "C.UTF-8",
           "PYTHONPATH": os.pathsep.join(p for p in (_CODE_ROOT, os.environ.get("PYTHONPATH")) if p)}
    for server in settings.mcp.servers:
        texts = [*(server.command or ()), *server.env.values(), server.url or "", *server.headers.values()]
        names = [name for name, _ in variables(texts)] + list(server.headers_env.values())
        env.update({name: os.environ[name] for name in names if name in os.environ})
    return env


def _all_unavailable(settings: SessionSettings, why: str) -> list[McpListing]:
    return [McpListing(name=s.name, key=listing_key(s), state="unavailable",
                       error=f"MCP server {s.name!r} could not be listed: {why}") for s in settings.mcp.servers]


def lister_for(state_dir: Path, run_as: tuple[int, int] | None, session_uids: range | None,
               sandbox: m.SandboxBoot | None) -> McpLister:
    """The lister for the daemon's identities (`supervisor.daemon.Identities`):
    as the sessions' shared user, else as the uid kept out of the sessions'
    range for it (`nobody` when the range has one uid), else as the daemon."""
    if run_as is not None:
        return McpLister(state_dir, run_as, False, sandbox)
    if session_uids is not None:
        uid = session_uids[-1] if len(session_uids) > 1 else 65534
        return McpLister(state_dir, (uid, uid), True, sandbox)
    return McpLister(state_dir, None, False, sandbox)
