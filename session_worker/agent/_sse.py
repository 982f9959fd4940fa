"""Incremental server-sent-events parser (the WHATWG event-stream format).

Pure: bytes in, events out, no I/O.  Network reads split the stream anywhere,
so the parser keeps a partial line, a partial UTF-8 sequence and a `\\r` that
may be the first half of a `\\r\\n` across calls.  Comments (`: ping`) and
unknown fields are dropped; `data:` lines of one event are joined with `\\n`.
The `[DONE]` sentinel of OpenAI-style streams is an ordinary event here; the
provider gives it its meaning.

`feed` runs once per network read of a streamed reply, so it works on whole
lines with str methods (C loops) rather than stepping through characters in
Python: the line breaks `\\r\\n` and `\\r` are rewritten to `\\n`, then split.
Line breaks are only these three: `str.splitlines` would also break on
U+2028 and others, which JSON strings may contain raw.
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
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        # Pieces of the current line whose line break has not arrived yet
        # (a list, so a long line over many reads is joined once).
        self._partial: list[str] = []
        # The text so far ended in "\r": if the next text starts with "\n"
        # it is the same line break, not an empty line (which would
        # dispatch an event).
        self._after_cr = False
        self._data: list[str] = []
        self._event = ""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        text = self._decode(chunk)
        if not text:
            # Nothing decoded yet (an empty read, or half a UTF-8
            # sequence): a pending "\r" still waits for its "\n".
            return []
        if self._after_cr:
            self._after_cr = False
            if text[0] == "\n":
                text = text[1:]
        if "\r" in text:
            self._after_cr = text[-1] == "\r"
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        lines = text.split("\n")
        # The last piece has no line break after it (it is "" when the text
        # ends with one): it waits for the next feed.
        rest = lines.pop()
        events: list[SSEEvent] = []
        if lines:
            partial = self._partial
            if partial:
                partial.append(lines[0])
                lines[0] = "".join(partial)
                partial.clear()
            data = self._data
            for line in lines:
                if not line:
                    if data:
                        events.append(SSEEvent("\n".join(data), self._event or "message"))
                        data.clear()
                    self._event = ""
                elif line[0] != ":":
                    name, sep, value = line.partition(":")
                    if sep and value[:1] == " ":
                        value = value[1:]
                    if name == "data":
                        data.append(value)
                    elif name == "event":
                        self._event = value
        if rest:
            self._partial.append(rest)
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: dispatch a last event whose blank line never came.

        A half line (no line break) is dropped: it was cut off in transit."""
        self._partial.clear()
        events: list[SSEEvent] = []
        if self._data:
            events.append(SSEEvent("\n".join(self._data), self._event or "message"))
            self._data.clear()
        self._event = ""
        return events
