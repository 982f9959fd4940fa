"""The sessionctl process and the Python client (run by the operator's or the
application's process, never by the daemon): the one-shot path (fast.py,
the `sessionctl` console script), the full command line (cli.py, also
`python -m supervisor.ctl`), its history, render, drain and top commands,
shell completion, the man page, and the client library (client.py, also
importable as supervisor.client).

May import ipc/ and the standard library or third-party packages only (and
the version from supervisor/__init__.py): a client needs none of the
daemon.  Kept empty: the one-shot path imports this package, and pays for
everything in it at every start.
"""
