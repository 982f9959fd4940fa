"""Starting and containing workers (run by sessiond; spawner.py's other half
is session_worker/zygote/, and cluster/nodehost.py runs it on a Ray node):
the Spawner seam, the zygote's daemon side, pidfds, cgroups (v1, v2 and the
choice between them), the sandbox probe, the MCP lister (a confined
process that lists MCP servers' tools for the daemon), and the host's part
of what contains a session's disk and IPC (workspace images, what its uid
left in the host's IPC namespace).

Owns the worker processes until they are handed to the core.  May import:
ipc/, supervisor.config, supervisor.errors and supervisor.logtag.  Never
the core: the core is handed a Spawner.
"""
