"""An incremental parser of server-sent events (the ``text/event-stream`` format).

Only what an OpenAI-style stream needs: ``data:`` fields (several in one event are joined with
``\\n``), comment lines (``:``) and other fields ignored, events ended by a blank line. Bytes may
arrive split anywhere, even inside a UTF-8 character or between ``\\r`` and ``\\n``.
"""

from __future__ import annotations

import codecs

MAX_EVENT_CHARS = 16 << 20  # a longer event is an error, not an ever-growing buffer


class SSEError(ValueError):
    """The stream is not valid SSE (an event past MAX_EVENT_CHARS, or invalid UTF-8)."""


class SSEDecoder:
    """Feed raw bytes as they arrive; get back the ``data`` payload of every completed event.

    ``feed(b"data: {...}\\n\\nda")`` returns ``["{...}"]`` and keeps ``da`` for the next call.
    ``[DONE]`` is returned like any payload; the caller decides what it means. Events without a
    ``data`` field are dropped.
    """

    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""  # text after the last complete line
        self._data: list[str] = []  # data lines of the event being read
        self._pending_cr = False  # the last chunk ended in "\r": a following "\n" belongs to it

    def feed(self, chunk: bytes) -> list[str]:
        """Parse ``chunk``; return the payloads of the events it completed, in order."""
        try:
            text = self._text.decode(chunk)
        except UnicodeDecodeError as e:
            raise SSEError(f"the stream is not UTF-8: {e}") from None
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]
        self._pending_cr = text.endswith("\r")
        self._buffer += text
        *lines, self._buffer = self._buffer.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        if len(self._buffer) + sum(map(len, self._data)) > MAX_EVENT_CHARS:
            raise SSEError(f"an event is longer than {MAX_EVENT_CHARS} characters")
        events = []
        for line in lines:
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            name, _, value = line.partition(":")
            if name == "data":
                self._data.append(value.removeprefix(" "))
        return events

    def flush(self) -> list[str]:
        """End of stream: the last event's payload if the server closed without a blank line."""
        tail = self.feed(b"\n\n") if self._buffer or self._data else []
        self._text.reset()
        return tail
