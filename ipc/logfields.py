"""Log records as fields a machine can query: journald's native protocol,
and JSON lines.  Standard library only.

Runs in the daemon (supervisor.ops.sdnotify.configure_logging installs it),
in the zygote and workers it forks (they inherit the root logger's handler;
a worker's filter adds its `session_id`), and in a zygote started by exec,
which sets itself up the same way (`configure_zygote`): hence ipc/, where
both sides may import it.  The field names are a contract (docs/operations.md).

Under journald (stderr is `$JOURNAL_STREAM`) and with the journal's socket
present, each record goes to that socket as one datagram of fields
(systemd.journal-fields(7); the protocol: https://systemd.io/JOURNAL_NATIVE_PROTOCOL/):
`MESSAGE`, `PRIORITY`, `SYSLOG_IDENTIFIER`, `CODE_FILE`/`CODE_LINE`/`CODE_FUNC`,
`LOGGER`, and for a line about one session `SESSION_ID`, plus, on its
lifecycle lines, `SESSIOND_EVENT` (`state`, `limit`, `turn_failed`),
`SESSION_STATE` or `SESSIOND_LIMIT`, `SESSION_UID` (the uid it runs as) and
`SESSION_OWNER_UID`, and for a line about a traced turn `TRACE_ID` and
`SPAN_ID` (the turn's span).  So `journalctl SESSION_ID=abc` finds a session's
lines, daemon's and worker's.  A field whose value holds a newline is sent
in the protocol's length-prefixed form; an entry too large for one datagram
goes in a sealed memfd passed with `SCM_RIGHTS`, as systemd's own client
does.  The socket is never waited on: a datagram the journal cannot take
now (`EAGAIN`), or any failure, sends that record down the `<N>` stream
instead, so nothing is lost and the loop never blocks.

`[daemon] log_format = "json"`: one JSON object a line on stderr with the
same field names (and `TIMESTAMP`, `PID`), for a log shipper.

`SESSIOND_LOG_FORMAT` (set by the daemon for the processes it starts)
carries `log_format` to a zygote started by exec.

`SESSIOND_JOURNAL_SOCKET` names another socket than
/run/systemd/journal/socket: for tests only (they bind a datagram socket of
their own; journald need not run), documented in docs/operations.md.
"""

from __future__ import annotations

import array
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import struct
import sys

__all__ = ["FORMAT_ENV", "JOURNAL_SOCKET", "SOCKET_ENV", "JournalHandler", "JsonFormatter", "PriorityFormatter",
           "TextFormatter", "configure_zygote",
           "encode_entry", "escape", "journal_socket", "on_journal", "record_fields", "syslog_priority"]

JOURNAL_SOCKET = "/run/systemd/journal/socket"
SOCKET_ENV = "SESSIOND_JOURNAL_SOCKET"
FORMAT_ENV = "SESSIOND_LOG_FORMAT"
IDENTIFIER = "sessiond"

# Record attributes (set by supervisor.logtag and the worker's filter)
# and the journal fields they become.
_SESSION_FIELDS = (
    ("session_id", "SESSION_ID"),
    ("sessiond_event", "SESSIOND_EVENT"),
    ("session_state", "SESSION_STATE"),
    ("sessiond_limit", "SESSIOND_LIMIT"),
    ("session_uid", "SESSION_UID"),
    ("session_owner_uid", "SESSION_OWNER_UID"),
    # A line about a traced turn: its trace and span (supervisor.logtag).
    ("trace_id", "TRACE_ID"),
    ("span_id", "SPAN_ID"),
)
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))
_U64 = struct.Struct("<Q")
# Retried through a memfd (systemd's client does the same).
_TOO_BIG = frozenset({errno.EMSGSIZE, errno.ENOBUFS})


def syslog_priority(levelno: int) -> int:
    for threshold, priority in _PRIORITIES:
        if levelno >= threshold:
            return priority
    return 7


def journal_socket() -> str | None:
    """The journal's socket if there is one here (or the tests' one)."""
    path = os.environ.get(SOCKET_ENV) or JOURNAL_SOCKET
    try:
        return path if stat.S_ISSOCK(os.stat(path).st_mode) else None
    except OSError:
        return None


_message = logging.Formatter("%(message)s")


def record_fields(record: logging.LogRecord) -> dict[str, str]:
    """The record as journal fields (values as text), in a stable order."""
    fields = {
        "MESSAGE": _message.format(record),  # with the traceback, if any
        "PRIORITY": str(syslog_priority(record.levelno)),
        "SYSLOG_IDENTIFIER": IDENTIFIER,
        "LOGGER": record.name,
        "CODE_FILE": record.pathname,
        "CODE_LINE": str(record.lineno),
        "CODE_FUNC": record.funcName,
    }
    for attr, name in _SESSION_FIELDS:
        value = getattr(record, attr, None)
        if value is not None and value != "":
            fields[name] = str(value)
    return fields


def encode_entry(fields: dict[str, str]) -> bytes:
    """One journal entry in the native protocol: `KEY=value\\n`, or for a
    value with a newline `KEY\\n`, its length (u64 LE), the value, `\\n`."""
    out = bytearray()
    for key, text in fields.items():
        value = text.encode("utf-8", "replace")
        if b"\n" in value:
            out += key.encode() + b"\n" + _U64.pack(len(value)) + value + b"\n"
        else:
            out += key.encode() + b"=" + value + b"\n"
    return bytes(out)


class JournalHandler(logging.Handler):
    """Sends records to the journal's socket; `fallback` (the `<N>` stream)
    takes any record the socket does not."""

    def __init__(self, path: str, fallback: logging.Handler) -> None:
        super().__init__()
        self.path = path
        self.fallback = fallback
        self._sock: socket.socket | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.send(encode_entry(record_fields(record)))
        except Exception:
            self.fallback.handle(record)

    def send(self, entry: bytes) -> None:
        sock = self._sock
        if sock is None:
            sock = self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            sock.setblocking(False)  # never make the loop wait on journald
        try:
            sock.sendto(entry, self.path)
        except OSError as exc:
            if exc.errno not in _TOO_BIG:
                raise
            self._send_memfd(sock, entry)

    def _send_memfd(self, sock: socket.socket, entry: bytes) -> None:
        fd = os.memfd_create("sessiond-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            view = memoryview(entry)
            while view:
                view = view[os.write(fd, view):]
            # Sealed, so journald may map it knowing we cannot change it.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
            sock.sendmsg([], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], 0, self.path)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.fallback.close()
        super().close()


class JsonFormatter(logging.Formatter):
    """One JSON object a line: the journal's field names, plus `TIMESTAMP`
    (UTC, ISO 8601), `PID`, and `PRIORITY` and `CODE_LINE` as numbers."""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, object] = {
            "TIMESTAMP": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
                         .isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "PID": record.process,
            **record_fields(record),
        }
        fields["PRIORITY"] = syslog_priority(record.levelno)
        fields["CODE_LINE"] = record.lineno
        for key in ("SESSION_UID", "SESSION_OWNER_UID"):
            if key in fields:
                fields[key] = int(str(fields[key]))
        return json.dumps(fields, ensure_ascii=False)


def on_journal(fd: int) -> bool:
    """True when `fd` is the stream journald gave us (`$JOURNAL_STREAM`,
    device and inode, as systemd.exec(5) says to compare)."""
    dev, sep, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(fd)
        return st.st_dev == int(dev) and st.st_ino == int(ino)
    except (OSError, ValueError):
        return False


def configure_zygote(fmt: str) -> bool:
    """A zygote started by exec (it has no handler of the daemon's): log as
    the daemon does, per `$SESSIOND_LOG_FORMAT` and the journal.  False
    when that is plain lines (the caller sets those up)."""
    if os.environ.get(FORMAT_ENV) == "json":
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
    elif on_journal(2) and (path := journal_socket()) is not None:
        fallback = logging.StreamHandler(sys.stderr)
        fallback.setFormatter(PriorityFormatter(fmt))
        handler = JournalHandler(path, fallback)
    else:
        return False
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return True


def escape(text: str) -> str:
    """`text` with every non-printable character (newlines, carriage
    returns, terminal escapes) written out as its escape sequence: what a
    client, a handler or a tool wrote, made one harmless piece of a line.
    The one escaping function of every process (text logs, the tool
    host's lines, the web console's)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


# Starts every line of a record after its first (a traceback's): no line
# that text inside a record makes can read as a record of its own.
CONTINUED = "  | "


class TextFormatter(logging.Formatter):
    """Log lines as text (a terminal, a file, journald's stream): the
    message escaped to one line, a traceback (or stack) as a block whose
    every line starts with `CONTINUED` and is escaped too.  A reason or an
    exception that quotes its input (a handler's, a client's) cannot forge
    a line of the log, nor write terminal escapes to it."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = escape(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        lines = [self.formatMessage(record)]
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        for block in (record.exc_text or "", self.formatStack(record.stack_info) if record.stack_info else ""):
            lines += [CONTINUED + escape(line) for line in block.splitlines()]
        return "\n".join(lines)


class PriorityFormatter(TextFormatter):
    """`<N>` before each line, for the journal's stream (sd-daemon(3)): every
    line of a traceback too, or `journalctl -p err` would miss them."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))
