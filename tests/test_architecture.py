"""The layout's rules, checked on the source (pure): the daemon and the worker
side meet only in ipc/; inside supervisor/, each folder imports only the
folders its allow-list names (FOLDER_MAY_IMPORT); inside session_worker/,
laid out by process, likewise (WORKER_SIDE_MAY_IMPORT), each folder using
only the ipc/ modules of its links (IPC_MAY_USE), and the tool host nothing
but the standard library; sessionctl and the client library (supervisor/ctl/)
pull in nothing but ipc/ and the standard library; no module imports itself
back through others; no module is past the size a reader can hold (the
core's parts less still)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest


pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("supervisor", "session_worker", "ipc")
MAX_LINES = 700
# The core is split by job, not by length (issue 31): each of its parts stays
# well under the daemon-wide cap, with room to grow before it needs a split.
MAX_CORE_LINES = 500


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


@functools.cache
def _graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports; built at the first check
    that needs it, not at collection: parsing every module takes ~0.5 s, which
    each xdist worker paid before running a test, also one that ran none of these."""
    return {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_daemon_and_the_worker_side_meet_only_in_ipc() -> None:
    crossing = [
        f"{a} imports {b}" for a, deps in _graph().items() for b in deps
        if {a.split(".")[0], b.split(".")[0]} == {"supervisor", "session_worker"}
    ]
    assert crossing == []
    assert all(not dep.startswith(("supervisor", "session_worker"))
               for name, deps in _graph().items() if name.startswith("ipc") for dep in deps)


# Which of our folders each part of the daemon's package may import, read as
# "the folder on the left runs in this process and may use these".  A module
# may always import its own folder, ipc/ (the contract every process shares)
# and `supervisor` itself (its __init__ holds only the version).  The folder
# of supervisor.x.y is supervisor.x; supervisor/*.py at the top are folders
# of their own.
FOLDER_MAY_IMPORT: dict[str, set[str]] = {
    # sessiond's leaves: what everything else reads.
    "supervisor.errors": set(),
    "supervisor.logtag": set(),  # session=ID on log lines: used at every level, so below all
    "supervisor.config": {"supervisor.errors"},
    # The seams the core is handed, and what stands behind them.
    "supervisor.spawn": {"supervisor.config", "supervisor.errors", "supervisor.logtag"},
    "supervisor.store": {"supervisor.config", "supervisor.errors", "supervisor.logtag"},
    # The host's I/O the core decides on: /proc, the measuring thread, btrfs, workspaces, passwd.
    "supervisor.host": {"supervisor.config", "supervisor.errors", "supervisor.logtag", "supervisor.spawn"},
    # The core: sessions and their supervision; it sees the seams, never who calls it.  The
    # recorder and the tracer it calls are its own protocols (core/recorder.py, core/tracer.py).
    "supervisor.core": {"supervisor.config", "supervisor.errors", "supervisor.logtag",
                        "supervisor.spawn", "supervisor.store", "supervisor.host"},
    # Running it as a service: implements the core's recorder and tracer, reads what it counts.
    "supervisor.ops": {"supervisor.config", "supervisor.errors", "supervisor.logtag", "supervisor.core"},
    # The control socket: calls into the core.
    "supervisor.api": {"supervisor.config", "supervisor.errors", "supervisor.logtag",
                       "supervisor.spawn", "supervisor.store", "supervisor.core"},
    # Several machines: wires the core to Ray and to other daemons.
    "supervisor.cluster": {"supervisor.config", "supervisor.errors", "supervisor.logtag",
                           "supervisor.spawn", "supervisor.store", "supervisor.host", "supervisor.core"},
    # The start-up checks the composition root runs first (state directory, sockets, identities, host).
    "supervisor.startup": {"supervisor.config", "supervisor.errors", "supervisor.logtag", "supervisor.ops",
                           "supervisor.spawn", "supervisor.host", "supervisor.core"},
    # The composition root: the one place that builds and connects the parts.
    "supervisor.daemon": {"supervisor.config", "supervisor.errors", "supervisor.logtag", "supervisor.ops",
                          "supervisor.spawn", "supervisor.store", "supervisor.host", "supervisor.core",
                          "supervisor.api", "supervisor.cluster", "supervisor.startup"},
    "supervisor.cli": {"supervisor.config", "supervisor.daemon"},
    # Another process (sessionctl, an application): none of the daemon.
    "supervisor.ctl": set(),
    "supervisor.client": {"supervisor.ctl"},  # the library's public name
}

# Arrows between two folders the rules above do not allow, each with why
# (none today: the metrics recorder and the tracer the core calls are the
# core's protocols, which supervisor.ops implements from above).
EXCEPTIONS: dict[tuple[str, str], str] = {}


def _folder(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "supervisor" else parts[0]


def test_every_daemon_folder_has_rules() -> None:
    folders = {_folder(n) for n in MODULES if n.startswith("supervisor.")}
    assert folders == set(FOLDER_MAY_IMPORT), folders ^ set(FOLDER_MAY_IMPORT)


def test_each_folder_imports_only_what_its_rules_allow() -> None:
    wrong = [
        f"{a} imports {b}" for a, deps in _graph().items() if a.startswith("supervisor.") for b in deps
        if b.startswith("supervisor.") and _folder(b) != _folder(a)
        and _folder(b) not in FOLDER_MAY_IMPORT[_folder(a)] and (a, b) not in EXCEPTIONS
    ]
    assert wrong == []
    assert all(b in _graph().get(a, ()) for a, b in EXCEPTIONS), "an exception no longer needed: drop it"


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
            todo.extend(_graph().get(name, ()))
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
        for w in _graph().get(v, ()):
            if w not in _graph():
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

    for v in _graph():
        if v not in index:
            visit(v)
    assert cycles == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_readable(name: str) -> None:
    lines = MODULES[name].read_text().count("\n")
    cap = MAX_CORE_LINES if name.startswith("supervisor.core.") else MAX_LINES
    assert lines <= cap, f"{MODULES[name]} has {lines} lines (max {cap}): split it by job"


def test_the_checker_sees_a_crossing() -> None:
    # The graph is real: the worker's entry point imports the handler interface.
    assert "session_worker.handler" in _graph()["session_worker.worker.main"]
    assert "ipc.messages" in _graph()["supervisor.api.server"]


# ---------------------------------------------------------------- the worker side, by process
# session_worker/ is laid out by process (its __init__.py draws it): which of
# its folders each may import, read as FOLDER_MAY_IMPORT is ("the folder on
# the left runs in this process and may use these"), besides itself, ipc/
# (below: which of it) and `session_worker` itself (a face that imports
# nothing).  The folder of session_worker.x.y is session_worker.x; the
# modules at the top (the handler API, the echo handler, errors) are folders
# of their own.
WORKER_SIDE_MAY_IMPORT: dict[str, set[str]] = {
    # The leaves: the side's errors; the tool host, which imports nothing of
    # ours (the standard library only: test_the_tool_host_needs_only_the_standard_library).
    "session_worker.errors": set(),
    "session_worker.toolhost": set(),
    # The worker's code: the handler API, the handlers, the worker itself.
    # None of it imports the zygote, the lister or the tool host.
    "session_worker.tracing": set(),
    # Interruption is the steps'; TurnContext.run is the agent's bash, under its rules.
    "session_worker.handler": {"session_worker.errors", "session_worker.worker", "session_worker.agent"},
    "session_worker.echo": {"session_worker.handler"},
    "session_worker.agent": {"session_worker.errors", "session_worker.handler", "session_worker.tracing",
                             "session_worker.worker"},
    # Reached only by an operator's `[agent] handler = "session_worker.adapters...:handler"`.
    "session_worker.adapters": {"session_worker.handler", "session_worker.agent"},
    # Loads the handlers it knows by name (echo, agent); never the adapters.
    "session_worker.worker": {"session_worker.errors", "session_worker.handler", "session_worker.tracing",
                              "session_worker.echo", "session_worker.agent"},
    # The processes that run the worker's code besides the worker: the zygote
    # preloads it (and runs a worker's first lines after fork); the lister
    # runs the sandbox and the agent's MCP client as a session's worker would.
    "session_worker.zygote": {"session_worker.errors", "session_worker.worker", "session_worker.echo",
                              "session_worker.agent"},
    "session_worker.mcplist": {"session_worker.errors", "session_worker.worker", "session_worker.agent"},
}

# Which modules of ipc/ each may use: the links it speaks and the contract
# it shares.  Only the zygote speaks the zygote link (zygote_wire), only the
# lister the lister's pipe (ipc.mcplist), only the worker frames and
# connections; none uses the daemon's or sessionctl's (operator, pacing,
# inputs, wiregen, protogen, mcpjson, traceparent, paths).
_CONTRACT = {"ipc.settings", "ipc.budget", "ipc.contract", "ipc.mcp", "ipc.logfields", "ipc.linux", "ipc.install"}
IPC_MAY_USE: dict[str, set[str]] = {
    "session_worker.errors": set(),
    "session_worker.toolhost": set(),
    "session_worker.tracing": {"ipc.messages"},  # the spans it sends (WorkerSpans)
    "session_worker.handler": _CONTRACT,
    "session_worker.echo": _CONTRACT,
    "session_worker.agent": _CONTRACT,
    "session_worker.adapters": _CONTRACT,
    "session_worker.worker": _CONTRACT | {"ipc.messages", "ipc.framing", "ipc.connection", "ipc.errors",
                                          "ipc.loop"},
    "session_worker.zygote": _CONTRACT | {"ipc.messages", "ipc.zygote_wire"},
    "session_worker.mcplist": _CONTRACT | {"ipc.mcplist"},
}


def _side_folder(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_every_worker_side_folder_has_rules() -> None:
    folders = {_side_folder(n) for n in MODULES if n.startswith("session_worker.")}
    assert folders == set(WORKER_SIDE_MAY_IMPORT) == set(IPC_MAY_USE), \
        folders ^ set(WORKER_SIDE_MAY_IMPORT) | folders ^ set(IPC_MAY_USE)


def _worker_side_strays(graph: dict[str, set[str]]) -> list[str]:
    wrong: list[str] = []
    for a, deps in graph.items():
        if a == "session_worker" and deps:
            wrong.extend(f"{a} (the face) imports {b}" for b in deps)
        if not a.startswith("session_worker."):
            continue
        here = _side_folder(a)
        for b in deps:
            if b.startswith("session_worker.") and _side_folder(b) != here \
                    and _side_folder(b) not in WORKER_SIDE_MAY_IMPORT[here]:
                wrong.append(f"{a} imports {b}")
            elif b.startswith("ipc.") and b not in IPC_MAY_USE[here]:
                wrong.append(f"{a} imports {b}")
    return wrong


def test_each_worker_side_folder_imports_only_what_its_rules_allow() -> None:
    assert _worker_side_strays(_graph()) == []


def test_the_worker_side_checker_sees_a_stray() -> None:
    # The worker's code reaching into the zygote; the zygote using the lister's pipe.
    graph = {"session_worker.worker.main": {"session_worker.zygote.server"},
             "session_worker.zygote.server": {"ipc.mcplist", "session_worker.worker.main"}}
    assert _worker_side_strays(graph) == ["session_worker.worker.main imports session_worker.zygote.server",
                                          "session_worker.zygote.server imports ipc.mcplist"]


def test_each_worker_side_package_says_who_runs_it_and_what_it_may_import() -> None:
    faces = sorted((REPO / "session_worker").rglob("__init__.py"))
    assert len(faces) >= 7, faces  # the side's face, zygote, worker, mcplist, toolhost, agent, adapters
    for path in faces:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "run" in doc and "May import" in doc, path


def _not_standard_library(source: str) -> list[str]:
    """Every import in `source` of a module outside the standard library (a
    relative one included), at any depth, `__import__` and `import_module`
    of a constant name too."""
    import sys

    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and ast.unparse(node.func) in ("__import__", "importlib.import_module", "import_module"):
            names.append(str(node.args[0].value))
    return [n for n in names if n.startswith(".") or n.partition(".")[0] not in sys.stdlib_module_names]


def test_the_tool_host_needs_only_the_standard_library() -> None:
    # It runs on the system's Python in isolated mode (-I -S), from its
    # source text, under bubblewrap where nothing of the venv is visible.
    paths = sorted((REPO / "session_worker" / "toolhost").rglob("*.py"))
    assert [p.name for p in paths] == ["__init__.py", "host.py"], paths
    assert {p.name: _not_standard_library(p.read_text()) for p in paths} == {"__init__.py": [], "host.py": []}
    # ... and nothing imports it: the worker sends its source.
    assert [a for a, deps in _graph().items() for b in deps if b.startswith("session_worker.toolhost")] == []


def test_the_standard_library_checker_sees_another_import() -> None:
    src = ("import os, msgspec\nfrom . import x\nfrom ipc import messages\n"
           "def f():\n    import yaml.parser\n    __import__('psutil')\n    return importlib.import_module('json')\n")
    assert _not_standard_library(src) == ["msgspec", ".", "ipc", "yaml.parser", "psutil"]


# ---------------------------------------------------------------- wiring
# Parts get their collaborators when they are built (supervisor/daemon.py:_build,
# SessionManager.__init__); nobody sets a hook onto another object afterwards.
# A hook is a callable assigned onto an object that is not `self` (a lambda,
# an `on_*` attribute, a bound method of the assigning class), or anything
# assigned into a part reached through `self` or through a collaborator
# (`self.workers.x = ...`, `manager.ledger.x = ...`).
_PARTS = {"workers", "ledger", "events", "sweeper", "slots", "subagents", "workspaces", "spawner", "store",
          "proc_table", "server", "manager", "mgr", "fronts", "recorder", "metrics", "fencing"}
_COLLABORATORS = {"manager", "mgr", "spawner", "store", "server", "ledger", "workers", "fronts"}

# What must stay, and why.
HOOKS_ALLOWED: dict[tuple[str, str], str] = {
    ("supervisor.core.workers", "spawner.on_exit"): "the spawner is built before the loop and the core (the "
    "zygote is forked before any thread): its reports are routed once, by their owner, as it is built",
    ("supervisor.core.workers", "spawner.on_zygote_lost"): "as on_exit",
    ("supervisor.core.workers", "spawner.on_worker_lost"): "as on_exit (cluster mode)",
}


def _late_hooks(name: str, source: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []

    def root(node: ast.expr) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    def visit(node: ast.AST, cls: ast.ClassDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, ast.ClassDef) else cls
            if isinstance(child, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and child.value is not None:
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                flat = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
                methods = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))} \
                    if cls is not None else set()
                for t in flat:
                    if not isinstance(t, ast.Attribute) or (isinstance(t.value, ast.Name) and t.value.id == "self"):
                        continue
                    v = child.value
                    hook = isinstance(v, ast.Lambda) or t.attr.startswith("on_") or (
                        isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "self"
                        and v.attr in methods)
                    into_part = isinstance(t.value, ast.Attribute) and t.value.attr.lstrip("_") in _PARTS \
                        and root(t.value) in {"self"} | _COLLABORATORS
                    onto = isinstance(t.value, ast.Name) and t.value.id in _COLLABORATORS
                    if hook or into_part or onto:
                        found.append((name, ast.unparse(t)))
            visit(child, inner)

    visit(ast.parse(source), None)
    return found


def test_no_hook_is_set_on_another_object_after_it_is_built() -> None:
    found = [hit for name, path in MODULES.items() if name.startswith("supervisor.")
             for hit in _late_hooks(name, path.read_text())]
    assert [hit for hit in found if hit not in HOOKS_ALLOWED] == []
    assert all(hit in found for hit in HOOKS_ALLOWED), "an allowed hook is gone: drop it from the list"


def test_the_hook_checker_sees_a_late_hook() -> None:
    src = ("class Owner:\n    def __init__(self, ledger):\n        ledger.on_unsaved = self.kill\n"
           "    def kill(self): ...\n"
           "def wire(manager, spawner):\n    manager.workers.claim = claim\n    spawner.metrics = rec\n"
           "    x.make_room = lambda s: None\n")
    assert [what for _, what in _late_hooks("m", src)] == [
        "ledger.on_unsaved", "manager.workers.claim", "spawner.metrics", "x.make_room"]


# ---------------------------------------------------------------- who owns a session's fields
# The table in supervisor/core/session.py's docstring says which part writes
# which field of a Session; a WorkerProc is WorkerOwner's.  Any assignment to
# such a field (`session.state = ...`, `session.seq += 1`, `worker.expected = ...`)
# outside its owner's module fails here.
_SESSION_NAMES = {"session", "s", "restored", "parent", "child", "existing", "root", "sess"}
_WORKER_NAMES = {"worker", "w", "proc"}
# Writes shared on purpose, and why.
FIELDS_SHARED: dict[tuple[str, str], str] = {
    ("memory", "supervisor.core.workers"): "each new worker starts with fresh figures, which the Sweeper fills",
    ("children", "supervisor.core.intake"): "Intake keeps the registry and parents' lists on the manager's behalf",
    # A waiter registers its own future; only the owner resolves and drops them.
    ("state_waiters", "supervisor.cluster.drain"): "a drain waits for a state change; EventLog wakes it",
    ("pings", "supervisor.core.manager"): "a session ping's answer, sent by the manager; WorkerOwner answers it",
    ("turn_results", "supervisor.core.subagents"): "a parent waits on its child's turn; the ledger ends it",
}


def _dataclass_fields(tree: ast.Module, name: str) -> set[str]:
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _owners() -> tuple[dict[str, set[str]], set[str]]:
    import re

    path = REPO / "supervisor" / "core" / "session.py"
    tree = ast.parse(path.read_text(), str(path))
    fields = _dataclass_fields(tree, "Session")
    # One block per owner: "    Owner (module.py[,  fields...]" then lines indented
    # past the owner column; a line may name a second module ("module.py)").
    blocks: list[tuple[set[str], list[str]]] = []
    for line in (ast.get_docstring(tree) or "").splitlines():
        if (head := re.match(r"\s{4}\w+\s+\((\w+)\.py,?\)?(.*)", line)) is not None:
            blocks.append(({f"supervisor.core.{head[1]}"}, [head[2]]))
        elif blocks and line.startswith(" " * 20):
            if (more := re.match(r"\s+(\w+)\.py\)(.*)", line)) is not None:
                blocks[-1][0].add(f"supervisor.core.{more[1]}")
                line = more[2]
            blocks[-1][1].append(line)
        elif blocks and blocks[-1][1]:
            blocks.append((set(), []))  # the table ended
    owners: dict[str, set[str]] = {}
    for modules, lines in blocks:
        for word in re.findall(r"[a-z_]+", " ".join(lines)):
            if modules and word in fields:
                owners.setdefault(word, set()).update(modules)
    return owners, _dataclass_fields(tree, "WorkerProc")


# Methods that change the container they are called on: `session.x.append(...)`
# writes `x` as surely as `session.x = ...` does.
_MUTATORS = {"append", "appendleft", "extend", "insert", "pop", "popleft", "popitem", "remove", "clear",
             "add", "discard", "update", "setdefault", "sort", "reverse", "difference_update",
             "intersection_update", "symmetric_difference_update"}


_CONTAINERS = ("list[", "dict[", "set[", "deque[", "collections.deque[", "OrderedDict[")


@functools.cache
def _container_fields() -> frozenset[str]:
    """Fields of Session and WorkerProc that hold a container (a method
    call on another field, `session.store.append(...)`, uses it: no write)."""
    tree = ast.parse((REPO / "supervisor" / "core" / "session.py").read_text())
    out = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in ("Session", "WorkerProc")):
        for n in cls.body:
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) \
                    and ast.unparse(n.annotation).startswith(_CONTAINERS):
                out.add(n.target.id)
    return frozenset(out)


def _written(node: ast.AST) -> list[ast.Attribute]:
    """The attributes `node` writes: assigned (`a.x = `, `a.x += `), through a
    subscript (`a.x[k] = `, `del a.x[k]`), or by a mutating method (`a.x.pop()`)."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        flat = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
        out = []
        for t in flat:
            while isinstance(t, ast.Subscript):
                t = t.value
            if isinstance(t, ast.Attribute):
                out.append(t)
        return out
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
        target = node.func.value
        while isinstance(target, ast.Subscript):
            target = target.value
        if isinstance(target, ast.Attribute) and target.attr in _container_fields():
            return [target]
    return []


def _field_writes(name: str, source: str, owners: dict[str, set[str]], worker_fields: set[str]) -> list[str]:
    wrong: list[str] = []
    for node in ast.walk(ast.parse(source)):
        for t in _written(node):
            base = t.value
            of = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
            if of in _SESSION_NAMES and t.attr in owners and name not in owners[t.attr] \
                    and (t.attr, name) not in FIELDS_SHARED:
                wrong.append(f"{name}:{node.lineno}: {ast.unparse(t)} (owner {sorted(owners[t.attr])})")
            if of in _WORKER_NAMES | {"worker"} and t.attr in worker_fields and name != "supervisor.core.workers":
                wrong.append(f"{name}:{node.lineno}: {ast.unparse(t)} (owner supervisor.core.workers)")
    return wrong


def test_the_ownership_table_covers_every_field() -> None:
    owners, _ = _owners()
    assert owners["error"] == {"supervisor.core.manager", "supervisor.core.holding", "supervisor.core.damage"}
    assert owners["seq"] == {"supervisor.core.events"}
    tree = ast.parse((REPO / "supervisor" / "core" / "session.py").read_text())
    assert _dataclass_fields(tree, "Session") - set(owners) == {"id"}  # (set once, at construction)


def test_a_session_s_fields_are_written_only_by_their_owner() -> None:
    owners, worker_fields = _owners()
    wrong = [w for name, path in MODULES.items() if name.startswith("supervisor.")
             for w in _field_writes(name, path.read_text(), owners, worker_fields)]
    assert wrong == []


def test_the_ownership_checker_sees_a_stray_write() -> None:
    owners, worker_fields = _owners()
    src = "def f(session, manager):\n    session.seq += 1\n    session.worker.stop_reason = 1\n    session.state = 2\n"
    assert len(_field_writes("supervisor.core.fencing", src, owners, worker_fields)) == 3
    assert _field_writes("supervisor.core.events", "def f(session):\n    session.seq += 1\n",
                         owners, worker_fields) == []
    # Through a subscript or a mutating method, not only an assignment;
    # a method of a field that holds no container (the store) writes nothing.
    src = ("def f(session):\n    session.pings[1] = 2\n    del session.pings[1]\n"
           "    session.pending_asks.pop('r')\n    session.store.append(b'')\n")
    assert len(_field_writes("supervisor.core.fencing", src, owners, worker_fields)) == 3


# ---------------------------------------------------------------- the core's I/O
# The core decides; the folders below it do (ARCHITECTURE.md, "The core's
# I/O").  A module of supervisor/core/ imports none of the standard
# library's I/O modules, never opens a file nor names one under /proc or
# /sys, never calls a path's I/O methods nor watches a descriptor itself: it
# acts through the loop's transports and timers, through the seams (the
# Spawner, the StateStore) and through supervisor/host/ and supervisor/spawn/.
# What it may use of `os` and `signal` is the allow-list below, each with why;
# ARCHITECTURE.md states the same list.
CORE_IO_MODULES = {
    "ctypes", "fcntl", "glob", "grp", "io", "mmap", "multiprocessing", "pty", "pwd", "resource", "select",
    "selectors", "shutil", "socket", "subprocess", "tempfile", "termios", "threading", "concurrent", "stat",
}
CORE_OS_ALLOWED = {
    "getpid",  # who this process is (the zygote's fork is told apart from the daemon): no I/O
    "geteuid",  # whether the daemon runs as root (session uids, cgroups v1): no I/O
}
# signal: only its numbers (SIGKILL, SIGTERM...) and the Signals enum; a
# signal is sent through a PidFd (supervisor/spawn/pidfd.py) or the Spawner.
_SIGNAL_NAMES_ONLY = "signal"
_PATH_IO = {
    "mkdir", "chmod", "chown", "lchown", "unlink", "rmdir", "read_text", "read_bytes", "write_text",
    "write_bytes", "iterdir", "touch", "symlink_to", "lstat", "is_symlink", "exists", "is_dir", "is_file",
    "resolve", "glob", "rglob", "readlink", "samefile", "scandir", "listdir", "rmtree",
    "add_reader", "remove_reader", "add_writer", "remove_writer",
}
_HOST_FILES = ("/proc", "/sys")


def _core_io(source: str) -> list[str]:
    """What of the host's I/O a core module's source does itself, in line
    order; nothing under `if TYPE_CHECKING:` counts (names for mypy only)."""
    tree = ast.parse(source)
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for n in ast.walk(node)}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [(line, f"import {a.name}") for a in node.names
                      if a.name.split(".")[0] in CORE_IO_MODULES or a.name.startswith("os.")]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            top = (node.module or "").split(".")[0]
            if top in CORE_IO_MODULES or (node.module or "").startswith("os."):
                found.append((line, f"from {node.module} import ..."))
            elif top == "os":
                found += [(line, f"from os import {a.name}") for a in node.names if a.name not in CORE_OS_ALLOWED]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "os" and node.attr not in CORE_OS_ALLOWED:
                found.append((line, f"os.{node.attr}"))
            elif node.value.id == _SIGNAL_NAMES_ONLY and not (node.attr.startswith("SIG") or node.attr == "Signals"):
                found.append((line, f"signal.{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and any(node.value == top or node.value.startswith(top + "/") for top in _HOST_FILES):
            found.append((line, f"{node.value!r}"))
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "open":
                found.append((line, "open()"))
            elif isinstance(node.func, ast.Attribute) and node.func.attr in _PATH_IO:
                found.append((line, f".{node.func.attr}()"))
    return [f"{what} at line {line}" for line, what in sorted(found)]


def test_the_core_does_no_io_of_its_own() -> None:
    wrong = {name: hits for name, path in MODULES.items() if _folder(name) == "supervisor.core"
             if (hits := _core_io(path.read_text()))}
    assert wrong == {}


def test_the_io_checker_sees_io() -> None:
    src = ("import fcntl\nimport os\nfrom shutil import rmtree\nfrom typing import TYPE_CHECKING\n"
           "if TYPE_CHECKING:\n    import socket\n"
           "def f(p):\n    os.getpid()\n    os.stat(p)\n    open(p)\n    p.mkdir()\n    signal.SIGKILL\n"
           "    signal.signal(1, None)\n    loop.add_reader(3, f)\n    p.exists()\n"
           "    x = f'/proc/{pid}/statm'\n    y = '/sys/fs/cgroup'\n    z = '/process'\n"
           "from os import getpid, pread\nimport os.path\n")
    assert _core_io(src) == [
        "import fcntl at line 1", "from shutil import ... at line 3", "os.stat at line 9", "open() at line 10",
        ".mkdir() at line 11", "signal.signal at line 13", ".add_reader() at line 14", ".exists() at line 15",
        "'/proc/' at line 16", "'/sys/fs/cgroup' at line 17", "from os import pread at line 19",
        "import os.path at line 20",
    ]
