"""The pipe between the daemon and the process it lists MCP servers' tools
with (`python -P -m session_worker.mcplist`): one order on its stdin, one
answer on its stdout, both msgpack.

The daemon's side is `supervisor.spawn.mcplist`, the lister's
`session_worker.mcplist`.  The answer is hostile input to the daemon (the
lister ran servers' code beside it): it is decoded with the bounds of
`ipc.mcp.McpListing`, at most `MAX_ANSWER_BYTES`, and only the servers it
was asked for are kept.
"""

from __future__ import annotations

import msgspec

from ipc.mcp import McpListing
from ipc.messages import SandboxBoot

__all__ = ["MAX_ANSWER_BYTES", "McpListOrder", "answer_decoder", "order_decoder"]

# 32 servers of 128 tools of (16 KiB schema + 2 KiB description), and room.
MAX_ANSWER_BYTES = 96 << 20


class McpListOrder(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # msgpack of ipc.settings.SessionSettings: the servers to list
    # (mcp.servers), their timeouts, and the sandbox they are listed in.
    settings: bytes
    # What the daemon found at start for confining tools (None: off).
    sandbox: SandboxBoot | None = None
    # An empty directory of the lister's own: the servers' working directory.
    workspace: str
    # The lister runs as a uid no session has (RLIMIT_NPROC is its own).
    own_uid: bool = False


order_decoder = msgspec.msgpack.Decoder(McpListOrder)
answer_decoder = msgspec.msgpack.Decoder(list[McpListing])
