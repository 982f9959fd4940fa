"""The MCP lister (run by the lister process: the daemon starts it by exec,
`python -P -m session_worker.mcplist`, confined; supervisor.spawn.mcplist is
its daemon side): it starts each lazy MCP server of its order, lists its
tools and stops it (lister.py); `__main__.py` is the exec entry.

May import: ipc/, session_worker.errors and the worker's code it runs as a
session's worker would: the sandbox and the covers over the daemon's Python
(session_worker.worker), the agent's MCP client (session_worker.agent).
"""

from __future__ import annotations

from session_worker.mcplist.lister import list_servers, main

__all__ = ["list_servers", "main"]
