"""A handler for tests/test_session_python.py (`python_handlers:imports_at_turn`)."""

from __future__ import annotations

import importlib
import os
from typing import Any

from session_worker.handler import HandlerInit, TurnContext, TurnResult


class ImportsAtTurn:
    """Imports, at its turn, the module the input names: one the zygote
    did not preload, read as the session's uid."""

    def __init__(self, init: HandlerInit) -> None:
        pass

    def restore(self, state: Any, records: list[Any]) -> None:
        pass

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        module = importlib.import_module(text)
        return TurnResult(f"imported {module.__name__} as uid {os.getuid()}")

    def snapshot(self) -> Any:
        return None

    async def aclose(self) -> None:
        pass


def imports_at_turn(init: HandlerInit) -> ImportsAtTurn:
    return ImportsAtTurn(init)
