"""The console's HTTP side (runs in the `sessionctl web` process): an ASGI
app built with starlette.

    GET  /?token=T                         the page (static/index.html)
    GET  /static/NAME                      its script and style sheet
    GET  /api/events?token=T               the session list (server-sent events)
    GET  /api/sessions/ID/events?token=T   one session's conversation (server-sent events)
    POST /api/sessions/ID/ACTION           send {text}, interrupt, stop, restart,
                                           answer {request_id, allow}; JSON in, JSON out

Every request first passes the guard (guard.py); a refusal is a 403 with
the reason, and a line on stderr.  Every response carries a Content
Security Policy that lets the page run only its own script (no inline
script, no other origin), and no CORS header.  The page puts what sessions
produce into the document as text only (static/app.js).

Each event stream and each action opens its own connection to the daemon
(an action: for the one request), as the user who runs the console.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ipc.inputs import valid_session_id
from ipc.logfields import escape
from supervisor.ctl.client import AsyncClient
from supervisor.ctl.errors import DaemonUnavailable, RequestError
from supervisor.ctl.web.feed import Connect, Emit, session_list, session_view
from supervisor.ctl.web.guard import Guard

__all__ = ["build_app"]

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    # The token is in the page's URL: never hand it on.
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
_ASSET_TYPES = {"app.js": "text/javascript; charset=utf-8", "app.css": "text/css; charset=utf-8"}
MAX_BODY_BYTES = 2 * 1024 * 1024
# A stream that a page stopped reading is cut past this many unsent
# events; the page's EventSource reconnects and starts from a snapshot.
MAX_QUEUED_EVENTS = 10_000
KEEPALIVE_SECS = 15.0
_PATH_SHOWN = 256  # characters of a refused path the log line shows
# What the daemon's errors are, in HTTP.
_STATUS = {"not_found": 404, "bad_request": 400, "conflict": 409, "permission_denied": 403,
           "capacity": 503, "limit_exceeded": 429}


def _asset(name: str) -> bytes:
    return resources.files("supervisor.ctl.web").joinpath("static", name).read_bytes()


class _Guarded:
    """ASGI middleware: the guard before anything else, the security
    headers on everything."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        path = request.url.path
        why = self.guard.refusal(
            request.method, request.headers, request.query_params.get("token"),
            needs_token=not path.startswith("/static/"), page=path == "/",
        )
        if why is not None:
            # The path is the client's (decoded: %1b is ESC): escaped, so a
            # refusal cannot write terminal escapes or lines of its own.
            shown = escape(str(scope.get("path", ""))[:_PATH_SHOWN])
            print(f"sessionctl web: refused {escape(request.method)} {shown}: {why}",
                  file=sys.stderr, flush=True)
            # Closed once answered: a client the guard refuses holds no connection (conns.py).
            refused = PlainTextResponse(f"refused: {why}\n", status_code=403, headers={"Connection": "close"})
            await _with_headers(refused)(scope, receive, send)
            return

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      *((k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items())]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _with_headers(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response


def build_app(guard: Guard, connect: Connect, closing: asyncio.Event) -> ASGIApp:
    """`closing`: set when the console is stopping; the event streams end
    then, so that the server's graceful shutdown does not wait on them."""
    page = _asset("index.html")
    assets = {name: _asset(name) for name in _ASSET_TYPES}

    async def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8")

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in assets:
            return PlainTextResponse("not found\n", status_code=404)
        return Response(assets[name], media_type=_ASSET_TYPES[name])

    async def list_events(request: Request) -> Response:
        return _stream(lambda emit: session_list(connect, emit), closing)

    async def session_events(request: Request) -> Response:
        sid = request.path_params["sid"]
        if not valid_session_id(sid):
            return JSONResponse({"ok": False, "message": f"invalid session id {sid!r}"}, status_code=400)
        return _stream(lambda emit: session_view(connect, sid, emit), closing)

    async def action(request: Request) -> Response:
        sid, name = request.path_params["sid"], request.path_params["action"]
        if not valid_session_id(sid):
            return _failed(400, f"invalid session id {sid!r}")
        if name not in _ACTIONS:
            return _failed(404, f"no action {name!r}")
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > MAX_BODY_BYTES:
                return _failed(413, "request body too large")
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return _failed(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _failed(400, "the body must be a JSON object")
        args = _arguments(name, body)
        if isinstance(args, str):
            return _failed(400, args)
        try:
            client = await connect()
        except (DaemonUnavailable, RequestError) as exc:
            return _failed(503, str(exc))
        try:
            return JSONResponse({"ok": True, **await _act(client, sid, name, args)})
        except RequestError as exc:
            return _failed(_STATUS.get(exc.code, 500), exc.message, exc.code)
        except DaemonUnavailable as exc:
            return _failed(503, str(exc))
        finally:
            await client.close()

    routes = [
        Route("/", index),
        Route("/static/{name}", static),
        Route("/api/events", list_events),
        Route("/api/sessions/{sid}/events", session_events),
        Route("/api/sessions/{sid}/{action}", action, methods=["POST"]),
    ]
    return _Guarded(Starlette(routes=routes), guard)


def _failed(status: int, message: str, code: str = "") -> Response:
    return JSONResponse({"ok": False, "code": code, "message": message}, status_code=status)


_ACTIONS = ("send", "answer", "interrupt", "stop", "restart")


def _arguments(action: str, body: dict[str, Any]) -> dict[str, Any] | str:
    """The action's arguments from its JSON body, or why they are wrong."""
    if action == "send":
        text = body.get("text")
        if not isinstance(text, str) or not text:
            return "expected 'text': a non-empty string"
        return {"text": text}
    if action == "answer":
        request_id, allow = body.get("request_id"), body.get("allow")
        if not isinstance(request_id, str) or not 0 < len(request_id) <= 200:
            return "expected 'request_id': the request's id"
        if not isinstance(allow, bool):
            return "expected 'allow': true or false"
        return {"request_id": request_id, "allow": allow}
    return {}


async def _act(client: AsyncClient, sid: str, action: str, args: dict[str, Any]) -> dict[str, Any]:
    match action:
        case "send":
            accepted = await client.send_input(sid, args["text"])
            return {"turn": accepted.turn}
        case "answer":
            await client.answer(sid, args["request_id"], args["allow"])
        case "interrupt":
            await client.interrupt(sid)
        case "stop":
            await client.stop(sid)
        case "restart":
            await client.restart(sid)
    return {}


def _stream(feed: Callable[[Emit], Coroutine[Any, Any, None]], closing: asyncio.Event) -> Response:
    return StreamingResponse(_sse(feed, closing), media_type="text/event-stream",
                             headers={"x-accel-buffering": "no"})


async def _sse(feed: Callable[[Emit], Coroutine[Any, Any, None]],
               closing: asyncio.Event) -> AsyncIterator[bytes]:
    """The feed runs in a task of its own and hands its events over a
    queue, so that a quiet feed still lets a keep-alive through (and so a
    page that went away is noticed), the stream ends when the console
    stops, and the feed is cancelled cleanly when the page goes."""
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def run() -> None:
        try:
            await feed(queue.put_nowait)
        except Exception as exc:  # a defect: tell the page rather than hang it
            queue.put_nowait({"type": "error", "message": f"{type(exc).__name__}: {exc}"})
        queue.put_nowait(None)

    task = asyncio.create_task(run())
    closed = asyncio.ensure_future(closing.wait())
    getter: asyncio.Future[dict[str, Any] | None] | None = None
    try:
        # Reconnect soon if the console restarts (EventSource's retry).
        yield b"retry: 1000\n\n"
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, closed}, timeout=KEEPALIVE_SECS,
                                         return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                if closed in done:
                    return
                yield b": keep-alive\n\n"
                continue
            item = getter.result()
            if item is None or queue.qsize() > MAX_QUEUED_EVENTS:
                return
            yield b"data: " + json.dumps(item).encode() + b"\n\n"
    finally:
        # Not awaited: this generator may itself be being cancelled (the
        # page went away); the task closes its daemon connection on its own.
        # The getter too: left waiting on the queue, it was collected later
        # as "Task was destroyed but it is pending!" on the console's stderr.
        task.cancel()
        closed.cancel()
        if getter is not None:
            getter.cancel()
