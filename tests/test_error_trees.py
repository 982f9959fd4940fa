"""The error trees, checked on the source (pure): every exception class of
ours lives in an errors module (one per side: supervisor/errors.py,
supervisor/ctl/errors.py, session_worker/errors.py, session_worker/agent/
_errors.py, ipc/errors.py), and each such module's docstring draws every
class it defines, so the drawing a reader trusts cannot fall behind."""

from __future__ import annotations

import ast
import builtins
import functools
from pathlib import Path

import pytest


pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("supervisor", "session_worker", "ipc")

# Classes still defined next to their code, each with why: none now.
NOT_YET_MOVED: dict[str, set[str]] = {}

_BUILTIN_EXCEPTIONS = {name for name, obj in vars(builtins).items()
                       if isinstance(obj, type) and issubclass(obj, BaseException)}


def _is_errors_module(path: Path) -> bool:
    return path.stem in ("errors", "_errors")


def _paths() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))]


@functools.cache
def _classes() -> dict[Path, dict[str, list[str]]]:
    """Every top-level class of ours: file -> name -> the names of its bases
    (parsed at the first check that needs it, not at collection: see test_architecture._graph)."""
    out: dict[Path, dict[str, list[str]]] = {}
    for path in _paths():
        out[path] = {
            node.name: [ast.unparse(b).rpartition(".")[2] for b in node.bases]
            for node in ast.parse(path.read_text(), str(path)).body if isinstance(node, ast.ClassDef)
        }
    return out


@functools.cache
def _exception_names() -> frozenset[str]:
    """Our classes whose bases lead to a builtin exception (by name)."""
    known = set(_BUILTIN_EXCEPTIONS)
    changed = True
    while changed:
        changed = False
        for classes in _classes().values():
            for name, bases in classes.items():
                if name not in known and any(b in known for b in bases):
                    known.add(name)
                    changed = True
    return frozenset(known - _BUILTIN_EXCEPTIONS)


def test_every_exception_class_lives_in_an_errors_module() -> None:
    strays = {
        str(path.relative_to(REPO)): names
        for path, classes in _classes().items() if not _is_errors_module(path)
        if (names := {n for n in classes if n in _exception_names()})
    }
    assert strays == NOT_YET_MOVED, "move it into its side's errors module (or drop it from NOT_YET_MOVED)"


@pytest.mark.parametrize("path", sorted(p for p in _paths() if _is_errors_module(p)),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_each_errors_module_draws_its_whole_tree(path: Path) -> None:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    missing = [name for name in _classes()[path] if name in _exception_names() and name not in doc]
    assert missing == [], f"{path.name}'s docstring does not draw {missing}"


def test_the_checker_sees_an_exception() -> None:
    # Through our own bases too: ZygoteDied derives from SpawnerDied.
    assert {"ZygoteDied", "IdTaken", "DaemonUnavailable", "OrderNotSent"} <= _exception_names()
