"""The handler interface: what runs inside a worker for one session.

A handler is plain Python that turns one input into a streamed reply.  It is
created once per worker process by a *factory* (`package.module:factory`, or
the built-in names `echo` and `agent`) and lives as long as the worker.  The
worker owns the event loop, the socket to the daemon and the heartbeat; the
handler only sees a `TurnContext`.

Durability contract (the daemon is the only writer of state):

* `handle()` returns a `TurnResult` whose `record` is any msgpack-able value
  describing what this turn added to the handler's state.  The daemon appends
  it to the session log before it tells the client the turn is done.
* `snapshot()` returns the handler's whole state; the worker sends one every
  `snapshot_every_turns` turns and the daemon replaces the log tail with it.
* `restore(state, records)` rebuilds the handler in a fresh worker from the
  last snapshot (or None) and the records committed after it, in order.
  Whatever `handle()` changed in memory must be reproducible from the record,
  or a restarted worker will differ from the one that crashed.

Interrupts arrive as cancellation of the `handle()` task.  A handler may catch
`asyncio.CancelledError`, tidy its state and return a `TurnResult` with
`interrupted=True` (the partial reply is kept); if it lets the cancellation
through, the worker commits the text streamed so far with a `None` record.

Failures: raise `TurnFailure(reason, record=...)` to fail the turn while still
committing what it changed; any other exception fails the turn with no record,
so the handler must leave its in-memory state as it was before the turn.

Durable steps (docs/agent.md, "Durable steps"): `await ctx.step(key, fn)`
runs `fn` once and returns its msgpack-able result once the daemon has
journaled it durably (an `idempotent` step, e.g. an LLM request, does not
wait; every step that is not waits, before it runs, for the steps that had
ended before it started).  Steps may run at the same time (`asyncio.gather`):
a step is known by the order in which the turn started it and its key,
never by the order it ended.  If the worker dies during the turn (a crash,
the memory cap, a node lost, the daemon killed) and the session's
`retry_aborted_turn` is on (the default), the restarted worker runs the same
turn again from `handle()`: each `ctx.step` already journaled returns its
result without running `fn`; the code between steps runs again, so it must
be deterministic and free of side effects, and start the same steps in the
same order.  The steps that were in flight when the worker died run again,
unless `interrupted=` gives their result instead.
A handler whose class sets `uses_steps = True` has such a turn resumed even
if it died before its first step; one that marks no step and does not say
so has it fail with `TurnFailed`, as before.
"""

from __future__ import annotations

import abc
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ipc.budget import Standing
from ipc.settings import SessionSettings
# Re-exported: a handler's author raises them as this interface's (docs/agent.md).
from session_worker.errors import CommandRefused, SpawnError, StepError, TurnFailure
from session_worker.worker.steps import Interruption

__all__ = [
    "CommandRefused",
    "CommandResult",
    "Handler",
    "Interruption",
    "SpawnError",
    "StepError",
    "HandlerFactory",
    "HandlerInit",
    "TurnContext",
    "TurnFailure",
    "TurnResult",
    "import_object",
]


@dataclass(slots=True)
class TurnResult:
    reply: str
    record: Any = None
    interrupted: bool = False
    # ipc.contract.StopReason: why the last model reply ended early ("" = it did not).
    stop_reason: str = ""
    # The provider's own word for it ("length", "content_filter", "max_tokens"...).
    stop_detail: str = ""
    # Tokens spent by the turn: prompt_tokens, completion_tokens, reasoning_tokens.
    usage: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class CommandResult:
    """What `ctx.run` gives back: the command's output (stdout and stderr
    merged, cut in the middle past `[tools] output_limit_bytes`), its exit
    code (None when it was killed: the timeout, a signal, its sandbox
    lost), and the status line the agent's `bash` tool adds for the model.
    `str()` of it is the text `bash` gives the model."""

    output: str
    exit_code: int | None
    status: str
    text: str  # the output, then the status line

    def __str__(self) -> str:
        return self.text


@dataclass(slots=True, frozen=True)
class HandlerInit:
    """What a factory gets when the worker starts."""

    session: str
    settings: SessionSettings
    workspace: Path
    # 0 for a top-level session, parent's depth + 1 for a sub-agent.
    depth: int = 0


class TurnContext(abc.ABC):
    """The handler's view of the running turn; implemented by the worker."""

    session: str
    turn: int
    settings: SessionSettings
    workspace: Path
    depth: int
    # Why this turn is a resumed one (its worker died during it); None: a first run.
    resumed: Interruption | None = None

    async def step(self, key: str, fn: Callable[[], Any], *, kind: str = "",
                   interrupted: Callable[[Interruption], Any] | None = None, idempotent: bool = False,
                   wait: bool = True) -> Any:
        """Run `fn` (sync or async) once as a durable step of this turn and
        return its msgpack-able result once it is journaled durably; on a
        resumed turn, the journaled result without running `fn` (see the
        module's docstring).  Every step that had ended before this one
        started is durable before `fn` runs (and, when another step may be
        in flight, this step's start).  `interrupted(why)`: the result of
        a step that was in flight when the worker died, instead of running
        `fn` again.  `idempotent` (`fn` may run again without harm: an LLM
        request) waits for neither; `wait=False` returns before the result
        is durable (the next step that is not idempotent waits for it).
        `key` names the step (checked on replay); `kind` is for operators
        ("llm", "tool"...).  Not abstract: a context that cannot journal (a
        test's) just runs `fn`."""
        value = fn()
        if inspect.isawaitable(value):
            value = await value
        return value

    @abc.abstractmethod
    def emit(self, text: str) -> None:
        """Stream a piece of the reply to attached clients (a TextDelta)."""

    @abc.abstractmethod
    def notice(self, kind: str, data: dict[str, Any]) -> None:
        """Tell attached clients something that is not reply text
        (a tool call starting or finishing, a compaction)."""

    def reasoning(self, text: str) -> None:
        """Stream a piece of the model's reasoning (not reply text) to the
        clients that asked for it.  Not abstract: a context that cannot
        deliver it drops it."""

    def flush(self) -> None:
        """Send what was emitted so far now.  The worker writes a turn's
        frames together at the loop's next pass, which comes only when the
        handler next waits: a handler with more work in hand (an LLM
        reply's rest, already read) calls this after the text a user is
        waiting for.  Not abstract: a context that sends at once has
        nothing to do."""

    @abc.abstractmethod
    def limit_exceeded(self, kind: str, value: float, limit: float) -> None:
        """Report that a limit of the loop (e.g. kind="turns") was reached."""

    def budget_spent(self) -> tuple[Mapping[str, int], Mapping[str, int]]:
        """What counts against the `[agent.budget]` ceilings besides this
        turn's own calls (ipc.budget): the session's turns before this one,
        and the other sessions of its uid, as the daemon counts them.  Not
        abstract: a context that cannot know says nothing was spent."""
        return {}, {}

    def report_spend(self, spend: dict[str, int]) -> None:
        """What this turn spent so far, after each LLM call: cumulative, in
        ipc.budget's keys (the usage's token keys and `llm_calls`).  The
        daemon counts it at once against the uid's ceilings (its other
        sessions may be running), and into the session's if the turn ends
        without a commit.  Not abstract: a context may drop it."""

    async def begin_llm_call(self) -> Standing | None:
        """Call right before an LLM request goes out: the daemon checks the
        `[agent.budget]` ceilings against its own figures and counts the
        call durably first (so a worker killed during the call has paid
        for it).  None: make the call; a `Standing`: the ceiling that
        leaves no room for it (do not make it).  Raises `TurnFailure`
        when the call could not be counted.  Not abstract: a context
        without a daemon counts nothing and says go."""
        return None

    def budget_exceeded(self, ceiling: str, used: int, limit: int, unit: str) -> None:
        """Report that a budget ceiling (its config key) stopped the turn."""
        self.limit_exceeded("budget", used, limit)

    @abc.abstractmethod
    async def ask_permission(self, tool: str, arguments: dict[str, Any]) -> bool:
        """Ask attached clients to approve a tool call; False when denied or
        when no answer arrives before the turn times out."""

    async def run(self, command: str, *, timeout_secs: float | None = None) -> CommandResult:
        """Run `command` with `/bin/bash -c` in the session's workspace, as
        the agent's `bash` tool runs it: in the session's sandbox (its tool
        host: its uid, namespaces, Landlock, seccomp, network policy and
        process limit), under the same `[[permissions]]` rules (tool
        `bash`, matched on the command; `ask` waits for a client's answer),
        killed past `timeout_secs` (at most `[tools] bash_timeout_secs`),
        its output capped.  Raises `CommandRefused` (with the reason) when
        it does not run.  A tool of a framework that shells out calls this
        rather than `subprocess`: its own code runs in the worker, outside
        the sandbox (docs/agent.md)."""
        # The agent's bash and its permission rules: one implementation for both.
        from session_worker.agent._bash import run_captured
        from session_worker.agent._errors import ToolError
        from session_worker.agent._permissions import decide

        tools = self.settings.tools
        if "bash" not in tools.enabled:
            raise CommandRefused('commands are not enabled for this session ([tools] enabled has no "bash")')
        action = decide(self.settings.permissions, "bash", command)
        if action == "deny":
            raise CommandRefused("permission denied: a rule forbids this bash command")
        if action == "ask" and not await self.ask_permission("bash", {"command": command}):
            raise CommandRefused("permission denied: the user did not approve this bash command")
        cap = tools.bash_timeout_secs
        timeout = cap if timeout_secs is None else min(max(float(timeout_secs), 0.001), cap)
        try:
            ran = await run_captured(command, self.workspace.resolve(), timeout, tools.output_limit_bytes)
        except ToolError as exc:  # no sandbox to run it in
            raise CommandRefused(str(exc)) from None
        return CommandResult(ran.output, ran.exit_code, ran.status, ran.text)

    @abc.abstractmethod
    async def spawn_agent(self, task: str, handler: str | None = None) -> str:
        """Have the daemon run a child session on `task`; returns its final
        reply.  Raises `SpawnError` with a readable reason when the daemon
        refuses (a sub-agent limit) or the child fails."""


@runtime_checkable
class Handler(Protocol):
    def restore(self, state: Any, records: list[Any]) -> None: ...

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult: ...

    def snapshot(self) -> Any: ...

    async def aclose(self) -> None: ...


HandlerFactory = Callable[[HandlerInit], Handler]


def import_object(spec: str, what: str, error: type[Exception] = ImportError) -> Any:
    """Resolve `package.module:attr` to a callable; `error(readable reason)`
    when it cannot be (used for handlers and for custom tools alike)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise error(f"{what} {spec!r}: use 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise error(f"{what} {spec!r}: cannot import {module_name}: {exc}") from exc
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise error(f"{what} {spec!r}: {module_name} has no function {attr!r}")
    return obj
