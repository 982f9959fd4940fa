"""Our modules' syntax trees, parsed once a test process.

The checks on the source (tests/test_architecture.py, tests/test_error_trees.py)
walk the same ~210 modules of supervisor/, session_worker/ and ipc/ several
times; parsing them is nearly all of their cost (~1 s on the suite's 2-core
machine).  Parsed at module level, each xdist worker paid it at collection,
even for a run that selects none of those checks.  Now the first check that
needs a tree parses it, and the next one reuses it.  Keyed by the text, so a
check always sees the source it read; the trees are only read, never changed.
"""

from __future__ import annotations

import ast
import functools

__all__ = ["parse"]


@functools.cache
def parse(source: str) -> ast.Module:
    return ast.parse(source)
