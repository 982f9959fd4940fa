"""`sessionctl web`: the web console (run by the sessionctl process of the
user who starts it, never by the daemon).  A small ASGI app (starlette,
served by uvicorn: the optional `web` extra) on 127.0.0.1 behind a token;
it reaches the daemon only through the client library, over the control
socket, with that user's credentials, so it sees what `sessionctl` would.

    guard.py    who may ask: the token, Host, Origin and Sec-Fetch-Site checks (pure)
    feed.py     what the page is told: the session list and one session's
                conversation, as JSON events, reconnecting to the daemon
    app.py      the routes, the event streams (SSE), the actions
    serve.py    the command: bind, print the URL, serve until Ctrl-C
    static/     the page: plain HTML, JS and CSS, no build step

May import ipc/ and the rest of supervisor/ctl/ (the client library), the
standard library, starlette and uvicorn.
"""
