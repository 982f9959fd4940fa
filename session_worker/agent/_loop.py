"""One turn of the agent loop: input → (compact?) → LLM → tools → … → reply.

Runs in the worker's event loop, inside the `handle()` task.  The turn keeps
just enough bookkeeping to be cut at any await: the text of the response
being streamed and the tool calls not yet answered.  On cancellation
(interrupt) it journals the partial text and an "interrupted" result for each
unanswered call, so the history stays a valid provider request: every
assistant tool call is followed by one tool message per call id.

Every LLM response and every tool result is a durable step (`ctx.step`, one
call site each: `_complete`, `_summarize`, `_tool_step`).  Consecutive calls
of one response to tools in `[tools] parallel` run at once (`_run_batch`:
their steps start in the order of the calls, overlap, and are answered in
that order).  A turn resumed
after its worker died runs this same code again: the journaled steps come
back without a request or a tool run, which rebuilds the history and the
reply; everything between steps follows from them.  The one step that was
running is redone if it is an LLM call; a tool is answered as killed
(`_killed_result`) unless it is in `[tools] rerun_after_crash`.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from session_worker.agent import _traced
from session_worker.agent._compaction import (
    RequestSizes,
    cut_index,
    estimate_tokens,
    summary_request,
    system_content,
)
from session_worker.agent import _budget
from session_worker.agent._errors import BudgetReached, ProviderError, ToolError
from session_worker.agent._history import History, Journal, well_formed
from session_worker.agent._permissions import decide
from session_worker.agent._provider import OnText, Provider
from session_worker.agent._stream import Completion, ToolCall, stop_reason_of, usage_counts
from session_worker.agent._tools import ToolEnv, ToolRegistry, check_arguments
from session_worker.errors import TurnFailure
from session_worker.handler import Interruption, TurnContext, TurnResult
from ipc.contract import LimitKind, StopReason
from ipc.settings import SessionSettings

__all__ = ["Turn"]

_INTERRUPTED_TEXT = "\n\n[interrupted by the user]"
_INTERRUPTED_RESULT = "error: interrupted by the user before this tool call finished; it may have partly run."
_NO_NAME = "missing_tool_name"
_FAILED_TEXT = "[no reply: this request failed ({reason})]"
_CUT_TEXT = "\n\n[the response was cut off: {reason}]"
# How much of a tool's output goes into the `tool_result` notice; the whole
# output is in the history.
_NOTICE_OUTPUT_CHARS = 2000


class Turn:
    def __init__(
        self,
        *,
        settings: SessionSettings,
        provider: Provider,
        tools: ToolRegistry,
        history: History,
        workspace: Path,
        ctx: TurnContext,
        sizes: RequestSizes | None = None,
    ) -> None:
        self._settings = settings
        # The history's JSON sizes, kept by the handler across turns.
        self._sizes = sizes if sizes is not None else RequestSizes()
        self._provider = provider
        self._tools = tools
        self._history = history
        self._journal = Journal(history)
        self._ctx = ctx
        self._env = ToolEnv(workspace, settings, ctx)
        self._reply: list[str] = []
        # Text of the response being streamed; None when not streaming.
        self._partial: list[str] | None = None
        self._separate = False
        # Calls of the last journaled assistant message still without a result.
        self._unanswered: list[ToolCall] = []
        # Provider retries are not waited for past the turn's timeout (the
        # daemon would kill the worker mid-wait and the error be lost).
        self._deadline = time.monotonic() + settings.agent.turn_timeout_secs
        # Tokens and calls of this turn's LLM calls (compaction included),
        # live or replayed from their steps, for its usage and its
        # [agent.budget] check.
        self._spend = _budget.TurnSpend()
        # LLM calls asked for so far (their steps' keys).
        self._calls = 0
        self._asking = asyncio.Lock()

    def reconfigure(self, settings: SessionSettings, tools: ToolRegistry) -> None:
        """New rules and limits for the rest of this turn (the provider in
        use is kept until the turn ends)."""
        self._settings = settings
        self._tools = tools
        self._env = ToolEnv(self._env.workspace, settings, self._ctx)

    async def run(self, text: str) -> TurnResult:
        self._journal.append({"role": "user", "content": text})
        try:
            result = await self._loop()
        except asyncio.CancelledError:
            result = self._interrupted()
        except BudgetReached as exc:
            result = self._stop_at_budget(exc)
        except ProviderError as exc:
            reason = self._provider.redact(str(exc))
            self._keep_partial(_CUT_TEXT.format(reason="provider error"))
            self._close_failed_turn(reason)
            raise TurnFailure(
                f"LLM provider error: {reason}", record=self._journal.record(failed=True)
            ) from exc
        except BaseException:
            # No record will be committed: leave the state as it was.
            self._journal.rollback()
            raise
        result.usage = self._spend.tokens()
        return result

    # -- the loop -------------------------------------------------------------

    async def _loop(self) -> TurnResult:
        n = 0
        while True:
            n += 1
            await self._maybe_compact()
            completion = await self._complete()
            stop = stop_reason_of(completion.finish_reason)
            if stop is not StopReason.COMPLETE:
                return self._stop_early(completion, stop)
            calls = completion.tool_calls
            self._journal.append(_assistant_message(completion))
            self._unanswered = list(calls)
            if not calls:
                return TurnResult("".join(self._reply), self._journal.record())
            # Read each pass: a reload may lower it during the turn.
            if n >= self._settings.agent.max_turns:
                return self._stop_at_turn_limit(n, calls)
            await self._run_calls(calls)

    def _stop_early(self, completion: Completion, stop: StopReason) -> TurnResult:
        """The reply was truncated, filtered or refused: the turn ends here,
        and no tool call of it runs (a truncated call's arguments may be cut
        mid-JSON, and a filtered reply is not the model's whole intent)."""
        detail = completion.finish_reason or ""
        message: dict[str, Any] = {
            "role": "assistant", "content": completion.text, **completion.history_fields,
        }
        if completion.tool_calls:
            names = ", ".join(c.name or "?" for c in completion.tool_calls)
            self._ctx.notice(
                "tool_calls_not_run",
                {
                    "reason": str(stop),
                    "finish_reason": detail,
                    "calls": [{"id": c.id, "name": c.name} for c in completion.tool_calls],
                },
            )
            # Told to the model too, so that the next input does not find
            # it believing those calls ran.
            message["content"] = (
                completion.text
                + f"\n\n[tool call(s) {names} not run: the reply ended with "
                f"finish_reason {detail!r} before they were complete]"
            ).lstrip()
        self._journal.append(message)
        return TurnResult(
            "".join(self._reply),
            self._journal.record(stop=str(stop)),
            stop_reason=str(stop),
            stop_detail=detail,
        )

    def _stop_at_turn_limit(self, n: int, calls: list[ToolCall]) -> TurnResult:
        limit = self._settings.agent.max_turns
        for call in calls:
            self._answer(
                call,
                False,
                f"error: not run: this input reached the limit of {limit} model calls "
                "(agent.max_turns).",
            )
        self._ctx.limit_exceeded(LimitKind.TURNS, n, limit)
        note = (
            f"[Stopped: reached the limit of {limit} model calls for one input "
            f"(agent.max_turns); {len(calls)} requested tool call(s) were not run. "
            "Send another message to continue.]"
        )
        self._emit(("\n\n" if self._reply else "") + note)
        self._journal.append({"role": "assistant", "content": note})
        return TurnResult("".join(self._reply), self._journal.record(limit="turns"))

    def _stop_at_budget(self, exc: BudgetReached) -> TurnResult:
        """A ceiling of [agent.budget] left no room for the next LLM call:
        the turn ends here (every tool call of the last reply has its result,
        so the history stays a valid request)."""
        self._partial = None  # (the check comes before the request: nothing streamed)
        self._ctx.budget_exceeded(exc.ceiling, exc.used, exc.limit, exc.unit)
        note = _budget.stop_note(exc)
        self._emit(("\n\n" if self._reply else "") + note)
        self._journal.append({"role": "assistant", "content": note})
        return TurnResult("".join(self._reply), self._journal.record(limit="budget"))

    async def _complete(self) -> Completion:
        said = "".join(self._reply)
        self._separate = bool(said) and not said.endswith("\n")
        streamed = False

        async def call() -> dict[str, Any]:
            nonlocal streamed
            # Only a call made now is checked: a journaled one was paid for.
            await _budget.begin_call(self._settings.agent.budget, self._ctx, self._spend)
            streamed = True
            self._partial = []
            completion = await self._provider.stream_chat(
                self._request_messages(),
                self._tools.schemas(),
                self._on_text,
                self._on_retry,
                self._deadline,
                self._on_reasoning,
                self._ctx.flush,
            )
            return _completion_data(completion)

        self._calls += 1
        data = await self._ctx.step(f"llm:{self._calls}", call, kind="llm", idempotent=True)
        self._partial = None  # the response is whole: streamed now, or journaled before
        completion = _completion_of(data)
        if not streamed:
            # Journaled before the worker died: its text was streamed then, and
            # is the reply's all the same.
            if self._separate and completion.text:
                self._separate = False
                self._reply.append("\n\n")
            if completion.text:
                self._reply.append(completion.text)
        self._spent(completion.usage)
        return completion

    def _spent(self, usage: dict[str, Any] | None) -> None:
        """One LLM call's tokens, made now or replayed from its step: the
        turn's count, reported to the daemon (which keeps the larger
        figure, so a replay is never counted twice)."""
        self._spend.add(usage_counts(usage))
        self._ctx.report_spend(dict(self._spend.counts))

    def _request_messages(self) -> list[dict[str, Any]]:
        system = system_content(self._settings.agent.system_prompt, self._history.summary)
        return [{"role": "system", "content": system}, *well_formed(self._history.messages)]

    def _on_text(self, text: str) -> None:
        if self._separate:
            self._separate = False
            self._emit("\n\n")
        if self._partial is not None:
            self._partial.append(text)
        self._emit(text)

    def _on_reasoning(self, text: str) -> None:
        # Not reply text: clients get it as its own event kind, to show or hide.
        self._ctx.reasoning(text)

    def _emit(self, text: str) -> None:
        self._reply.append(text)
        self._ctx.emit(text)

    def _on_retry(self, info: dict[str, Any]) -> None:
        self._ctx.notice("provider_retry", info)

    # -- tools ----------------------------------------------------------------

    async def _run_calls(self, calls: list[ToolCall]) -> None:
        limit = self._settings.agent.max_tool_calls_per_turn
        if len(calls) > limit:
            self._ctx.limit_exceeded(LimitKind.TOOL_CALLS, len(calls), limit)
        for batch in _batches(calls[:limit], self._settings.tools.parallel):
            await self._run_batch(batch)
        for call in calls[limit:]:
            self._answer(
                call,
                False,
                f"error: not run: at most {limit} tool calls are run per response "
                "(agent.max_tool_calls_per_turn); request it again in your next response.",
            )

    async def _run_batch(self, batch: list[ToolCall]) -> None:
        """Run the calls of `batch` at the same time (one step each, started
        in the order of the calls) and answer them in that order."""
        if len(batch) == 1:
            self._answer(batch[0], *await self._tool_step(batch[0]))
            return
        runs = [asyncio.ensure_future(self._tool_step(call)) for call in batch]
        try:
            await asyncio.gather(*runs)
        except asyncio.CancelledError:
            # Interrupted: what finished keeps its result; in order.
            for call, run in zip(batch, runs):
                if run.done() and not run.cancelled() and run.exception() is None:
                    self._answer(call, *run.result())
                else:
                    self._answer(call, False, _INTERRUPTED_RESULT)
            raise
        except BaseException:
            for run in runs:
                run.cancel()
            raise
        for call, run in zip(batch, runs):
            self._answer(call, *run.result())

    async def _tool_step(self, call: ToolCall) -> tuple[bool, str, bool]:
        """The call as a durable step: run once, its result journaled.  A
        tool safe to run again (`rerun_after_crash`: read-only) is run again
        if the worker died during it, and needs nothing durable before it
        runs; any other waits for the response that asked for it.  The
        third value: the result is the journal's, of a run before the
        worker died (a resumed turn rebuilding itself), not a new one."""
        rerun = call.name in self._settings.tools.rerun_after_crash
        fresh = False

        def run() -> Any:
            nonlocal fresh
            fresh = True
            return _traced.tool_call(call.id, call.name, self._run_one(call), call.arguments)

        def killed(why: Interruption) -> list[Any]:
            nonlocal fresh
            fresh = True
            return _killed_result(why)

        # wait=False: the next LLM request overlaps this result's flush; the
        # next tool that acts still waits for it.
        result = await self._ctx.step(f"tool:{call.name}:{call.id}", run, kind="tool",
                                      interrupted=None if rerun else killed, idempotent=rerun, wait=False)
        return bool(result[0]), str(result[1]), not fresh

    async def _run_one(self, call: ToolCall) -> tuple[bool, str]:
        parsed = _parse_arguments(call.arguments)
        self._ctx.notice(
            "tool_call",
            {
                "id": call.id,
                "name": call.name,
                "arguments": parsed if isinstance(parsed, dict) else call.arguments,
            },
        )
        if not call.name:
            available = ", ".join(self._tools.names()) or "none"
            return False, (
                "error: this tool call has no function name, so nothing was run; "
                f"call again with one of: {available}"
            )
        tool = self._tools.get(call.name)
        if tool is None:
            available = ", ".join(self._tools.names()) or "none"
            return False, f"error: unknown tool {call.name!r}; available tools: {available}"
        if not isinstance(parsed, dict):
            return False, (
                f"error: the arguments are not a JSON object ({parsed}); "
                f"received: {call.arguments[:500]!r}"
            )
        # Models often send null for an optional argument they do not use.
        args = {key: value for key, value in parsed.items() if value is not None}
        problem = check_arguments(tool.parameters, args)
        if problem is not None:
            return False, f"error: {problem}"
        action = decide(self._settings.permissions, tool.name, tool.main_argument(args))
        if action == "deny":
            return False, f"error: permission denied: a rule forbids this {tool.name} call."
        if action == "ask" and not await self._ask(tool.name, args):
            return False, f"error: permission denied: the user did not approve this {tool.name} call."
        try:
            return True, await tool.run(args, self._env)
        except ToolError as exc:
            return False, f"error: {exc}"
        except Exception as exc:
            return False, f"error: tool {tool.name} failed: {type(exc).__name__}: {exc}"

    async def _ask(self, tool: str, args: dict[str, Any]) -> bool:
        # Calls run at once ask one at a time: a client answers one prompt.
        async with self._asking:
            return await self._ctx.ask_permission(tool, args)

    def _answer(self, call: ToolCall, ok: bool, output: str, replayed: bool = False) -> None:
        self._journal.tool_result(call.id, output, ok)
        self._unanswered = [c for c in self._unanswered if c is not call]
        preview = output[:_NOTICE_OUTPUT_CHARS]
        self._ctx.notice(
            "tool_result",
            {
                "id": call.id,
                "name": call.name,
                "ok": ok,
                "output": preview,
                "truncated": len(output) > len(preview),
                # A result its clients saw before the worker died: not a new run.
                **({"replayed": True} if replayed else {}),
            },
        )

    # -- compaction -----------------------------------------------------------

    async def _maybe_compact(self) -> None:
        loop = self._settings.agent.loop
        system_prompt = self._settings.agent.system_prompt
        schemas = self._tools.schemas()
        history = self._history
        before = estimate_tokens(system_prompt, history.summary, history.messages, schemas, self._sizes)
        if before <= loop.compaction_threshold_tokens:
            return
        cut = cut_index(history.messages, loop.compaction_keep_recent_turns)
        if cut == 0:
            return
        notice: dict[str, Any] = {"tokens_before": before, "dropped_messages": cut}
        summary: str | None = None
        data = await self._summarize(cut)
        if "error" in data:
            notice["error"] = str(data["error"])
        else:
            self._spent(data.get("usage"))
            summary = str(data.get("text", "")).strip() or None
            if summary is None:
                notice["error"] = "the provider returned an empty summary"
        self._journal.compact(cut, summary)
        notice["method"] = "summarized" if summary is not None else "dropped"
        notice["tokens_after"] = estimate_tokens(
            system_prompt, history.summary, history.messages, schemas, self._sizes
        )
        self._ctx.notice("compaction", notice)

    async def _summarize(self, cut: int) -> dict[str, Any]:
        """The summary of the oldest `cut` messages, as a durable step."""

        async def call() -> dict[str, Any]:
            await _budget.begin_call(self._settings.agent.budget, self._ctx, self._spend)
            try:
                completion = await self._provider.stream_chat(
                    summary_request(self._history.summary, self._history.messages[:cut]),
                    None,
                    _ignore_text,
                    self._on_retry,
                    self._deadline,
                )
            except ProviderError as exc:
                return {"error": self._provider.redact(str(exc))}
            return {"text": completion.text, "usage": completion.usage}

        self._calls += 1
        data: dict[str, Any] = await self._ctx.step(f"compact:{self._calls}", call, kind="llm", idempotent=True)
        return data

    # -- endings --------------------------------------------------------------

    def _keep_partial(self, marker: str) -> None:
        if self._partial:
            self._journal.append({"role": "assistant", "content": "".join(self._partial) + marker})
        self._partial = None

    def _close_failed_turn(self, reason: str) -> None:
        """Keep the input of a failed turn (the model should know it was
        asked), but never end the history on it: the next input would make
        two user messages in a row, which strict chat templates (Mistral,
        Llama, Gemma...) answer with a 400.  An assistant note closes it."""
        if self._history.messages and self._history.messages[-1].get("role") != "assistant":
            self._journal.append(
                {"role": "assistant", "content": _FAILED_TEXT.format(reason=reason[:500])}
            )

    def _interrupted(self) -> TurnResult:
        self._keep_partial(_INTERRUPTED_TEXT)
        for call in list(self._unanswered):
            self._answer(call, False, _INTERRUPTED_RESULT)
        return TurnResult(
            "".join(self._reply), self._journal.record(interrupted=True), interrupted=True
        )


def _ignore_text(_: str) -> None:
    pass


def _batches(calls: list[ToolCall], parallel: list[str]) -> list[list[ToolCall]]:
    """The calls in the order they run: consecutive calls of tools in
    `[tools] parallel` together, any other call alone."""
    batches: list[list[ToolCall]] = []
    for call in calls:
        if call.name in parallel and batches and batches[-1][0].name in parallel:
            batches[-1].append(call)
        else:
            batches.append([call])
    return batches


def _killed_result(why: Interruption) -> list[Any]:
    """What the model is told of the tool that was running when the worker
    died (it is not run again: it may have had its effect)."""
    if why.killed:
        return [False, f"error: the tool was killed: {why.cause}"]
    if not why.certain:
        return [False, f"error: {why.cause} while this tool was starting or running; "
                       "it may or may not have completed"]
    return [False, f"error: {why.cause} while this tool ran; it may or may not have completed"]


def _completion_data(c: Completion) -> dict[str, Any]:
    """A completion as its step journals it (msgpack-able)."""
    return {
        "text": c.text, "calls": [[t.id, t.name, t.arguments] for t in c.tool_calls],
        "finish": c.finish_reason, "usage": c.usage, "reasoning": c.reasoning, "fields": c.history_fields,
    }


def _completion_of(data: dict[str, Any]) -> Completion:
    return Completion(
        text=data["text"], tool_calls=[ToolCall(id=i, name=n, arguments=a) for i, n, a in data["calls"]],
        finish_reason=data["finish"], usage=data["usage"], reasoning=data["reasoning"],
        history_fields=data["fields"],
    )


def _parse_arguments(raw: str) -> dict[str, Any] | str:
    """The call's arguments, or why they cannot be used."""
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        return f"invalid JSON: {exc}"
    if not isinstance(value, dict):
        return "a JSON object is required"
    return value


def _assistant_message(completion: Completion) -> dict[str, Any]:
    # `history_fields`: the reasoning, kept for the dialect to send back.
    if not completion.tool_calls:
        return {"role": "assistant", "content": completion.text, **completion.history_fields}
    calls = []
    for call in completion.tool_calls:
        # Invalid JSON goes back as "{}": some servers re-parse the history's
        # arguments and would reject the whole next request.  The tool result
        # quotes what the model sent.
        usable = call.arguments.strip() and isinstance(_parse_arguments(call.arguments), dict)
        arguments = call.arguments if usable else "{}"
        calls.append(
            {
                "id": call.id,
                "type": "function",
                # A nameless call goes back under a placeholder: servers
                # refuse an empty function name in the history.
                "function": {"name": call.name or _NO_NAME, "arguments": arguments},
            }
        )
    return {
        "role": "assistant",
        "content": completion.text or None,
        "tool_calls": calls,
        **completion.history_fields,
    }

