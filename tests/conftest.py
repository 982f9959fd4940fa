from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import harness
from fakellm import FakeLLM
from harness import Daemon
from pg_server import pg_server  # noqa: F401 (a session-scoped fixture: one server a run)

FAST_CONFIG = """
[agent.worker]
heartbeat_interval_secs = 0.2
restart_backoff_initial_ms = 20
[daemon]
stop_grace_secs = 2.0
shutdown_grace_secs = 5.0
"""


@pytest.fixture
def reachable_dir() -> Iterator[Callable[..., Path]]:
    """`reachable_dir(prefix, mode=0o711)`: a new directory in the temp dir
    (short paths: a Unix socket's is at most 108 bytes) that other uids may
    pass through (pytest's tmp_path is private to root), as a daemon's
    root under /var/lib is.  Removed after the test's daemons are gone:
    `make_daemon` asks for this fixture, so it is torn down first; a
    directory removed while its daemon still ran was written again and
    left behind."""
    made: list[Path] = []

    def make(prefix: str, mode: int = 0o711) -> Path:
        path = Path(tempfile.mkdtemp(prefix=prefix))
        made.append(path)
        os.chmod(path, mode)
        return path

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_daemon(tmp_path: Path, reachable_dir: Callable[..., Path]) -> Iterator[callable]:
    made: list[Daemon] = []

    def make(
        config: str = FAST_CONFIG, start: bool = True, root: Path | None = None, trust: bool = True
    ) -> Daemon:
        d = Daemon(root or tmp_path / f"d{len(made)}", config, trust=trust)
        made.append(d)
        if start:
            d.start()
        return d

    yield make
    for d in made:
        d.cleanup()
    for d in made:
        d.assert_no_leftovers()


@pytest.fixture
def llm() -> Iterator[FakeLLM]:
    """A scripted OpenAI-compatible server on loopback (tests/fakellm.py)."""
    with FakeLLM() as server:
        yield server


@pytest.fixture
def daemon(make_daemon) -> Daemon:
    return make_daemon()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Every Daemon's directories in the temp dir, also of those a test made
    without `make_daemon` and never cleaned up (never started, or only
    stopped): a run leaves the temp dir as it found it.  Each fixture is
    torn down by now; only directories go, never a process."""
    for d in harness.MADE:
        d.remove_temp_dirs()


# The test tiers (ARCHITECTURE.md, "Tests and benches"), registered in pyproject.toml.  Every
# test names exactly one, so `make test-fast` (-m "not process") is a
# promise about what it runs, not a guess.
TIERS = ("pure", "protocol", "component", "process")


@pytest.hookimpl(tryfirst=True)  # before -m/-k deselect anything: check every collected test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problems = []
    for item in items:
        tiers = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
        if len(tiers) != 1:
            problems.append(f"  {item.nodeid}: {', '.join(tiers) if tiers else 'no tier'}")
    if problems:
        raise pytest.UsageError(
            f"every test needs exactly one tier marker ({', '.join(TIERS)}): "
            "`pytestmark = pytest.mark.<tier>` for a file of one tier, "
            "`@pytest.mark.<tier>` on each test otherwise (see ARCHITECTURE.md, 'Tests and benches')\n" + "\n".join(problems)
        )
    _longest_files_first(config, items)


def _longest_files_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under --dist loadfile (make test) each file goes whole to the next
    worker that is free, in the order collected: a long file collected late
    (alphabetically) ran on while the other workers had nothing left.  The
    files with the most process-tier tests (each one seconds long, the
    others milliseconds) go first, the short ones fill in at the end, as a
    longest-first schedule does.  Stable: a file's tests keep their order."""
    workerinput = getattr(config, "workerinput", {})  # an xdist worker's: its own `dist` is "no"
    if workerinput.get("dist", config.getoption("dist", "no")) != "loadfile":
        return
    process = Counter(item.path for item in items if item.get_closest_marker("process") is not None)
    items.sort(key=lambda item: -process[item.path])


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """(xdist, in the controller) tells each worker the run's --dist, for
    `_longest_files_first`: the schedule is made from the workers' order."""
    node.workerinput["dist"] = node.config.getoption("dist")


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection left alive (sessiond's modules and the tests', the
    libraries they import: ~120,000 objects the collector tracks) lives
    for the whole run: moved out of the garbage collector's sight, as
    CPython's gc.freeze is meant for, so that each full collection a
    test's garbage sets off stops walking it.  Objects made from here on
    are collected as ever.  make test-fast, same machine, back to back:
    2.3 s of the two workers' CPU went to collections, 1.0 s with this."""
    gc.freeze()


# A failed test that ran a daemon shows that daemon's log: what it said
# before the assertion is most often the reason.  Each daemon made from the
# start of the test's setup on (tests/harness.py `MADE`) counts, whichever
# fixture or helper made it; the tail only, so a chatty daemon does not
# bury the assertion.
LOG_TAIL_LINES = 80
LOG_TAIL_CHARS = 12_000
_FIRST_DAEMON = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_FIRST_DAEMON] = len(harness.MADE)


def _log_tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - LOG_TAIL_CHARS))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    lines = text.splitlines()[-LOG_TAIL_LINES:]
    return "\n".join(lines) if lines else "(empty)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed or _FIRST_DAEMON not in item.stash:
        return
    for d in harness.MADE[item.stash[_FIRST_DAEMON]:]:
        report.sections.append(
            (f"sessiond log ({report.when}): {d.log_path} (last {LOG_TAIL_LINES} lines)",
             _log_tail(d.log_path))
        )
