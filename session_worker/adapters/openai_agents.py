"""The OpenAI Agents SDK (`openai-agents`) as a sessiond handler.

    # mymodule.py                          # config.toml: [agent] handler = "mymodule:make"
    from agents import Agent, function_tool
    from session_worker.adapters.openai_agents import handler

    make = handler(Agent(name="helper", instructions="...", tools=[...]))

Runs in the worker; `handler(agent)` runs where the operator's module is
imported (the zygote, when it is preloaded: then every session shares the
SDK's pages and the wrapped agent).  Each turn is one `Runner.run` of the
agent on the session's conversation so far plus the input, with:

* **the session's provider**: every model call goes to `[provider]
  base_url` and `model` (the agents' own `model` is replaced, handoffs' and
  agents-as-tools' included), with the key from `api_key_env`, which stays
  in the worker (non-dumpable, never in a tool's environment).  The SDK's
  Chat Completions model speaks to it (`kind = "openai"`); its tracing
  exporter is off (sessiond's traces have the calls).
* **durable steps**: each model call is a step (`llm:N`, idempotent: redone
  if its worker dies during it, its text streamed again), each function
  tool call a step (`tool:NAME:ID`, answered as killed if its worker died
  during it, unless `[tools] rerun_after_crash` lists it).  The SDK runs a
  response's tool calls side by side: so do their steps.  What a tool does
  inside (an agent used as a tool: its whole nested run) is part of its step.
* **what clients see**, as for the built-in agent: text and reasoning as
  they stream, `tool_call`/`tool_result` notices, `handoff` notices, usage
  in `TurnDone`, `[agent.budget]` before each call, `agent.max_turns` as the
  SDK's `max_turns`, `[[permissions]]` on each tool (a tool's own
  `needs_approval` asks the clients too), history with the tool calls.
* **guardrails**: a tripped input or output guardrail ends the turn as
  `stop_reason = "filtered"` (`stop_detail` names it).

The run context (`RunContextWrapper.context`, a tool's `ctx.context`) is
the turn's `TurnContext`: a tool runs a command in the session's sandbox
with `await wrapper.context.run(command)`.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from agents import (
    Agent,
    AgentsException,
    FunctionTool,
    Handoff,
    InputGuardrailTripwireTriggered,
    MaxTurnsExceeded,
    Model,
    ModelResponse,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OutputGuardrailTripwireTriggered,
    RunConfig,
    RunContextWrapper,
    RunHooks,
    Runner,
    Usage,
    handoff,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai.types.responses.response_usage import OutputTokensDetails
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from openai.types.responses import ResponseOutputItem
from pydantic import TypeAdapter
from pydantic_core import to_jsonable_python

from ipc.contract import StopReason
from session_worker.adapters import _common
from session_worker.agent._errors import BudgetReached
from session_worker.agent._provider import NO_CA_TLS, redact
from session_worker.handler import HandlerFactory, HandlerInit, TurnContext, TurnFailure, TurnResult

__all__ = ["handler"]

_output_items: TypeAdapter[list[ResponseOutputItem]] = TypeAdapter(list[ResponseOutputItem])
_INTERRUPTED = "\n\n[interrupted by the user]"
# The SDK's own exporter would post every run to OpenAI from a thread of its own.
set_tracing_disabled(True)


def handler(agent: Agent[Any]) -> HandlerFactory:
    """A handler factory running `agent` (see the module's docstring)."""
    wrapped = _Wrapping().agent(agent)

    def make(init: HandlerInit) -> OpenAIAgentsHandler:
        return OpenAIAgentsHandler(wrapped, init)

    return make


class _Wrapping:
    """The agent with its function tools as durable steps, and each agent
    it hands off to wrapped the same way when the handoff happens."""

    def __init__(self) -> None:
        self._done: dict[int, Agent[Any]] = {}

    def agent(self, agent: Agent[Any]) -> Agent[Any]:
        done = self._done.get(id(agent))
        if done is not None:
            return done
        clone = agent.clone(tools=[_durable_tool(t) if isinstance(t, FunctionTool) else t for t in agent.tools])
        self._done[id(agent)] = clone
        self._done[id(clone)] = clone
        clone.handoffs = [self._handoff(h if isinstance(h, Handoff) else handoff(h)) for h in agent.handoffs]
        return clone

    def _handoff(self, h: Handoff[Any, Any]) -> Handoff[Any, Any]:
        invoke = h.on_invoke_handoff

        async def on_invoke(wrapper: RunContextWrapper[Any], arguments: str) -> Agent[Any]:
            return self.agent(await invoke(wrapper, arguments))

        return dataclasses.replace(h, on_invoke_handoff=on_invoke)


def _durable_tool(tool: FunctionTool) -> FunctionTool:
    """`tool` whose every call is a durable step (`_common.tool_step`); its
    `needs_approval` asks the session's clients inside the step."""
    invoke, needs = tool.on_invoke_tool, tool.needs_approval
    durable = copy.copy(tool)

    async def on_invoke(wrapper: Any, arguments: str) -> Any:
        ctx = wrapper.context
        if not isinstance(ctx, TurnContext) or _common.inside_step():
            return await invoke(wrapper, arguments)  # part of a step already (an agent used as a tool)

        async def approval() -> bool:
            if callable(needs):
                return bool(await needs(wrapper, _common.parse_arguments(arguments) or {}, wrapper.tool_call_id))
            return bool(needs)

        _, value = await _common.tool_step(ctx, tool.name, wrapper.tool_call_id, arguments,
                                           tool.params_json_schema, lambda: invoke(wrapper, arguments), approval)
        return value

    durable.on_invoke_tool = on_invoke
    durable.needs_approval = False
    return durable


class _Turn:
    """One turn's bookkeeping: its context, the reply as it streams (or is
    replayed), its LLM calls so far and their spend."""

    def __init__(self, ctx: TurnContext) -> None:
        self.ctx = ctx
        self.reply: list[str] = []
        self.calls = 0
        self.spend = _common.Spend(ctx)
        self._separate = False

    def response_begins(self) -> None:
        self._separate = bool(self.reply) and not self.reply[-1].endswith("\n")

    def text(self, piece: str, emit: bool = True) -> None:
        if not piece:
            return
        if self._separate:
            self._separate = False
            self.reply.append("\n\n")
            if emit:
                self.ctx.emit("\n\n")
        self.reply.append(piece)
        if emit:
            self.ctx.emit(piece)


class _DurableModel(Model):
    """The session's model, each call a durable step of the running turn."""

    def __init__(self, owner: OpenAIAgentsHandler) -> None:
        self._owner = owner

    async def get_response(self, system_instructions: str | None, input: Any, model_settings: ModelSettings,
                           tools: list[Any], output_schema: Any, handoffs: list[Any], tracing: Any,
                           *, previous_response_id: str | None = None, conversation_id: str | None = None,
                           prompt: Any = None) -> ModelResponse:
        inner = self._owner.model()
        args = (system_instructions, input, model_settings, tools, output_schema, handoffs, tracing)
        turn = self._owner.turn
        if turn is None or _common.inside_step():  # an agent used as a tool: part of its step
            return await inner.get_response(*args, previous_response_id=previous_response_id,
                                            conversation_id=conversation_id, prompt=prompt)
        turn.calls += 1
        turn.response_begins()
        streamed = False

        async def call() -> dict[str, Any]:
            nonlocal streamed
            turn.spend.check()  # only a call made now: a journaled one was paid for
            streamed = True
            done: Any = None
            events: AsyncIterator[Any] = inner.stream_response(
                *args, previous_response_id=previous_response_id, conversation_id=conversation_id, prompt=prompt)
            async for event in events:
                kind = getattr(event, "type", "")
                if kind == "response.output_text.delta":
                    turn.text(event.delta)
                elif kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
                    turn.ctx.reasoning(event.delta)
                elif kind == "response.completed":
                    done = event.response
            if done is None:
                raise AgentsException("the model's stream ended without a completed response")
            usage = done.usage
            return {
                "output": [item.model_dump(mode="json", exclude_none=True) for item in done.output],
                "id": done.id,
                "usage": _usage(usage),
            }

        data = await turn.ctx.step(f"llm:{turn.calls}", call, kind="llm", idempotent=True)
        output = _output_items.validate_python(data["output"])
        if not streamed:  # journaled before its worker died: its text streamed then
            for item in output:
                for part in getattr(item, "content", None) or ():
                    turn.text(getattr(part, "text", "") or "", emit=False)
        counts = data["usage"] or {}
        turn.spend.add(counts)
        usage = Usage(requests=1, input_tokens=counts.get("input_tokens", 0),
                      output_tokens=counts.get("output_tokens", 0),
                      total_tokens=counts.get("input_tokens", 0) + counts.get("output_tokens", 0),
                      output_tokens_details=OutputTokensDetails(reasoning_tokens=counts.get("reasoning_tokens", 0)))
        return ModelResponse(output=output, usage=usage, response_id=data["id"])

    def stream_response(self, system_instructions: str | None, input: Any, model_settings: ModelSettings,
                        tools: list[Any], output_schema: Any, handoffs: list[Any], tracing: Any,
                        *, previous_response_id: str | None = None, conversation_id: str | None = None,
                        prompt: Any = None) -> AsyncIterator[Any]:
        # Only a streamed run calls this (an agent used as a tool with
        # `on_stream`, inside its tool's step); the turn itself runs
        # `Runner.run`, whose calls come to `get_response`.
        return self._owner.model().stream_response(
            system_instructions, input, model_settings, tools, output_schema, handoffs, tracing,
            previous_response_id=previous_response_id, conversation_id=conversation_id, prompt=prompt)


class _Hooks(RunHooks[Any]):
    async def on_handoff(self, context: RunContextWrapper[Any], from_agent: Any, to_agent: Any) -> None:
        if isinstance(context.context, TurnContext):
            context.context.notice("handoff", {"from": from_agent.name, "to": to_agent.name})


class OpenAIAgentsHandler:
    """One session's handler: the conversation (Responses-format input
    items, the SDK's `to_input_list()`) is its state; a turn's record
    appends the items it added."""

    uses_steps = True

    def __init__(self, agent: Agent[Any], init: HandlerInit) -> None:
        self._agent = agent
        self._settings = init.settings
        self._items: list[Any] = []
        self._model = _DurableModel(self)
        self._inner: OpenAIChatCompletionsModel | None = None
        self._client: AsyncOpenAI | None = None
        self._stale: list[AsyncOpenAI] = []
        self._key: str | None = None
        self.turn: _Turn | None = None

    def restore(self, state: Any, records: list[Any]) -> None:
        self._items = list(state or [])
        for record in records:
            if isinstance(record, dict):
                self._items += [op["message"] for op in record.get("ops", ())]

    def snapshot(self) -> Any:
        return self._items

    def reconfigure(self, settings: Any) -> None:
        """A reload: the next turn uses the new provider settings."""
        if settings.provider != self._settings.provider and self._client is not None:
            self._stale.append(self._client)  # closed at the next turn: a call may be using it now
            self._inner = self._client = None
        self._settings = settings

    def model(self) -> OpenAIChatCompletionsModel:
        """The SDK's Chat Completions model on the session's provider, made
        at the first call (an idle session builds no client)."""
        if self._inner is None:
            provider = self._settings.provider
            problem = provider.missing()
            if problem is not None:
                raise TurnFailure(f"no LLM provider is configured: set {problem}")
            if provider.kind != "openai":
                raise TurnFailure(f"the OpenAI Agents adapter needs an OpenAI-compatible provider: provider.kind "
                                  f"is {provider.kind!r}, set it to \"openai\" (with a compatible base_url)")
            if provider.api_key_env and not os.environ.get(provider.api_key_env):
                raise TurnFailure(f"environment variable {provider.api_key_env} (provider.api_key_env) is not set")
            self._key = os.environ.get(provider.api_key_env) if provider.api_key_env else None
            base = (provider.base_url or "").rstrip("/")
            # The SDK's own HTTP client class (its HTTP library is its business).
            http = DefaultAsyncHttpxClient(trust_env=False, verify=True if base[:6].lower() == "https:" else NO_CA_TLS)
            # The SDK insists on a key: a server that needs none gets this one.
            client = self._client = AsyncOpenAI(base_url=base, api_key=self._key or "no-key", max_retries=provider.max_retries,
                                 timeout=provider.read_timeout_secs, http_client=http)
            # A run the SDK starts without our config (a guardrail's agent)
            # reaches the same provider, never OpenAI's by default.
            set_default_openai_client(client, use_for_tracing=False)
            set_default_openai_api("chat_completions")
            self._inner = OpenAIChatCompletionsModel(model=provider.model or "", openai_client=client)
        return self._inner

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        while self._stale:
            await self._stale.pop().close()
        self.model()  # a provider that cannot be used fails the turn before anything runs
        turn = self.turn = _Turn(ctx)
        user: Any = {"role": "user", "content": text}
        provider = self._settings.provider
        config = RunConfig(model=self._model, tracing_disabled=True, model_settings=ModelSettings(
            include_usage=provider.stream_usage, max_tokens=provider.max_tokens))
        try:
            result = await Runner.run(self._agent, [*self._items, user], context=ctx, hooks=_Hooks(),
                                      max_turns=ctx.settings.agent.max_turns, run_config=config)
        except asyncio.CancelledError:
            return self._end(turn, [user], "".join(turn.reply) + _INTERRUPTED, interrupted=True)
        except MaxTurnsExceeded:
            return self._end(turn, [user], _common.turn_limit_note(ctx, turn.calls))
        except (InputGuardrailTripwireTriggered, OutputGuardrailTripwireTriggered) as exc:
            name = exc.guardrail_result.guardrail.get_name()
            which = "input" if isinstance(exc, InputGuardrailTripwireTriggered) else "output"
            return self._end(turn, [user], f"[withheld: the {which} guardrail {name} tripped]",
                             stop=StopReason.FILTERED, detail=f"{which} guardrail {name}")
        except Exception as exc:
            budget = _budget_reached(exc)
            if budget is not None:
                return self._end(turn, [user], turn.spend.stopped(budget))
            if isinstance(exc, TurnFailure):
                raise
            reason = redact(f"{type(exc).__name__}: {exc}", self._key)
            note = {"role": "assistant", "content": f"[no reply: this request failed ({reason[:500]})]"}
            self._items += [user, note]
            raise TurnFailure(f"the agent failed: {reason}", record={"ops": _common.append_ops([user, note])}) from None
        finally:
            self.turn = None
        added = to_jsonable_python(result.to_input_list()[len(self._items):])
        self._items += added
        reply = "".join(turn.reply)
        if not reply and result.final_output is not None:
            reply = str(result.final_output)
        return TurnResult(reply=reply, record={"ops": _common.append_ops(added)}, usage=turn.spend.tokens())

    def _end(self, turn: _Turn, items: list[Any], note: str, *, interrupted: bool = False,
             stop: StopReason = StopReason.COMPLETE, detail: str = "") -> TurnResult:
        """A turn that ends before the SDK's run does: its input and a note
        (the conversation stays a valid request); the note is the reply's end."""
        if not interrupted:
            turn.text(note)
        reply = note if interrupted else "".join(turn.reply)
        added = [*items, {"role": "assistant", "content": note.strip()}]
        self._items += added
        return TurnResult(reply=reply, record={"ops": _common.append_ops(added)}, interrupted=interrupted,
                          stop_reason=str(stop), stop_detail=detail, usage=turn.spend.tokens())

    async def aclose(self) -> None:
        for client in (*self._stale, self._client):
            if client is not None:
                await client.close()


def _usage(usage: Any) -> dict[str, int] | None:
    """A response's usage as its step keeps it (the SDK reports 0 for what
    the server did not say: a reasoning count of 0 is left out)."""
    if usage is None:
        return None
    out = {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}
    reasoning = usage.output_tokens_details.reasoning_tokens if usage.output_tokens_details else 0
    return out | ({"reasoning_tokens": reasoning} if reasoning else {})


def _budget_reached(exc: BaseException) -> BudgetReached | None:
    """The budget check ends the run from inside a model call; the SDK may
    wrap what it raised."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None or isinstance(seen, BudgetReached):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
