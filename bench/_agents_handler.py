"""An OpenAI Agents SDK handler for bench/frameworks.py: preloaded by the
zygote when a daemon allows it (its module imports the SDK)."""

from agents import Agent, function_tool

from session_worker.adapters.openai_agents import handler


@function_tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


make = handler(Agent(name="bench", instructions="Answer briefly.", tools=[add]))
