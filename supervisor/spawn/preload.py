"""What the zygote imports before it forks: the operator's handler modules.

Runs in the daemon (the list is made from the config before the zygote is
forked, and told again to a zygote started by exec).  A session whose
handler is preloaded costs a fork of an interpreter that has its framework
in memory already, shared by every session, instead of an import in each
worker (~1.6 s and ~70 MiB for the OpenAI Agents SDK: bench/frameworks.py).

The modules: those of `[agent] handler`, `allowed_handlers` (a pattern
`package.module:*` names its module), `[agent.subagents] allowed_handlers`,
`[tools] custom`, and `[daemon] preload_modules`.  The zygote imports them
in that order, once (`session_worker.zygote.server._prepare`); one that
fails, or that starts a thread (the zygote forks: a thread in it would not
be in its workers, and a lock it held stays held there), is an error that
names it: at start, the daemon's (`ZygoteSpawner.attach`); in a zygote
started again later, a log line, and the sessions of that handler import it
themselves (and fail at boot with its error).  The list is fixed at start:
a reload that changes it is logged (`reloaded`) and changes nothing until
the daemon restarts, since a new zygote would mean stopping every session.
"""

from __future__ import annotations

import logging

from supervisor.config import Config

__all__ = ["modules", "reloaded"]

log = logging.getLogger("sessiond.zygote")
_BUILT_IN = ("agent", "echo")


def modules(cfg: Config) -> list[str]:
    """The modules to preload, in order, each once."""
    handlers = [cfg.agent.handler, *cfg.agent.allowed_handlers, *cfg.agent.subagents.allowed_handlers,
                *cfg.tools.custom]
    names = [h.partition(":")[0] for h in handlers if h not in _BUILT_IN and ":" in h]
    return list(dict.fromkeys([*names, *cfg.daemon.preload_modules]))


def reloaded(old: Config, new: Config) -> None:
    """Say what a reload that changes the preload list does (nothing yet)."""
    added = [name for name in modules(new) if name not in modules(old)]
    if added:
        log.warning("the reloaded config names modules the zygote has not preloaded (%s): sessions that use "
                    "them import them after their fork, slower and with more memory each, until the daemon "
                    "is restarted", ", ".join(added))
