"""What a plain daemon imports: none of supervisor/cluster/ (ARCHITECTURE.md,
the folder map: `cluster/` is imported only with `[cluster] backend =
"ray"`, or a PostgreSQL store's fronts).

A real daemon, started as `sessiond run` is, with a plain config: when it
tells systemd it is ready (`sdnotify.ready`, once it serves) it writes down
every module of ours it has imported, then stops itself with SIGTERM, as
systemd would stop it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import Daemon, env_for_children

pytestmark = pytest.mark.process

# Run in the daemon's own process: its start-up path, unchanged, up to serving.
_DRIVER = textwrap.dedent("""
    import os, signal, sys
    from supervisor.ops import sdnotify

    told = sdnotify.ready

    def ready(status):
        told(status)
        with open(sys.argv[1], "w") as out:
            out.write("\\n".join(sorted(n for n in sys.modules if n.split(".")[0] == "supervisor")))
        os.kill(os.getpid(), signal.SIGTERM)  # stopped as systemd stops it

    sdnotify.ready = ready
    from supervisor.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def test_a_plain_daemon_imports_nothing_of_the_cluster(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "d")
    listed = tmp_path / "modules.txt"
    args = daemon.cmd[daemon.cmd.index("supervisor.cli") + 1:]
    with open(daemon.log_path, "ab") as log:
        done = subprocess.run([sys.executable, "-c", _DRIVER, str(listed), *args], stdout=log,
                              stderr=subprocess.STDOUT, env=env_for_children(), cwd=str(daemon.root),
                              start_new_session=True, timeout=60)
    assert done.returncode == 0, daemon.log_path.read_text()[-3000:]
    modules = set(listed.read_text().split())
    # It got as far as serving: the control server and the manager were built.
    assert {"supervisor.daemon", "supervisor.api.server", "supervisor.core.manager"} <= modules, modules
    assert sorted(n for n in modules if n == "supervisor.cluster" or n.startswith("supervisor.cluster.")) == []
