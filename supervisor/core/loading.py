"""Sessions on disk into the registry when the daemon starts: listed first
(cheap: the store's directory read once), then loaded in the background
while the daemon already serves, and at once when a request names one not
loaded yet.

Runs in the daemon's loop.  Why: loading costs a few reads and a decode
per session, and with 100,000 on disk that is 10-15 s on 2 cores; a daemon
that loaded them all before it listened would answer nothing, not even
`ping`, meanwhile.  So `_serve` lists them (`list_stored`), listens, and this
loads them (`run`): a file store's reads and decoding (`read_stored`) in a
thread, a chunk at a time, then each session of the chunk registered on the
loop (`Intake.load_one`), a slice at a time between the loop's other work.
Not the next chunk read while this one is registered: both are Python, and
the thread, which lets go of the GIL at every read, would wait for it each
time (the load took 1.8x as long).  The order is the store's (the file
store: the sessions the last daemon's journal wrote first, which holds the
turns it died in: their restart is scheduled as each is loaded).

What a request needs of a session not loaded yet is had at once:
`SessionManager.get` loads it (`load_now`) before answering, and a parent's
`stop` and `rm` load its children first (`load_prefixed`: a child's id
starts with its parent's, supervisor.core.subagents.child_prefix).  The ids
are known from the listing, so `create` of one of them is refused as ever.
What needs every session waits for the load to end (`wait`, bounded:
`create` and import, for the per-uid quota and the session uids) or says
that it is partial (`progress`: `stats`, metrics, systemd's status); `ls`
waits a little (`settle`), then says so too.

A store whose reads cannot leave the loop (PostgreSQL: its connections are
its own threads') is opened on the loop, a slice at a time (`read_stored`
None); cluster mode loads everything before it listens (supervisor.daemon).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Callable

from supervisor.errors import Capacity
from supervisor.store.state_store import LoadedSession, SessionLog

__all__ = ["CHUNK", "SETTLE_SECS", "Loader", "Opener", "WAIT_SECS"]

log = logging.getLogger("sessiond.manager")

# How a stored session is opened, on the loop (KeyError: there is none).
Opener = Callable[[], tuple[SessionLog, LoadedSession]]

CHUNK = 256  # sessions read in one hop to the thread
SLICE = 32  # sessions registered between two yields to the loop (~1-3 ms)
# How long a request that needs every session (create, import) waits for the load.
WAIT_SECS = 60.0
# How long `ls` waits for it before it answers with the sessions loaded so
# far (and says so): a few sessions are loaded in milliseconds, and a list
# that showed none of them a moment after a restart read as all lost.
SETTLE_SECS = 1.0
_RETRY_SECS = 1.0  # a session that could not be read for want of fds is tried again after this


class Loader:
    """The sessions listed at start and not loaded yet, and their loading.

    `list_ids` lists them (in the order to load them), `open_stored` opens
    one on the loop, `read_stored` (None: none) reads one in a thread and
    returns what opens it on the loop; `load_one` registers one (Intake:
    restored, or damaged); `finish` runs once every one is loaded (Intake:
    orphaned workspaces removed)."""

    def __init__(self, list_ids: Callable[[], list[str]], open_stored: Callable[[str], tuple[SessionLog, LoadedSession]],
                 read_stored: Callable[[str], Opener] | None, load_one: Callable[[str, Opener], None],
                 finish: Callable[[], None], closing: Callable[[], bool]) -> None:
        self._list_ids = list_ids
        self._open = open_stored
        self._read = read_stored
        self._load_one = load_one
        self._finish = finish
        self._closing = closing
        self._pending: dict[str, None] = {}  # in the order to load them
        self._sorted: list[str] = []  # every listed id, sorted (load_prefixed); loaded ones stay
        self._total = 0
        self._done = asyncio.Event()
        self._finished = True

    # ---------------------------------------------------------------- the loop's

    def list_stored(self) -> int:
        """The sessions on disk, listed (nothing of theirs read yet)."""
        ids = self._list_ids()
        self._pending = dict.fromkeys(ids)
        self._sorted = sorted(ids)
        self._total, self._finished = len(ids), False
        self._done.clear()
        return len(ids)

    @property
    def progress(self) -> tuple[int, int] | None:
        """(loaded, listed) while the load runs; None once it is done."""
        return None if self._finished else (self._total - len(self._pending), self._total)

    def listed(self, session_id: str) -> bool:
        """Listed and not loaded yet."""
        return session_id in self._pending

    def load_now(self, session_id: str) -> None:
        """Loaded now, if it is listed and not yet: a request names it."""
        if session_id in self._pending:
            del self._pending[session_id]
            self._register(session_id, lambda: self._open(session_id))

    def load_prefixed(self, prefix: str) -> None:
        """Every listed session whose id starts with `prefix`, loaded now."""
        at = bisect.bisect_left(self._sorted, prefix)
        while at < len(self._sorted) and self._sorted[at].startswith(prefix):
            self.load_now(self._sorted[at])
            at += 1

    def load_everything_now(self) -> None:
        """Every listed session loaded before this returns (cluster mode,
        tests); one that cannot be for want of fds stays listed, loaded
        when a request names it."""
        for session_id in list(self._pending):
            try:
                self.load_now(session_id)
            except Capacity as exc:
                log.error("%s", exc.message)
        self._end()

    async def run(self) -> None:
        """The background load: every listed session, in order."""
        try:
            while self._pending and not self._closing():
                await self._pass(list(self._pending))
                if self._pending and not self._closing():
                    await asyncio.sleep(_RETRY_SECS)  # (only those refused for want of fds are left)
        except Exception:
            log.exception("loading the sessions in the background failed; loading the rest now")
            self.load_everything_now()
        if not self._closing():
            self._end()

    async def _pass(self, order: list[str]) -> None:
        for start in range(0, len(order), CHUNK):
            openers = await self._openers(order[start:start + CHUNK])
            for i, (session_id, opener) in enumerate(openers):
                if self._closing():
                    return
                if session_id in self._pending:  # (else a request loaded it meanwhile)
                    del self._pending[session_id]
                    try:
                        self._register(session_id, opener)
                    except Capacity:
                        pass  # out of fds: still listed, tried again
                if i % SLICE == SLICE - 1:
                    await asyncio.sleep(0)

    async def _openers(self, chunk: list[str]) -> list[tuple[str, Opener]]:
        wanted = [sid for sid in chunk if sid in self._pending]
        if self._read is None:
            return [(sid, self._opener(sid)) for sid in wanted]
        return await asyncio.to_thread(self._read_chunk, wanted)

    def _opener(self, session_id: str) -> Opener:
        return lambda: self._open(session_id)

    def _register(self, session_id: str, opener: Opener) -> None:
        try:
            self._load_one(session_id, opener)
        except Capacity:
            self._pending[session_id] = None  # out of fds: not damaged, still to load
            raise
        if not self._pending:
            self._end()

    def _end(self) -> None:
        if self._finished or self._pending:  # (`finish` needs every session: it removes what none has)
            return
        try:
            self._finish()
        except Exception:
            log.exception("after loading the sessions")
        self._finished = True
        self._sorted = []
        self._done.set()

    # ---------------------------------------------------------------- a thread's

    def _read_chunk(self, chunk: list[str]) -> list[tuple[str, Opener]]:
        """In a thread: each session's files read and decoded; a failure
        is raised on the loop, by its opener, as an open would raise it."""
        assert self._read is not None
        out: list[tuple[str, Opener]] = []
        for session_id in chunk:
            try:
                out.append((session_id, self._read(session_id)))
            except Exception as exc:
                out.append((session_id, _raiser(exc)))
        return out

    # ---------------------------------------------------------------- waiting

    async def _done_within(self, secs: float) -> bool:
        """Until every listed session is loaded (True), or `secs` passed."""
        if self._finished:
            return True
        try:
            await asyncio.wait_for(self._done.wait(), secs)
        except TimeoutError:
            return False
        return True

    async def wait(self, what: str) -> None:
        """Until every listed session is loaded; `capacity` past WAIT_SECS."""
        if not await self._done_within(WAIT_SECS):
            loaded, total = self.progress or (self._total, self._total)
            raise Capacity(f"{what} waits for the daemon to load the sessions on disk, and it has loaded "
                           f"{loaded} of {total} in {WAIT_SECS:g}s; try again shortly")

    async def done(self) -> None:
        """Until every listed session is loaded (no bound)."""
        await self._done.wait()

    async def settle(self) -> None:
        """Until every listed session is loaded, or SETTLE_SECS passed (ls)."""
        await self._done_within(SETTLE_SECS)


def _raiser(exc: Exception) -> Opener:
    def opener() -> tuple[SessionLog, LoadedSession]:
        raise exc
    return opener
