from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import Daemon

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
def daemon(make_daemon) -> Daemon:
    return make_daemon()
