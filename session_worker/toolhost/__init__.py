"""The tool host (run by the tool host process: one per session that ran a
tool, started by the worker with the system's Python in isolated mode,
`python -I -S`): host.py confines itself and starts every command of the
session's tools.  The worker does not import it: it reads host.py's source
and sends it to the new process (session_worker.worker.sandbox), so under
bubblewrap nothing of the venv or the checkout need be visible.

May import: the standard library only (nothing of ours, no third-party
package, not ipc/); tests/test_architecture.py walks every import here.
"""
