"""The daemon's tool lists of the lazy MCP servers, told to every session.

Runs in the daemon's loop.  Every session used to start and list every MCP
server at its first turn (a second or more each, and every sub-agent,
restarted and revived worker again).  Instead the daemon lists each lazy
server once, through the lister it is handed (`supervisor.spawn.mcplist`:
a process of its own, sandboxed), and puts the lists in the config it
runs (`mcp.listed`), so that every session's settings carry them: at boot,
and as new settings (`SessionManager.reload`) when they change.  A session
offers those tools at once and starts a server only when one is called
(`session_worker.agent._mcp`).

A list is kept for one server table (`ipc.mcp.listing_key`): a reload that
changes a table lists it again, one that does not keeps its list.  Each is
listed again every `relist_interval_secs`, to follow a new version of the
server; a relist that fails keeps the list that worked.  A server that
cannot be listed is `unavailable` (sessions offer none of its tools and
say why, once) and tried again after `retry_backoff_secs`, doubling at each
failure in a row up to 32 times it: no session waits for it meanwhile.
While a list is `pending`, a session's first turn waits for it, up to
`start_timeout_secs`.

Eager servers (`lazy = false`) are not listed here: each session lists
them itself, in its own sandbox.  Without a lister (cluster mode: the
servers would be started on other machines) nothing is listed here either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from ipc.mcp import McpListing, listing_key
from ipc.settings import McpServer, SessionSettings
from supervisor.config import Config

__all__ = ["McpCatalog"]

log = logging.getLogger("sessiond.mcp")

_MAX_BACKOFF_FACTOR = 32
Lister = Callable[[SessionSettings], Awaitable[list[McpListing]]]


class McpCatalog:
    def __init__(self, lister: Lister | None, publish: Callable[[Config], None]) -> None:
        self._lister = lister
        # Runs the config with the new lists (the manager's reload).
        self._publish = publish
        self._config: Config | None = None  # the last one attached, as loaded
        self._lists: dict[str, McpListing] = {}
        self._failures: dict[str, int] = {}
        self._due: dict[str, float] = {}  # when to list it (again), monotonic
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.attempts: dict[str, int] = {}

    def attach(self, cfg: Config) -> Config:
        """`cfg` with the lists of its lazy servers (pending where there is
        none yet for a server's table: listed soon)."""
        self._config = cfg
        if self._lister is None:
            return cfg
        lazy = [s for s in cfg.mcp.servers if s.lazy]
        for server in lazy:
            key = listing_key(server)
            known = self._lists.get(server.name)
            if known is None or known.key != key:
                self._lists[server.name] = McpListing(name=server.name, key=key)
                self._failures.pop(server.name, None)
                self._due[server.name] = 0.0
        names = {s.name for s in lazy}
        for gone in [n for n in self._lists if n not in names]:
            del self._lists[gone]
            self._due.pop(gone, None)
            self._failures.pop(gone, None)
        if lazy and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()
        return _with(cfg, [self._lists[s.name] for s in lazy])

    async def _run(self) -> None:
        while True:
            now = time.monotonic()
            due = sorted(name for name, at in self._due.items() if at <= now)
            if not due:
                self._wake.clear()
                wait = min(self._due.values(), default=now + 3600.0) - now
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(wait, 0.0))
                continue
            try:
                await self._list(due)
            except Exception:
                log.exception("listing MCP servers failed")
                for name in due:
                    self._due[name] = time.monotonic() + 60.0

    async def _list(self, names: list[str]) -> None:
        cfg = self._config
        assert cfg is not None and self._lister is not None
        servers = [s for s in cfg.mcp.servers if s.lazy and s.name in names]
        for name in names:
            self._due.pop(name, None)
        if not servers:
            return
        for server in servers:
            self.attempts[server.name] = self.attempts.get(server.name, 0) + 1
        settings = cfg.session_settings()
        settings = msgspec.structs.replace(settings, mcp=msgspec.structs.replace(
            settings.mcp, servers=servers, enabled=None, listed=[]))
        started = time.monotonic()
        answer = {x.name: x for x in await self._lister(settings)}
        changed = False
        for server in servers:
            changed = self._take(server, answer.get(server.name), started) or changed
        if changed and self._config is not None:
            self._publish(self.attach(self._config))

    def _take(self, server: McpServer, got: McpListing | None, started: float) -> bool:
        """A server's new listing in; whether what sessions are told changed."""
        key = listing_key(server)
        known = self._lists.get(server.name)
        if known is None or known.key != key or got is None:
            return False  # a reload changed or dropped it meanwhile: its own listing follows
        got = msgspec.structs.replace(got, name=server.name, key=key)  # never the lister's word for them
        cfg = self._config
        assert cfg is not None
        if got.state == "listed":
            self._failures.pop(server.name, None)
            self._due[server.name] = started + cfg.mcp.relist_interval_secs
            if known.state == "listed" and (known.version, known.tools) != (got.version, got.tools):
                log.info("MCP server %s: its tools changed (version %r -> %r)", server.name, known.version,
                         got.version)
            elif known.state != "listed":
                log.info("MCP server %s: %d tool(s) listed (version %r)%s", server.name, len(got.tools),
                         got.version, f"; {len(got.refused)} refused" if got.refused else "")
        else:
            failures = self._failures[server.name] = self._failures.get(server.name, 0) + 1
            backoff = cfg.mcp.retry_backoff_secs
            wait = min(backoff * 2 ** (failures - 1), backoff * _MAX_BACKOFF_FACTOR)
            self._due[server.name] = time.monotonic() + wait
            log.warning("%s; tried again in %.0f s%s", got.error, wait,
                        "; sessions keep the tools it listed before" if known.state == "listed" else
                        "; sessions are not offered its tools meanwhile (lazy = false lists it in each "
                        "session's sandbox, with its network and workspace)")
            if known.state == "listed":
                return False  # a list that worked is kept
        self._lists[server.name] = got
        return got != known

    def stats(self) -> dict[str, Any]:
        return {name: {"state": x.state, "tools": len(x.tools), "version": x.version, "error": x.error,
                       "attempts": self.attempts.get(name, 0)} for name, x in self._lists.items()}


def _with(cfg: Config, listed: list[McpListing]) -> Config:
    return msgspec.structs.replace(cfg, mcp=msgspec.structs.replace(cfg.mcp, listed=listed))
