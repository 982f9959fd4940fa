"""A real headless Chromium for tests, driven over WebDriver (W3C) with httpx.

The distribution's `chromium` and `chromedriver` (Debian: the packages
chromium and chromium-driver; `make system-deps` installs them as root).
No selenium: the few WebDriver commands the tests need are plain HTTP
calls to chromedriver, which starts and drives the browser.

    with Browser.start() as browser:
        browser.get("http://127.0.0.1:PORT/?token=...")
        browser.js("return document.title")
        browser.click("#btn-stop")
        browser.png()            # a screenshot, PNG bytes
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

__all__ = ["Browser", "BrowserMissing", "find_browser"]

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


class BrowserMissing(RuntimeError):
    pass


def find_browser() -> tuple[str, str]:
    """(chromium, chromedriver) paths, or BrowserMissing naming what to install."""
    browser = os.environ.get("SESSIOND_TEST_CHROMIUM") or next(
        (p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)
    driver = os.environ.get("SESSIOND_TEST_CHROMEDRIVER") or shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", browser), ("chromium-driver", driver)) if not path]
    if missing:
        raise BrowserMissing(
            "the web console's browser tests need a headless Chromium and its driver: install "
            f"{' and '.join(missing)} (Debian/Ubuntu: apt-get install chromium chromium-driver; "
            "`make test` does it as root)")
    assert browser is not None and driver is not None
    return browser, driver


class Browser:
    def __init__(self, driver: subprocess.Popen[str], base: str, session: str, profile: str) -> None:
        self._driver = driver
        self._http = httpx.Client(base_url=f"{base}/session/{session}", timeout=60)
        self._profile = profile
        self._base = base
        self.session = session

    @classmethod
    @contextlib.contextmanager
    def start(cls, width: int = 1280, height: int = 800) -> Iterator[Browser]:
        chromium, chromedriver = find_browser()
        profile = tempfile.mkdtemp(prefix="sd-chromium-")
        # Chromium's own temp dirs (org.chromium.Chromium.*, which a killed
        # browser leaves) go into the profile, removed below.
        scratch = os.path.join(profile, "tmp")
        os.mkdir(scratch)
        # --port=0: the driver picks a free port and says which.
        driver = subprocess.Popen([chromedriver, "--port=0"], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                  env={**os.environ, "TMPDIR": scratch})
        browser: Browser | None = None
        try:
            assert driver.stdout is not None
            port = None
            for line in driver.stdout:
                if found := re.search(r"started successfully on port (\d+)", line):
                    port = int(found.group(1))
                    break
            if port is None:
                raise BrowserMissing(f"chromedriver did not start (exit {driver.wait(5)})")
            base = f"http://127.0.0.1:{port}"
            args = ["--headless=new", "--disable-gpu", "--no-first-run", "--disable-extensions",
                    "--disable-background-networking", "--disable-sync", f"--user-data-dir={profile}",
                    f"--window-size={width},{height}", "--hide-scrollbars"]
            if os.geteuid() == 0:
                args.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
            reply = httpx.post(f"{base}/session", timeout=60, json={"capabilities": {"alwaysMatch": {
                "browserName": "chrome", "goog:chromeOptions": {"binary": chromium, "args": args}}}})
            reply.raise_for_status()
            browser = cls(driver, base, reply.json()["value"]["sessionId"], profile)
            yield browser
        finally:
            if browser is not None:
                with contextlib.suppress(httpx.HTTPError):
                    browser._http.delete("")
                browser._http.close()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(driver.pid, 9)
            driver.wait(10)
            if driver.stdout is not None:
                driver.stdout.close()
            shutil.rmtree(profile, ignore_errors=True)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        reply = self._http.request(method, path, json=body)
        data = reply.json()
        if reply.status_code != 200:
            raise AssertionError(f"webdriver {method} {path}: {data.get('value', data)}")
        return data["value"]

    def get(self, url: str) -> None:
        self._call("POST", "/url", {"url": url})

    def js(self, script: str, *args: Any) -> Any:
        """Run `script` (a function body: `return ...`) in the page."""
        return self._call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def text(self, selector: str) -> str | None:
        """The text of the first element `selector` matches, or None."""
        value: str | None = self.js(
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : null", selector)
        return value

    def click(self, selector: str) -> None:
        element = self._call("POST", "/element", {"using": "css selector", "value": selector})
        self._call("POST", f"/element/{next(iter(element.values()))}/click", {})

    def type(self, selector: str, text: str) -> None:
        element = self._call("POST", "/element", {"using": "css selector", "value": selector})
        self._call("POST", f"/element/{next(iter(element.values()))}/value", {"text": text})

    def png(self) -> bytes:
        return base64.b64decode(self._call("GET", "/screenshot"))

    def wait(self, predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what} "
                                     f"(page: {self.js('return document.body.innerText')[:2000]!r})")
            time.sleep(0.02)
