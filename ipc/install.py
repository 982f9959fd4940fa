"""How to install one of sessiond's optional extras (`web`, `mcp`, `otel`,
`cluster`) for the Python this process runs on: what a message that misses
one says.  Both sides and sessionctl import it.

`pip install 'sessiond[web]'` is the command for a release on a package
index, run by whichever pip comes first on PATH; in a checkout (README,
`make run`) the package is the checkout itself, installed editable into
its `.venv`, and that command would fetch another copy into another
Python.  So: the pip of this interpreter (`python -m pip`), and in a
checkout `-e` with the checkout's path (`.venv/bin/pip install -e
'.[web]'` run from it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["install_command"]

_ROOT = Path(__file__).resolve().parent.parent


def install_command(extra: str, root: Path = _ROOT, python: str = sys.executable, cwd: str | None = None) -> str:
    here = Path(cwd if cwd is not None else os.getcwd())
    pip = Path(python).with_name("pip")
    # A virtual environment's own pip is this Python's; elsewhere `pip` may be another's.
    venv = (Path(python).parent.parent / "pyvenv.cfg").is_file()
    runner = f"{_shown(pip, here)} install" if venv and pip.exists() else f"{_shown(Path(python), here)} -m pip install"
    if (root / "pyproject.toml").is_file() and "site-packages" not in root.parts:
        where = "." if root == here else str(root)
        return f"{runner} -e '{where}[{extra}]'"
    return f"{runner} 'sessiond[{extra}]'"


def _shown(path: Path, here: Path) -> str:
    """`path` relative to `here` when it is below it (.venv/bin/pip)."""
    try:
        return str(path.relative_to(here))
    except ValueError:
        return str(path)
