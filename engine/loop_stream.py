"""Streaming a speculative round's tokens while the next round's verify pass runs on the device.

A verified row emits up to k + 1 tokens; detokenising them and pushing their TokenEvents is host
work the next round does not need, as long as none of them can end the request. For such a row
``_advance_later`` does the bookkeeping the next round needs now (append the tokens, count them,
``num_computed``, the rollback of rejected drafts, commit) and leaves the text and the events to
``_stream_deferred``, which the loop hands to ``runner.verify(items, during=...)``: the runner calls
it once the next verify pass is queued on the device, before it waits for the pass
(``engine.spec.speculator.Speculator.verify``). The loop also calls it after every runner call and
before any final event (``_finish``), so a request's events keep their order and come at most one
round late. The tokens and texts are those of the synchronous path: a row whose tokens could end
the request (a stop token, ``max_tokens``, the context) or whose request has stop strings or a
constraint takes the synchronous path (engine.loop ``_advance``). ``StreamLater`` is a base class of
engine.loop.Engine; must not import engine.loop, numpy or CUDA.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.scheduler import Scheduled
from engine.stop import StopChecker
from engine.types import MemraError, StepItem, TokenEvent

log = logging.getLogger("memra.engine")


class StreamLater:
    """Engine's deferred streaming (module docstring). Uses Engine's tokenizer, runner, blocks,
    spec, lock, ``_live``, ``_n``, ``_ttft`` and ``_finish``."""

    _later: list[tuple[Any, list[int]]] | None = None  # (Sequence, its tokens) still to stream

    def _stop_of(self, seq: Any) -> StopChecker:
        """The request's StopChecker (built on its first tokens)."""
        st = seq.state
        if st.stop is None:
            req = seq.request
            eos = frozenset() if req.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
            decoder = self.tokenizer.incremental_decoder(skip_special_tokens=True)
            st.stop = StopChecker(decoder, req.stop, eos | frozenset(req.stop_token_ids))
        return st.stop

    def _decoding_failed(self, seq: Any, exc: Exception) -> None:
        """Fail this request only (e.g. the tokenizer rejects a token), from inside the except block
        (the log carries the traceback); the caller holds the state lock."""
        rid = seq.request.request_id
        log.exception("post-processing failed for request %s", rid)
        err = MemraError(f"the engine failed while decoding this request: {exc}", code="engine_error")
        self._finish(seq, "error", error=err)

    def _advance_later(self, s: Scheduled, tokens: list[int], it: StepItem) -> bool:
        """A verified row's tokens, their text and events left to ``_stream_deferred``; False
        (nothing done) where one of them could end the request, or the request has stop strings
        or a constraint."""
        seq = s.seq
        n = len(tokens)
        stop = self._stop_of(seq)
        if (
            stop.strings.stops
            or seq.request.constraint is not None
            or seq.num_generated + n >= seq.max_tokens
            or len(seq.token_ids) + n >= self.runner.max_model_len
            or not stop.stop_token_ids.isdisjoint(tokens)
        ):
            return False
        seq.token_ids.extend(tokens)
        self._n["generated_tokens_total"] += n
        seq.num_computed = s.start + s.count + n - 1
        self.spec.settle(seq.seq_id, len(it.draft), n - 1, seq.num_computed, self.blocks, self.runner)
        self.blocks.commit(seq.seq_id, seq.token_ids, seq.num_computed)
        if self._later is None:
            self._later = []
        self._later.append((seq, tokens))
        return True

    def _stream_deferred(self, locked: bool = False) -> None:
        """Detokenise and push the events of the rows ``_advance_later`` left (engine thread; with
        ``locked`` the caller holds the state lock). A request whose token the tokenizer rejects
        fails alone, as on the synchronous path."""
        todo = self._later
        if not todo:
            return
        self._later = None
        for seq, tokens in todo:
            rid = seq.request.request_id
            if self._live.get(rid) is not seq:
                continue
            st = seq.state
            try:
                texts = [st.stop.push(t)[0] for t in tokens]
            except Exception as exc:
                if locked:
                    self._decoding_failed(seq, exc)
                else:
                    with self._lock:
                        self._decoding_failed(seq, exc)
                continue
            put = st.handle._events.put
            for token, text in zip(tokens, texts, strict=True):
                put(TokenEvent(rid, [token], text, ttft_s=self._ttft(st)))
