"""A compiled LangGraph graph as a sessiond handler.

    # mygraph.py                           # config.toml: [agent] handler = "mygraph:make"
    from session_worker.adapters.langgraph import handler
    make = handler(builder.compile())

Runs in the worker; `handler(graph)` runs where the operator's module is
imported (the zygote, when preloaded).  Each turn is one run of the graph
(`astream`) from the session's state so far plus the input:

* **each node's run is a durable step** (`node:RUN:NAME:STEP:PATH`): on a
  resumed turn a journaled node returns its update without running, so the
  graph takes the same path; the node its worker died in runs again (at
  least once, as a step without `interrupted`).  Nodes of one super-step
  run side by side, and so do their steps.  What a node runs inside (a
  subgraph, a model call) is part of its step.
* **a `ToolNode`'s tool calls are steps of their own** (`tool:NAME:ID`,
  as the agent's: `tool_call`/`tool_result` notices, `[[permissions]]`, a
  tool its worker died in is answered as killed unless `[tools]
  rerun_after_crash` lists it); the node itself is then no step.
* **interrupts are permission requests**: a node's `interrupt(value)` asks
  the session's clients (`sessionctl approve|deny`; tool = `value["tool"]`
  or the node's name, arguments = `value` or `{"question": value}`), the
  answer (True or False) is journaled and resumes the node
  (`Command(resume=answer)`).  The graph runs with a checkpointer of the
  adapter's own (in memory, one thread per turn): LangGraph's durability is
  sessiond's steps, not the checkpointer.
* **state**: the graph's values after each turn, journaled as the turn's
  record (LangGraph's own serializer: messages, pydantic models and
  dataclasses come back as they were).  The next turn's input is
  `input(text, values)`: by default the values with a user message appended
  to `messages`; the reply is `reply(values)`: by default the text of the
  last message when it is the AI's.  Clients see a model's text token by
  token as a node streams it (LangGraph's `messages` stream: a chat model
  a node awaits streams), and a node's other new AI messages as it ends;
  tool calls as notices, usage from the messages' `usage_metadata`; `[agent.budget]` is checked before each node that runs,
  and `agent.max_turns` is the graph's `recursion_limit` (super-steps).
"""

from __future__ import annotations

import contextvars
import copy
import itertools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, ToolMessage, convert_to_openai_messages
from langchain_core.runnables import Runnable, RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.errors import GraphInterrupt, GraphRecursionError
from langgraph.prebuilt import ToolNode
from langgraph.pregel import Pregel
from langgraph.types import Command, Interrupt

from session_worker.adapters import _common
from session_worker.agent._errors import BudgetReached
from session_worker.handler import HandlerFactory, HandlerInit, Interruption, TurnContext, TurnResult

__all__ = ["handler"]

_serde = JsonPlusSerializer()
_turn: contextvars.ContextVar[_Turn | None] = contextvars.ContextVar("sessiond_langgraph_turn", default=None)
Input = Callable[[str, dict[str, Any]], Any]
Reply = Callable[[dict[str, Any]], str]


def _dumps(value: Any) -> list[Any]:
    kind, data = _serde.dumps_typed(value)
    return [kind, data]


def _loads(data: list[Any]) -> Any:
    return _serde.loads_typed((data[0], data[1]))


def default_input(text: str, values: dict[str, Any]) -> dict[str, Any]:
    """The state so far, with the user's text appended to `messages`."""
    return {**values, "messages": [*values.get("messages", ()), HumanMessage(text)]}


def default_reply(values: dict[str, Any]) -> str:
    """The text of the last message, when it is the AI's."""
    messages = values.get("messages") or []
    last = messages[-1] if messages else None
    return last.text if isinstance(last, AIMessage) else ""


def handler(graph: Pregel[Any, Any, Any, Any], *, input: Input = default_input,
            reply: Reply = default_reply) -> HandlerFactory:
    """A handler factory running the compiled `graph` (see the module's
    docstring); `input` and `reply` map a turn to the graph and back."""
    nodes = {}
    for name, node in graph.nodes.items():
        if name.startswith("__"):
            continue
        bound = _durable_tools(node.bound) if isinstance(node.bound, ToolNode) else _DurableNode(name, node.bound)
        nodes[name] = node.copy({"bound": bound})
    saver = InMemorySaver()
    wrapped = graph.copy({"nodes": {**graph.nodes, **nodes}, "checkpointer": saver})

    def make(init: HandlerInit) -> LangGraphHandler:
        return LangGraphHandler(wrapped, saver, input, reply)

    return make


class _Turn:
    def __init__(self, ctx: TurnContext) -> None:
        self.ctx = ctx
        self.run = 0  # the graph's runs in this turn: 1, then one more per resume
        self.spend = _common.Spend(ctx)
        self.text: list[str] = []
        # Messages streamed token by token, by id: (their place in `text`,
        # the separator they began with).
        self.streamed: dict[str, tuple[int, str]] = {}

    def _separator(self) -> str:
        return "\n\n" if self.text and not self.text[-1].endswith("\n") else ""

    def streaming(self, chunk: Any) -> None:
        """A piece of an AI message a model streams while its node runs:
        to the clients at once (the node's update, when it ends, adds it to
        the reply without saying it again)."""
        if not isinstance(chunk, AIMessageChunk) or not chunk.id or not isinstance(chunk.content, str):
            return
        if not chunk.content:
            return
        place = self.streamed.get(chunk.id)
        if place is None:
            place = self.streamed[chunk.id] = (len(self.text), self._separator())
            self.text.append(place[1])
            self.ctx.emit(place[1] + chunk.content)
        else:
            self.ctx.emit(chunk.content)
        self.text[place[0]] += chunk.content

    def said(self, update: Any, live: bool) -> None:
        """A node's update: its new AI messages are reply text (streamed
        now when the node ran now, unless a model streamed it already) and
        their usage counts."""
        messages = update.get("messages") if isinstance(update, dict) else None
        if isinstance(messages, BaseMessage):
            messages = [messages]
        for message in messages or ():
            if not isinstance(message, AIMessage):
                continue
            if message.usage_metadata:
                usage = message.usage_metadata
                details = usage.get("output_token_details") or {}
                self.spend.add({"prompt_tokens": usage.get("input_tokens"),
                                "completion_tokens": usage.get("output_tokens"),
                                "reasoning_tokens": details.get("reasoning")})
            if message.id is not None and message.id in self.streamed:
                # Said already, piece by piece: the message's own text takes its place.
                index, sep = self.streamed.pop(message.id)
                self.text[index] = sep + message.text
            elif message.text:
                piece = self._separator() + message.text
                self.text.append(piece)
                if live:
                    self.ctx.emit(piece)


class _DurableNode(Runnable[Any, Any]):
    """A node's runnable whose run is a durable step of the turn."""

    def __init__(self, name: str, bound: Runnable[Any, Any]) -> None:
        self.name = name
        self.bound = bound

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        raise RuntimeError("sessiond runs the graph with ainvoke: a node is a durable step of the turn")

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        turn = _turn.get()
        if turn is None or _common.inside_step():  # a subgraph's node: part of its parent's step
            return await self.bound.ainvoke(input, config, **kwargs)
        meta = (config or {}).get("metadata") or {}
        path = ".".join(str(p) for p in meta.get("langgraph_path", ())[1:])
        ran = False

        async def fn() -> dict[str, Any]:
            nonlocal ran
            turn.spend.check()
            ran = True
            with _common.in_step():
                try:
                    value = await self.bound.ainvoke(input, config, **kwargs)
                except GraphInterrupt as exc:
                    return {"interrupt": [[i.value, i.id] for i in exc.args[0]]}
            return {"value": _dumps(value)}

        data = await turn.ctx.step(f"node:{turn.run}:{self.name}:{meta.get('langgraph_step', 0)}:{path}", fn,
                                   kind="node")
        if "interrupt" in data:
            raise GraphInterrupt(tuple(Interrupt(value=v, id=i) for v, i in data["interrupt"]))
        value = _loads(data["value"])
        turn.said(value, live=ran)
        return value


def _durable_tools(node: ToolNode) -> ToolNode:
    """A copy of the ToolNode whose every tool call is a durable step."""
    durable = copy.copy(node)
    outer = node._awrap_tool_call  # an interceptor the operator gave the node runs inside the step

    async def wrap(request: Any, execute: Callable[[Any], Any]) -> Any:
        turn = _turn.get()
        run = (lambda: outer(request, execute)) if outer is not None else (lambda: execute(request))
        if turn is None or _common.inside_step():
            return await run()
        call = request.tool_call
        name, call_id = call["name"], call.get("id") or ""
        schema = request.tool.tool_call_schema.model_json_schema() if request.tool is not None else {}

        async def invoke() -> Any:
            return _dumps(await run())

        ok, value = await _common.tool_step(turn.ctx, name, call_id, json.dumps(call.get("args", {})), schema, invoke)
        if ok and isinstance(value, list):
            return _loads(value)
        return ToolMessage(str(value), tool_call_id=call_id, name=name, status="error")

    durable._awrap_tool_call = wrap
    # Its runnable calls the methods it was built with: bound to the copy now.
    durable.func, durable.afunc = durable._func, durable._afunc
    return durable


class LangGraphHandler:
    """One session's handler: the graph's values are its state."""

    uses_steps = True

    def __init__(self, graph: Pregel[Any, Any, Any, Any], saver: InMemorySaver, input: Input, reply: Reply) -> None:
        self._graph = graph
        self._saver = saver
        self._input = input
        self._reply = reply
        self._values: dict[str, Any] = {}

    def restore(self, state: Any, records: list[Any]) -> None:
        self._values = _loads(state) if state else {}
        for record in records:
            if isinstance(record, dict) and "values" in record:
                self._values = _apply(self._values, record)

    def snapshot(self) -> Any:
        return _dumps(self._values)

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        turn = _Turn(ctx)
        token = _turn.set(turn)
        thread = f"{ctx.session}:{ctx.turn}"
        config: RunnableConfig = {"configurable": {"thread_id": thread},
                                  "recursion_limit": ctx.settings.agent.max_turns}
        graph_input: Any = self._input(text, self._values)
        try:
            values = await self._run(turn, graph_input, config)
        except (BudgetReached, GraphRecursionError) as exc:
            # The graph's state stays as the last turn left it: only the note is this turn's.
            note = turn.spend.stopped(exc) if isinstance(exc, BudgetReached) else \
                _common.turn_limit_note(ctx, ctx.settings.agent.max_turns)
            ctx.emit(note)
            return TurnResult(reply="".join(turn.text) + note, record=None, usage=turn.spend.tokens())
        finally:
            _turn.reset(token)
            await self._saver.adelete_thread(thread)
        record = _record(self._values, values)
        self._values = values
        return TurnResult(reply=self._reply(values), record=record, usage=turn.spend.tokens())

    async def _run(self, turn: _Turn, graph_input: Any, config: RunnableConfig) -> dict[str, Any]:
        """Run the graph; each time it stops at interrupts, ask the clients
        (each answer a step) and resume it with the answers."""
        asks = itertools.count(1)
        while True:
            turn.run += 1
            result: Any = None
            async for mode, data in self._graph.astream(graph_input, config, stream_mode=["messages", "values"]):
                if mode == "messages":
                    turn.streaming(data[0])
                else:
                    result = data
            pending = result.pop("__interrupt__", None) if isinstance(result, dict) else None
            if not pending:
                return dict(result)
            answers = {}
            for interrupt in pending:
                answers[interrupt.id] = await turn.ctx.step(f"ask:{next(asks)}", _asker(turn.ctx, interrupt.value),
                                                            kind="ask", interrupted=_refused)
            graph_input = Command(resume=next(iter(answers.values())) if len(answers) == 1 else answers)

    async def aclose(self) -> None:
        pass


def _asker(ctx: TurnContext, value: Any) -> Callable[[], Awaitable[bool]]:
    """An interrupt's value as a permission request."""
    if isinstance(value, dict):
        tool, arguments = str(value.get("tool") or "interrupt"), value
    else:
        tool, arguments = "interrupt", {"question": value}
    return lambda: ctx.ask_permission(tool, arguments)


def _refused(why: Interruption) -> bool:
    """An approval pending when the worker died is not taken as given."""
    return False


def _record(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """A turn's record: the values it left, `messages` as what it added
    when it only added (the whole list when it changed earlier ones), and
    the added messages as `ops` for `sessionctl history`."""
    old, new = list(before.get("messages") or ()), list(after.get("messages") or ())
    rest = {k: v for k, v in after.items() if k != "messages"}
    appended = len(new) >= len(old) and all(a is b or a == b for a, b in zip(old, new))
    added = new[len(old):] if appended else new
    return {
        "values": _dumps(rest),
        "messages": _dumps(added),
        "appended": appended,
        "ops": _common.append_ops(convert_to_openai_messages(added) if added else []),
    }


def _apply(values: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    messages = _loads(record["messages"])
    if record.get("appended"):
        messages = [*values.get("messages", ()), *messages]
    out = dict(_loads(record["values"]))
    if messages or "messages" in values:
        out["messages"] = messages
    return out

