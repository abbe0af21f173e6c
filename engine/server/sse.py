"""SSE framing and a closeable WSGI body iterator whose ``close()`` cancels the generation.

Falcon's SSE helpers are ASGI-only, so frames are written by hand. Must not import the engine loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

OK_COMMENT = b": ok\n\n"
KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


def data(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def event(name: str, obj: dict) -> bytes:
    return (f"event: {name}\n").encode() + data(obj)


class ClosingStream:
    """WSGI body: iterates ``chunks`` and calls ``on_close`` exactly once, even if never started.

    waitress calls ``close()`` when the response ends or the client disconnects; a bare generator
    would skip its ``finally`` if it was closed before its first ``next()``.
    """

    def __init__(self, chunks: Iterator[bytes], on_close: Callable[[], None]):
        self._chunks = chunks
        self._on_close = on_close
        self._closed = False

    def __iter__(self) -> ClosingStream:
        return self

    def __next__(self) -> bytes:
        return next(self._chunks)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self._chunks, "close", None)
            if close is not None:
                close()
        finally:
            self._on_close()
