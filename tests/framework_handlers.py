"""Handlers of real agent frameworks, for the adapters' tests (tests/test_adapters_e2e.py).

`openai_make`: an OpenAI Agents SDK agent with two function tools:
`slow(n, secs)` appends `start n` and `end n` to `counter` in the workspace
around a sleep (forever when `secs` < 0: until the test kills its worker),
and `shell(command)` runs a command in the session's sandbox (`ctx.run`).

`graph_make`: a LangGraph graph of three nodes, `a` then `b` and `c` side by
side; each appends its name to `counter`, after pausing once (the first time
it runs, marker `paused-X`) for the test to kill its worker in.
"""

from __future__ import annotations

import asyncio
import operator
from pathlib import Path
from typing import Annotated, Any, TypedDict

from agents import Agent, RunContextWrapper, function_tool
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from session_worker.adapters.langgraph import handler as graph_handler
from session_worker.adapters.openai_agents import handler as openai_handler
from session_worker.handler import HandlerInit, TurnContext


def _append(ctx: TurnContext, line: str) -> None:
    with open(Path(ctx.workspace) / "counter", "a") as f:
        f.write(line + "\n")


@function_tool
async def slow(wrapper: RunContextWrapper[TurnContext], n: int, secs: float) -> str:
    """Count n, taking secs seconds."""
    _append(wrapper.context, f"start {n}")
    await asyncio.sleep(secs if secs >= 0 else 3600)
    _append(wrapper.context, f"end {n}")
    return f"counted {n}"


@function_tool
async def shell(wrapper: RunContextWrapper[TurnContext], command: str) -> str:
    """Run a shell command in the workspace."""
    return (await wrapper.context.run(command)).text


openai_make = openai_handler(Agent(name="counter", instructions="Count.", tools=[slow, shell]))


class _State(TypedDict):
    log: Annotated[list[str], operator.add]


def _node(name: str) -> Any:
    async def run(state: _State, config: RunnableConfig) -> dict[str, Any]:
        workspace = Path(config["configurable"]["workspace"])
        marker = workspace / f"paused-{name}"
        if not marker.exists():
            marker.write_text("x")
            await asyncio.sleep(3600)  # the first time: the test kills the worker here
        with open(workspace / "counter", "a") as f:
            f.write(name + "\n")
        return {"log": [name]}

    return run


def _graph() -> Any:
    builder = StateGraph(_State)
    for name in "abc":
        builder.add_node(name, _node(name))
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("a", "c")
    builder.add_edge("b", END)
    builder.add_edge("c", END)
    return builder.compile()


_graph_factory = graph_handler(_graph(), input=lambda text, values: {"log": [f"in:{text}"]},
                               reply=lambda values: " ".join(values["log"]))


def graph_make(init: HandlerInit) -> Any:
    handler = _graph_factory(init)
    # The nodes find the workspace in the run's config.
    handler._graph = handler._graph.with_config({"configurable": {"workspace": str(init.workspace)}})
    return handler

