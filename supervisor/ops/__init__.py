"""Operations (run by sessiond): systemd's notify protocol, the Prometheus
metrics and the log lines' session tags.

Leaves the rest of the daemon reports through.  May import: ipc/,
supervisor.config and supervisor.errors; metrics.py also reads
supervisor.core's Session and State, the things it counts.
"""
