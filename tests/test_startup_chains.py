"""The daemon's refusals keep their cause (`raise ... from
exc`): the OSError or lookup under a StartupError stays on it for whoever
debugs it, while sessiond prints the one line (supervisor/cli.py).  Where
the cause could quote a secret (the PostgreSQL driver's errors, which may
hold the DSN), the daemon keeps `from None`."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor import startup
from supervisor.core.drainreq import check_request
from supervisor.errors import BadRequest, StartupError
from supervisor.host.users import resolve_group

@pytest.mark.component
def test_a_state_directory_that_cannot_be_made_keeps_its_oserror(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(StartupError, match="is not usable") as caught:
        startup.check_state_dir(blocker / "state")
    assert isinstance(caught.value.__cause__, OSError), caught.value.__cause__


@pytest.mark.component
def test_a_socket_directory_that_cannot_be_made_keeps_its_oserror(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(StartupError, match="cannot create the socket directory") as caught:
        startup.prepare_socket_path(blocker / "run" / "sessiond.sock")
    assert isinstance(caught.value.__cause__, OSError), caught.value.__cause__


@pytest.mark.component
def test_an_unknown_socket_group_keeps_the_lookup_that_failed() -> None:
    with pytest.raises(StartupError, match="no such group") as caught:
        resolve_group("sessiond-no-such-group-31")
    assert isinstance(caught.value.__cause__, KeyError), caught.value.__cause__


@pytest.mark.pure
def test_a_drain_request_naming_no_node_keeps_the_parse_that_failed() -> None:
    with pytest.raises(BadRequest, match="neither an IP address nor a Ray node id") as caught:
        check_request("not-a-node", None)
    assert isinstance(caught.value.__cause__, ValueError), caught.value.__cause__
