"""The same handler as bench/_agents_handler.py, its SDK imported by each
worker after its fork (the zygote preloads only this small module): what a
framework's session cost before the zygote preloaded handlers."""

from typing import Any


def make(init: Any) -> Any:
    from bench._agents_handler import make as real

    return real(init)
