"""`sessionctl web [--port N]` (runs in the sessionctl process of the user
who starts it): bind 127.0.0.1, make the token, print the URL, serve until
Ctrl-C.  uvicorn serves the app on this process's event loop; the daemon
is reached through the client library over the control socket.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import socket
import sys
from types import FrameType

from ipc.install import install_command
from ipc.loop import run as run_loop
from supervisor.ctl.client import AsyncClient
from supervisor.ctl.errors import DaemonUnavailable, RequestError
from supervisor.ctl.render import EXIT_FAILED, EXIT_OK, EXIT_SIGINT

__all__ = ["run_web"]

_NEEDS_EXTRA = "sessionctl web needs starlette and uvicorn, the 'web' extra: "


def run_web(socket_path: str | None, port: int, as_json: bool = False) -> int:
    """Serve until Ctrl-C.  The URL is the first line on stdout (with
    `as_json`: `{"url": ..., "port": ...}`), once the port is bound."""
    try:
        import uvicorn

        from supervisor.ctl.web.app import build_app
        from supervisor.ctl.web.conns import bounded_h11
        from supervisor.ctl.web.guard import Guard
    except ImportError as exc:
        print(f"sessionctl: {_NEEDS_EXTRA}{install_command('web')} ({exc})", file=sys.stderr)
        return EXIT_FAILED
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Loopback only, whatever the machine's interfaces: the console
        # acts with this user's rights over the control socket.
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
    except OSError as exc:
        listener.close()
        print(f"sessionctl: cannot listen on 127.0.0.1:{port}: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILED
    port = listener.getsockname()[1]
    token = secrets.token_urlsafe(32)

    async def connect() -> AsyncClient:
        # (0: the feed reconnects by itself, and tells the page: supervisor.ctl.web.feed)
        return await AsyncClient.connect(socket_path, client_name="sessionctl-web", reconnect_secs=0)

    closing = asyncio.Event()
    config = uvicorn.Config(
        # h11 with a deadline and a cap on connections whose request head is not in (conns.py).
        build_app(Guard(token, port), connect, closing), http=bounded_h11(), ws="none", lifespan="off",
        log_config=None, log_level="warning", access_log=False, server_header=False,
        # Never take the client's address from X-Forwarded-For: the guard
        # needs the request as the browser sent it.
        proxy_headers=False, timeout_graceful_shutdown=1,
    )

    class Server(uvicorn.Server):
        interrupted = False  # a Ctrl-C stopped it: exit 130, whatever else comes of the signal

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            self.interrupted = self.interrupted or sig == signal.SIGINT
            # A signal handler: only enqueue.  The streams end on the loop.
            loop.call_soon_threadsafe(closing.set)

    server = Server(config)
    loop: asyncio.AbstractEventLoop

    url = f"http://127.0.0.1:{port}/?token={token}"
    print(json.dumps({"url": url, "port": port}) if as_json else url, flush=True)
    print("sessionctl web: open the URL above in a browser on this machine; Ctrl-C stops",
          file=sys.stderr, flush=True)

    async def serve() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        try:
            client = await connect()
            await client.close()
        except (DaemonUnavailable, RequestError) as exc:
            print(f"sessionctl web: {exc}; the page shows the sessions once sessiond answers",
                  file=sys.stderr, flush=True)
        await server.serve(sockets=[listener])

    # The exit code comes from our own note of the Ctrl-C: uvicorn stops,
    # then raises the signal again, and whether that surfaces here as a
    # KeyboardInterrupt, a cancelled main task or nothing at all depends on
    # which handler it meets and when (a console with pages open exited 0).
    try:
        run_loop(serve())
    except KeyboardInterrupt:
        return EXIT_SIGINT
    except asyncio.CancelledError:
        if not server.interrupted:
            raise
        return EXIT_SIGINT
    finally:
        listener.close()
    return EXIT_SIGINT if server.interrupted else EXIT_OK
