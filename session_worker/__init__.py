"""The worker side of sessiond: the code of every process but the daemon,
sessionctl and the span exporter, one folder per process (ARCHITECTURE.md,
"The processes").  A module's folder says which process runs it:

    zygote/        the zygote (forked by the daemon before it has a thread, or
                   `python -P -m session_worker.zygote`): preloads the worker's
                   code, forks one worker per session, reaps them
    worker/        a session's worker: boot, turns, durable steps, the link to
                   the daemon; and its plumbing: the sandbox's worker side (the
                   tool host's client, the seccomp filter, starting processes),
                   the covers over the daemon's Python (_reach), openat2, signals
    handler.py     the handler API a handler imports (`from session_worker.handler
    tracing.py       import ...`, `from session_worker import tracing`): the worker
    echo.py agent/ the handlers we ship (`echo`, `agent`, `[agent] handler =
    adapters/        "session_worker.adapters.openai_agents:..."`): the worker
    mcplist/       the MCP lister (`python -P -m session_worker.mcplist`, run by
                   the daemon): lists lazy MCP servers' tools with the agent's client
    toolhost/      the tool host (the system's Python, `-I -S`, sent its source by
                   the worker): where every tool of a session starts
    errors.py      the side's errors: every process here but the tool host

May import ipc/ (the contract every process shares) and never supervisor/.
Inside, read bottom-up: errors.py imports nothing of ours; the worker's
code (worker/, the handler API, the handlers) imports only itself and
errors.py, never zygote/, mcplist/ or toolhost/; the zygote may import the
worker's code (it preloads it and runs a worker's first lines after fork),
the lister the worker's sandbox and the agent's MCP client; nothing imports
the tool host, which imports nothing but the standard library.  Each folder
uses only the ipc/ modules of its own links.  tests/test_architecture.py
holds these rules (WORKER_SIDE_MAY_IMPORT, IPC_MAY_USE).

This face imports nothing: every process of the side imports it first.
"""
