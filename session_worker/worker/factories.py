"""Handler names to factories: "echo", "agent" or "package.module:factory".

Kept apart from `session_worker.handler` (the interface every handler
imports) so that the interface imports no handler and no handler imports
this: no cycle.  Runs in a worker, at boot.
"""

from __future__ import annotations

from session_worker.errors import HandlerLoadError
from session_worker.handler import HandlerFactory, import_object

__all__ = ["load_factory"]


def load_factory(name: str) -> HandlerFactory:
    """Resolve `echo`, `agent` or `package.module:factory` to a factory."""
    if name == "echo":
        from session_worker.echo import EchoHandler

        return EchoHandler
    if name == "agent":
        from session_worker.agent import AgentHandler

        return AgentHandler
    if ":" not in name:
        raise HandlerLoadError(
            f"unknown handler {name!r}: use 'echo', 'agent' or 'package.module:factory'"
        )
    factory: HandlerFactory = import_object(name, "handler", HandlerLoadError)
    return factory
