"""Re-reading the config: on SIGHUP and on `sessionctl reload`.

Runs in the daemon's loop.  A file that does not load (a bad key or value,
naming both and the file) is refused and the running config kept; one that
loads is handed whole to `apply` (the daemon's: `SessionManager.reload` and
the zygote's spare workers).  Either way the caller learns what happened:
`sessionctl reload` gets it as its reply, SIGHUP's only reader is the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from ipc import operator as op
from supervisor.config import Config, load_config
from supervisor.errors import ConfigError
from supervisor.ops import sdnotify

__all__ = ["Reloader", "changes"]

log = logging.getLogger("sessiond.reload")

_VALUE_CHARS = 80  # of each side of a change line: a long permission list is clipped


class Reloader:
    def __init__(self, config_path: Path | None, current: Callable[[], Config],
                 apply: Callable[[Config], None], status: Callable[[], str]) -> None:
        self._path = config_path
        self._current = current
        self._apply = apply
        self._status = status  # systemd's STATUS= line once it is done

    def reload(self) -> op.ReloadReply:
        source = str(self._path) if self._path is not None else "the embedded defaults"
        sdnotify.reloading()
        try:
            cfg = load_config(self._path)
        except ConfigError as exc:
            log.error("reload refused, keeping the running config: %s", exc)
            sdnotify.ready(self._status())
            return op.ReloadReply(id=0, taken=False, source=source, error=str(exc))
        old = self._current()
        notes = []
        if cfg.store != old.store:
            notes.append("[store] changed: it takes effect at the next start, not on reload")
        if cfg.tracing != old.tracing:
            notes.append("[tracing] changed: it takes effect at the next start, not on reload "
                         "(the span exporter is started with the daemon)")
        if cfg.sandbox != old.sandbox:
            notes.append("[sandbox] changed: workers started from now on use it (a live session's on its "
                         "next worker); mode = \"required\" is checked at the next start")
        changed = changes(old, cfg)
        self._apply(cfg)
        sdnotify.configure_logging(cfg.daemon.log_level.upper(), log_format=cfg.daemon.log_format)
        for note in notes:
            log.warning("%s", note)
        log.info("config reloaded from %s: %s", source,
                 "; ".join(changed) if changed else "nothing changed")
        sdnotify.ready(self._status())
        return op.ReloadReply(id=0, taken=True, source=source, changed=changed, notes=notes)


def changes(old: Config, new: Config) -> list[str]:
    """Each leaf key whose value differs, as `dotted.key: old -> new`."""
    before, after = _leaves(msgspec.to_builtins(old)), _leaves(msgspec.to_builtins(new))
    missing = object()
    out = []
    for key in sorted(before.keys() | after.keys()):
        if key == "mcp.listed":
            continue  # the daemon's own (its MCP tool lists), not the file's
        a, b = before.get(key, missing), after.get(key, missing)
        if a != b:
            out.append(f"{key}: {_show(a, missing)} -> {_show(b, missing)}")
    return out


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _show(value: Any, missing: object) -> str:
    if value is missing:
        return "(unset)"
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= _VALUE_CHARS else text[: _VALUE_CHARS - 1] + "…"
