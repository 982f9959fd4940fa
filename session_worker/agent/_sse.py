"""Incremental server-sent-events parser (the WHATWG event-stream format).

Pure: bytes in, events out, no I/O.  Network reads split the stream anywhere,
so the parser keeps a partial line, a partial UTF-8 sequence and a `\\r` that
may be the first half of a `\\r\\n` across calls.  Comments (`: ping`) and
unknown fields are dropped; `data:` lines of one event are joined with `\\n`.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

__all__ = ["SSEEvent", "SSEParser"]


@dataclass(slots=True, frozen=True)
class SSEEvent:
    data: str
    event: str = "message"


class SSEParser:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._line = ""
        # A chunk ended in "\r": if the next one starts with "\n" it is the
        # same line break, not an empty line (which would dispatch an event).
        self._after_cr = False
        self._data: list[str] = []
        self._event = ""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        text = self._decoder.decode(chunk)
        events: list[SSEEvent] = []
        start = 0
        if self._after_cr and text.startswith("\n"):
            start = 1
        self._after_cr = False
        i = start
        n = len(text)
        while i < n:
            ch = text[i]
            if ch == "\r" or ch == "\n":
                self._line += text[start:i]
                self._take_line(self._line, events)
                self._line = ""
                if ch == "\r":
                    if i + 1 < n:
                        if text[i + 1] == "\n":
                            i += 1
                    else:
                        self._after_cr = True
                start = i + 1
            i += 1
        self._line += text[start:]
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: dispatch a last event whose blank line never came.

        A half line (no line break) is dropped: it was cut off in transit."""
        self._line = ""
        events: list[SSEEvent] = []
        self._dispatch(events)
        return events

    def _take_line(self, line: str, events: list[SSEEvent]) -> None:
        if not line:
            self._dispatch(events)
            return
        if line.startswith(":"):
            return
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value

    def _dispatch(self, events: list[SSEEvent]) -> None:
        if self._data:
            events.append(SSEEvent("\n".join(self._data), self._event or "message"))
        self._data = []
        self._event = ""
