"""Incremental Server-Sent Events parser: bytes in, ``(event, data)`` pairs out, in order.

Lines end in ``\\n``, ``\\r\\n`` or ``\\r``; ``data:`` lines (one optional space after the colon) accumulate, joined
by ``\\n``; a blank line dispatches the event; ``:`` lines are comments (keep-alives); ``event:`` names the event
(``None`` when absent). Reads may split anywhere, also inside a UTF-8 character or a ``\\r\\n``. At the end of the
stream a pending event without its blank line is still handed out (lenient, like most clients); whether ``[DONE]``
arrived is the caller's test for a complete stream.
"""

from __future__ import annotations

import codecs


class SSEParser:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._data: list[str] = []
        self._event: str | None = None
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[tuple[str | None, str]]:
        """Parse one read; returns the events it completed."""
        return self._lines(self._decoder.decode(chunk))

    def close(self) -> list[tuple[str | None, str]]:
        """End of stream: flush a partial line and a pending event."""
        events = self._lines(self._decoder.decode(b"", final=True))
        if self._buffer:
            self._line(self._buffer, events)
            self._buffer = ""
        if self._data:
            events.append((self._event, "\n".join(self._data)))
            self._data, self._event = [], None
        return events

    def _lines(self, text: str) -> list[tuple[str | None, str]]:
        events: list[tuple[str | None, str]] = []
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]  # the \n of a \r\n split across two reads
        self._pending_cr = False
        text = self._buffer + text
        start = 0
        length = len(text)
        while True:
            cr = text.find("\r", start)
            lf = text.find("\n", start)
            if cr < 0 and lf < 0:
                break
            if cr >= 0 and (lf < 0 or cr < lf):
                end, nxt = cr, cr + 1
                if nxt < length and text[nxt] == "\n":
                    nxt += 1
                elif nxt == length:
                    self._pending_cr = True
            else:
                end, nxt = lf, lf + 1
            self._line(text[start:end], events)
            start = nxt
        self._buffer = text[start:]
        return events

    def _line(self, line: str, events: list[tuple[str | None, str]]) -> None:
        if line == "":
            if self._data:
                events.append((self._event, "\n".join(self._data)))
            self._data, self._event = [], None
            return
        if line.startswith(":"):
            return
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
