"""A module that says when it is imported (tests/test_hostile.py): it must
never be, since no operator allowed it as a handler."""

import os
from pathlib import Path

_marker = os.environ.get("SESSIOND_IMPORT_MARKER")
if _marker:
    Path(_marker).write_text("imported\n")


def factory(init: object) -> None:
    raise RuntimeError("import_marker is not a handler")
