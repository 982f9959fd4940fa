"""The daemon's file descriptors: how many live sessions they allow, and a
refusal (`capacity`, naming them) before the last one is gone.

Runs in the daemon.  A session at rest holds no fd of the daemon's
(SessionLog.at_rest); a live one holds `FDS_PER_LIVE_SESSION`, measured
with a real daemon (tests/test_resting_fds.py counts them): its worker's
socket and pidfd, its log's `fence` and `log.N` and, under cgroup v1, the
eventfd and `memory.oom_control` that report its OOM.  The sweep's `/proc`
files are open only while it measures one session (supervisor.host.proctable),
so none of them is a live session's; a tool process it has seen costs one
pidfd (its kill handle) while it runs.  A boot needs a few more for a moment (its snapshot and logs read, a
spare's socket): `FDS_PER_START`.  Besides sessions the daemon holds its
own (`DAEMON_FDS`: the listening socket, journal, spend ledger, lock, log,
the zygote's pipes, the acceptor's reserve; 24 measured with no spare
worker) and keeps room for control connections (one user's whole
allowance, `max_connections_per_uid`) and the store's passing files.

So the live ceiling is `max_concurrent_sessions`, clamped to what the fds
left after that reserve hold (said as a warning at start).  The count is
an estimate: every create and revive also checks the fds open now, so that
connections or anything else holding fds make it `capacity`, never EMFILE
half-way through opening a session's files; and an EMFILE met anyway is
mapped to the same refusal (`out_of_fds`).  Listing them is O(the fds)
(thousands with hundreds of live sessions), so a check far from the limit
goes by the last listing, moved on by the live sessions started since, for
at most `RECOUNT_SECS`; near the limit (within `_NEAR` of it) it lists them
every time.
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass, field

from supervisor.config import Config
from supervisor.errors import Capacity
from supervisor.host import fds

__all__ = ["DAEMON_FDS", "FDS_PER_LIVE_SESSION", "FDS_PER_START", "FdBudget", "at_start", "out_of_fds", "raise_nofile_limit"]

log = logging.getLogger("sessiond.daemon")

FDS_PER_LIVE_SESSION = 6
FDS_PER_START = 4
DAEMON_FDS = 32
_STORE_RESERVE = 16  # a snapshot's next log, history and export reads, the spend ledger rewritten
_HEADROOM = 16  # kept free after a start: `ls`, `status`, `stop`, `rm` and their connections
# A check goes by the last listing while it says at least this share of the
# limit is free beyond what a start needs, for RECOUNT_SECS at most.
_NEAR = 8  # (an eighth)
RECOUNT_SECS = 1.0
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)
_SETTING = "the daemon's RLIMIT_NOFILE: LimitNOFILE= in the unit, or ulimit -n"


@dataclass(slots=True)
class FdBudget:
    limit: int  # the daemon's RLIMIT_NOFILE (soft, once raised)
    reserve: int  # held apart from live sessions: the daemon's own, connections, the store
    # The last listing: fds open, live sessions then, when (monotonic); None: none yet.
    _counted: tuple[int, int, float] | None = field(default=None, compare=False)

    @classmethod
    def of(cls, limit: int, config: Config) -> FdBudget:
        reserve = DAEMON_FDS + config.daemon.spare_workers + config.daemon.max_connections_per_uid + _STORE_RESERVE
        return cls(limit, reserve)

    @property
    def live_fit(self) -> int:
        """Live sessions these fds hold (at least one: a daemon that runs none is no use)."""
        return max(1, (self.limit - self.reserve) // FDS_PER_LIVE_SESSION)

    def live_ceiling(self, config: Config) -> int:
        return min(config.agent.limits.max_concurrent_sessions, self.live_fit)

    def clamped(self, config: Config) -> str:
        """Why the live ceiling is below max_concurrent_sessions ('' when it is not)."""
        wanted = config.agent.limits.max_concurrent_sessions
        if wanted <= self.live_fit:
            return ""
        return (f"[agent.limits] max_concurrent_sessions = {wanted} does not fit the daemon's file "
                f"descriptors: RLIMIT_NOFILE {self.limit} holds {self.live_fit} live sessions "
                f"({FDS_PER_LIVE_SESSION} fds each, after {self.reserve} kept for the daemon, its "
                f"connections and its store); at most {self.live_fit} run at once: raise LimitNOFILE= "
                f"in the unit (or ulimit -n) to at least "
                f"{self.reserve + wanted * FDS_PER_LIVE_SESSION}, or lower max_concurrent_sessions")

    def describe(self) -> str:
        return (f"RLIMIT_NOFILE {self.limit}: room for {self.live_fit} live sessions "
                f"({FDS_PER_LIVE_SESSION} fds each; {self.reserve} kept for the daemon, its connections "
                "and its store; a session at rest holds none)")

    def busy_refusal(self, config: Config) -> str:
        """The setting that bounds live sessions now, for a `capacity` message."""
        clamp = self.clamped(config)
        if not clamp:
            return "max_concurrent_sessions"
        return (f"max_concurrent_sessions = {config.agent.limits.max_concurrent_sessions}, held to "
                f"{self.live_fit} by the daemon's file descriptors ({_SETTING}, {self.limit})")

    def check(self, live: int) -> None:
        """`capacity` unless a session can start with room to spare: the
        fds open now, what a live session holds, what its boot needs for a
        moment and what `ls`, `status`, `stop` and `rm` need must fit
        (`live`: the live sessions now, which move the last listing on)."""
        need = FDS_PER_LIVE_SESSION + FDS_PER_START + _HEADROOM
        now = time.monotonic()
        if self._counted is not None:
            last, then, at = self._counted
            estimate = last + max(0, live - then) * FDS_PER_LIVE_SESSION
            if now - at < RECOUNT_SECS and estimate + need + self.limit // _NEAR <= self.limit:
                return  # far from the limit, listed a moment ago
        held = fds.open_count(self.limit)
        if held is None:
            return  # no /proc: the EMFILE mapping (out_of_fds) still answers
        self._counted = (held, live, now)
        if held + need > self.limit:
            raise Capacity(
                f"no file descriptors left for another live session: {held} of the daemon's "
                f"{self.limit} are open and a session needs {FDS_PER_LIVE_SESSION} ({_SETTING}); "
                "try again when some sessions or connections have ended")


def at_start(config: Config) -> FdBudget:
    """The daemon's fds (its limit raised by `raise_nofile_limit` first):
    what they hold said, and a warning where max_concurrent_sessions does
    not fit."""
    budget = FdBudget.of(fds.nofile_limit(), config)
    log.info("file descriptors: %s", budget.describe())
    if why := budget.clamped(config):
        log.warning("%s", why)
    return budget


def out_of_fds(exc: BaseException | None, doing: str = "") -> Capacity | None:
    """`capacity` naming file descriptors when `exc`, or what it was raised
    from, is EMFILE or ENFILE (the daemon's table or the host's), else None."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_FDS:
            table = "the daemon's" if exc.errno == errno.EMFILE else "the host's (fs.file-max)"
            return Capacity(f"{doing}out of file descriptors ({table}: {exc.strerror}; {_SETTING}); "
                            "existing sessions are not affected; try again when some sessions or "
                            "connections have ended")
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None
