"""The daemon's core (run by sessiond): sessions, their states and events,
the turn ledger (and a turn's durable steps), the workers' supervision, the
sweep, limits and the per-session overrides.

Owns every Session and its fields (core/session.py says which part owns
which field).  May import: ipc/, supervisor.config, supervisor.errors and
supervisor.logtag, the seams it is handed (supervisor.spawn: the Spawner
seam, pidfd, cgroups; supervisor.store: the StateStore seam and the file
store it defaults to).  Never supervisor.ops, the API, the cluster or
sessionctl: those call into it (the metrics recorder and the tracer it
calls are its own protocols, recorder.py and tracer.py, which ops implements).
"""
