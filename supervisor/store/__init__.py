"""Where sessions are kept (run by sessiond): the StateStore seam, the file
store (files, journal, replay, logscan, sessiondir), the in-memory store and the
PostgreSQL store (postgres/).

Owns what is on disk or in the database.  May import: ipc/,
supervisor.config, supervisor.errors and supervisor.logtag.  Never the
core: the core is handed a StateStore.
"""
