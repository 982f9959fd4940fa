"""Handlers with one behaviour each, for tests (`fixture_handlers:NAME`)."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from session_worker.handler import HandlerInit, TurnContext, TurnFailure, TurnResult


# How long a deliberately hung handler blocks: far past any test's deadline.
HANG_SECS = 3600


class _Base:
    def __init__(self, init: HandlerInit) -> None:
        self.turns = 0
        self.init = init

    def restore(self, state: Any, records: list[Any]) -> None:
        self.turns = int(state or 0) + len(records)

    def snapshot(self) -> Any:
        return self.turns

    async def aclose(self) -> None:
        return None


class Slow(_Base):
    """Streams 'tick i' deltas forever-ish, 20 ms apart, until interrupted or
    `count` is reached (the input text is the count)."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        count = int(text) if text.isdigit() else 1000
        parts: list[str] = []
        try:
            for i in range(count):
                piece = f"tick {i}\n"
                parts.append(piece)
                ctx.emit(piece)
                await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            self.turns += 1
            return TurnResult("".join(parts), record=1, interrupted=True)
        self.turns += 1
        return TurnResult("".join(parts), record=1)


def slow(init: HandlerInit) -> Slow:
    return Slow(init)


class CrashMidTurn(_Base):
    """Turn text 'crash' kills the worker with SIGKILL after one delta."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        if text == "crash":
            ctx.emit("about to crash")
            await asyncio.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        if text == "fail":
            raise TurnFailure("asked to fail", record=1)
        self.turns += 1
        ctx.emit(f"{self.turns}: {text}")
        return TurnResult(f"{self.turns}: {text}", record=1)


def crash_mid_turn(init: HandlerInit) -> CrashMidTurn:
    return CrashMidTurn(init)


class QuotesItsInput(_Base):
    """Fails every turn with an exception that quotes its input as is (a
    handler's bug that a client can word)."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        raise ValueError(f"cannot parse {text}")


def quotes_its_input(init: HandlerInit) -> QuotesItsInput:
    return QuotesItsInput(init)


def crash_at_boot(init: HandlerInit) -> Any:
    raise RuntimeError("this handler cannot start")


class BigReply(_Base):
    """Replies with int(text) bytes in 4 KiB deltas, paced so that a client
    that reads keeps up and one that does not falls behind."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        total = int(text)
        chunk = "x" * 4096
        sent = 0
        while sent < total:
            ctx.emit(chunk)
            sent += len(chunk)
            await asyncio.sleep(0.001)  # (uvloop's timers have 1 ms resolution)
        self.turns += 1
        return TurnResult("big", record=1)


def big_reply(init: HandlerInit) -> BigReply:
    return BigReply(init)


class BigEcho(_Base):
    """Echo (`N: TEXT`) followed by 32 KiB: a turn whose commit is far
    larger than its input, so that on a nearly full disk the input is
    saved and the commit is not."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        n = self.turns + 1
        await asyncio.sleep(0)
        self.turns = n
        return TurnResult(f"{n}: {text}" + "." * 32768, record=1)


def big_echo(init: HandlerInit) -> BigEcho:
    return BigEcho(init)


class Leaky(_Base):
    """Input N: allocate N MiB in 8 MiB steps (touching every page), then hold it."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        hoard = []
        for _ in range(int(text) // 8):
            block = bytearray(8 * 1024 * 1024)
            for i in range(0, len(block), 4096):
                block[i] = 1
            hoard.append(block)
            ctx.emit(".")
            await asyncio.sleep(0.01)
        self.turns += 1
        return TurnResult(f"held {len(hoard) * 8} MiB", record=1)


def leaky(init: HandlerInit) -> Leaky:
    return Leaky(init)


class ChildHog(_Base):
    """Input N: spawn a child process (in our group) that allocates N MiB
    and sleeps; report its pid, then wait for it."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        code = (
            "import time\n"
            f"b = bytearray({int(text)} * 1024 * 1024)\n"
            "for i in range(0, len(b), 4096): b[i] = 1\n"
            "import signal; signal.pause()\n"
        )
        proc = await asyncio.create_subprocess_exec("python3", "-c", code)
        ctx.emit(f"child {proc.pid}\n")
        await proc.wait()
        self.turns += 1
        return TurnResult("child ended", record=1)


def child_hog(init: HandlerInit) -> ChildHog:
    return ChildHog(init)


class Tools(_Base):
    """Starts tool processes and reports their pids, then waits forever:
    one `sleep` in our process group, one that ignores SIGTERM, and one
    that left the group with setsid (an escapee)."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        plain = await asyncio.create_subprocess_exec("sleep", "300")
        # Its pid is told once its trap is set: a SIGTERM before the trap
        # (a busy machine runs bash late) would end it, and a test that
        # counts on a tool outliving SIGTERM would see it gone.
        stubborn = await asyncio.create_subprocess_exec(
            "bash", "-c", "trap '' TERM; echo trapped; while true; do sleep 0.1; done",
            stdout=asyncio.subprocess.PIPE,
        )
        assert stubborn.stdout is not None
        await stubborn.stdout.readline()
        escapee = await asyncio.create_subprocess_exec("setsid", "sleep", "300")
        ctx.emit(f"pids {plain.pid} {stubborn.pid} {escapee.pid}\n")
        await asyncio.sleep(3600)
        return TurnResult("never", record=1)


def tools(init: HandlerInit) -> Tools:
    return Tools(init)


class BusyLoop(_Base):
    """Input 'spin': a pure-Python busy loop that never yields to the event loop."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        if text == "spin":
            ctx.emit("spinning")
            while True:
                pass
        self.turns += 1
        return TurnResult(f"{self.turns}: {text}", record=1)


def busy_loop(init: HandlerInit) -> BusyLoop:
    return BusyLoop(init)


class BlockingSleep(_Base):
    """Input 'block': a blocking sleep on the event loop's thread (a C call
    that never returns to the loop)."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        if text == "block":
            import time

            ctx.emit("blocking")
            await asyncio.sleep(0)
            time.sleep(HANG_SECS)
        self.turns += 1
        return TurnResult(f"{self.turns}: {text}", record=1)


def blocking_sleep(init: HandlerInit) -> BlockingSleep:
    return BlockingSleep(init)


class Deaf(_Base):
    """Ignores interrupts: keeps sleeping when cancelled."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        ctx.emit("not listening")
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue


def deaf(init: HandlerInit) -> Deaf:
    return Deaf(init)


class CrashOnce(_Base):
    """Crashes (SIGKILL) in the middle of its first turn ever (a marker file
    in the workspace remembers), then behaves like echo."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        marker = self.init.workspace / "crashed-once"
        if not marker.exists():
            self.init.workspace.mkdir(parents=True, exist_ok=True)
            marker.write_text("x")
            ctx.emit("crashing")
            await asyncio.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        self.turns += 1
        return TurnResult(f"{self.turns}: {text}", record=1)


def crash_once(init: HandlerInit) -> CrashOnce:
    return CrashOnce(init)


class CrashOnceSteps(CrashOnce):
    """CrashOnce, declaring that it keeps the durable-steps contract (it has
    nothing to journal): its crashed turn is resumed, i.e. run again."""

    uses_steps = True


def crash_once_steps(init: HandlerInit) -> CrashOnceSteps:
    return CrashOnceSteps(init)


class CrashAlwaysSteps(_Base):
    """Uses steps, and crashes (SIGKILL) in every run of every turn: a
    loop of kills for the restart intensity to end."""

    uses_steps = True

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        await ctx.step("before", lambda: 1)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


def crash_always_steps(init: HandlerInit) -> CrashAlwaysSteps:
    return CrashAlwaysSteps(init)


class BootOnce(_Base):
    """Boots the first time only; every later boot fails (marker file)."""

    def __init__(self, init: HandlerInit) -> None:
        super().__init__(init)
        marker = init.workspace / "booted"
        if marker.exists():
            raise RuntimeError("refusing to boot twice")
        init.workspace.mkdir(parents=True, exist_ok=True)
        marker.write_text("x")

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        self.turns += 1
        return TurnResult(f"{self.turns}: {text}", record=1)


def boot_once(init: HandlerInit) -> BootOnce:
    return BootOnce(init)


_FD_PROBE = """
import os, resource
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1 << 16, 1 << 16))
    raised = "raised"
except (ValueError, OSError):
    raised = "kept"
n = 0
try:
    while n < 1 << 20:
        os.open("/dev/null", os.O_RDONLY)
        n += 1
except OSError as exc:
    print(raised, exc.errno, n, *resource.getrlimit(resource.RLIMIT_NOFILE))
"""


class WhoAmI(_Base):
    """Replies with the worker's uid, its workspace owner and its limits."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        import resource

        if text == "forkbomb":
            return TurnResult(self._forkbomb(), record=None)
        if text.startswith("forks "):  # N children that wait to be killed
            n = int(text.split()[1])
            for _ in range(n):
                if os.fork() == 0:
                    signal.pause()
                    os._exit(0)
            return TurnResult(f"forked {n}", record=None)
        if text.startswith("shm "):  # a SysV shared memory segment of that many bytes, made by handler code
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            ident = libc.shmget(0, ctypes.c_size_t(int(text.split()[1])), 0o1600)  # IPC_PRIVATE, IPC_CREAT
            return TurnResult(f"shm {ident}" if ident >= 0 else f"shmget failed: {ctypes.get_errno()}", record=None)
        if text == "fds":  # a tool (a child process) tries to raise RLIMIT_NOFILE, then opens fds until refused
            import sys

            probe = await asyncio.create_subprocess_exec(sys.executable, "-c", _FD_PROBE,
                                                         stdout=asyncio.subprocess.PIPE)
            out, _ = await probe.communicate()
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)
            return TurnResult(f"worker={limit[0]},{limit[1]} tool={out.decode().strip()}", record=None)
        if text.startswith("write "):
            mib = int(text.split()[1])
            try:
                (self.init.workspace / "big").write_bytes(b"x" * (mib << 20))
            except OSError as exc:
                return TurnResult(f"write failed: {exc.strerror}", record=None)
            return TurnResult(f"wrote {mib} MiB", record=None)
        ws = self.init.workspace
        (ws / "probe").write_text("x")
        reply = (
            f"uid={os.getuid()} ws_uid={ws.stat().st_uid} "
            f"core={resource.getrlimit(resource.RLIMIT_CORE)[0]} "
            f"nproc={resource.getrlimit(resource.RLIMIT_NPROC)[0]}"
        )
        return TurnResult(reply, record=None)

    def _forkbomb(self) -> str:
        import time

        made = 0
        try:
            while made < 10_000:
                if os.fork() == 0:
                    signal.pause()
                    os._exit(0)
                made += 1
        except OSError as exc:
            return f"stopped after {made}: {exc.strerror}"
        return f"never stopped ({made})"


def whoami(init: HandlerInit) -> WhoAmI:
    return WhoAmI(init)


def hang_at_boot(init: HandlerInit) -> Any:
    """A factory that never returns (a handler stuck loading a model, say)."""
    import time

    time.sleep(HANG_SECS)
    raise AssertionError("unreachable")


class AfterTurn(_Base):
    """Input "freeze": after replying, block the event loop (between turns).
    Input "grow N": after replying, a background task allocates N MiB (touching
    every page) and holds it, while no turn runs."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        loop = asyncio.get_running_loop()
        if text == "freeze":
            import time

            loop.call_later(0.05, time.sleep, HANG_SECS)
        elif text.startswith("grow "):
            size = int(text.split()[1]) << 20

            async def grow() -> None:
                await asyncio.sleep(0.05)
                self.held = bytearray(size)
                for i in range(0, size, 4096):
                    self.held[i] = 1

            self.task = loop.create_task(grow())
        self.turns += 1
        return TurnResult("ok", record=1)


def after_turn(init: HandlerInit) -> AfterTurn:
    return AfterTurn(init)


class ThreeSteps(_Base):
    """Three durable steps, each appending its name to `counter` in the
    workspace.  After each, a `pause` step waits to be killed the first
    time it runs (marker `after-N`): a step, as the contract wants anything
    that acts to be."""

    uses_steps = True

    def _run(self, name: str) -> str:
        with open(self.init.workspace / "counter", "a") as f:
            f.write(name + "\n")
        return name.upper()

    async def _pause(self, n: int) -> None:
        marker = self.init.workspace / f"after-{n}"
        if not marker.exists():
            marker.write_text("x")
            await asyncio.sleep(3600)

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        out = []
        for n, name in enumerate(("a", "b", "c")):
            out.append(await ctx.step(name, lambda name=name: self._run(name)))
            await ctx.step(f"pause-{n}", lambda n=n: self._pause(n))
        self.turns += 1
        return TurnResult(f"{self.turns}: {''.join(out)} {text}", record=1)


def three_steps(init: HandlerInit) -> ThreeSteps:
    return ThreeSteps(init)


class PauseOnceSteps(_Base):
    """Steps "a", "wait", "b": a first run says "waiting" from inside
    "wait" (its start is sent before its function runs, so the daemon has
    it in flight by then) and waits there (to be killed, or its node lost);
    a resumed run finds "a" journaled and goes on."""

    uses_steps = True

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        a = await ctx.step("a", lambda: "A")
        ctx.emit("after a\n")
        first_run = ctx.resumed is None

        async def wait() -> None:
            if first_run:
                ctx.emit("waiting\n")
                await asyncio.sleep(3600)

        await ctx.step("wait", wait)
        b = await ctx.step("b", lambda: "B")
        self.turns += 1
        return TurnResult(f"{self.turns}: {a}{b} {text}", record=1)


def pause_once_steps(init: HandlerInit) -> PauseOnceSteps:
    return PauseOnceSteps(init)


class BigStep(_Base):
    """One step whose result is `text` characters long (the size caps)."""

    uses_steps = True

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        value = await ctx.step("big", lambda: "x" * int(text))
        return TurnResult(f"{len(value)}", record=1)


def big_step(init: HandlerInit) -> BigStep:
    return BigStep(init)


class ParallelSteps(_Base):
    """Three steps at once ("a", "b", "c": asyncio.gather), then "last".
    Each appends `start <input><name>` to `counter` in the workspace, waits
    for the file `go-<input><name>`, appends `end ...` and returns its name
    in capitals.  A step in flight when the worker died is answered
    `<name>:<reason>`, never run again."""

    uses_steps = True

    async def _run(self, text: str, name: str) -> str:
        ws = self.init.workspace
        with open(ws / "counter", "a") as f:
            f.write(f"start {text}{name}\n")
        while not (ws / f"go-{text}{name}").exists():
            await asyncio.sleep(0.01)
        with open(ws / "counter", "a") as f:
            f.write(f"end {text}{name}\n")
        return name.upper()

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        parts = await asyncio.gather(*(
            ctx.step(x, lambda x=x: self._run(text, x), interrupted=lambda why, x=x: f"{x}:{why.reason}")
            for x in "abc"))
        last = await ctx.step("last", lambda: self._run(text, "last"))
        self.turns += 1
        return TurnResult(" ".join([*parts, last]), record=1)


def parallel_steps(init: HandlerInit) -> ParallelSteps:
    return ParallelSteps(init)


class FastStream(_Base):
    """Input N: N small deltas as fast as the worker can send them (the
    loop yielded to every 64, so that they go out as they come)."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        count = int(text)
        for i in range(count):
            ctx.emit(f"{i % 10}")
            if i % 64 == 63:
                await asyncio.sleep(0)
        self.turns += 1
        return TurnResult(f"{count} deltas", record=1)


def fast_stream(init: HandlerInit) -> FastStream:
    return FastStream(init)


class CpuChunks(_Base):
    """Input N: N chunks of 5 ms of CPU work, the loop given a turn between
    each (a healthy loop that needs the CPU: parsing, a framework's own
    work); replies 'N chunks'."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        import time

        count = int(text)
        for _ in range(count):
            began = time.thread_time()
            while time.thread_time() - began < 0.005:
                pass
            await asyncio.sleep(0)
        self.turns += 1
        return TurnResult(f"{count} chunks", record=1)


def cpu_chunks(init: HandlerInit) -> CpuChunks:
    return CpuChunks(init)
