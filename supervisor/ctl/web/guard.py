"""Who may talk to the console (pure; runs in the `sessionctl web` process).

The console listens on 127.0.0.1, but every page the user's browser opens
can send requests there, and a name an attacker controls can be made to
resolve to 127.0.0.1 (DNS rebinding).  So each request passes, in order:

- Host: exactly the console's own address (127.0.0.1:PORT or
  localhost:PORT).  A rebound name arrives with the attacker's Host.
- Origin: when the browser sends one (it does for every POST and every
  cross-origin request), it must be the console's own origin.  A POST
  without one is refused: the page's own always carry it.
- Sec-Fetch-Site: when sent, `same-origin`, or `none` for the page itself
  (a typed or bookmarked URL).  This catches the requests that carry no
  Origin, such as an <img> or <script> pointed at the console by another
  page on the same machine.
- The token: the one printed with the URL, compared in constant time.
  It travels in the query (the page's URL, the event streams: EventSource
  cannot set headers) or in the X-Sessiond-Token header.
- A POST's body is JSON (`Content-Type: application/json`): a page of
  another origin cannot send that without a CORS preflight, which the
  console never answers (it sends no CORS header at all).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

__all__ = ["Guard", "TOKEN_HEADER"]

TOKEN_HEADER = "x-sessiond-token"
_SITES_FOR_THE_PAGE = ("same-origin", "none")


class Guard:
    def __init__(self, token: str, port: int) -> None:
        self._token = token.encode()
        self.hosts = (f"127.0.0.1:{port}", f"localhost:{port}")
        self.origins = tuple(f"http://{host}" for host in self.hosts)

    def token_ok(self, given: str | None) -> bool:
        # compare_digest on bytes: its time does not depend on where they differ.
        return given is not None and hmac.compare_digest(given.encode(), self._token)

    def refusal(self, method: str, headers: Mapping[str, str], query_token: str | None,
                *, needs_token: bool = True, page: bool = False) -> str | None:
        """Why the request is refused, or None.  `headers`: lower-case names.
        `page`: the HTML page itself, which a person opens by typing or
        pasting its URL (Sec-Fetch-Site: none)."""
        if headers.get("host", "") not in self.hosts:
            return "unexpected Host header (the console answers only at its own address)"
        origin = headers.get("origin")
        if origin is not None and origin not in self.origins:
            return "request from another origin"
        if method not in ("GET", "HEAD") and origin is None:
            return "a request that changes something must carry the console's Origin"
        site = headers.get("sec-fetch-site")
        allowed_sites = _SITES_FOR_THE_PAGE if page else ("same-origin",)
        if site is not None and site not in allowed_sites:
            return f"request from another site (Sec-Fetch-Site: {site})"
        if needs_token and not (self.token_ok(query_token) or self.token_ok(headers.get(TOKEN_HEADER))):
            return "wrong or missing token"
        if method == "POST" and headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return "expected a JSON body (Content-Type: application/json)"
        return None
