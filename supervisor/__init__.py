"""sessiond's supervisor: the daemon, its client library and the CLIs.

One folder per process and concern (each folder's __init__ says who runs it
and what it may import; tests/test_architecture.py holds the rules):
cli.py, startup.py and daemon.py (sessiond's command, its start-up checks
and its wiring), config/, errors.py, logtag.py; core/ (sessions and their
supervision), api/ (the control socket), spawn/ (starting and containing
workers), store/ (where sessions are kept), host/ (the host's I/O the core
decides on), cluster/ (several machines; nodehost.py runs in Ray's node
host), ops/ (systemd, metrics, tracing); ctl/ (sessionctl and the client
library, another process: it needs only ipc/).
"""

__version__ = "0.1.0"
