"""The web console without a browser: the guard (supervisor/ctl/web/guard.py,
which requests pass, on headers alone; test_web_console.py shows a real
browser sending them), and the page's files shipped as package data."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import pytest

from supervisor.ctl.web.guard import Guard

pytestmark = pytest.mark.pure

TOKEN = "t0ken-" + "x" * 40
PORT = 8123
HOST = f"127.0.0.1:{PORT}"
ORIGIN = f"http://{HOST}"
guard = Guard(TOKEN, PORT)


def refusal(method: str = "GET", token: str | None = TOKEN, **headers: str) -> str | None:
    base = {"host": HOST}
    base.update({k.replace("_", "-"): v for k, v in headers.items()})
    return guard.refusal(method, base, token)


def test_the_page_s_own_requests_pass() -> None:
    assert refusal() is None
    assert refusal(sec_fetch_site="same-origin") is None
    assert guard.refusal("GET", {"host": HOST, "sec-fetch-site": "none"}, TOKEN, page=True) is None
    assert refusal("POST", token=None, origin=ORIGIN, content_type="application/json",
                   x_sessiond_token=TOKEN, sec_fetch_site="same-origin") is None
    assert refusal(host=f"localhost:{PORT}", origin=f"http://localhost:{PORT}") is None
    assert guard.refusal("GET", {"host": HOST}, None, needs_token=False) is None


@pytest.mark.parametrize("token", [None, "", "wrong", TOKEN[:-1], TOKEN + "x", TOKEN.upper()])
def test_a_wrong_or_missing_token_is_refused(token: str | None) -> None:
    assert refusal(token=token) == "wrong or missing token"
    assert refusal(token=None, x_sessiond_token=token or "") == "wrong or missing token"


@pytest.mark.parametrize("host", ["attacker.example:8123", "127.0.0.1:8124", "127.0.0.1", "", "0.0.0.0:8123",
                                  "[::1]:8123"])
def test_another_host_is_refused_even_with_the_token(host: str) -> None:
    assert "Host" in (refusal(host=host) or "")


@pytest.mark.parametrize("origin", ["http://localhost:9000", "http://127.0.0.1:8124", "null",
                                    "https://127.0.0.1:8123", "http://attacker.example"])
def test_another_origin_is_refused(origin: str) -> None:
    assert refusal(origin=origin) == "request from another origin"
    assert refusal("POST", origin=origin, content_type="application/json") == "request from another origin"


def test_a_post_must_carry_the_origin_and_json() -> None:
    assert "Origin" in (refusal("POST", content_type="application/json") or "")
    assert "JSON" in (refusal("POST", origin=ORIGIN, content_type="text/plain") or "")
    assert "JSON" in (refusal("POST", origin=ORIGIN) or "")
    assert refusal("POST", origin=ORIGIN, content_type="application/json; charset=utf-8") is None


@pytest.mark.parametrize("site", ["cross-site", "same-site"])
def test_a_request_from_another_site_is_refused(site: str) -> None:
    assert "another site" in (refusal(sec_fetch_site=site) or "")
    assert "another site" in (guard.refusal("GET", {"host": HOST, "sec-fetch-site": site}, TOKEN, page=True) or "")


def test_none_is_for_the_page_alone() -> None:
    # Sec-Fetch-Site: none is a typed URL: the page, not the API.
    assert "another site" in (refusal(sec_fetch_site="none") or "")


def test_the_page_s_files_are_package_data() -> None:
    # A wheel carries only the files package-data names: the page must be among them.
    repo = Path(__file__).resolve().parent.parent
    globs = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    web = repo / "supervisor" / "ctl" / "web"
    shipped = [p for p in (web / "static").iterdir()
               if any(fnmatch.fnmatch(str(p.relative_to(web)), g) for g in globs["supervisor.ctl.web"])]
    assert {p.name for p in shipped} == {"index.html", "app.js", "app.css"}



def test_a_missing_extra_is_installed_by_a_command_for_this_install(tmp_path: Path) -> None:
    """In a checkout (README: `make run`) the package is the checkout in
    its .venv: the command is that venv's pip with -e and the checkout, not
    `pip install 'sessiond[web]'` (another copy, maybe another Python)."""
    from ipc.install import install_command

    checkout = tmp_path / "sessiond"
    (checkout / ".venv" / "bin").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    (checkout / ".venv" / "pyvenv.cfg").write_text("")
    (checkout / ".venv" / "bin" / "pip").write_text("")
    python = str(checkout / ".venv" / "bin" / "python")
    assert install_command("web", checkout, python, str(checkout)) == ".venv/bin/pip install -e '.[web]'"
    assert install_command("web", checkout, python, "/elsewhere") == \
        f"{checkout}/.venv/bin/pip install -e '{checkout}[web]'"
    # An installed release: the pip of the Python it runs on.
    site = tmp_path / "lib" / "site-packages"
    site.mkdir(parents=True)
    assert install_command("mcp", site, "/usr/bin/python3", "/home/me") == \
        "/usr/bin/python3 -m pip install 'sessiond[mcp]'"
