"""The agent handler with timestamps, for `bench/agent.py --probe` only.

Imported inside a worker (`handler = "bench._agent_probe:ProbedAgent"`):
the worker's half of "what each millisecond of the first token goes to".
Each stamp is `time.perf_counter_ns()`, CLOCK_MONOTONIC on Linux, so it
compares with the bench client's and the FakeLLM's stamps across
processes.  The stamps of a turn go back to the bench as a `probe` notice
at the end of the turn, after the measured stream.

Stamps (the first of each kind in the turn):
* `input`: the worker's `Input` decoded (`Worker.on_message`);
* `handle`: `AgentHandler.handle()` entered (the turn task running);
* `request`: httpx about to write the request (its `request` event hook:
  body built, connection taken from the pool);
* `response`: the response's status and headers read (`response` hook);
* `read`: the first body bytes the SSE parser gets;
* `emit`: the first text handed to `ctx.emit` (its `Delta` frame is
  queued);
* `write`: the first write to the daemon's socket after `emit` (the
  frames queued in one pass of the loop go out in one write).

With `SESSIOND_BENCH_AGENT_PROFILE=PATH` in the worker's environment
(`bench/agent.py --profile PATH`), each measured turn also runs under
cProfile (CPU time) from `handle()` to the first `emit`, and the stats are dumped to
`PATH.<pid>` after the turn (the bench merges them).

Patching here, not in the product: the probe costs a few microseconds per
stamp and only the probe run pays them.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as the daemon's launcher: bench/ first on sys.path would shadow
    # the project's ipc package (bench/ipc.py).
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

import cProfile  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from ipc.connection import FramedProtocol  # noqa: E402
from session_worker.worker import main as worker_main  # noqa: E402
from session_worker.agent import _provider  # noqa: E402
from session_worker.agent._handler import AgentHandler  # noqa: E402
from session_worker.handler import HandlerInit, TurnContext, TurnResult  # noqa: E402
from ipc import messages as m  # noqa: E402

_ns = time.perf_counter_ns
_stamps: dict[str, int] = {}


def _stamp(name: str) -> None:
    if name not in _stamps:
        _stamps[name] = _ns()


_on_message = worker_main.Worker.on_message


def _timed_on_message(self: worker_main.Worker, msg: m.ToWorker) -> None:
    if isinstance(msg, m.Input):
        _stamps.clear()
        _stamp("input")
    _on_message(self, msg)


worker_main.Worker.on_message = _timed_on_message  # type: ignore[method-assign]


_flush = FramedProtocol._flush


def _timed_flush(self: FramedProtocol[Any]) -> None:
    if self._wbuf and "emit" in _stamps:
        _stamp("write")
    _flush(self)


FramedProtocol._flush = _timed_flush  # type: ignore[method-assign]


class _TimedParser(_provider.SSEParser):
    def feed(self, chunk: bytes) -> list[Any]:
        _stamp("read")
        return super().feed(chunk)


_provider.SSEParser = _TimedParser  # type: ignore[misc]


async def _on_request(_: httpx.Request) -> None:
    _stamp("request")


async def _on_response(_: httpx.Response) -> None:
    _stamp("response")


_PROFILE = os.environ.get("SESSIOND_BENCH_AGENT_PROFILE")


class ProbedAgent(AgentHandler):
    def __init__(self, init: HandlerInit) -> None:
        super().__init__(init)
        # CPU time of this thread, not wall time: on a busy machine the wall
        # time of a call includes the time the worker waited for a CPU.
        self._profile = cProfile.Profile(time.thread_time_ns, 1e-9) if _PROFILE else None
        self._turns = 0

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        _stamp("handle")
        self._turns += 1
        # The first turn is the bench's warm-up call: not profiled.
        profile = self._profile if self._turns > 1 else None
        if profile is not None:
            profile.enable()
        client = self._provider._client
        client.event_hooks = {"request": [_on_request], "response": [_on_response]}
        emit = ctx.emit

        def timed_emit(piece: str) -> None:
            if profile is not None and "emit" not in _stamps:
                profile.disable()
            _stamp("emit")
            emit(piece)

        ctx.emit = timed_emit  # type: ignore[method-assign]
        try:
            return await super().handle(text, ctx)
        finally:
            ctx.notice("probe", dict(_stamps))
            if profile is not None:
                profile.disable()
                profile.dump_stats(f"{_PROFILE}.{os.getpid()}")


# -- the daemon's half: `python bench/_agent_probe.py run ...` -----------------
#
# Run as the daemon's launcher (`bench/agent.py --probe`), with
# SESSIOND_BENCH_AGENT_PROBE_DAEMON=FILE: for the first `Delta` of each
# turn, one JSON line with `read` (the daemon read the worker's frames),
# `handled` (its dispatch of the Delta: the TextDelta frame is queued) and
# `written` (the next write to another connection: the client's).


def _probe_daemon(path: str) -> None:
    import json

    from supervisor.core.workers import WorkerOwner

    out = open(path, "a", buffering=1)  # noqa: SIM115 (open for the daemon's life)
    seen: set[tuple[str, int]] = set()
    pending: dict[str, Any] = {}
    received = FramedProtocol.data_received
    dispatch = WorkerOwner._on_message
    flush = FramedProtocol._flush

    def data_received(self: FramedProtocol[Any], data: bytes) -> None:
        self._probe_read = _ns()  # type: ignore[attr-defined]
        received(self, data)

    def on_message(self: WorkerOwner, session: Any, worker: Any, msg: Any) -> None:
        first = isinstance(msg, m.Delta) and (session.id, msg.turn) not in seen
        if first:
            seen.add((session.id, msg.turn))
            pending.update(read=getattr(worker.conn, "_probe_read", 0), handled=0, worker=worker.conn)
        dispatch(self, session, worker, msg)
        if first:
            pending["handled"] = _ns()

    def timed_flush(self: FramedProtocol[Any]) -> None:
        if pending and self is not pending["worker"] and self._wbuf:
            stamps = {"read": pending["read"], "handled": pending["handled"], "written": _ns()}
            pending.clear()
            out.write(json.dumps(stamps) + "\n")
        flush(self)

    FramedProtocol.data_received = data_received  # type: ignore[method-assign]
    WorkerOwner._on_message = on_message  # type: ignore[method-assign]
    FramedProtocol._flush = timed_flush  # type: ignore[method-assign]


if __name__ == "__main__":
    from supervisor.cli import main as _cli_main

    _probe_daemon(os.environ["SESSIOND_BENCH_AGENT_PROBE_DAEMON"])
    sys.exit(_cli_main(sys.argv[1:]))
