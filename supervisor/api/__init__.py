"""The control socket (run by sessiond): the server and its connections,
peer identity, rate-limited logging, export/import and the worker socket's
accept.

Owns the clients' connections.  May import: ipc/, supervisor.config and
supervisor.errors, supervisor.core (through its public operations),
supervisor.store, supervisor.spawn (the sandbox probe, for status),
supervisor.ops and supervisor.cluster.drain (the drain request it serves).
"""
