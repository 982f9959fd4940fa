"""How sessionctl prints sessions, stats and pongs as text: shared by the
full command line (supervisor.ctl.cli) and its one-shot path
(supervisor.ctl.fast), so that both print the same bytes.

Everything here works on the plain form of a reply (`ctl.to_plain`: the
dicts `--json` prints, every field present) and imports only the standard
library's built-in modules and supervisor.ctl.errors (which imports
nothing): the one-shot path imports it at start-up."""

from __future__ import annotations

import sys
import time

from supervisor.ctl.errors import DaemonUnavailable, RequestError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["EXIT_CODES", "EXIT_FAILED", "EXIT_NO_SESSION", "EXIT_OK", "EXIT_SIGINT", "EXIT_SIGPIPE", "EXIT_UNREACHABLE",
           "EXIT_USAGE", "stdout_gone",
           "SORT_KEYS", "exit_code_for", "exit_codes_text", "failed", "fmt_age", "fmt_bytes", "loading_text", "plural", "pong_text", "print_stats", "print_status", "print_table",
           "sandbox_line", "shown_state", "waiting_text"]

# sessionctl's exit codes (a contract: scripts test them), for both paths
# and every command; `sessionctl --help` and the man page list EXIT_CODES.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_NO_SESSION = 0, 1, 2, 3, 4
EXIT_SIGINT = 128 + 2  # as a shell reports a command SIGINT ended
EXIT_SIGPIPE = 128 + 13  # stdout's reader went away (`sessionctl send ... | head`), as a shell reports SIGPIPE
EXIT_CODES = (
    (EXIT_OK, "done"),
    (EXIT_FAILED, "the operation failed (a turn failed, the daemon refused)"),
    (EXIT_USAGE, "usage (bad arguments, a bad --id, --handler or --set)"),
    (EXIT_UNREACHABLE, "cannot reach the daemon, or lost it"),
    (EXIT_NO_SESSION, "no such session"),
)


def exit_codes_text() -> str:
    """The exit codes, one a line, as `--help` ends."""
    return "".join(f"  {code}  {meaning}\n" for code, meaning in EXIT_CODES)


def stdout_gone() -> int:
    """stdout's reader went away (BrokenPipeError): say nothing (the
    reader wanted no more), point stdout at /dev/null so that the
    interpreter's last flush cannot raise again, and end as SIGPIPE would."""
    import os  # (a built-in module: free)

    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 1)
    return EXIT_SIGPIPE


def exit_code_for(error_code: str) -> int:
    """The exit code for the daemon's error `error_code` (the wire's
    ErrorCode: not_found is "no such session", any other a failure)."""
    return EXIT_NO_SESSION if error_code == "not_found" else EXIT_FAILED


def failed(exc: DaemonUnavailable | RequestError) -> int:
    """Say on stderr why a command ended, and return its exit code: both
    paths of sessionctl end the same way."""
    if isinstance(exc, DaemonUnavailable):
        print(f"sessionctl: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    print(f"sessionctl: {exc.message}", file=sys.stderr)
    return exit_code_for(exc.code)


# `top --sort`: here, not in supervisor.ctl.top, so that the command line's
# parser need not import curses.
SORT_KEYS = ("cpu", "rss", "turns", "restarts", "age", "id", "state", "budget")


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size: float = n
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return str(size)


def sandbox_line(sb: dict[str, Any]) -> str:
    if sb.get("mode") == "off":
        return "sandbox: off (sandbox.mode = off)"
    have = [name for name, on in (("namespaces", sb.get("namespaces")),
                                  (f"Landlock ABI {sb.get('landlock_abi')}", sb.get("landlock_abi")),
                                  ("seccomp", sb.get("seccomp")), ("cgroups", sb.get("cgroups"))) if on]
    missing = "; ".join(f"no {k}: {v}" for k, v in sb.get("why_not", {}).items())
    refused = f"; {sb['refused']}" if sb.get("refused") else ""  # fail closed: tools do not run
    return f"sandbox ({sb.get('mode')}): {', '.join(have) or 'nothing'}" + (f"; {missing}" if missing else "") + refused


def fmt_age(secs: float) -> str:
    """12s, 5m, 3h07m, 2d04h: how long ago, to the unit that matters."""
    s = max(0, int(secs))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def plural(n: int, word: str) -> str:
    """`1 client`, `2 clients`."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def shown_state(s: dict[str, Any]) -> str:
    """The state as `ls` and `top` show it: a running turn that waits on a
    person says so (`running (waiting)`); `--json` keeps `state` as it is
    and lists the requests in `waiting`."""
    return f"{s['state']} (waiting)" if s.get("waiting") else s["state"]


def waiting_text(sid: str, w: dict[str, Any], now: float) -> str:
    """One request a person must answer, and how."""
    since = time.strftime("%H:%M:%S", time.localtime(w["since"])) if w["since"] else "?"
    age = f" ({fmt_age(now - w['since'])})" if w["since"] else ""
    return (f"{w['tool']} since {since}{age}, request {w['request_id']} "
            f"(sessionctl approve|deny {sid})")


def print_table(sessions: list[dict[str, Any]], now: float | None = None) -> None:
    """`ls`: one row a session in the order given, children indented under
    their parent.  CPU is the daemon's last sample (`cpu_percent`), AGE the
    time since the session was created."""
    now = time.time() if now is None else now
    by_id = {s["id"]: s for s in sessions}
    kids: dict[str, list[dict[str, Any]]] = {}
    for s in sessions:
        if s["parent"] in by_id:
            kids.setdefault(s["parent"], []).append(s)
    rows: list[tuple[str, dict[str, Any]]] = []

    def walk(s: dict[str, Any], depth: int) -> None:
        rows.append(("  " * depth + ("└ " if depth else "") + s["id"], s))
        for child in kids.get(s["id"], ()):
            walk(child, depth + 1)

    for s in sessions:
        if s["parent"] is None or s["parent"] not in by_id:
            walk(s, 0)
    header = ("ID", "STATE", "PID", "RSS", "CPU%", "AGE", "TURNS", "RESTARTS", "HANDLER")
    table = [header] + [
        (name, shown_state(s), str(s["pid"] or "-"), fmt_bytes(s["rss_bytes"]),
         "-" if s.get("cpu_percent") is None else f"{s['cpu_percent']:.0f}",
         fmt_age(now - s["created_at"]) if s["created_at"] else "-", str(s["turns"]),
         str(s["restarts"]), s["handler"])
        for name, s in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for s in sessions:
        if s["error"]:
            print(f"{s['id']}: {s['state']}: {s['error']}")
        for w in s.get("waiting") or ():
            print(f"{s['id']}: waiting on a person: {waiting_text(s['id'], w, now)}")


def print_status(s: dict[str, Any]) -> None:
    """`status`: one field a line."""
    exit_text = "-"
    e = s["last_exit"]
    if e is not None:
        how = f"signal {e['signal']}" if e["signal"] else f"code {e['code']}"
        exit_text = f"{e['reason']} ({how}){': ' + e['detail'] if e['detail'] else ''}"
    fields = [
        ("id", s["id"]), ("state", shown_state(s)), ("handler", s["handler"]), ("pid", s["pid"] or "-"),
        ("rss", fmt_bytes(s["rss_bytes"])),
        ("disk", fmt_bytes(s["disk_bytes"]) + (f", {s['disk_inodes']} files" if s.get("disk_inodes") else "")),
        ("turns", s["turns"]), ("restarts", s["restarts"]),
        ("created", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["created_at"]))),
        ("last exit", exit_text), ("seq", s["seq"]),
    ]
    for w in s.get("waiting") or ():
        fields.append(("waiting", waiting_text(s["id"], w, time.time())))
    if s["node"]:
        fields.append(("node", s["node"]))  # cluster mode: where its worker runs
    if s["error"]:
        fields.append(("error", s["error"]))
    if s["parent"]:
        fields.append(("parent", s["parent"]))
    if s["children"]:
        fields.append(("children", ", ".join(s["children"])))
    budget = s.get("budget")
    for c in budget.get("ceilings", []) if isinstance(budget, dict) else []:
        if not (isinstance(c, dict) and isinstance(c.get("ceiling"), str) and {"used", "limit", "unit"} <= c.keys()):
            continue
        # One line per [agent.budget] ceiling set: what counts against it now.
        unknown = " (and unknown before its import)" if c.get("unknown") is True else ""
        fields.append(("budget", f"{c['ceiling'].rpartition('.')[2]} {c['used']} of {c['limit']} {c['unit']}{unknown}"))
    for k, v in fields:
        print(f"{k + ':':<11}{v}")


def print_stats(stats: dict[str, Any]) -> None:
    """`stats`: the daemon in three lines (a fourth when tracing is on)."""
    print(f"sessiond {stats['version']}, pid {stats['pid']}, up {stats['uptime_secs']:.0f}s, "
          f"rss {fmt_bytes(stats['rss_bytes'])}")
    states = ", ".join(f"{n} {k}" for k, n in sorted(stats["by_state"].items()))
    print(f"{plural(stats['sessions'], 'session')} ({states or 'none'}), "
          f"{plural(stats['live_workers'], 'live worker')}, {plural(stats['clients'], 'client')}")
    if stats["sandbox"]:
        print(sandbox_line(stats["sandbox"]))
    if stats.get("loading"):
        print(loading_text(stats["loading"]))
    tracing = stats.get("tracing")
    if tracing:  # (an admin's view, with tracing on: docs/tracing.md)
        print(f"tracing: {tracing.get('exporter')} to {tracing.get('endpoint')}: {tracing.get('spans')} spans, "
              f"{tracing.get('exported')} exported, {tracing.get('queued')} queued, "
              f"{tracing.get('dropped')} dropped, {tracing.get('failed')} failed")


def loading_text(loading: dict[str, Any]) -> str:
    """A daemon just started still loads the sessions on disk (ls, stats)."""
    far = f" ({loading['loaded']} of {loading['total']} so far)" if loading.get("total") else ""
    return f"sessiond is still loading the sessions on disk{far}: counts and lists hold those loaded so far"


def pong_text(session: str | None, pid: int, rtt_ms: float) -> str:
    who = f"worker of {session}" if session else "sessiond"
    return f"pong from {who} (pid {pid}) in {rtt_ms:.2f} ms"
