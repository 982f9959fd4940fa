"""`python -P -m session_worker.mcplist [--as UID:GID] < order > answer`:
the MCP lister, started by the daemon by exec (supervisor.spawn.mcplist).
Runs in the lister process."""

from __future__ import annotations

import sys

from session_worker.mcplist.lister import main

if __name__ == "__main__":
    sys.exit(main())
