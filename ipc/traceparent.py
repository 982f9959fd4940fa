"""A W3C Trace Context `traceparent` (https://www.w3.org/TR/trace-context/),
checked the same way by sessionctl, the client library and the daemon (pure).

A client hands one in with its input (`Send.traceparent`, `sessionctl send
--traceparent` or $TRACEPARENT) so that the turn's trace continues the
caller's.  It comes from outside (a web backend may pass on a header its own
caller chose): only the exact form is taken: lowercase hex, the version's
field lengths, no all-zero ids, version ff refused, at most 256 characters.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["MAX_TRACEPARENT_CHARS", "TraceParent", "format_traceparent", "parse_traceparent"]

MAX_TRACEPARENT_CHARS = 256
_FORM = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[\x21-\x7e]*)?")


class TraceParent(NamedTuple):
    trace_id: int
    span_id: int
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)


def parse_traceparent(text: str) -> TraceParent:
    """The trace it names; ValueError saying what is wrong otherwise."""
    if len(text) > MAX_TRACEPARENT_CHARS:
        raise ValueError(f"traceparent is longer than {MAX_TRACEPARENT_CHARS} characters")
    match = _FORM.fullmatch(text)
    if match is None:
        raise ValueError(
            "traceparent must look like 00-<32 hex digits>-<16 hex digits>-<2 hex digits> "
            "(W3C Trace Context, lowercase)"
        )
    version, trace, span, flags, rest = match.groups()
    if version == "ff":
        raise ValueError("traceparent version ff is invalid")
    if version == "00" and rest is not None:
        raise ValueError("traceparent version 00 has exactly four fields")
    trace_id, span_id = int(trace, 16), int(span, 16)
    if trace_id == 0 or span_id == 0:
        raise ValueError("traceparent trace-id and parent-id must not be all zeros")
    return TraceParent(trace_id, span_id, int(flags, 16))


def format_traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"
