"""A session's worker (run by the worker process, one per live session,
forked by the zygote; the zygote imports all of it before it forks, and
the MCP lister uses its sandbox): boot, turns and the link to the daemon
(main.py), the handler's loading (factories.py), a turn's durable steps
(steps.py), and the worker's process plumbing: the tools' sandbox as the
worker sees it (sandbox.py: it starts the tool host and hands it orders;
_seccomp.py: the filter the tools run under; _spawn.py: starting a process
with only the descriptors it is given), the covers over the daemon's Python
that the zygote finds and each worker mounts at boot (_reach.py), openat2
for the file tools (_linux.py), signal dispositions set cheaply after fork
(_signals.py).

May import: ipc/, session_worker.errors, the handler API
(session_worker.handler, session_worker.tracing) and the handlers it loads
by name (session_worker.echo, session_worker.agent).  Never the zygote,
the lister or the tool host: the tool host is started from its source text
(toolhost/host.py), not imported.

Imports nothing itself: session_worker.handler imports steps.py from here.
"""
