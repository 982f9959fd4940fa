"""The worker: one process, one session.  Runs in a child forked by the zygote.

The zygote calls `run_worker(sock)` right after fork; nothing here runs in the
daemon.  It never writes state: each turn ends with a `Done` carrying the
handler's record, which the daemon appends.  Two phases:

* Boot to first input, with no event loop (`boot`, `_idle`): read `Boot`,
  confine the process, build the handler and restore it from what the
  daemon sent, say `Ready`; then block in one `recv` until the next idle
  heartbeat is due, answering pings.  Most sessions are idle most of the
  time: an idle worker that has not built a loop, a transport and their
  buffers has copied fewer of the zygote's pages (bench/README.md, "Idle
  worker memory and boot").  A handler's constructor and `restore` so run
  with no loop running; a failure there still fails the `create`.
* From the first input on, an event loop (made here: a loop must never cross
  a fork) serves inputs one at a time (`_serve`, `Worker`).

Liveness: heartbeats from the worker's own thread of control: the idle wait
beats on its timeout, the loop from a timer every `heartbeat_interval_secs`
(slower while no turn runs).  A handler stuck in a busy loop or a C call
starves the loop, the heartbeats stop, and the daemon kills the worker; that
is the point of sending them from here and not from a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import resource
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import setproctitle

from ipc import messages as m
from ipc.contract import EXIT_BOOT_FAILED, IDLE_HEARTBEAT_FACTOR, LimitKind
from ipc.connection import FramedProtocol
from ipc.errors import BadMessage, FrameTooLarge, ProtocolError
from ipc.framing import HEADER as _HEADER
from ipc.framing import FrameEncoder
from ipc.linux import set_dumpable, set_pdeathsig, unshare_ipc
from ipc.loop import run as run_loop
from ipc.budget import Standing
from ipc.settings import SessionSettings
from session_worker import tracing
from session_worker.worker import _reach, sandbox
from session_worker.worker._logtag import name_process
from session_worker.worker._signals import set_signal
from session_worker.worker.factories import load_factory
from session_worker.errors import SpawnError, StopWhileIdle, TurnFailure
from session_worker.handler import (
    Handler,
    HandlerInit,
    TurnContext,
    TurnResult,
)
from session_worker.worker.steps import Interruption, TurnSteps

__all__ = ["run_worker"]

log = logging.getLogger("sessiond.worker")


_decoder = msgspec.msgpack.Decoder(m.ToWorker)
_settings_decoder = msgspec.msgpack.Decoder(SessionSettings)
_encode = msgspec.msgpack.Encoder().encode
_decode_any = msgspec.msgpack.Decoder().decode
_frames = FrameEncoder()
# The daemon is trusted; the limit only stops a garbled length prefix.
_MAX_FRAME = 1 << 30
_RECV_BYTES = 256 * 1024


class _Context(TurnContext):
    def __init__(self, worker: Worker, turn: int, resumed: m.Resumed | None = None,
                 spent: dict[str, int] | None = None, uid_spent: dict[str, int] | None = None) -> None:
        self._worker = worker
        self.session = worker.session
        self.turn = turn
        # [agent.budget]: the daemon's figures, with the input (uid_spent
        # again whenever another session of the uid spends: BudgetUpdate).
        self.spent = spent or {}
        self.uid_spent = uid_spent or {}
        self.settings = worker.settings
        self.workspace = worker.workspace
        self.depth = worker.depth
        self.streamed: list[str] = []
        ws = worker.settings.agent.worker
        self.steps = TurnSteps(turn, worker.send, worker.conn.flush, resumed,
                               ws.max_step_kb * 1024, ws.max_turn_steps_mb << 20)
        self.resumed = self.steps.interruption

    async def step(self, key: str, fn: Callable[[], Any], *, kind: str = "",
                   interrupted: Callable[[Interruption], Any] | None = None, idempotent: bool = False,
                   wait: bool = True) -> Any:
        if not self.settings.agent.worker.retry_aborted_turn:
            # Nothing would resume from them: no journal, no wait.
            return await super().step(key, fn, kind=kind, interrupted=interrupted, idempotent=idempotent)
        return await self.steps.step(key, fn, kind, interrupted, idempotent, wait)

    def emit(self, text: str) -> None:
        if text:
            self.streamed.append(text)
            self._worker.send(m.Delta(turn=self.turn, text=text))

    def flush(self) -> None:
        self._worker.conn.flush()

    def reasoning(self, text: str) -> None:
        # Not in `streamed`: an interrupted turn keeps its reply text only.
        if text:
            self._worker.send(m.WorkerReasoning(turn=self.turn, text=text))

    def notice(self, kind: str, data: dict[str, Any]) -> None:
        self._worker.send(m.WorkerNotice(turn=self.turn, kind=kind, data=data))

    def limit_exceeded(self, kind: str, value: float, limit: float) -> None:
        self._worker.send(m.WorkerLimit(turn=self.turn, kind=kind, value=value, limit=limit))

    def budget_spent(self) -> tuple[dict[str, int], dict[str, int]]:
        return self.spent, self.uid_spent

    def report_spend(self, spend: dict[str, int]) -> None:
        self._worker.send(m.Spent(turn=self.turn, spend=spend))

    async def begin_llm_call(self) -> Standing | None:
        request_id, fut = self._worker.new_request()
        self._worker.send(m.Spent(turn=self.turn, request_id=request_id))
        self._worker.conn.flush()
        answer = await fut
        assert isinstance(answer, m.CallCleared)
        if answer.error:
            raise TurnFailure(f"the LLM call could not be counted against the budgets: {answer.error}")
        if not answer.ceiling:
            return None
        return Standing(answer.ceiling, answer.used, answer.limit, answer.unit, answer.unknown)

    def budget_exceeded(self, ceiling: str, used: int, limit: int, unit: str) -> None:
        self._worker.send(m.WorkerLimit(turn=self.turn, kind=LimitKind.BUDGET, value=used, limit=limit,
                                        ceiling=ceiling, unit=unit))

    async def ask_permission(self, tool: str, arguments: dict[str, Any]) -> bool:
        request_id, fut = self._worker.new_request()
        self._worker.send(
            m.AskPermission(turn=self.turn, request_id=request_id, tool=tool, arguments=arguments)
        )
        answer = await fut
        assert isinstance(answer, m.PermissionAnswer)
        return answer.allow

    async def spawn_agent(self, task: str, handler: str | None = None) -> str:
        request_id, fut = self._worker.new_request()
        self._worker.send(
            m.SpawnAgent(turn=self.turn, request_id=request_id, task=task, handler=handler,
                         span=tracing.current_span_id())
        )
        result = await fut
        assert isinstance(result, m.SpawnResult)
        if not result.ok:
            raise SpawnError(result.reason)
        return result.reply


@dataclass(slots=True)
class Booted:
    """What Boot built, before any event loop exists: the session's identity
    and settings, its confined process, its handler restored from state."""

    session: str
    settings: SessionSettings
    workspace: Path
    depth: int
    handler: Handler
    turns_since_snapshot: int
    # Handed to `sandbox.configure` with the first input: the tool host
    # serves turns only, and making it at boot cost every idle worker.
    sandbox_plan: sandbox.Plan | None
    sandbox_report: dict[str, Any]

    def reconfigure(self, settings: SessionSettings) -> None:
        """The operator reloaded the config: new rules and limits from the
        next tool call (handlers that implement `reconfigure`) and the next
        heartbeat on."""
        self.settings = settings
        hook = getattr(self.handler, "reconfigure", None)
        if callable(hook):
            try:
                hook(settings)
            except Exception:
                log.exception("the handler could not take the new settings")


def boot(msg: m.Boot) -> Booted:
    """Confine this process, build the handler and restore it from the state
    the daemon sent.  Runs before the worker has an event loop (see
    `_idle`): a handler's constructor and `restore` run with none running."""
    settings = _settings_decoder.decode(msg.settings)
    workspace = Path(msg.workspace)
    _reach.cover_held()  # the daemon's Python opened to the session's uid, where it must be (still root)
    own_ipc = _confine(settings, msg.run_as_uid, msg.run_as_gid)
    workspace.mkdir(parents=True, exist_ok=True, mode=0o700)
    plan = sandbox.plan_for(msg.sandbox, settings, _real_path(workspace),
                            per_session_uid=msg.run_as_uid is not None, own_ipc=own_ipc)
    factory = load_factory(msg.handler)
    init = HandlerInit(session=msg.session, settings=settings, workspace=workspace, depth=msg.depth)
    handler = factory(init)
    state = _decode_any(msg.snapshot) if msg.snapshot else None
    handler.restore(state, [_decode_any(r) for r in msg.records])
    return Booted(
        session=msg.session, settings=settings, workspace=workspace, depth=msg.depth,
        handler=handler, turns_since_snapshot=len(msg.records), sandbox_plan=plan,
        sandbox_report=plan.describe() if plan is not None else {},
    )


def _real_path(path: Path) -> Path:
    """`path.resolve()` for a directory, asked of the kernel: open it and
    read back the path it opened.  `Path.resolve` walks the path in Python
    (an lstat per component), and in a worker's boot that walk copied
    ~0.15 MiB of the zygote's pages."""
    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return path.resolve()
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:  # no /proc
        return path.resolve()
    finally:
        os.close(fd)


class Worker:
    """A booted worker once its first input came: the event loop's side."""

    def __init__(self, conn: FramedProtocol[m.ToWorker], booted: Booted) -> None:
        self.conn = conn
        self.booted = booted
        self.session = booted.session
        self.workspace = booted.workspace
        self.depth = booted.depth
        self.handler: Handler = booted.handler
        self.turn_task: asyncio.Task[None] | None = None
        self.turn_ctx: _Context | None = None
        self._requests: dict[str, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self.stopping = asyncio.get_running_loop().create_future()
        self._beat_timer: asyncio.TimerHandle | None = None

    @property
    def settings(self) -> SessionSettings:
        return self.booted.settings

    def send(self, msg: Any) -> None:
        self.conn.send(msg)

    def new_request(self) -> tuple[str, asyncio.Future[Any]]:
        request_id = f"{os.getpid()}-{next(self._ids)}"
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._requests[request_id] = fut
        fut.add_done_callback(lambda _: self._requests.pop(request_id, None))
        return request_id, fut

    # Runs from data_received: keep it to dispatch, no awaiting.
    def on_message(self, msg: m.ToWorker) -> None:
        match msg:
            case m.Input(turn=turn, text=text):
                if self.turn_task is not None and not self.turn_task.done():
                    self.send(m.Failed(turn=turn, reason="a turn is already running"))
                    return
                self.turn_ctx = _Context(self, turn, msg.resumed, msg.spent, msg.uid_spent)
                self.turn_task = asyncio.get_running_loop().create_task(self.run_turn(self.turn_ctx, text, msg))
                # The full pace while the turn runs, but no beat now: the
                # daemon counts the turn's allowance from its start, and a
                # frame now would wake it (on a busy machine, preempt us)
                # while the turn makes its first request (an LLM's).
                self._arm_beat()
            case m.InterruptTurn():
                if self.turn_task is not None and not self.turn_task.done():
                    self.turn_task.cancel()
            case m.WorkerPing(nonce=nonce):
                self.send(m.WorkerPong(nonce=nonce))
            case m.PermissionAnswer(request_id=rid) | m.SpawnResult(request_id=rid) | m.CallCleared(request_id=rid):
                fut = self._requests.get(rid)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            case m.Shutdown():
                self.request_stop()
            case m.StepSaved(turn=turn):
                if self.turn_ctx is not None and self.turn_ctx.turn == turn:
                    self.turn_ctx.steps.saved(msg)
            case m.MemoryHigh():
                gc.collect()
            case m.Reconfigure(settings=raw):
                self.booted.reconfigure(_settings_decoder.decode(raw))
            case m.BudgetUpdate(turn=turn, uid_spent=uid_spent):
                if self.turn_ctx is not None and self.turn_ctx.turn == turn:
                    self.turn_ctx.uid_spent = uid_spent
            case m.Boot():
                log.warning("ignoring a second Boot")

    async def run_turn(self, ctx: _Context, text: str, msg: m.Input | None = None) -> None:
        turn = ctx.turn
        if msg is not None and msg.trace:
            tracing.begin_turn(turn, self.send, msg.trace_content, msg.trace_id)
        try:
            result = await self.handler.handle(text, ctx)
        except asyncio.CancelledError:
            # The handler let the interrupt through: keep what streamed.
            result = TurnResult(reply="".join(ctx.streamed), record=None, interrupted=True)
        except TurnFailure as exc:
            record = _encode(exc.record) if exc.record is not None else b""
            self.send(m.Failed(turn=turn, reason=exc.reason, record=record))
            return
        except Exception as exc:
            # A handler's bug: the operator needs the traceback at the
            # default log level, the client the place it broke.
            log.error("turn %d failed", turn, exc_info=True)
            self.send(m.Failed(turn=turn, reason=failure_reason(exc)))
            return
        record = _encode(result.record) if result.record is not None else b""
        snapshot = b""
        if record:
            self.booted.turns_since_snapshot += 1
            if self.booted.turns_since_snapshot >= self.settings.agent.worker.snapshot_every_turns:
                snapshot = _encode(self.handler.snapshot())
                self.booted.turns_since_snapshot = 0
        self.send(
            m.Done(
                turn=turn, reply=result.reply, record=record,
                interrupted=result.interrupted, snapshot=snapshot,
                stop_reason=result.stop_reason, stop_detail=result.stop_detail,
                usage=result.usage,
            )
        )

    def beat(self) -> None:
        """Heartbeat, and arm the next."""
        self.send(m.Heartbeat())
        self._arm_beat()

    def _arm_beat(self) -> None:
        """The next heartbeat: a timer, not a task (an idle worker's one
        wakeup); slower while no turn runs (IDLE_HEARTBEAT_FACTOR)."""
        if self._beat_timer is not None:
            self._beat_timer.cancel()
        interval = self.settings.agent.worker.heartbeat_interval_secs
        if self.turn_task is None or self.turn_task.done():
            interval *= IDLE_HEARTBEAT_FACTOR
        self._beat_timer = asyncio.get_running_loop().call_later(interval, self.beat)

    def request_stop(self) -> None:
        if not self.stopping.done():
            self.stopping.set_result(None)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        # The daemon's stop sends SIGTERM to our whole process group (tools
        # included); for us it means the same as Shutdown: finish tidily.
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        self._arm_beat()
        try:
            await asyncio.wait(
                [self.stopping, self.conn.closed], return_when=asyncio.FIRST_COMPLETED
            )
            task = self.turn_task
            if task is not None and not task.done():
                task.cancel()
                # The handler tidies up and Done goes out before we leave.
                with contextlib.suppress(BaseException):
                    await task
        finally:
            if self._beat_timer is not None:
                self._beat_timer.cancel()
            with contextlib.suppress(Exception):
                await self.handler.aclose()


def failure_reason(exc: BaseException) -> str:
    """`KeyError: 'missing' (at handler.py:12 in lookup)`: the exception and
    its last frame, the line that raised, for the client's message."""
    reason = f"{type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        reason += f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return reason


def _warm_up() -> None:
    """Walk the boot path once while a spare waits for its Boot.

    Right after fork every page is shared with the zygote, and the first
    write to each (a reference count, an allocator's free list) costs a
    copy-on-write fault.  A spare worker waits for its Boot; taking those
    faults now, on the path Boot will take up to Ready, moves them out of
    the time a client waits for its session.  Only that path: what an idle
    worker never touches stays shared."""
    _decoder.decode(_encode(m.Boot(session="", handler="", settings=b"", workspace="")))
    settings = _settings_decoder.decode(_encode(SessionSettings()))
    init = HandlerInit(session="warm-up", settings=settings, workspace=Path("."))
    load_factory("echo")(init).restore(None, [_decode_any(_encode(1))])
    _frames.encode(m.Ready(pid=0))


def _confine(settings: SessionSettings, uid: int | None, gid: int | None) -> str:
    """Resource limits, an IPC namespace and the user to run as, before any
    handler code runs; tools inherit them.  Returns '' when this worker has
    an IPC namespace of its own (what SysV IPC its handler and tools make
    goes with the session), else why not."""
    # While still root (CAP_SYS_ADMIN: a root daemon, the shipped unit).
    # An unprivileged worker's tool host makes one with a user namespace.
    own_ipc = unshare_ipc() if os.geteuid() == 0 else "the worker is not root"
    limits = settings.agent.limits
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core dumps of session memory
    # RLIMIT_NPROC counts every process of a user: set here only when the
    # session has a uid of its own (else the tool host sets it inside the
    # sandbox's user namespace, or the sweep counts).
    own_uid = uid is not None and os.geteuid() == 0
    if limits.max_processes is not None and own_uid:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
    if limits.max_file_size_mb is not None:
        size = limits.max_file_size_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    # Hard too: a tool may not raise it back to the daemon's (raised) limit;
    # never above the hard limit we got (an unprivileged worker may not raise it).
    files = min(limits.max_open_files, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
    if uid is not None and os.geteuid() == 0:
        run_gid = gid if gid is not None else uid
        parent = os.getppid()
        os.setgroups([])
        os.setresgid(run_gid, run_gid, run_gid)
        os.setresuid(uid, uid, uid)
        # A change of credentials clears the parent-death signal: re-arm it,
        # then make sure the zygote did not die in between.
        set_pdeathsig(signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)
    # The zygote's non-dumpable flag came with fork, but a change of
    # credentials resets it: set it again so that our tools (same uid, their
    # own execve makes them dumpable) cannot read our environ or memory,
    # which hold the provider's key.
    set_dumpable(False)
    return own_ipc


class _Link:
    """The daemon's socket before the event loop exists: blocking reads of
    whole frames, the first byte with a timeout (the next heartbeat);
    blocking writes of small frames.

    Reads take exactly one frame, so nothing of a later frame is buffered
    here when the event loop's transport takes the socket over.  SIGTERM
    (the daemon's stop, to our process group) is noted; while we wait for
    a frame it also interrupts the wait (`StopWhileIdle`), so a stop is never left
    waiting for the next heartbeat."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.stop_requested = False
        self._waiting = False
        set_signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.stop_requested = True
        if self._waiting:
            raise StopWhileIdle

    def recv(self, timeout: float | None) -> m.ToWorker | BadMessage | None | bool:
        """The next message; False if none began within `timeout`; None when
        the daemon hung up, sent a frame over the limit, or we are stopped."""
        if self.stop_requested:
            return None
        sock = self.sock
        sock.settimeout(timeout)
        self._waiting = True
        try:
            head = sock.recv(_HEADER.size)
        except TimeoutError:
            return False
        except (StopWhileIdle, OSError):
            return None
        finally:
            self._waiting = False
        sock.settimeout(None)
        try:
            head += self._read(_HEADER.size - len(head))
            (length,) = _HEADER.unpack(head)
            if length > _MAX_FRAME:
                log.error("bad frame from the daemon: %s", FrameTooLarge(length, _MAX_FRAME))
                return None
            body = self._read(length)
        except (EOFError, OSError):
            return None
        try:
            msg: m.ToWorker = _decoder.decode(body)
        except Exception as exc:
            return BadMessage(f"{type(exc).__name__}: {exc}")
        return msg

    def _read(self, n: int) -> bytes:
        chunks = []
        while n > 0:
            chunk = self.sock.recv(min(n, _RECV_BYTES))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def send(self, msg: Any) -> bool:
        self.sock.settimeout(None)
        try:
            self.sock.sendall(_frames.encode(msg))
        except OSError:
            return False
        return True


def _next_boot(link: _Link) -> m.ToWorker | None:
    """The first message (the daemon sends Boot first); None if it hung up."""
    while True:
        msg = link.recv(None)
        if msg is None or msg is False:
            return None
        if isinstance(msg, BadMessage):
            log.error("bad frame from the daemon: %s", msg)
            continue
        assert msg is not True
        return msg


def _idle(link: _Link, booted: Booted) -> m.Input | None:
    """Wait for the first input without an event loop; None to exit.

    Most sessions are idle most of the time, and an idle worker needs no
    loop, no transport and no buffers: it blocks in one `recv` until the
    next heartbeat is due, answers pings, takes new settings, and leaves
    at Shutdown, SIGTERM or the daemon's hang-up.  The first Input is
    handed back, to run in the loop."""
    next_beat = time.monotonic() + _idle_interval(booted)
    while True:
        msg = link.recv(max(0.0, next_beat - time.monotonic()))
        match msg:
            case None:
                return None
            case False:
                if not link.send(m.Heartbeat()):
                    return None
                next_beat = time.monotonic() + _idle_interval(booted)
            case m.Input():
                # Beat now, once: the daemon's allowance for this turn runs
                # from its start, and building the loop comes out of it.
                link.send(m.Heartbeat())
                return msg
            case m.WorkerPing(nonce=nonce):
                link.send(m.WorkerPong(nonce=nonce))
            case m.Shutdown():
                return None
            case m.Reconfigure(settings=raw):
                booted.reconfigure(_settings_decoder.decode(raw))
                next_beat = min(next_beat, time.monotonic() + _idle_interval(booted))
            case m.MemoryHigh():
                gc.collect()
            case m.Boot():
                log.warning("ignoring a second Boot")
            case BadMessage():
                log.error("bad frame from the daemon: %s", msg)
            case _:
                pass  # an interrupt or an answer, with no turn to take it


def _idle_interval(booted: Booted) -> float:
    return booted.settings.agent.worker.heartbeat_interval_secs * IDLE_HEARTBEAT_FACTOR


async def _serve(link: _Link, booted: Booted, first: m.Input) -> int:
    """From the first input on: the event loop, its transport, the turns."""
    loop = asyncio.get_running_loop()
    worker: Worker | None = None
    early: list[m.ToWorker] = []

    def on_message(msg: m.ToWorker) -> None:
        if worker is not None:
            worker.on_message(msg)
        else:
            early.append(msg)

    def on_bad(exc: ProtocolError) -> None:
        log.error("bad frame from the daemon: %s", exc)

    sandbox.configure(booted.sandbox_plan)
    link.sock.setblocking(False)
    _, conn = await loop.create_unix_connection(
        lambda: FramedProtocol(_decoder, on_message=on_message, on_bad_message=on_bad,
                               max_frame_bytes=_MAX_FRAME),
        sock=link.sock,
    )
    worker = Worker(conn, booted)
    # The loop takes SIGTERM over from the idle phase's handler; one that
    # came in between was only noted.
    loop.add_signal_handler(signal.SIGTERM, worker.request_stop)
    if link.stop_requested:
        worker.request_stop()
    for msg in [first, *early]:
        worker.on_message(msg)
    await worker.serve()
    await _flush(conn)
    return 0


async def _flush(conn: FramedProtocol[Any]) -> None:
    transport = conn.transport
    if transport is None:
        return
    conn.flush()
    await conn.drain()
    transport.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.shield(conn.closed), 1.0)


def run_worker(sock: socket.socket, warm_up: bool = False) -> int:
    """Entry point in the forked child; returns the exit code.

    Boot (confinement, handler, restore) and Ready run before any event
    loop exists, then the worker waits for its first input in `_idle`; the
    loop is built only when that input comes (`_serve`).  An idle worker
    so touches, and copies from the zygote, only the pages of that path.
    Logging was set up once in the zygote (`session_worker.zygote`), not
    here: even a `basicConfig` that finds handlers in place runs enough
    Python to copy ~0.4 MiB of the zygote's pages into every worker."""
    setproctitle.setproctitle("sessiond: worker (spare)" if warm_up else "sessiond: worker")
    link = _Link(sock)
    if warm_up:
        _warm_up()
    first = _next_boot(link)
    if first is None:
        return 0  # the daemon went away before booting us
    if not isinstance(first, m.Boot):
        link.send(m.BootFailed(reason=f"expected boot, got {type(first).__name__}"))
        return EXIT_BOOT_FAILED
    name_process(first.session)
    try:
        booted = boot(first)
    except Exception as exc:
        log.debug("boot failed", exc_info=True)
        link.send(m.BootFailed(reason=f"{type(exc).__name__}: {exc}"))
        return EXIT_BOOT_FAILED
    uses_steps = bool(getattr(booted.handler, "uses_steps", False))
    if not link.send(m.Ready(pid=os.getpid(), sandbox=booted.sandbox_report, uses_steps=uses_steps)):
        return 0
    del first
    inputs = _idle(link, booted)
    if inputs is None:
        with contextlib.suppress(Exception):
            run_loop(booted.handler.aclose())
        return 0
    return run_loop(_serve(link, booted, inputs))
