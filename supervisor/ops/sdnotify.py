"""systemd glue for the daemon: readiness and watchdog notifications, socket
activation, and logging that journald understands. Standard library only.

Everything here runs in the daemon's main process. ``sessiond.service`` sets
``NotifyAccess=main``, so systemd ignores notifications from any other pid:
a worker or the zygote calling :func:`notify` would be talking to nobody.

Protocols implemented (see sd_notify(3), sd_listen_fds(3), sd_watchdog_enabled(3)
and systemd.exec(5) on ``$JOURNAL_STREAM``):

* ``$NOTIFY_SOCKET`` names an ``AF_UNIX`` datagram socket, either a path or,
  with a leading ``@``, an abstract name. One datagram carries newline
  separated ``KEY=VALUE`` assignments. systemd identifies the sender by the
  kernel's ``SCM_CREDENTIALS``, so nothing identifying goes in the message.
* ``$WATCHDOG_USEC`` (and optionally ``$WATCHDOG_PID``) announce that
  ``WATCHDOG=1`` must arrive at least that often.
* ``$LISTEN_PID``/``$LISTEN_FDS``/``$LISTEN_FDNAMES`` hand over already-bound
  sockets as fds 3, 4, ...
* ``$JOURNAL_STREAM`` is ``DEV:INODE`` of the stream journald connected to
  stdout/stderr; a ``<N>`` prefix on a line sets that line's syslog priority.

Notification is advisory: a failed send is logged at debug level and reported
as ``False``, never raised, because the daemon must keep serving sessions
whether or not anybody is listening.

Typical start-up in the daemon::

    configure_logging(logging.INFO)
    socks = listen_fds()          # before any fork: the env vars go away here
    ...
    ready()
    interval = watchdog_interval_secs()
    if interval is not None:
        tasks.add(asyncio.create_task(watchdog_loop(interval, describe_state)))
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import TextIO

from ipc.logfields import (
    FORMAT_ENV, JournalHandler, JsonFormatter, PriorityFormatter, TextFormatter, journal_socket, on_journal,
)

__all__ = [
    "SD_LISTEN_FDS_START",
    "JournalFormatter",
    "configure_logging",
    "journal_stderr",
    "listen_fds",
    "listen_fds_with_names",
    "notify",
    "ready",
    "reloading",
    "status",
    "stopping",
    "watchdog_interval_secs",
    "watchdog_loop",
    "watchdog_ping",
]

log = logging.getLogger(__name__)

#: The first fd that socket activation passes; fds 0-2 stay stdio.
SD_LISTEN_FDS_START = 3

_LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


# --------------------------------------------------------------------------
# sd_notify


def _notify_address() -> str | None:
    """The address from ``$NOTIFY_SOCKET`` in the form ``sendto`` takes."""
    raw = os.environ.get("NOTIFY_SOCKET", "")
    if not raw:
        return None
    if raw.startswith("@"):
        # Abstract namespace: the kernel name starts with a NUL byte.
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    # systemd 254+ may also hand out vsock: addresses (VMs); not our case.
    log.debug("NOTIFY_SOCKET=%r is not a path or abstract name; ignoring", raw)
    return None


def notify(*fields: str) -> bool:
    """Send ``fields`` (``"KEY=VALUE"`` strings) as one notification datagram.

    Returns True if the datagram was handed to the service manager, False if
    ``$NOTIFY_SOCKET`` is unset (not run by systemd, or ``Type=simple``) or
    the send failed. Never raises: the daemon's work does not depend on it.
    """
    if not fields:
        return False
    address = _notify_address()
    if address is None:
        return False
    data = "\n".join(fields).encode("utf-8", errors="replace")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            # Non-blocking: this runs on the event loop, and a full receive
            # queue in PID 1 must cost one lost ping, not a stalled daemon.
            sock.setblocking(False)
            sock.sendto(data, address)
    except OSError as exc:
        log.debug("sd_notify %r to %r failed: %s", fields, address, exc)
        return False
    return True


def _one_line(text: str) -> str:
    # A newline would end the STATUS= assignment and start a bogus new one.
    return " ".join(text.splitlines())


def ready(status_text: str | None = None) -> bool:
    """Start-up (or a reload) is complete: systemd marks the unit active.

    Call it once the control socket is being served, and again after each
    reload announced with :func:`reloading`.
    """
    if status_text is None:
        return notify("READY=1")
    return notify("READY=1", "STATUS=" + _one_line(status_text))


def status(text: str) -> bool:
    """Free-form one-line state shown by ``systemctl status sessiond``."""
    return notify("STATUS=" + _one_line(text))


def stopping() -> bool:
    """The daemon began a graceful stop (SIGTERM received)."""
    return notify("STOPPING=1")


def reloading() -> bool:
    """A config reload (SIGHUP) begins; follow it with :func:`ready`.

    ``MONOTONIC_USEC`` lets systemd 253+ match this message to the reload
    it requested (``Type=notify-reload``); older versions ignore the field.
    """
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify("RELOADING=1", f"MONOTONIC_USEC={usec}")


def watchdog_ping() -> bool:
    """Tell systemd the daemon is alive (``WatchdogSec=``)."""
    return notify("WATCHDOG=1")


def watchdog_interval_secs() -> float | None:
    """How often to call :func:`watchdog_ping`, or None when no watchdog is on.

    That is half of ``$WATCHDOG_USEC`` (sd_watchdog_enabled(3) advises
    pinging at half the timeout, so one late ping is not fatal). When
    ``$WATCHDOG_PID`` is set, the watchdog is only ours if it names this
    process: a child that inherited the variables must not ping.
    """
    raw_usec = os.environ.get("WATCHDOG_USEC")
    if not raw_usec:
        return None
    raw_pid = os.environ.get("WATCHDOG_PID")
    try:
        usec = int(raw_usec)
        if raw_pid and int(raw_pid) != os.getpid():
            return None
    except ValueError:
        log.warning("ignoring malformed WATCHDOG_USEC=%r WATCHDOG_PID=%r", raw_usec, raw_pid)
        return None
    if usec <= 0:
        return None
    return usec / 2 / 1_000_000


async def watchdog_loop(interval: float, status_fn: Callable[[], str] | None = None) -> None:
    """Ping the watchdog every ``interval`` seconds until cancelled.

    Run it as a task on the daemon's event loop: because the pings come from
    the loop itself, a loop that is blocked (a synchronous call that hangs, a
    deadlock) stops pinging, and systemd kills and restarts the daemon after
    ``WatchdogSec``. That is the point; do not move this into a thread.

    ``status_fn``, if given, is called each round; its text is sent as
    ``STATUS=`` when it differs from the last one sent. An exception from it
    is logged and does not stop the pings: a bug in a status line must not
    get a healthy daemon killed.
    """
    if not interval > 0:
        raise ValueError(f"watchdog interval must be positive, got {interval!r}")
    last_status: str | None = None
    while True:
        watchdog_ping()
        if status_fn is not None:
            try:
                text = status_fn()
            except Exception:
                log.exception("status callback for the watchdog loop failed")
            else:
                if text != last_status:
                    status(text)
                    last_status = text
        await asyncio.sleep(interval)


# --------------------------------------------------------------------------
# Socket activation


def listen_fds_with_names() -> list[tuple[str, socket.socket]]:
    """Take the sockets systemd passed us, with their ``FileDescriptorName=``.

    Implements sd_listen_fds(3): the fds are only ours when ``$LISTEN_PID`` is
    this process (the variables may have been inherited from a parent that
    was activated). The three variables are removed from the environment in
    every case, so that the zygote, workers and tools do not inherit them and
    mistake fds 3.. for sockets. Each fd gets FD_CLOEXEC for the same reason.
    Family and type come from the fd itself. Call it once, early: a second
    call finds nothing.

    Names default to ``"unknown"`` as in sd_listen_fds_with_names(3).
    """
    raw_pid = os.environ.get("LISTEN_PID")
    raw_count = os.environ.get("LISTEN_FDS")
    raw_names = os.environ.get("LISTEN_FDNAMES")
    for name in _LISTEN_VARS:
        os.environ.pop(name, None)

    if raw_pid is None or raw_count is None:
        return []
    try:
        pid = int(raw_pid)
        count = int(raw_count)
    except ValueError:
        log.warning("ignoring malformed LISTEN_PID=%r LISTEN_FDS=%r", raw_pid, raw_count)
        return []
    if pid != os.getpid():
        log.debug("LISTEN_PID=%d is not us (%d); sockets not ours", pid, os.getpid())
        return []
    if count <= 0:
        return []

    names = raw_names.split(":") if raw_names else []
    result: list[tuple[str, socket.socket]] = []
    for i, fd in enumerate(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count)):
        name = names[i] if i < len(names) and names[i] else "unknown"
        try:
            os.set_inheritable(fd, False)
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            # A ListenFIFO= or a closed fd: nothing the daemon can serve on.
            log.warning("fd %d (%s) passed by systemd is not a usable socket: %s", fd, name, exc)
            continue
        result.append((name, sock))
    return result


def listen_fds() -> list[socket.socket]:
    """The sockets systemd passed us (see :func:`listen_fds_with_names`)."""
    return [sock for _, sock in listen_fds_with_names()]


# --------------------------------------------------------------------------
# Logging to the journal

def journal_stderr() -> bool:
    """True when fd 2 is the stream journald gave us (``$JOURNAL_STREAM``).

    Comparing device and inode, not just testing that the variable is set,
    matters: a process started from a service's shell inherits the variable
    while its stderr may be a terminal or a file.
    """
    return on_journal(2)


class JournalFormatter(PriorityFormatter):
    """Prefixes every line with ``<N>``, N the record's syslog priority.

    journald stores each line as its own entry, so every line of a multi-line
    record (a traceback) carries the prefix; otherwise the traceback would be
    logged at the default priority, invisible to ``journalctl -p err``.
    No timestamp by default: the journal records its own.
    """

    def __init__(self, fmt: str | None = "%(name)s: %(message)s") -> None:
        super().__init__(fmt)


_PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Handler(logging.StreamHandler[TextIO]):
    """Marks the handler configure_logging installed, to replace it later."""


def _stream_is_journal(stream: TextIO) -> bool:
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        # pytest's capture, io.StringIO...: not a file descriptor at all.
        return False
    return on_journal(fd)


class _Journal(JournalHandler):
    """Marks the native journal handler configure_logging installed."""


def configure_logging(
    level: int | str = logging.INFO, stream: TextIO | None = None, log_format: str = "text"
) -> logging.Handler:
    """Send the root logger to ``stream`` (default stderr), journal-aware.

    When the stream is journald's (``$JOURNAL_STREAM``), records go to the
    journal's socket as fields (ipc.logfields), or, without that
    socket, as lines with priority prefixes and no timestamp; on a terminal
    or a file they get a timestamp and the level name.  ``log_format="json"``
    (``[daemon] log_format``): JSON lines on the stream, journald or not.
    Calling it again replaces the handler it installed before (a reload may
    change the level) instead of adding a second one.  Returns the handler.
    """
    target = stream if stream is not None else sys.stderr
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, (_Handler, _Journal))]:
        root.removeHandler(old)
        old.close()
    handler: logging.Handler = _Handler(target)
    on_journal = _stream_is_journal(target)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    elif on_journal:
        handler.setFormatter(JournalFormatter())
        path = journal_socket()
        if path is not None:
            handler = _Journal(path, fallback=handler)
    else:
        handler.setFormatter(TextFormatter(_PLAIN_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    # A zygote started by exec (the first one died) sets itself up from this.
    os.environ[FORMAT_ENV] = log_format
    return handler
