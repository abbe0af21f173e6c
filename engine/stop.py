"""Stop conditions for one request: stop token ids and stop strings with text holdback.

Text that could still be the start of a stop string is held back until it can no longer match;
on a match only the text before the stop string is released. Pure Python: must not import numpy,
CUDA or other engine modules (``engine.types`` aside).
"""

from __future__ import annotations

from collections.abc import Iterable


class StopStrings:
    """Feed decoded text pieces; get back ``(releasable text, matched)``. Text after a match is dropped."""

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.matched:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        first = -1
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (first == -1 or i < first):
                first = i
        if first != -1:
            self.matched = True
            self._held = ""
            return buf[:first], True
        hold = 0
        for s in self.stops:
            # longest suffix of buf that is a proper prefix of s
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Release the held-back text (the request ended without a match)."""
        out, self._held = ("" if self.matched else self._held), ""
        return out


class StopChecker:
    """Per-request stop logic over sampled tokens: stop token ids, stop strings, incremental text.

    ``decoder`` is a tokenizer incremental decoder (``push(ids) -> str``, ``flush() -> str``).
    ``push`` returns ``(text, finish_reason)``; ``finish_reason`` is ``"stop"`` or ``None``.
    A stop token's own text is never emitted.
    """

    def __init__(self, decoder, stop_strings: Iterable[str], stop_token_ids: Iterable[int]):
        self.decoder = decoder
        self.strings = StopStrings(stop_strings)
        self.stop_token_ids = frozenset(stop_token_ids)

    def push(self, token_id: int) -> tuple[str, str | None]:
        if token_id in self.stop_token_ids:
            return self.finish()[0], "stop"
        text, matched = self.strings.feed(self.decoder.push([token_id]))
        return text, ("stop" if matched else None)

    def finish(self) -> tuple[str, bool]:
        """Flush the decoder and the holdback at the end of a request: ``(text, a stop string matched)``.

        The decoder's tail (bytes it was holding) can itself complete a stop string.
        """
        if self.strings.matched:
            return "", True
        text, matched = self.strings.feed(self.decoder.flush())
        return (text, True) if matched else (text + self.strings.flush(), False)
