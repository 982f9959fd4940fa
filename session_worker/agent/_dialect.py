"""Provider dialects: what differs between the APIs the provider speaks.

A `Dialect` knows its endpoint, its headers, how to render the internal
history (`_history`) as a request body, and which `Assembler` reads its
stream.  Everything else (HTTP, retries, SSE, error descriptions, flushing
text to the client) is the provider's and shared.  Pure: no I/O here.

* `OpenAIDialect`: `POST {base_url}/chat/completions`, `Authorization:
  Bearer`, messages as they are stored.
* `AnthropicDialect`: `POST {base_url}/messages`, `x-api-key` and
  `anthropic-version`, the body built by `_anthropic.request_body`.
"""

from __future__ import annotations

from typing import Any, Protocol

from session_worker.agent._anthropic import (
    ANTHROPIC_VERSION,
    DEFAULT_MAX_TOKENS,
    AnthropicAssembler,
    request_body,
)
from session_worker.agent._history import reasoning_for_request
from session_worker.agent._stream import Assembler, StreamAssembler
from ipc.settings import ProviderSettings

__all__ = ["AnthropicDialect", "Dialect", "OpenAIDialect", "dialect_for"]


class Dialect(Protocol):
    path: str

    def headers(self, key: str | None) -> dict[str, str]: ...

    def body(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, dropped: set[str]
    ) -> dict[str, Any]:
        """The request for `messages` (system message first, internal form);
        `dropped`: optional parameters this server rejected."""
        ...

    def assembler(self) -> Assembler: ...


class OpenAIDialect:
    path = "/chat/completions"

    def __init__(self, settings: ProviderSettings) -> None:
        self._settings = settings

    def headers(self, key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    def body(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, dropped: set[str]
    ) -> dict[str, Any]:
        settings = self._settings
        body: dict[str, Any] = {
            "model": settings.model,
            "messages": reasoning_for_request(
                messages, settings.reasoning_history, ("reasoning_content", "reasoning")
            ),
            "stream": True,
        }
        if settings.stream_usage and "stream_options" not in dropped:
            body["stream_options"] = {"include_usage": True}
        if settings.max_tokens is not None:
            body["max_tokens"] = settings.max_tokens
        if tools:
            body["tools"] = tools
        return body

    def assembler(self) -> Assembler:
        return StreamAssembler()


class AnthropicDialect:
    path = "/messages"

    def __init__(self, settings: ProviderSettings) -> None:
        self._settings = settings

    def headers(self, key: str | None) -> dict[str, str]:
        headers = {"anthropic-version": ANTHROPIC_VERSION}
        if key:
            headers["x-api-key"] = key
        return headers

    def body(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, dropped: set[str]
    ) -> dict[str, Any]:
        settings = self._settings
        return request_body(
            settings.model or "",
            reasoning_for_request(messages, settings.reasoning_history, ("thinking_blocks",)),
            tools,
            max_tokens=settings.max_tokens or DEFAULT_MAX_TOKENS,
            thinking_budget_tokens=settings.thinking_budget_tokens,
        )

    def assembler(self) -> Assembler:
        return AnthropicAssembler()


def dialect_for(settings: ProviderSettings) -> Dialect:
    if settings.kind == "anthropic":
        return AnthropicDialect(settings)
    return OpenAIDialect(settings)
