"""What tests/test_adapters.py runs the frameworks with: the OpenAI Agents
SDK's tools and agents, LangGraph's graphs.  Imported by its tests when they
run, not when the suite is collected: the two frameworks take seconds to
import, which every worker of `make test-fast` paid before a test ran."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Annotated, Any

from agents import Agent, GuardrailFunctionOutput, InputGuardrail, RunContextWrapper, function_tool
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import interrupt

from fakellm import FakeLLM
from session_worker.adapters.langgraph import handler as graph_handler
from session_worker.adapters.openai_agents import handler as openai_handler
from session_worker.handler import HandlerInit
from test_agent_support import make_settings

__all__ = ["Agent", "counts", "graph_handler", "guarded_agent", "openai_session", "ran_tools", "spin_graph", "streaming_graph",
           "tool_graph"]

counts: list[int] = []


@function_tool
async def count(n: int) -> str:
    """Count n."""
    counts.append(n)
    return f"counted {n}"


@function_tool(needs_approval=True)
async def launch(target: str) -> str:
    """Launch at a target."""
    return f"launched {target}"


def openai_session(llm: FakeLLM, tmp_path: Path, sdk_agent: Agent[Any] | None = None,
                   **settings: Any) -> tuple[Any, Any]:
    s = make_settings(llm, **settings)
    made = openai_handler(sdk_agent or Agent(name="t", instructions="Count.", tools=[count, launch]))
    h = made(HandlerInit(session="s", settings=s, workspace=tmp_path))
    h.restore(None, [])
    return h, s


def guarded_agent() -> Agent[Any]:
    """An agent whose input guardrail trips on "secret"."""
    async def block(ctx: RunContextWrapper[Any], agent: Any, text: Any) -> GuardrailFunctionOutput:
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered="secret" in str(text))

    return Agent(name="g", instructions="x", input_guardrails=[InputGuardrail(block, name="no_secrets")])


class _Tools(MessagesState):
    log: Annotated[list[str], operator.add]


ran_tools: list[str] = []


@tool
def lookup(q: str) -> str:
    """Look q up."""
    ran_tools.append(q)
    return f"found {q}"


def tool_graph() -> Any:
    def think(state: _Tools) -> dict[str, Any]:
        if any(m.type == "tool" for m in state["messages"]):
            return {"messages": [AIMessage("Found both.")]}
        return {"messages": [AIMessage("", tool_calls=[{"name": "lookup", "args": {"q": "a"}, "id": "t1"},
                                                       {"name": "lookup", "args": {"q": "b"}, "id": "t2"}])]}

    def ask(state: _Tools) -> dict[str, Any]:
        return {"log": [f"approved={interrupt({'tool': 'publish', 'what': 'the answer'})}"]}

    def route(state: _Tools) -> str:
        return "tools" if state["messages"][-1].tool_calls else "ask"

    builder = StateGraph(_Tools)
    builder.add_node("think", think)
    builder.add_node("tools", ToolNode([lookup]))
    builder.add_node("ask", ask)
    builder.add_edge(START, "think")
    builder.add_conditional_edges("think", route, ["tools", "ask"])
    builder.add_edge("tools", "think")
    builder.add_edge("ask", END)
    return builder.compile()


def spin_graph() -> Any:
    """A graph whose one node loops for ever."""
    builder = StateGraph(_Tools)
    builder.add_node("spin", lambda state: {"log": ["spin"]})
    builder.add_edge(START, "spin")
    builder.add_edge("spin", "spin")
    return builder.compile()


def streaming_graph() -> Any:
    """A node that awaits a chat model streaming its answer, then a node
    that adds a message of its own."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel

    model = GenericFakeChatModel(messages=iter([AIMessage("Hello there, world"), AIMessage("Again")]))

    async def think(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    def sign(state: MessagesState) -> dict[str, Any]:
        return {"messages": [AIMessage("-- signed")]}

    builder = StateGraph(MessagesState)
    builder.add_node("think", think)
    builder.add_node("sign", sign)
    builder.add_edge(START, "think")
    builder.add_edge("think", "sign")
    builder.add_edge("sign", END)
    return builder.compile()
