"""`sessionctl web` in a real headless Chromium (tests/webdriver.py), against
a real daemon whose sessions run the agent on the scripted LLM server.

One daemon, one console and one browser for the module (Chromium's start
is the slow part); each test makes its own session.  Without Chromium and
its driver the tests fail and say what to install (`make test` installs
them as root): never a silent skip.

SESSIOND_CONSOLE_SCREENSHOT=docs/console.png writes the README's picture
of the console, taken in the permission test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from fakellm import Delay, FakeLLM, Hang, Stream, chunk, text_stream, tool_call_stream
from harness import Daemon, env_for_children, wait_for
from test_story_e2e import script_the_turn
from webdriver import Browser

pytestmark = pytest.mark.process

CONFIG = """
[agent]
handler = "agent"
[agent.worker]
heartbeat_interval_secs = 0.2
restart_backoff_initial_ms = 20
[provider]
base_url = "{base_url}"
model = "test-model"
retry_backoff_initial_ms = 1
[daemon]
stop_grace_secs = 1.0
[[permissions]]
tool = "bash"
match = "*"
action = "ask"
"""


@dataclass
class Console:
    daemon: Daemon
    proc: subprocess.Popen[str]
    url: str
    port: int
    token: str
    stderr: Path

    def refusals(self) -> str:
        return self.stderr.read_text()


@pytest.fixture(scope="module")
def scripted() -> Iterator[FakeLLM]:
    with FakeLLM() as server:
        yield server


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory, scripted: FakeLLM) -> Iterator[Console]:
    root = tmp_path_factory.mktemp("web")
    d = Daemon(root / "daemon", CONFIG.format(base_url=scripted.base_url))
    proc = None
    try:
        d.start()
        stderr = root / "console.err"
        with open(stderr, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "supervisor.ctl", "--socket", str(d.socket), "web"],
                stdout=subprocess.PIPE, stderr=err, text=True, env=env_for_children(),
                start_new_session=True,
            )
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        found = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/\?token=([A-Za-z0-9_-]{40,})", url)
        assert found, f"sessionctl web printed {url!r}; stderr: {stderr.read_text()}"
        yield Console(d, proc, url, int(found.group(1)), found.group(2), stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        d.cleanup()
    d.assert_no_leftovers()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with Browser.start() as b:
        yield b


def open_session(browser: Browser, console: Console, sid: str) -> None:
    """The console's page, then the session's view (a click on its row)."""
    browser.get(console.url)
    row = f'#session-rows tr[data-session="{sid}"]'
    browser.wait(lambda: browser.text(row), 10, f"the row of {sid}")
    browser.click(row)
    browser.wait(lambda: browser.text("#view-title") == sid, 5, "the session's view")


def turn(n: int, part: str = "") -> str:
    return f'#conversation .turn[data-turn="{n}"] {part}'.rstrip()


def send_from_page(browser: Browser, text: str) -> None:
    browser.type("#input", text)
    browser.click("#btn-send")


def test_the_list_shows_a_new_session_within_a_second(console: Console, browser: Browser) -> None:
    browser.get(console.url)
    browser.wait(lambda: "pid" in (browser.text("#daemon") or ""), 10, "the console to reach sessiond")
    with console.daemon.client() as c:
        sid = c.create().id
        created = time.monotonic()
    row = f'#session-rows tr[data-session="{sid}"]'
    # Polled until a deadline of one second after the create returned.
    browser.wait(lambda: browser.text(row), 1.0 - (time.monotonic() - created), "the new session in the list")
    assert "idle" in browser.text(row) or "starting" in browser.text(row)


def test_sub_agents_are_listed_under_their_parent(console: Console, browser: Browser, scripted: FakeLLM) -> None:
    scripted.script(
        tool_call_stream(("r1", "spawn_agent", {"task": "child task"})),  # the parent
        text_stream("child result"),                                       # the sub-agent
        text_stream("parent done"),                                        # the parent
    )
    browser.get(console.url)
    with console.daemon.client() as c:
        parent = c.create().id
        assert c.send_text(parent, "delegate") == "parent done"
        child = next(s.id for s in c.list() if s.parent == parent)
    order = "return [...document.querySelectorAll('#session-rows tr')].map(r => r.getAttribute('data-session'))"
    browser.wait(lambda: child in browser.js(order), 5, "the sub-agent in the list")
    rows = browser.js(order)
    assert rows.index(child) == rows.index(parent) + 1
    assert browser.text(f'#session-rows tr[data-session="{child}"] .tree') == "└ "


def test_a_reply_streams_token_by_token_and_is_shown_as_text(
        console: Console, browser: Browser, scripted: FakeLLM) -> None:
    hostile = '<img src=x onerror="window.__pwned=1">'
    pieces = ["alpha ", hostile + " ", "beta ", "gamma"]
    events: list = [chunk({"role": "assistant", "content": ""})]
    for piece in pieces:
        events += [chunk({"content": piece}), Delay(0.3)]
    scripted.script(Stream([*events, chunk({}, "stop")]))
    with console.daemon.client() as c:
        sid = c.create().id
    open_session(browser, console, sid)
    send_from_page(browser, "count slowly")
    seen: list[str] = []

    def ended() -> bool:
        text = browser.text(turn(1, ".say")) or ""
        if text and (not seen or seen[-1] != text):
            seen.append(text)
        return bool(browser.js(f"return !!document.querySelector('{turn(1)}.ended')"))

    browser.wait(ended, 15, "the turn to end")
    final = "".join(pieces)
    assert browser.text(turn(1, ".say")) == final
    assert browser.text(turn(1, ".input .text")) == "count slowly"
    # The reply grew in the page piece by piece before it was whole.
    partial = [text for text in seen if text != final]
    assert len(partial) >= 2 and all(final.startswith(text) for text in partial), seen
    # Model output is text: no element was made of it, no handler ran.
    assert browser.js("return document.querySelectorAll('#conversation img').length") == 0
    assert browser.js("return window.__pwned === undefined")


def test_a_permission_request_is_approved_from_the_page_and_the_tool_runs(
        console: Console, browser: Browser, scripted: FakeLLM) -> None:
    command = "echo approved-$((6*7)) > proof.txt && echo wrote proof.txt"
    scripted.script(
        tool_call_stream(("c1", "bash", {"command": command, "timeout_secs": 20})),
        Stream([*text_stream("The tool wrote ", "proof.txt.").events,
                {**chunk(), "choices": [], "usage": {"prompt_tokens": 812, "completion_tokens": 64}}]),
    )
    with console.daemon.client() as c:
        sid = c.create().id
    open_session(browser, console, sid)
    send_from_page(browser, "write the proof")
    card = turn(1, ".ask")
    browser.wait(lambda: browser.text(card), 15, "the permission request")
    assert "bash" in browser.text(card + " .ask-title")
    # The full arguments, as the tool will get them.
    assert json.loads(browser.text(card + " .args")) == {"command": command, "timeout_secs": 20}
    assert not (console.daemon.workspace(sid) / "proof.txt").exists()
    browser.click(card + " .allow")
    browser.wait(lambda: browser.js(f"return !!document.querySelector('{turn(1)}.ended')"), 20, "the turn to end")
    assert browser.text(card + " .ask-status").startswith("allowed by uid ")
    assert (console.daemon.workspace(sid) / "proof.txt").read_text() == "approved-42\n"
    # The call and its result, folded (their full text is inside).
    assert "bash" in browser.text(turn(1, "details.tool.call summary"))
    assert "wrote proof.txt" in browser.text(turn(1, "details.tool.result pre"))
    assert browser.text(turn(1, ".say")) == "The tool wrote proof.txt."
    if path := os.environ.get("SESSIOND_CONSOLE_SCREENSHOT"):
        row = f'#session-rows tr[data-session="{sid}"]'
        browser.wait(lambda: "idle" in browser.text(row), 5, "the list to catch up")
        browser.js("document.querySelector(arguments[0]).open = true", turn(1, "details.tool.result"))
        Path(path).write_bytes(browser.png())


def test_limit_hits_and_restarts_are_marked(console: Console, browser: Browser, scripted: FakeLLM) -> None:
    scripted.script(tool_call_stream(("c1", "list_dir", {"path": "."})))
    with console.daemon.client() as c:
        info = c.create(settings={"agent.max_turns": 1})
    open_session(browser, console, info.id)
    send_from_page(browser, "look around")
    browser.wait(lambda: "limit turns: 1 model call reached" in (browser.text("#conversation .marker.limit") or ""),
                 15, "the limit hit")
    with console.daemon.client() as c:
        pid = c.status(info.id).pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: c.status(info.id).state == "idle" and c.status(info.id).pid != pid, 15, "the restart")
    markers = "return [...document.querySelectorAll('#conversation .marker.restart')].map(e => e.textContent)"
    browser.wait(lambda: any("crashed → restarting" in m for m in browser.js(markers)), 5,
                 "the restart to be marked")


def test_a_turn_resumed_after_its_worker_died_is_marked_and_ends_once(console: Console, browser: Browser) -> None:
    """A handler that keeps the durable-steps contract crashes in its first
    run of the turn: the page marks the resume (why, and at which step) and
    shows the one reply of the one turn."""
    with console.daemon.client() as c:
        info = c.create(handler="fixture_handlers:crash_once_steps")
    open_session(browser, console, info.id)
    send_from_page(browser, "again please")
    markers = "return [...document.querySelectorAll('#conversation .marker.restart')].map(e => e.textContent)"
    browser.wait(lambda: any("turn resumed at step 0 after crashed" in m for m in browser.js(markers)), 15,
                 "the resume to be marked")
    browser.wait(lambda: "1: again please" in (browser.text("#conversation") or ""), 15, "the turn's reply")


def test_interrupt_stop_restart_from_the_page_and_a_daemon_restart_underneath(
        console: Console, browser: Browser, scripted: FakeLLM) -> None:
    d = console.daemon
    scripted.script(Stream([chunk({"role": "assistant", "content": "partial"}), Hang()]))
    with d.client() as c:
        sid = c.create().id
    open_session(browser, console, sid)
    send_from_page(browser, "talk forever")
    browser.wait(lambda: browser.text(turn(1, ".say")) == "partial", 15, "the partial reply")
    browser.click("#btn-interrupt")
    browser.wait(lambda: "interrupted" in (browser.text(turn(1, ".end")) or ""), 15, "the interrupt")

    def state() -> str:
        with d.client() as c:
            return c.status(sid).state

    browser.click("#btn-stop")
    wait_for(lambda: state() == "stopped", 15, "the stop")
    browser.wait(lambda: browser.text("#view-state") == "stopped", 5, "the page to show it stopped")
    assert "→ stopped" in browser.js("return document.querySelector('#conversation').innerText")
    browser.click("#btn-restart")
    wait_for(lambda: state() == "idle", 15, "the restart")

    # The daemon goes away and comes back: the page says both, and goes on.
    d.stop()
    browser.wait(lambda: "cannot reach sessiond" in (browser.text("#banner") or ""), 10, "the page to say so")
    d.start()
    browser.wait(lambda: "reconnected" in (browser.text("#banner") or ""), 15, "the page to reconnect")
    browser.wait(lambda: browser.text(f'#session-rows tr[data-session="{sid}"]'), 5, "the list again")
    browser.wait(lambda: browser.text(turn(1, ".input .text")) == "talk forever", 10, "the view again")


def test_a_wrong_token_is_refused(console: Console, browser: Browser) -> None:
    base = f"http://127.0.0.1:{console.port}"
    wrong = "x" * len(console.token)
    browser.get(f"{base}/?token={wrong}")
    assert "wrong or missing token" in browser.js("return document.body.innerText")
    assert browser.js("return document.querySelector('#session-rows')") is None
    for url in (f"{base}/api/events?token={wrong}", f"{base}/api/events", f"{base}/?token="):
        assert httpx.get(url).status_code == 403, url
    # The right token at another name (DNS rebinding: a name of the
    # attacker's that resolves to 127.0.0.1): refused as well.
    rebound = httpx.get(f"{base}/api/events?token={console.token}",
                        headers={"Host": f"attacker.example:{console.port}"})
    assert rebound.status_code == 403 and "Host" in rebound.text


def test_a_request_body_past_its_bound_is_refused_unread(console: Console) -> None:
    """2 MiB at most: the console stops reading a larger body (413), and
    one just under is read (and refused for what it says, not its size)."""
    base = f"http://127.0.0.1:{console.port}"
    headers = {"Origin": base, "Content-Type": "application/json", "X-Sessiond-Token": console.token}
    url = f"{base}/api/sessions/nosuch/send"
    big = httpx.post(url, headers=headers, content=b'"' + b"x" * (2 << 20) + b'"')
    assert big.status_code == 413 and "too large" in big.text
    small = httpx.post(url, headers=headers, content=b'{"text": "' + b"x" * ((2 << 20) - 64) + b'"}')
    assert small.status_code != 413, small.text


# A page of another origin that knows the token (the worst case) tries to
# stop a session, to send it an input, and to read the list.
EVIL_PAGE = """<!doctype html><html><body>
<iframe name="sink" style="display:none"></iframe>
<form id="f" method="POST" enctype="text/plain" target="sink" action="BASE/api/sessions/SID/send?token=TOKEN">
<input name='{"text": "pwned", "pad": "' value='"}'></form>
<script>
(async () => {
  const base = "BASE", token = "TOKEN", sid = "SID", out = {};
  document.getElementById("f").submit();
  await fetch(base + "/api/sessions/" + sid + "/stop?token=" + token,
              {method: "POST", mode: "no-cors", body: "{}"})
    .then(() => out.nocors = "sent", (e) => out.nocors = "failed");
  await fetch(base + "/api/sessions/" + sid + "/stop?token=" + token,
              {method: "POST", headers: {"Content-Type": "application/json"}, body: "{}"})
    .then((r) => out.cors = "status " + r.status, (e) => out.cors = "blocked");
  await fetch(base + "/api/events?token=" + token)
    .then((r) => out.read = "status " + r.status, (e) => out.read = "blocked");
  document.title = "done " + JSON.stringify(out);
})();
</script></body></html>"""


def test_a_page_from_another_origin_cannot_drive_it(console: Console, browser: Browser) -> None:
    with console.daemon.client() as c:
        sid = c.create().id
        wait_for(lambda: c.status(sid).state == "idle", 10, "the session to start")
    page = (EVIL_PAGE.replace("BASE", f"http://127.0.0.1:{console.port}")
            .replace("TOKEN", console.token).replace("SID", sid)).encode()

    class Evil(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Evil)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # Another origin on the same machine: localhost, another port.
        browser.get(f"http://localhost:{server.server_address[1]}/")
        title = browser.wait(lambda: (t := browser.js("return document.title")).startswith("done") and t,
                             15, "the other page's attempts")
    finally:
        server.shutdown()
        server.server_close()
    out = json.loads(title.removeprefix("done "))
    assert out["cors"] == "blocked" and out["read"] == "blocked", out
    # The requests that a browser does send were refused when they arrived:
    path = f"/api/sessions/{sid}"
    log = wait_for(lambda: (log := console.refusals()).count(f"POST {path}/") >= 2 and log, 5,
                   "the console to refuse the other page's requests")
    assert f"refused POST {path}/stop: request from another origin" in log
    assert f"refused POST {path}/send: request from another origin" in log
    with console.daemon.client() as c:
        info = c.status(sid)
        assert info.state == "idle" and info.turns == 0
        assert c.history(sid).turns == []


def test_a_port_in_use_or_out_of_range_is_said(console: Console) -> None:
    taken = console.daemon.ctl("web", "--port", str(console.port), timeout=30)
    assert taken.returncode == 1
    assert f"cannot listen on 127.0.0.1:{console.port}" in taken.stderr
    assert console.daemon.ctl("web", "--port", "70000").returncode == 2
    # --json: the URL as one object.
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.ctl", "--socket", str(console.daemon.socket),
                             "--json", "web"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env_for_children())
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
    finally:
        proc.terminate()
        proc.wait(10)
    assert re.fullmatch(rf"http://127\.0\.0\.1:{first['port']}/\?token=[\w-]{{40,}}", first["url"]), first


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_ctrl_c_stops_a_console_with_pages_open_cleanly(console: Console, browser: Browser,
                                                         tmp_path: Path, sigint: str) -> None:
    """"ignored": started as a non-interactive shell starts a background job
    (`make test &`), SIGINT ignored; uvicorn still takes it, and the exit
    code (it was 0) comes from the console's own note of the Ctrl-C."""
    with console.daemon.client() as c:
        sid = c.create().id
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint == "ignored" else None
    with open(tmp_path / "err", "w") as err:
        second = subprocess.Popen(
            [sys.executable, "-m", "supervisor.ctl", "--socket", str(console.daemon.socket), "web"],
            stdout=subprocess.PIPE, stderr=err, text=True, env=env_for_children(), start_new_session=True,
            preexec_fn=ignore)
    try:
        assert second.stdout is not None
        other = Console(console.daemon, second, second.stdout.readline().strip(), 0, "", tmp_path / "err")
        open_session(browser, other, sid)  # both event streams open
        second.send_signal(signal.SIGINT)
        assert second.wait(15) == 130
    finally:
        if second.poll() is None:
            second.kill()
            second.wait(10)
    assert "Traceback" not in other.refusals(), other.refusals()
    browser.wait(lambda: "not answering" in (browser.text("#banner") or ""), 10, "the page to say so")


def test_half_open_connections_are_bounded_and_a_refused_path_is_escaped(console: Console) -> None:
    """A local user without the token opens connections and never finishes
    a request's head: past `MAX_WAITING_HEADS` the oldest are closed, and
    the user's own request still gets through.  And the path of a refused
    request reaches the console's stderr escaped: no terminal escape, no
    line of its own."""
    import socket

    from supervisor.ctl.web.conns import MAX_WAITING_HEADS
    from test_web_conns import closed_by_peer

    extra = 4
    held = []
    for _ in range(MAX_WAITING_HEADS + extra):
        s = socket.create_connection(("127.0.0.1", console.port))
        s.sendall(f"GET /?token=x HTTP/1.1\r\nHost: 127.0.0.1:{console.port}\r\n".encode())  # no end
        held.append(s)
    try:
        wait_for(lambda: all(closed_by_peer(s) for s in held[:extra]), 10, "the oldest half-open connections closed")
        assert httpx.get(console.url, timeout=10).status_code == 200
    finally:
        for s in held:
            s.close()
    with socket.create_connection(("127.0.0.1", console.port)) as s:  # (the path exactly as written)
        s.sendall(f"GET /%1b[31mred%0a2099-01-01%20forged%20line HTTP/1.1\r\nHost: 127.0.0.1:{console.port}\r\n"
                  "\r\n".encode())
        s.settimeout(10)
        answer = b""
        while chunk := s.recv(4096):  # (read to the end: the console closes a refused connection)
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 403") and b"connection: close" in answer.lower()
    wait_for(lambda: "[31mred" in console.refusals(), 5, "the refusal on stderr")
    assert "\x1b" not in console.refusals() and "\n2099-01-01" not in console.refusals()
    assert "\\x1b[31mred\\n2099-01-01 forged line" in console.refusals()


# ---------------------------------------------------------------- a person in the loop

# A turn's rendering, as one line per part of its reply (class and the text
# that shows folded), then its end; clock times masked (live markers are
# timed on arrival, stored ones by the daemon).
TURN_PARTS = """
const turn = document.querySelector('#conversation .turn[data-turn="' + arguments[0] + '"]');
if (!turn) return null;
const parts = [...turn.querySelectorAll('.reply > *')].map((n) => {
  const summary = n.querySelector(':scope > summary');
  const what = n.classList.contains('ask')
    ? n.querySelector('.ask-title').textContent + ' ' + n.querySelector('.args').textContent + ' | ' +
      n.querySelector('.ask-status').textContent
    : summary ? summary.textContent : n.textContent;
  return n.className + ' :: ' + what;
});
return [...parts, 'end :: ' + turn.querySelector('.end').textContent];
"""


def turn_parts(browser: Browser, n: int) -> list[str] | None:
    parts = browser.js(TURN_PARTS, n)
    return None if parts is None else [re.sub(r"\d{1,2}:\d\d:\d\d(\s?[AP]M)?", "T", p) for p in parts]


def ended(browser: Browser, n: int) -> bool:
    return bool(browser.js(f"return !!document.querySelector('{turn(n)}.ended')"))


def test_a_waiting_session_is_badged_counted_in_the_title_and_its_request_kept_in_view(
        console: Console, browser: Browser, scripted: FakeLLM) -> None:
    long = "\n".join(f"line {i}" for i in range(60))
    scripted.script(text_stream(long), text_stream(long),
                    tool_call_stream(("c1", "bash", {"command": "echo from-sessionctl"})), text_stream("ran"))
    with console.daemon.client() as c:
        sid = c.create().id
        for _ in range(2):
            c.send_text(sid, "talk")
    open_session(browser, console, sid)
    browser.wait(lambda: ended(browser, 2), 10, "the stored turns")
    # The person reads an earlier turn: the view is scrolled to the top.
    browser.js("document.querySelector('#conversation').scrollTop = 0")
    row = f'#session-rows tr[data-session="{sid}"]'
    with console.daemon.client() as c:
        c.send_input(sid, "run it")
    card = turn(3, ".ask")
    browser.wait(lambda: browser.text(card), 15, "the permission request")
    # In view however the view was scrolled, and said above it.
    in_view = """
    const card = document.querySelector(arguments[0]).getBoundingClientRect();
    const box = document.querySelector('#conversation').getBoundingClientRect();
    return card.top >= box.top - 1 && card.bottom <= box.bottom + 1;"""
    browser.wait(lambda: browser.js(in_view, card), 5, "the card in view")
    assert "waiting on you: bash (request " in browser.text("#waiting")
    # The list: a badge on the row, a count in the page's title.
    browser.wait(lambda: browser.js(f"return !document.querySelector('{row} .state-waiting').hidden"), 5,
                 "the waiting badge")
    assert browser.js("return document.title") == "(1 waiting) sessiond console"
    # Answered from sessionctl, by the session alone: the page says who and when.
    approve = console.daemon.ctl("approve", sid)
    assert approve.returncode == 0, approve.stderr
    browser.wait(lambda: re.fullmatch(r"allowed by uid \d+ \(sessionctl\) at .+",
                                      browser.text(card + " .ask-status") or ""), 10, "who answered")
    browser.wait(lambda: ended(browser, 3), 15, "the turn's end")
    assert browser.js("return document.querySelector('#waiting').hidden")
    browser.wait(lambda: browser.js(f"return document.querySelector('{row} .state-waiting').hidden"), 5,
                 "the badge gone")
    assert browser.js("return document.title") == "sessiond console"


def test_one_turn_reads_the_same_live_after_a_reload_and_after_a_daemon_restart(
        console: Console, browser: Browser, scripted: FakeLLM) -> None:
    """A permission request allowed from the page, a tool that fails, the
    worker SIGKILLed in an LLM call and the turn resumed: rendered live,
    then from what the daemon stored (a reload), then again after the
    daemon restarted; the three are the same."""
    d = console.daemon
    asked = len(scripted.requests)
    script_the_turn(scripted, "echo from-the-page")
    with d.client() as c:
        sid = c.create().id
    open_session(browser, console, sid)
    send_from_page(browser, "go")
    card = turn(1, ".ask")
    browser.wait(lambda: browser.text(card), 15, "the permission request")
    browser.click(card + " .allow")
    wait_for(lambda: len(scripted.requests) >= asked + 3, 15, "the third LLM call")
    with d.client() as c:
        os.kill(c.status(sid).pid, signal.SIGKILL)
    browser.wait(lambda: ended(browser, 1), 20, "the turn's end")
    live = turn_parts(browser, 1)
    assert live is not None
    assert [p.split(" :: ")[0] for p in live] == [
        "tool call", "ask settled", "tool result ok", "tool call", "tool result failed",
        "marker restart", "marker restart", "marker restart", "say", "end"], live
    assert re.fullmatch(r"ask settled :: permission request: bash \{.*from-the-page.*\} \| allowed by uid \d+ "
                        r"\(sessionctl-web\) at T", live[1].replace("\n", " ")), live[1]
    assert live[5].startswith("marker restart :: T  running → crashed") and "turn resumed at step 4" in live[7]
    assert live[8] == "say :: all done" and live[9] == "end :: done", live
    # A reload: the turn as the daemon stored it.
    open_session(browser, console, sid)
    browser.wait(lambda: ended(browser, 1), 10, "the stored turn")
    assert turn_parts(browser, 1) == live
    # The daemon restarts underneath: the page reconnects and reads it back
    # (into a new turn node: the old one is marked).
    browser.js("document.querySelector(arguments[0]).dataset.before = '1'", turn(1))
    d.stop()
    browser.wait(lambda: "cannot reach sessiond" in (browser.text("#banner") or ""), 10, "the page to say so")
    d.start()
    browser.wait(lambda: "reconnected" in (browser.text("#banner") or ""), 15, "the page to reconnect")
    browser.wait(lambda: browser.js("return !document.querySelector(arguments[0]).dataset.before", turn(1))
                 and turn_parts(browser, 1) == live, 10, "the same turn after the restart")
