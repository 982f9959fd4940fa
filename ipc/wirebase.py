"""The base of every tagged message on sessiond's sockets (ipc.messages for
the control link, ipc.worker_wire for the worker link, ipc.operator for the
control requests an operator's tools add).  Schema rules: ipc.messages."""

from __future__ import annotations

import msgspec

__all__ = ["Msg"]


class Msg(msgspec.Struct, tag_field="type", omit_defaults=True, kw_only=True, gc=False):
    """Every message is data (scalars, strings, lists and dicts of them),
    never part of a reference cycle, so none is tracked by the cyclic
    garbage collector (`gc=False`, inherited).  The daemon keeps tens of
    thousands of events for replay (`event_retention_bytes`): tracked, each
    full collection walked every one of them, 11-18 ms with 50 busy sessions,
    the whole of the control plane's p99 (bench/load.py)."""
