"""Shared helpers for the benchmarks in bench/: a throw-away daemon, statistics,
tables and goal lines.

Every bench script imports `_path` first (bench/_path.py) so that it runs
as `.venv/bin/python bench/X.py` from the repo root: Python puts the
script's directory, bench/, first on sys.path, where `bench/ipc.py` would
shadow the project's `ipc` package; `_path` swaps that entry for the repo
root, and the scripts import this module as `bench._common`.

The daemon runs in its own session (process group) with its state and socket
in one short temporary directory under /tmp.  It is stopped on normal exit,
on an exception, on Ctrl-C and on SIGTERM: SIGTERM to the daemon first (it
stops its workers), then SIGKILL to its process group and to every process it
was ever seen to have, then the directory is removed.

Nothing here is imported by the daemon or its workers.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import tomli_w

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    for key in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC",
                "SESSIOND_SOCKET"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def cached_env(cache_dir: str | Path) -> dict[str, str]:
    """`child_env` for a one-shot CLI timed as an installed one runs: with
    a bytecode cache (pip compiles one at install) in `cache_dir`, written
    by its first run even where the shell sets PYTHONDONTWRITEBYTECODE
    (every later run compiled the CLI again: ~50 ms of a 100 ms `ls`)."""
    env = child_env({"PYTHONPYCACHEPREFIX": str(cache_dir)})
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


# ---------------------------------------------------------------- cleanup on any exit

_cleanups: list[Any] = []


def _run_cleanups() -> None:
    while _cleanups:
        fn = _cleanups.pop()
        with contextlib.suppress(Exception):
            fn()


def _on_sigterm(signum: int, frame: Any) -> None:
    # Becomes an exception in the main thread, so `finally` blocks run.
    raise SystemExit(128 + signum)


atexit.register(_run_cleanups)
if __name__ != "__main__":
    with contextlib.suppress(ValueError):  # not in the main thread
        signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(signal.SIGHUP, _on_sigterm)


def on_exit(fn: Any) -> None:
    """Run `fn` at exit (LIFO), whatever the reason."""
    _cleanups.append(fn)


def kill_process_tree(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- a throw-away daemon


def _trusting(config: str) -> str:
    """The benches' handlers allowed; as root, tools run as root (as in the
    baselines the figures are compared with)."""
    data = tomllib.loads(config)
    data.setdefault("agent", {}).setdefault(
        "allowed_handlers", ["agent", "echo", "bench.bench_handlers:*", "bench._loop_launcher:*"])
    if os.geteuid() == 0:
        data.setdefault("daemon", {}).setdefault("allow_root_tools", True)
    return tomli_w.dumps(data)


class BenchDaemon:
    """A sessiond in a temp dir, in its own process group.

    `launcher`: None runs `python -m supervisor.cli run ...`; otherwise a
    script path run as `python LAUNCHER [launcher_args] run ...` (bench's
    loop launcher).
    """

    def __init__(self, config: str = "", *, launcher: Path | None = None,
                 launcher_args: Sequence[str] = (), python_flags: Sequence[str] = (),
                 tag: str = "sd", env: dict[str, str] | None = None) -> None:
        self.env = dict(env or {})
        self.dir = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir="/tmp"))
        self.socket = self.dir / "s.sock"
        self.state_dir = self.dir / "state"
        self.config_path = self.dir / "config.toml"
        self.config_path.write_text(_trusting(config))
        self.log_path = self.dir / "daemon.log"
        self.launcher = launcher
        self.launcher_args = list(launcher_args)
        self.python_flags = list(python_flags)
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: set[int] = set()
        on_exit(self.cleanup)

    @property
    def cmd(self) -> list[str]:
        tail = ["run", "--config", str(self.config_path), "--socket", str(self.socket),
                "--state-dir", str(self.state_dir)]
        if self.launcher is None:
            return [sys.executable, *self.python_flags, "-m", "supervisor.cli", *tail]
        return [sys.executable, *self.python_flags, str(self.launcher), *self.launcher_args, *tail]

    def start(self, timeout: float = 20.0) -> BenchDaemon:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=child_env(self.env), cwd=str(self.dir), start_new_session=True,
            )
        self.seen.add(self.proc.pid)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sessiond exited with {self.proc.returncode}:\n{self.log()}")
            if self._listening():
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"sessiond did not listen within {timeout}s:\n{self.log()}")
            time.sleep(0.01)
        self.remember()
        return self

    def _listening(self) -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(self.socket))
            return True
        except OSError:
            return False
        finally:
            s.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def remember(self) -> None:
        """Note every descendant now alive, so cleanup can kill it even if
        it left the daemon's process group (workers have their own)."""
        import psutil

        with contextlib.suppress(psutil.Error):
            self.seen.update(p.pid for p in psutil.Process(self.pid).children(recursive=True))

    def zygote_pid(self) -> int:
        import psutil

        kids = psutil.Process(self.pid).children()
        if len(kids) != 1:
            raise RuntimeError(f"expected one child of the daemon (the zygote), found {kids}")
        return kids[0].pid

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.remember()
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.proc.wait(5)
        # Workers are in their own groups and die by PDEATHSIG; make sure.
        for pid in self.seen:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        kill_process_tree(sorted(self.seen))
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> BenchDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def as_uid(uid: int, work: Callable[[], Any]) -> Any:
    """`work()` run in a child that becomes `uid` (its group too, and no
    others), its JSON-able result handed back; RuntimeError with the
    child's error if it failed.  Start several with `as_uid_start` and
    collect them with `as_uid_result` to have them run at once."""
    return as_uid_result(as_uid_start(uid, work))


def as_uid_start(uid: int, work: Callable[[], Any]) -> tuple[int, int]:
    """(the child's pid, the pipe its answer comes on): see `as_uid`."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, json.dumps({"ok": work()}).encode())
            code = 0
        except BaseException as exc:
            os.write(w, json.dumps({"fatal": f"{type(exc).__name__}: {exc}"}).encode())
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def as_uid_result(child: tuple[int, int]) -> Any:
    pid, r = child
    with os.fdopen(r) as f:
        answer = json.loads(f.read() or '{"fatal": "the child gave no answer"}')
    os.waitpid(pid, 0)
    if "fatal" in answer:
        raise RuntimeError(f"the child as another uid failed: {answer['fatal']}")
    return answer["ok"]


# ---------------------------------------------------------------- CPU accounting


def sched_ns(pid: int) -> tuple[int, int]:
    """(ns on a CPU, ns waiting for one) of every thread of `pid`, from
    /proc/PID/task/*/schedstat (nanosecond resolution, unlike cpu_times).
    The wait is time runnable but not running: contention from the rest
    of the machine and from the other processes in the chain."""
    run = wait = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return 0, 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        run += int(fields[0])
        wait += int(fields[1])
    return run, wait


class CpuMeter:
    """Accumulates CPU and run-queue wait per operation for named processes."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.run: dict[str, dict[str, int]] = {}
        self.wait: dict[str, dict[str, int]] = {}
        self.ops: dict[str, int] = {}

    def snap(self) -> dict[str, tuple[int, int]]:
        return {role: sched_ns(pid) for role, pid in self.pids.items()}

    def add(self, kind: str, before: dict[str, tuple[int, int]], ops: int,
            roles: Sequence[str] | None = None) -> None:
        after = self.snap()
        self.ops[kind] = self.ops.get(kind, 0) + ops
        run = self.run.setdefault(kind, {})
        wait = self.wait.setdefault(kind, {})
        for role in roles or self.pids:
            run[role] = run.get(role, 0) + after[role][0] - before[role][0]
            wait[role] = wait.get(role, 0) + after[role][1] - before[role][1]

    def per_op_us(self, kind: str) -> dict[str, dict[str, float]]:
        n = max(1, self.ops.get(kind, 0))
        return {
            "cpu_us": {r: v / n / 1000 for r, v in self.run.get(kind, {}).items()},
            "runq_wait_us": {r: v / n / 1000 for r, v in self.wait.get(kind, {}).items()},
        }


# ---------------------------------------------------------------- statistics


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_ns: Sequence[int | float]) -> dict[str, float]:
    """Figures in microseconds."""
    s = sorted(x / 1000.0 for x in samples_ns)
    return {
        "n": len(s),
        "median_us": percentile(s, 50),
        "p99_us": percentile(s, 99),
        "min_us": s[0] if s else math.nan,
        "mean_us": sum(s) / len(s) if s else math.nan,
    }


def fmt_us(us: float) -> str:
    if math.isnan(us):
        return "-"
    if us >= 10_000:
        return f"{us / 1000:.1f} ms"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    if us >= 100:
        return f"{us:.0f} µs"
    return f"{us:.1f} µs"


def fmt_bytes(n: float) -> str:
    if math.isnan(n):
        return "-"
    return f"{n / 1048576:.2f} MiB"


# ---------------------------------------------------------------- output


class Report:
    """Collects rows and goals; prints a table (stdout, or stderr with
    --json) and, with --json, one JSON object on stdout."""

    def __init__(self, name: str, as_json: bool) -> None:
        self.name = name
        self.as_json = as_json
        self.figures: dict[str, Any] = {}
        self.goals: list[dict[str, Any]] = []
        self.out = sys.stderr if as_json else sys.stdout

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
        def line(cells: Sequence[str]) -> str:
            first = f"{cells[0]:<{widths[0]}}"
            rest = "  ".join(f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:]))
            return f"{first}  {rest}".rstrip()
        self.say(line(headers))
        self.say(line(["-" * w for w in widths]))
        for r in rows:
            self.say(line([str(c) for c in r]))

    def goal(self, label: str, value: float, limit: float, text: str, *, higher_is_better: bool = False) -> bool:
        ok = value >= limit if higher_is_better else value <= limit
        self.goals.append({"goal": label, "value": value, "limit": limit, "pass": ok})
        self.say(f"GOAL {label}: {text} {'PASS' if ok else 'FAIL'}")
        return ok

    def finish(self) -> int:
        if self.as_json:
            obj = {"bench": self.name, "time": time.time(), "python": sys.version.split()[0],
                   "cpus": os.cpu_count(), "figures": self.figures, "goals": self.goals}
            print(json.dumps(obj, sort_keys=True, default=float))
        return 0


def arg_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object on stdout "
                   "(the table goes to stderr)")
    return p


def history_bench(name: str, doc: str, n: tuple[int, str], warmup: int) -> tuple[argparse.Namespace, Report]:
    """The arguments of a bench over sessions with a long and a short past
    (--n, --warmup, --history, --short, --msg-bytes) and its report."""
    p = arg_parser(doc.split("\n")[0])
    p.add_argument("--n", type=int, default=n[0], help=f"{n[1]} (default {n[0]})")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed rounds first (default {warmup})")
    p.add_argument("--history", type=int, default=10_000, help="long history, turns (default 10000)")
    p.add_argument("--short", type=int, default=10, help="short history, turns (default 10)")
    p.add_argument("--msg-bytes", type=int, default=100, help="size of each input (default 100)")
    args = p.parse_args()
    return args, Report(name, args.json)


def history_goals(rep: Report, args: argparse.Namespace, handlers: Sequence[str],
                  median_us: Callable[[str], float], within: float, title: str) -> None:
    """Per handler, a goal: the median with a long past within `within`x of
    the median with a short one.  `median_us(case)` (case: HANDLER_TURNS);
    `title` is formatted with history and short."""
    for h in handlers:
        short, long = median_us(f"{h}_{args.short}"), median_us(f"{h}_{args.history}")
        ratio = long / short
        rep.goal(f"{h}: " + title.format(history=args.history, short=args.short), ratio, within,
                 f"{ratio:.2f}x ({fmt_us(long)} vs {fmt_us(short)})")


def history_cases(handlers: Sequence[str], args: argparse.Namespace) -> list[tuple[str, int]]:
    """Each handler with a short and a long past."""
    return [(h, turns) for h in handlers for turns in (args.short, args.history)]


def message(i: int, size: int) -> str:
    head = f"message {i:06d} "
    return head + "x" * max(0, size - len(head))


async def build_history(client: Any, sid: str, turns: int, size: int) -> None:
    """Give session `sid` a past of `turns` real turns (client: an AsyncClient)."""
    for i in range(turns):
        await client.send_text(sid, message(i, size))


@contextlib.asynccontextmanager
async def clients_of(daemons: Sequence[Any]) -> AsyncIterator[list[Any]]:
    """Each of `daemons` started (its `start()` gives its client); after the
    block, the clients closed and every daemon cleaned up (`d.d.cleanup()`)."""
    try:
        clients = [await d.start() for d in daemons]
        yield clients
        for client in clients:
            await client.close()
    finally:
        for d in daemons:
            d.d.cleanup()


async def time_lists(client: Any, rounds: int) -> list[float]:
    """Seconds each of `rounds` listings took (client: an AsyncClient)."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await client.list()
        out.append(time.perf_counter() - t0)
    return out


def recv_frame(s: socket.socket) -> bytes:
    """One length-prefixed frame's body from a blocking socket."""
    (length,) = struct.unpack(">I", _recv_exact(s, 4))
    return _recv_exact(s, length)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed by the daemon")
        buf += chunk
    return bytes(buf)


async def create_echo_sessions(client: Any, n: int, in_flight: int = 16) -> tuple[float, list[str]]:
    """`n` echo sessions made by `client` (an AsyncClient), `in_flight` at a
    time: the creates per second, and their ids."""
    sem = asyncio.Semaphore(in_flight)
    sids: list[str] = []

    async def make() -> None:
        async with sem:
            sids.append((await client.create(handler="echo")).id)

    t0 = time.perf_counter()
    await asyncio.gather(*(make() for _ in range(n)))
    return n / (time.perf_counter() - t0), sids


def quiet_gc() -> None:
    """Freeze what is allocated so far: the collector then has little to scan
    during measurement, in the bench client as in the zygote."""
    import gc

    gc.collect()
    gc.freeze()


if __name__ == "__main__":
    print("bench/_common.py: helpers for the bench scripts; run bench/spawn.py, bench/ipc.py, bench/memory.py")
