from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

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
def make_daemon(tmp_path: Path) -> Iterator[callable]:
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


# The test tiers (STYLE.md, "Tests"), registered in pyproject.toml.  Every
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
            "`@pytest.mark.<tier>` on each test otherwise (see STYLE.md)\n" + "\n".join(problems)
        )
