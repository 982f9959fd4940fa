"""The layout's rules, checked on the source (pure): the daemon and the worker
side meet only in ipc/; inside supervisor/, each folder imports only the
folders its allow-list names (FOLDER_MAY_IMPORT); sessionctl and the client
library (supervisor/ctl/) pull in nothing but ipc/ and the standard library;
no module imports itself back through others; no module is past the size a
reader can hold."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("supervisor", "session_worker", "ipc")
MAX_LINES = 700


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module of ours that `name` imports, at any depth of its code
    (a function-level import is a dependency too)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                       for alias in node.names]
        out.update(t for t in targets if t.split(".")[0] in PACKAGES)
    out.discard(name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_daemon_and_the_worker_side_meet_only_in_ipc() -> None:
    crossing = [
        f"{a} imports {b}" for a, deps in GRAPH.items() for b in deps
        if {a.split(".")[0], b.split(".")[0]} == {"supervisor", "session_worker"}
    ]
    assert crossing == []
    assert all(not dep.startswith(("supervisor", "session_worker"))
               for name, deps in GRAPH.items() if name.startswith("ipc") for dep in deps)


# Which of our folders each part of the daemon's package may import, read as
# "the folder on the left runs in this process and may use these".  A module
# may always import its own folder, ipc/ (the contract every process shares)
# and `supervisor` itself (its __init__ holds only the version).  The folder
# of supervisor.x.y is supervisor.x; supervisor/*.py at the top are folders
# of their own.
FOLDER_MAY_IMPORT: dict[str, set[str]] = {
    # sessiond's leaves: what everything else reads.
    "supervisor.errors": set(),
    "supervisor.config": {"supervisor.errors"},
    "supervisor.ops": {"supervisor.config", "supervisor.errors"},
    # The seams the core is handed, and what stands behind them.
    "supervisor.spawn": {"supervisor.config", "supervisor.errors", "supervisor.ops"},
    "supervisor.store": {"supervisor.config", "supervisor.errors", "supervisor.ops"},
    # The core: sessions and their supervision; it sees the seams, never who calls it.
    "supervisor.core": {"supervisor.config", "supervisor.errors", "supervisor.ops",
                        "supervisor.spawn", "supervisor.store"},
    # The control socket: calls into the core.
    "supervisor.api": {"supervisor.config", "supervisor.errors", "supervisor.ops",
                       "supervisor.spawn", "supervisor.store", "supervisor.core"},
    # Several machines: wires the core to Ray and to other daemons.
    "supervisor.cluster": {"supervisor.config", "supervisor.errors", "supervisor.ops",
                           "supervisor.spawn", "supervisor.store", "supervisor.core"},
    # The composition root: the one place that builds and connects the parts.
    "supervisor.daemon": {"supervisor.config", "supervisor.errors", "supervisor.ops",
                          "supervisor.spawn", "supervisor.store", "supervisor.core",
                          "supervisor.api", "supervisor.cluster"},
    "supervisor.cli": {"supervisor.config", "supervisor.daemon"},
    # Another process (sessionctl, an application): none of the daemon.
    "supervisor.ctl": set(),
    "supervisor.client": {"supervisor.ctl"},  # the library's public name
}

# Arrows between two folders the rules above do not allow, each with why.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("supervisor.ops.metrics", "supervisor.core.session"): "metrics reads the sessions it counts",
    ("supervisor.ops.metrics", "supervisor.core.states"): "metrics counts sessions by state",
    ("supervisor.api.server", "supervisor.cluster.drain"): "the server serves the drain request",
}


def _folder(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "supervisor" else parts[0]


def test_every_daemon_folder_has_rules() -> None:
    folders = {_folder(n) for n in MODULES if n.startswith("supervisor.")}
    assert folders == set(FOLDER_MAY_IMPORT), folders ^ set(FOLDER_MAY_IMPORT)


def test_each_folder_imports_only_what_its_rules_allow() -> None:
    wrong = [
        f"{a} imports {b}" for a, deps in GRAPH.items() if a.startswith("supervisor.") for b in deps
        if b.startswith("supervisor.") and _folder(b) != _folder(a)
        and _folder(b) not in FOLDER_MAY_IMPORT[_folder(a)] and (a, b) not in EXCEPTIONS
    ]
    assert wrong == []
    assert all(b in GRAPH.get(a, ()) for a, b in EXCEPTIONS), "an exception no longer needed: drop it"


def test_each_subpackage_says_who_runs_it_and_what_it_may_import() -> None:
    for path in (REPO / "supervisor").rglob("__init__.py"):
        if path.parent.name == "supervisor":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "run" in doc and "May import" in doc, path


def test_a_client_program_needs_only_ipc() -> None:
    # From the library's public name and from every module of sessionctl.
    seen, todo = set(), ["supervisor.client", *(n for n in MODULES if _folder(n) == "supervisor.ctl")]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(GRAPH.get(name, ()))
    assert {n for n in seen if not n.startswith("ipc") and _folder(n) != "supervisor.ctl"} \
        <= {"supervisor", "supervisor.client"}, seen


def test_no_import_cycles() -> None:
    # Tarjan's strongly connected components over our modules.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert cycles == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_readable(name: str) -> None:
    lines = MODULES[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines (max {MAX_LINES}): split it by job"


def test_the_checker_sees_a_crossing() -> None:
    # The graph is real: the worker's entry point imports the handler interface.
    assert "session_worker.handler" in GRAPH["session_worker.main"]
    assert "ipc.messages" in GRAPH["supervisor.api.server"]
