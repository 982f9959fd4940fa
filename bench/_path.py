"""Imported first by every bench script, run as `.venv/bin/python bench/X.py`
from the checkout: Python put the script's directory, bench/, first on
sys.path, where bench/ipc.py and bench/mcp.py would shadow the project's
`ipc` package and the MCP SDK's `mcp`; this puts the checkout in its place,
so that `ipc`, `supervisor` and `bench._common` are the real ones."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
sys.path.insert(0, str(REPO))
