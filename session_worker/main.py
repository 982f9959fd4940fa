"""The worker: one process, one session.  Runs in a child forked by the zygote.

The zygote calls `run_worker(sock)` right after fork; nothing here runs in the
daemon.  The worker makes its own event loop (a loop must never cross a fork),
reads `Boot`, builds the handler, restores it from what the daemon sent, says
`Ready`, then serves inputs one at a time.  It never writes state: each turn
ends with a `Done` carrying the handler's record, which the daemon appends.

Liveness: a heartbeat from this loop every `heartbeat_interval_secs`.  A
handler stuck in a busy loop or a C call starves the loop, the heartbeats
stop, and the daemon kills the worker; that is the point of sending them from
here and not from a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

import msgspec
import setproctitle

from ipc import messages as m
from ipc.contract import EXIT_BOOT_FAILED, IDLE_HEARTBEAT_FACTOR
from ipc.connection import FramedProtocol
from ipc.errors import ProtocolError
from ipc.loop import run as run_loop
from ipc.settings import SessionSettings
from session_worker import sandbox
from session_worker.factories import load_factory
from session_worker.handler import (
    Handler,
    HandlerInit,
    SpawnError,
    TurnContext,
    TurnFailure,
    TurnResult,
)

__all__ = ["run_worker"]

log = logging.getLogger("sessiond.worker")


_decoder = msgspec.msgpack.Decoder(m.ToWorker)
_settings_decoder = msgspec.msgpack.Decoder(SessionSettings)
_encode = msgspec.msgpack.Encoder().encode
_decode_any = msgspec.msgpack.Decoder().decode


class _Context(TurnContext):
    def __init__(self, worker: Worker, turn: int) -> None:
        self._worker = worker
        self.session = worker.session
        self.turn = turn
        self.settings = worker.settings
        self.workspace = worker.workspace
        self.depth = worker.depth
        self.streamed: list[str] = []

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
            m.SpawnAgent(turn=self.turn, request_id=request_id, task=task, handler=handler)
        )
        result = await fut
        assert isinstance(result, m.SpawnResult)
        if not result.ok:
            raise SpawnError(result.reason)
        return result.reply


class Worker:
    def __init__(self, conn: FramedProtocol[m.ToWorker], boot: m.Boot) -> None:
        self.conn = conn
        self.session = boot.session
        self.settings = _settings_decoder.decode(boot.settings)
        self.workspace = Path(boot.workspace)
        self.depth = boot.depth
        self.handler: Handler | None = None
        self.turn_task: asyncio.Task[None] | None = None
        self.turns_since_snapshot = len(boot.records)
        self._requests: dict[str, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self.stopping = asyncio.get_running_loop().create_future()
        self.sandbox_report: dict[str, Any] = {}
        self._beat_timer: asyncio.TimerHandle | None = None

    def send(self, msg: Any) -> None:
        self.conn.send(msg)

    def new_request(self) -> tuple[str, asyncio.Future[Any]]:
        request_id = f"{os.getpid()}-{next(self._ids)}"
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._requests[request_id] = fut
        fut.add_done_callback(lambda _: self._requests.pop(request_id, None))
        return request_id, fut

    def boot(self, boot: m.Boot) -> None:
        _confine(self.settings, boot.run_as_uid, boot.run_as_gid)
        self.workspace.mkdir(parents=True, exist_ok=True, mode=0o700)
        plan = sandbox.plan_for(boot.sandbox, self.settings, self.workspace.resolve(),
                                per_session_uid=boot.run_as_uid is not None)
        sandbox.configure(plan)
        self.sandbox_report = plan.describe() if plan is not None else {}
        factory = load_factory(boot.handler)
        init = HandlerInit(
            session=self.session, settings=self.settings, workspace=self.workspace,
            depth=self.depth,
        )
        handler = factory(init)
        state = _decode_any(boot.snapshot) if boot.snapshot else None
        handler.restore(state, [_decode_any(r) for r in boot.records])
        self.handler = handler

    # Runs from data_received: keep it to dispatch, no awaiting.
    def on_message(self, msg: m.ToWorker) -> None:
        match msg:
            case m.Input(turn=turn, text=text):
                if self.turn_task is not None and not self.turn_task.done():
                    self.send(m.Failed(turn=turn, reason="a turn is already running"))
                    return
                self.turn_task = asyncio.get_running_loop().create_task(self.run_turn(turn, text))
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
            case m.PermissionAnswer(request_id=rid) | m.SpawnResult(request_id=rid):
                fut = self._requests.get(rid)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            case m.Shutdown():
                self.request_stop()
            case m.MemoryHigh():
                import gc

                gc.collect()
            case m.Reconfigure(settings=raw):
                self.reconfigure(_settings_decoder.decode(raw))
            case m.Boot():
                log.warning("ignoring a second Boot")

    def reconfigure(self, settings: SessionSettings) -> None:
        """The operator reloaded the config: new rules and limits from the
        next tool call (handlers that implement `reconfigure`) and the next
        heartbeat on."""
        self.settings = settings
        if self.handler is not None:
            hook = getattr(self.handler, "reconfigure", None)
            if callable(hook):
                try:
                    hook(settings)
                except Exception:
                    log.exception("the handler could not take the new settings")

    async def run_turn(self, turn: int, text: str) -> None:
        assert self.handler is not None
        ctx = _Context(self, turn)
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
            self.turns_since_snapshot += 1
            if self.turns_since_snapshot >= self.settings.agent.worker.snapshot_every_turns:
                snapshot = _encode(self.handler.snapshot())
                self.turns_since_snapshot = 0
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
        self.beat()
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
            if self.handler is not None:
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


def _warm_up(conn: FramedProtocol[Any]) -> None:
    """Walk the boot path once while a spare waits for its Boot.

    Right after fork every page is shared with the zygote, and the first
    write to each (a reference count, an allocator's free list) costs a
    copy-on-write fault.  A spare worker waits for its Boot; taking those
    faults now, on the path Boot will take, moves them out of the time a
    client waits for its session."""
    settings = _settings_decoder.decode(_encode(SessionSettings()))
    init = HandlerInit(session="warm-up", settings=settings, workspace=Path("."))
    handler = load_factory("echo")(init)
    handler.restore(None, [_decode_any(_encode(1))])
    conn.encode(m.Ready(pid=0))
    conn.encode(m.Done(turn=1, reply="", record=_encode(1)))
    _decoder.decode(_encode(m.Boot(session="", handler="", settings=b"", workspace="")))


def _confine(settings: SessionSettings, uid: int | None, gid: int | None) -> None:
    """Resource limits and the user to run as, before any handler code runs;
    tools inherit both."""
    import resource

    from ipc.linux import set_dumpable, set_pdeathsig

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


async def _main(sock: socket.socket, warm_up: bool) -> int:
    loop = asyncio.get_running_loop()
    first: asyncio.Future[m.ToWorker] = loop.create_future()
    worker: Worker | None = None

    def on_message(msg: m.ToWorker) -> None:
        if worker is not None:
            worker.on_message(msg)
        elif not first.done():
            first.set_result(msg)

    def on_bad(exc: ProtocolError) -> None:
        log.error("bad frame from the daemon: %s", exc)

    _, conn = await loop.create_unix_connection(
        lambda: FramedProtocol(
            _decoder, on_message=on_message, on_bad_message=on_bad,
            max_frame_bytes=1 << 30,
        ),
        sock=sock,
    )
    if warm_up:
        _warm_up(conn)
    waiting: list[asyncio.Future[Any]] = [first, conn.closed]
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if not first.done():
        return 0  # the daemon went away before booting us
    boot = first.result()
    if not isinstance(boot, m.Boot):
        conn.send(m.BootFailed(reason=f"expected boot, got {type(boot).__name__}"))
        return EXIT_BOOT_FAILED
    _name_process(boot.session)
    try:
        worker = Worker(conn, boot)
        worker.boot(boot)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        log.debug("boot failed:\n%s", traceback.format_exc())
        conn.send(m.BootFailed(reason=reason))
        await _flush(conn)
        return EXIT_BOOT_FAILED
    conn.send(m.Ready(pid=os.getpid(), sandbox=worker.sandbox_report))
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


class _SessionTag(logging.Filter):
    """Puts `session=ID` at the start of every line this worker logs.

    A filter on the handlers, not a format: the worker keeps the handler it
    inherited from the daemon through the zygote (journal priorities or
    timestamps, as the daemon chose) and only adds the field, whichever
    logger the record comes from (ours, asyncio, a handler's own)."""

    def __init__(self, session: str) -> None:
        super().__init__()
        self.prefix = f"session={session} "

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "session_tagged", False):
            record.msg = self.prefix + str(record.msg)
            record.session_tagged = True
        return True


def _name_process(session: str) -> None:
    """`ps` shows `sessiond: worker ID`, and the log lines carry the id."""
    setproctitle.setproctitle(f"sessiond: worker {session}")
    tag = _SessionTag(session)
    for handler in logging.getLogger().handlers:
        handler.addFilter(tag)


def run_worker(sock: socket.socket, warm_up: bool = False) -> int:
    """Entry point in the forked child; returns the exit code."""
    # No-op when the zygote was forked from the daemon (its handler came
    # along); a zygote started by exec has none.
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format=f"sessiond-worker[{os.getpid()}]: %(levelname)s: %(message)s",
    )
    setproctitle.setproctitle("sessiond: worker (spare)" if warm_up else "sessiond: worker")
    sock.setblocking(False)
    return run_loop(_main(sock, warm_up))
