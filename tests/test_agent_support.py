"""Shared helpers for the agent handler tests (no tests here).

`FakeCtx` stands in for the worker's TurnContext: it collects what the handler
emits and notices, and answers permission requests and sub-agent spawns from
a script.  `make_handler` builds an AgentHandler pointed at a FakeLLM.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from fakellm import FakeLLM
from session_worker.agent import AgentHandler
from session_worker.handler import HandlerInit, SpawnError, TurnContext
from ipc.settings import (
    AgentSettings,
    LoopSettings,
    PermissionRule,
    ProviderSettings,
    SessionSettings,
    SubagentSettings,
    ToolsSettings,
)

__all__ = [
    "FakeCtx",
    "make_handler",
    "make_settings",
    "poll",
    "run",
    "PermissionRule",
    "AgentSettings",
    "LoopSettings",
    "SubagentSettings",
    "ToolsSettings",
]

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def poll(check: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


class FakeCtx(TurnContext):
    def __init__(
        self,
        settings: SessionSettings,
        workspace: Path,
        *,
        answers: list[bool] | None = None,
        spawn_result: str | Exception = "sub-agent done",
        depth: int = 0,
    ) -> None:
        self.session = "s1"
        self.turn = 1
        self.settings = settings
        self.workspace = workspace
        self.depth = depth
        self.emits: list[str] = []
        self.reasonings: list[str] = []
        self.notices: list[tuple[str, dict[str, Any]]] = []
        self.limits: list[tuple[str, float, float]] = []
        self.asked: list[tuple[str, dict[str, Any]]] = []
        self.spawned: list[tuple[str, str | None]] = []
        self._answers = list(answers or [])
        self._spawn_result = spawn_result

    @property
    def text(self) -> str:
        return "".join(self.emits)

    def notices_of(self, kind: str) -> list[dict[str, Any]]:
        return [data for k, data in self.notices if k == kind]

    def emit(self, text: str) -> None:
        self.emits.append(text)

    def reasoning(self, text: str) -> None:
        self.reasonings.append(text)

    def notice(self, kind: str, data: dict[str, Any]) -> None:
        self.notices.append((kind, data))

    def limit_exceeded(self, kind: str, value: float, limit: float) -> None:
        self.limits.append((kind, value, limit))

    async def ask_permission(self, tool: str, arguments: dict[str, Any]) -> bool:
        self.asked.append((tool, arguments))
        if not self._answers:
            raise AssertionError(f"unexpected permission request for {tool}")
        return self._answers.pop(0)

    async def spawn_agent(self, task: str, handler: str | None = None) -> str:
        self.spawned.append((task, handler))
        if isinstance(self._spawn_result, Exception):
            raise self._spawn_result
        return self._spawn_result


def make_settings(
    llm: FakeLLM,
    *,
    agent: AgentSettings | None = None,
    tools: ToolsSettings | None = None,
    permissions: list[PermissionRule] | None = None,
    **provider: Any,
) -> SessionSettings:
    base = ProviderSettings(
        base_url=llm.base_url,
        model="test-model",
        max_retries=2,
        retry_backoff_initial_ms=1,
        connect_timeout_secs=5.0,
        read_timeout_secs=10.0,
    )
    return SessionSettings(
        agent=agent or AgentSettings(),
        provider=msgspec.structs.replace(base, **provider),
        tools=tools or ToolsSettings(),
        permissions=permissions or [],
    )


def make_handler(
    settings: SessionSettings, workspace: Path, depth: int = 0
) -> AgentHandler:
    return AgentHandler(
        HandlerInit(session="s1", settings=settings, workspace=workspace, depth=depth)
    )


# Re-exported for tests that script spawn failures.
SpawnError = SpawnError
