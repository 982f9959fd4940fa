"""Streaming LLM client: `POST {base_url}/chat/completions` (OpenAI and
compatible servers) or `POST {base_url}/messages` (Anthropic), chosen by
`provider.kind`.  What differs between the two (endpoint, headers, request
body, stream events) is the `_dialect`'s; HTTP, retries, SSE, error
descriptions and flushing text to the client are shared, here.

Runs in the worker's event loop.  One `httpx.AsyncClient` per handler, so
connections are reused across the LLM calls of a session.

Retries: a 429 or 5xx answer, or a failure to connect (nothing was sent, so
nothing was streamed to the user yet), is retried up to `max_retries` times,
waiting `Retry-After` when the server gives one, else an exponential backoff.
Optional parameters (`stream_options`): a 400/422 whose error names one
of them is retried once at once without it, and the parameter is left out
for the rest of this client's life (the session's, or until the provider
settings change), logged once.

Once a 200 stream has started, no retry: text already went to the clients,
and replaying would duplicate it; a broken stream is a `ProviderStreamError`.

Text reaches `on_text` once per network read, not once per SSE event: the
events of one read are decoded, their text joined, and handed on just before
the reader waits for the network again (`_anext_flushing_first`).  Nothing
waits for more data; only what is already in hand is joined.  The first text
of a completion is handed on at once, and `on_first` then asks the worker to
write it now: its frame would otherwise wait for the loop's next pass, that
is until the rest of the read was parsed (httpx hands out the chunks in hand
without suspending): 0.2-1.6 ms with a stream in full flow.  (Yielding to
the loop there instead cost ~8% of the streamed tokens/s, bench/agent.py.)

Process costs: the worker is forked from a zygote that imported this module,
so everything the first request needs is imported here, not on first use,
and no CA bundle is loaded for an `http://` base URL.

The API key lives only in the client's default headers.  Error messages are
built from our own text plus redacted server text, and httpx exceptions are
never chained to ours, because their request objects carry the
Authorization header.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import importlib
import json
import logging
import math
import os
import ssl
import time
import types
from collections.abc import AsyncIterator, Callable, Generator, Mapping
from typing import Any, cast

import httpcore  # noqa: F401  (httpx imports it on the first client)
import httpx
import msgspec
# httpcore imports sniffio inside each lock and event it sets up (two per
# request); absent, each of those failed imports searched sys.path again
# (~100 µs each, encode/httpcore#1103).  A dependency, imported here so
# that the zygote holds it.
import sniffio  # noqa: F401

from session_worker.agent._errors import (
    ProviderError,
    ProviderHTTPError,
    ProviderStreamError,
)
from session_worker.agent import _traced
from session_worker.agent._dialect import dialect_for
from session_worker.agent._sse import SSEParser
from session_worker.agent._stream import Assembler, Completion, Delta, describe_error
from ipc.settings import ProviderSettings

__all__ = ["NO_CA_TLS", "Provider", "redact"]

OnText = Callable[[str], None]
OnRetry = Callable[[dict[str, Any]], None]
OnFirst = Callable[[], None]

log = logging.getLogger("sessiond.worker.agent")

# httpx logs every request at INFO ("HTTP Request: POST ... 200 OK"), and a
# worker logs at INFO: one line per LLM call of every session in the
# daemon's log, formatted and written between the response's headers and
# its first token.  What matters of a request (retries, refused
# parameters, errors) this module logs or reports itself.
logging.getLogger("httpx").setLevel(logging.WARNING)

# Parameters a request can do without, so that a server rejecting one by
# name is retried without it.  `stream_options`: OpenAI's, unknown to older
# Azure API versions and to some proxies.
_OPTIONAL_PARAMETERS = ("stream_options",)

_RETRY_STATUSES = frozenset({429}) | frozenset(range(500, 600))
_REDACTED = "[redacted]"
# After [DONE], how long to wait for the body to end before giving up on
# reusing the connection.
_DRAIN_AFTER_DONE_SECS = 1.0

# anyio loads its asyncio backend on the first socket it opens (~15 ms of
# imports in each worker); importing it here puts it in the zygote.  A
# private module name, so a future anyio that moves it only costs the time.
with contextlib.suppress(ImportError):
    importlib.import_module("anyio._backends._asyncio")

# For an `http://` base URL no TLS is ever done (no redirects are followed,
# no proxy from the environment), but httpx builds an SSL context for every
# client, loading the CA bundle (~25 ms per worker) unless given one.  This
# one trusts no CA and checks host names: were it ever used, it would refuse
# the server rather than skip verification.
NO_CA_TLS = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)

_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode


def redact(text: str, secret: str | None) -> str:
    if secret and len(secret) >= 4:
        return text.replace(secret, _REDACTED)
    return text


class Provider:
    def __init__(
        self, settings: ProviderSettings, environ: Mapping[str, str] | None = None
    ) -> None:
        self._settings = settings
        env = os.environ if environ is None else environ
        self._key: str | None = None
        self._key_problem: str | None = None
        if settings.api_key_env:
            self._key = env.get(settings.api_key_env) or None
            if self._key is None:
                self._key_problem = (
                    f"environment variable {settings.api_key_env} (provider.api_key_env) is not set in "
                    "sessiond's environment: set it where sessiond is started (under systemd: `systemctl "
                    f"edit sessiond`, Environment={settings.api_key_env}=...) and restart sessiond"
                )
        self._dialect = dialect_for(settings)
        # Every request is a JSON body (`_attempt` sends it pre-encoded).
        headers = {
            "Accept": "text/event-stream",
            "Content-Type": "application/json",
            **self._dialect.headers(self._key),
        }
        timeout = httpx.Timeout(
            connect=settings.connect_timeout_secs,
            read=settings.read_timeout_secs,
            write=settings.read_timeout_secs,
            pool=settings.connect_timeout_secs,
        )
        base = (settings.base_url or "").rstrip("/")
        # https: httpx's own full verification (certifi's CAs).
        verify: ssl.SSLContext | bool = True if base[:6].lower() == "https:" else NO_CA_TLS
        self._client = httpx.AsyncClient(
            headers=headers, timeout=timeout, trust_env=False, verify=verify
        )
        self._url = f"{base}{self._dialect.path}"
        # Parsed once, not on every request (httpx's URL parser is pure
        # Python); a URL it refuses stays a str, to fail on the request as
        # it always did.
        self._endpoint: httpx.URL | str = self._url
        with contextlib.suppress(httpx.InvalidURL):
            self._endpoint = httpx.URL(self._url)
        # Optional parameters this server rejected (see the module docstring).
        self._dropped: set[str] = set()

    def redact(self, text: str) -> str:
        return redact(text, self._key)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def stream_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        on_text: OnText,
        on_retry: OnRetry | None = None,
        deadline: float | None = None,
        on_reasoning: OnText | None = None,
        on_first: OnFirst | None = None,
    ) -> Completion:
        """`_stream_chat`, as one GenAI `chat` span when the turn is traced."""
        with _traced.llm_span(self._settings, messages) as span:
            if not span.recording:
                return await self._stream_chat(messages, tools, on_text, on_retry, deadline, on_reasoning, on_first)
            completion = await self._stream_chat(
                messages, tools, on_text, _traced.on_retry(span, on_retry), deadline, on_reasoning,
                _traced.on_first(span, on_first),
            )
            _traced.llm_done(span, completion)
            return completion

    async def _stream_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        on_text: OnText,
        on_retry: OnRetry | None = None,
        deadline: float | None = None,
        on_reasoning: OnText | None = None,
        on_first: OnFirst | None = None,
    ) -> Completion:
        """One completion; `on_text` gets each text delta as it arrives,
        `on_reasoning` each piece of reasoning text; `on_first()` is called
        right after the first of either, before the rest of its network
        read is parsed (to send it on now: see the module docstring).

        `deadline` (time.monotonic()) is when the turn times out: a retry
        that would start after it is not waited for; the turn fails now,
        with the provider's error, instead of being killed mid-wait."""
        if self._key_problem is not None:
            raise ProviderError(self._key_problem)
        body = self._dialect.body(messages, tools, self._dropped)
        attempt = 0
        while True:
            failure = await self._attempt(body, on_text, on_reasoning or _ignore, on_first or _nothing)
            if isinstance(failure, Completion):
                return failure
            error, retry_after = failure
            rejected = _rejected_parameter(error, body)
            if rejected is not None:
                self._dropped.add(rejected)
                del body[rejected]
                log.warning("provider at %s rejects %r: sent without it from now on (%s)",
                            self._url, rejected, error)
                if on_retry is not None:
                    on_retry({"attempt": attempt + 1, "delay_secs": 0.0, "error": str(error),
                              "dropped_parameter": rejected})
                continue
            if retry_after is None or attempt >= self._settings.max_retries:
                if attempt and retry_after is not None:
                    raise ProviderError(f"{error} (gave up after {attempt + 1} attempts)")
                raise error
            delay = self._delay(attempt, retry_after)
            if delay is None:
                raise ProviderError(
                    f"{error}; the provider asked to retry after {retry_after:g} s, more "
                    f"than provider.retry_backoff_max_ms"
                )
            if deadline is not None and time.monotonic() + delay >= deadline:
                raise ProviderError(
                    f"{error}; not retried: waiting {delay:g} s would pass the turn's "
                    "timeout (agent.turn_timeout_secs)"
                )
            attempt += 1
            if on_retry is not None:
                on_retry({"attempt": attempt, "delay_secs": delay, "error": str(error)})
            await asyncio.sleep(delay)

    def _delay(self, attempt: int, retry_after: float) -> float | None:
        cap = self._settings.retry_backoff_max_ms / 1000
        if retry_after > 0:
            return retry_after if retry_after <= cap else None
        backoff: float = self._settings.retry_backoff_initial_ms / 1000 * 2.0**attempt
        return min(backoff, cap)

    async def _attempt(
        self, body: dict[str, Any], on_text: OnText, on_reasoning: OnText, on_first: OnFirst
    ) -> Completion | tuple[ProviderError, float | None]:
        """One HTTP exchange.  Returns the completion, or the error and,
        when it may be retried, the wait the server asked for (0 = ours)."""
        # Built outside the `except` blocks so that no httpx exception ends
        # up as __context__ of ours (see the module docstring).
        problem: str | None = None
        retryable = False
        try:
            # msgspec, not httpx's `json=` (the stdlib encoder): the body
            # is the whole history, encoded again for every LLM call.
            payload = _encode_json(body)
            async with self._client.stream("POST", self._endpoint, content=payload) as response:
                if response.status_code != 200:
                    raw = await response.aread()
                    status = response.status_code
                    message = self.redact(_error_message(raw))
                    error = ProviderHTTPError(status, message, _hint(status, self._settings, self._url))
                    if status in _RETRY_STATUSES:
                        return error, _retry_after(
                            response.headers.get("retry-after"),
                            response.headers.get("retry-after-ms"),
                        )
                    return error, None
                return await self._read(response, on_text, on_reasoning, on_first)
        except httpx.ConnectError as exc:
            problem, retryable = f"cannot connect to provider at {self._url}: {exc}", True
        except httpx.ConnectTimeout:
            problem, retryable = f"connecting to provider at {self._url} timed out", True
        except httpx.ReadTimeout:
            problem = (
                f"provider sent nothing for {self._settings.read_timeout_secs:g} s "
                "(provider.read_timeout_secs)"
            )
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            problem = f"connection to provider lost mid-response: {exc}"
        except httpx.HTTPError as exc:
            problem = f"provider request failed: {type(exc).__name__}: {exc}"
        assert problem is not None
        stream_error = ProviderStreamError(self.redact(problem))
        return stream_error, (0.0 if retryable else None)

    async def _read(
        self, response: httpx.Response, on_text: OnText, on_reasoning: OnText, on_first: OnFirst
    ) -> Completion:
        assembler = self._dialect.assembler()
        content_type = response.headers.get("content-type", "")
        if "application/json" in content_type:
            # A server that ignored `stream: true` answers with one object.
            raw = await response.aread()
            text, reasoning = assembler.feed(_json(raw, self.redact))
            if reasoning:
                on_reasoning(reasoning)
            if text:
                on_text(text)
            return assembler.finish()
        parser = SSEParser()
        feed = parser.feed
        take = self._take
        # Text and reasoning of the events in hand, not yet passed on.
        pending: list[str] = []
        pending_reasoning: list[str] = []

        def flush() -> None:
            # Reasoning first: within one read it came before the text.
            if pending_reasoning:
                reasoning = "".join(pending_reasoning)
                pending_reasoning.clear()
                on_reasoning(reasoning)
            if pending:
                text = "".join(pending)
                pending.clear()
                on_text(text)

        done = started = False
        chunks = response.aiter_bytes()
        try:
            while not done:
                try:
                    data = await _anext_flushing_first(chunks, flush)
                except StopAsyncIteration:
                    break
                for event in feed(data):
                    added = take(event.data, event.event, assembler)
                    if added is None:
                        done = True
                        break
                    text, reasoning = added
                    if reasoning:
                        pending_reasoning.append(reasoning)
                    if text:
                        pending.append(text)
                    if (text or reasoning) and not started:
                        # The first text goes at once, not after the
                        # rest of its read: time to first token is what
                        # a user feels, and it costs one more frame.
                        started = True
                        flush()
                        on_first()
        finally:
            # Also on an error: the text before it was the model's, as
            # when each event was passed on by itself.
            flush()
        if done:
            # Read the end of the body (the chunked terminator) so httpx can
            # return the connection to the pool; a response left half-read
            # is closed instead, and the next call pays a new connection.
            with contextlib.suppress(TimeoutError, httpx.HTTPError):
                async with asyncio.timeout(_DRAIN_AFTER_DONE_SECS):
                    async for _ in chunks:
                        pass
        else:
            for event in parser.close():
                added = take(event.data, event.event, assembler)
                if added is None:
                    done = True
                    break
                if added[1]:
                    on_reasoning(added[1])
                if added[0]:
                    on_text(added[0])
        if not done and not assembler.complete:
            raise ProviderStreamError(
                "provider stream ended before the response was complete "
                "(no finish or stop reason, and no end-of-stream event)"
            )
        return assembler.finish()

    def _take(self, data: str, event: str, assembler: Assembler) -> Delta | None:
        """Feed one event's data to `assembler`: the text and reasoning it
        adds, or None at the end of the stream (OpenAI's `[DONE]`, Anthropic's
        `message_stop`)."""
        if data.strip() == "[DONE]":
            return None
        chunk = _json(data, self.redact)
        if event == "error" and isinstance(chunk, dict) and "error" not in chunk:
            chunk = {"error": chunk}
        problem: str | None = None
        try:
            added = assembler.feed(chunk, event)
        except ProviderError as exc:
            problem = str(exc)
        else:
            # message_stop carries no text; `ended` is only ever set by one.
            return None if assembler.ended else added
        raise ProviderError(self.redact(problem))


def _ignore(_: str) -> None:
    pass


def _nothing() -> None:
    pass


@types.coroutine
def _anext_flushing_first(
    chunks: AsyncIterator[bytes], flush: Callable[[], None]
) -> Generator[Any, Any, bytes]:
    """`await anext(chunks)`, calling `flush()` first if that await is going
    to wait (suspend the task) rather than complete at once.

    httpx hands out one HTTP chunk per item, and one network read usually
    holds many (one SSE event each): those items come without suspending.
    Flushing just before the first suspension passes on everything the
    last read brought, once; nothing waits for data that has not arrived.
    The await is driven by hand, doing what `yield from` does (PEP 380),
    only to see where it first suspends.
    """
    step = chunks.__anext__().__await__()
    try:
        signal = step.send(None)
    except StopIteration as stop:
        return cast(bytes, stop.value)
    try:
        flush()
    except BaseException:
        step.close()
        raise
    while True:
        try:
            sent = yield signal
        except GeneratorExit:
            step.close()
            raise
        except BaseException as exc:
            try:
                signal = step.throw(exc)
            except StopIteration as stop:
                return cast(bytes, stop.value)
        else:
            try:
                signal = step.send(sent)
            except StopIteration as stop:
                return cast(bytes, stop.value)


def _json(raw: str | bytes, redact_fn: Callable[[str], str]) -> Any:
    try:
        return _decode_json(raw)
    except msgspec.DecodeError:
        pass
    try:
        # What msgspec refuses and Python's json takes: NaN, 1e400, a lone
        # surrogate escape (half an emoji from some servers).
        return _without_lone_surrogates(json.loads(raw))
    except ValueError:
        pass
    # Raised outside the `except`: the ValueError's message quotes the body.
    text = raw if isinstance(raw, str) else raw.decode("utf-8", "replace")
    snippet = redact_fn(text[:200])
    raise ProviderStreamError(f"provider sent invalid JSON: {snippet!r}")


def _without_lone_surrogates(value: Any) -> Any:
    """`value` with each lone surrogate in its strings replaced by U+FFFD.
    Python's json keeps them, and UTF-8 cannot carry them: left in, half an
    emoji would fail the Delta frame that carries it and every later
    request whose history holds it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_without_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_without_lone_surrogates(k): _without_lone_surrogates(v) for k, v in value.items()}
    return value


def _error_message(raw: bytes) -> str:
    """The provider's own words, in full: OpenAI/vLLM/llama.cpp/OpenRouter
    `{"error": {"message", "code", "metadata"...}}`, Ollama `{"error": "..."}`,
    FastAPI `{"detail": ...}`, else the body."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error", body.get("detail"))
        if isinstance(error, dict):
            return describe_error(error)
        if isinstance(error, str):
            return error
        if isinstance(body.get("message"), str):
            return describe_error(body)
    text = raw.decode("utf-8", "replace").strip()
    return text[:2000] if text else "(empty body)"


def _rejected_parameter(error: ProviderError, body: dict[str, Any]) -> str | None:
    """The optional parameter of `body` that a 400/422 answer names, if any
    (e.g. Azure: "Unrecognized request argument supplied: stream_options")."""
    if not isinstance(error, ProviderHTTPError) or error.status not in (400, 422):
        return None
    detail = error.detail.lower()
    for name in _OPTIONAL_PARAMETERS:
        if name in body and (name in detail or (name == "stream_options" and "include_usage" in detail)):
            return name
    return None


def _hint(status: int, settings: ProviderSettings, url: str) -> str:
    """The likely cause of an answer that retrying will not change."""
    if status == 401:
        where = (
            f"the key in ${settings.api_key_env} (provider.api_key_env)"
            if settings.api_key_env
            else "no key was sent: set provider.api_key_env"
        )
        return f"the provider refused the API key; check {where}"
    if status == 403:
        return (
            f"the API key has no access to model {settings.model!r} or to this endpoint "
            "(permissions, region or billing)"
        )
    if status == 404:
        return (
            f"unknown model {settings.model!r} (provider.model) or wrong endpoint "
            f"POST {url} (provider.base_url)"
        )
    if status in (400, 422):
        return (
            "the server refused the request: likely a parameter or message field it "
            "does not support, or a model that does not take tools"
        )
    return ""


def _retry_after(value: str | None, value_ms: str | None = None) -> float:
    """Seconds to wait from `retry-after-ms` (OpenAI, Azure: milliseconds,
    more precise, so preferred) or `Retry-After` (delta-seconds or HTTP
    date); 0 when absent or unreadable, meaning "use our own backoff"."""
    if value_ms:
        try:
            ms = float(value_ms)
        except ValueError:
            ms = math.nan
        if math.isfinite(ms) and ms > 0:
            return ms / 1000
    if not value:
        return 0.0
    try:
        secs = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return 0.0
        secs = when.timestamp() - time.time()
    if not math.isfinite(secs) or secs <= 0:
        return 0.0
    return secs
