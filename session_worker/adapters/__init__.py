"""Ready handlers for agent frameworks: an operator's own agent, run durable,
isolated and cheap in a session (docs/agent.md, "Agent frameworks").

Runs in a worker (and, preloaded, in the zygote: `handler(...)` is called
when the operator's module is imported).  Each module imports its framework
(an optional extra: `pip install 'sessiond[openai-agents]'` or
`'sessiond[langgraph]'`) and exposes one name, `handler`:

* `openai_agents.handler(agent)`: an OpenAI Agents SDK `Agent`;
* `langgraph.handler(compiled_graph)`: a compiled LangGraph graph;

each returns a handler factory for `[agent] handler = "mymodule:make"`.
`_common` is what both share: a tool call or a node as a durable step, the
turn's spend against `[agent.budget]`, and the notices clients see.

May import: ipc/, the handler API (session_worker.handler) and the agent's
parts they share (session_worker.agent).  Nothing of ours imports them.
"""
