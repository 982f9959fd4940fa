"""The `agent` handler: an LLM agent loop with tools, run inside a worker.

Module map (all private; `AgentHandler` is the whole public surface):

* `_handler`     AgentHandler: owns provider, tools and history; one Turn per input
* `_loop`        one turn: compaction, streaming, tool dispatch, interrupts
* `_provider`    streaming client (httpx), retries, redaction, error descriptions
* `_dialect`     what differs per API: endpoint, headers, request body, assembler (pure)
* `_sse`         incremental server-sent-events parser (pure)
* `_stream`      OpenAI chunk → text/reasoning deltas and assembled tool calls (pure)
* `_anthropic`   Messages API request body and stream events (pure)
* `_tools`       registry, schema checks; `_builtins`, `_bash`, `_custom`: the tools
* `_mcp`         MCP servers' tools as registry tools: the daemon's lists, lazy starts, backoff
* `_mcpclient`   one MCP server over the SDK, its spans (lazy import); `_mcpstdio`: a process
                 through the sandbox; `_mcphttp`: streamable HTTP and the legacy SSE
* `_permissions` first-match permission rules (pure)
* `_compaction`  token estimate and where to cut (pure)
* `_history`     state, ops, records, restore
* `_errors`      the exception tree

Runs in the worker (the zygote preloads it; the MCP lister runs its MCP
client).  May import: ipc/, session_worker.errors, the handler API
(session_worker.handler, session_worker.tracing) and the worker's plumbing
(session_worker.worker: the sandbox, starting processes, openat2).
"""

from session_worker.agent._handler import AgentHandler

__all__ = ["AgentHandler"]
