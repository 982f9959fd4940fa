"""sessiond across machines: the wiring (wiring.py), the Ray spawner and its
spares, the fronts (daemons sharing one database) and drain, all run
by sessiond; and the node host (nodehost.py), which runs in another process:
the Ray actor on every node, which starts that node's zygote.

Imported only with `[cluster] backend = "ray"` or a PostgreSQL store's
fronts: a plain daemon imports none of it (tests/test_daemon_imports.py).

Owns which daemon and which node hold a session.  May import everything of
the daemon's it wires (ipc/, core, spawn, store, ops, config, errors); never
the API or sessionctl.
"""
