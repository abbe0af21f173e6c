"""SSE framing and a closeable WSGI body iterator whose ``close()`` cancels the generation.

Falcon's SSE helpers are ASGI-only, so frames are written by hand; error bodies are engine.server.errors'.
Must not import the engine loop.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

from .errors import ApiError, engine_error

OK_COMMENT = b": ok\n\n"
KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"
MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'  # Anthropic's terminal event
log = logging.getLogger("memra.server")


def data(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def event(name: str, obj: dict) -> bytes:
    return (f"event: {name}\n").encode() + data(obj)


class ClosingStream:
    """WSGI body: iterates ``chunks`` and calls ``on_close`` exactly once, even if never started.

    waitress calls ``close()`` when the response ends or the client disconnects; a bare generator
    would skip its ``finally`` if it was closed before its first ``next()``.
    """

    def __init__(
        self,
        chunks: Iterator[bytes],
        on_close: Callable[[], None],
        on_error: Callable[[BaseException], bytes],
    ):
        self._chunks = chunks
        self._on_close = on_close
        self._on_error = on_error
        self._closed = False
        self._failed = False

    def __iter__(self) -> ClosingStream:
        return self

    def __next__(self) -> bytes:
        if self._failed:
            raise StopIteration
        try:
            return next(self._chunks)
        except StopIteration:
            raise
        except Exception as exc:  # a bug mid-stream: tell the client in-band instead of cutting the socket
            log.exception("error while streaming a response")
            self._failed = True
            return self._on_error(exc)

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


def _internal(exc: BaseException) -> ApiError:
    return engine_error(f"internal error while streaming ({type(exc).__name__})")


def openai_stream_error(exc: BaseException) -> bytes:
    return data(_internal(exc).openai_body()) + DONE


def anthropic_stream_error(exc: BaseException) -> bytes:
    return event("error", _internal(exc).anthropic_body()) + MESSAGE_STOP
