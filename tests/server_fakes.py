"""Fake engine and tokenizer for the server tests: scripted text chunks, recorded submits and aborts."""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass

from engine.types import GenerationRequest, MemraError, TokenEvent, Usage


class FakeTokenizer:
    """One token per character (id = code point); a plain-text chat template that lists the tools."""

    eos_token_ids = [0]
    vocab_size = 0x110000

    def encode(self, text: str, add_special_tokens: bool = False, scope=None) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids if i)

    def apply_chat_template(self, messages, *, tools=None, add_generation_prompt=True, **kwargs) -> str:
        out = []
        if tools:
            out.append("<tools>" + json.dumps(tools) + "</tools>\n")
        for m in messages:
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"unknown role {m['role']}")
            out.append(f"<{m['role']}>{m.get('content') or ''}{json.dumps(m.get('tool_calls', ''))}\n")
        if add_generation_prompt:
            out.append("<assistant>")
        return "".join(out)


@dataclass
class FakeStats:
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 100
    kv_blocks_free: int = 90
    kv_blocks_cached: int = 5
    prefix_query_tokens: int = 10
    prefix_hit_tokens: int = 4
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    preemptions: int = 0


class FakeHandle:
    def __init__(self, engine: FakeEngine, req: GenerationRequest):
        self.request_id = req.request_id
        self.q: queue.Queue[TokenEvent] = queue.Queue()
        self._engine = engine

    def get(self, timeout: float | None = None) -> TokenEvent:
        return self.q.get(timeout=timeout)

    def __iter__(self):
        while True:
            ev = self.get()
            yield ev
            if ev.finish_reason:
                return

    def cancel(self) -> None:
        self._engine.abort(self.request_id)


class FakeEngine:
    """``script(req) -> list[str]`` gives the text chunks; ``delay_s`` between chunks;
    ``forever=True`` streams until aborted; ``submit_error`` is raised by submit."""

    def __init__(self, script=None, delay_s: float = 0.0):
        self.script = script or (lambda req: ["Hello", ", ", "world", "!"])
        self.delay_s = delay_s
        self.forever = False
        self.finish_reason = "stop"
        self.submit_error: MemraError | None = None
        self.submitted: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.alive = True
        self.drained = False
        self.invariant_error: str | None = None
        self._abort_events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def submit(self, req: GenerationRequest) -> FakeHandle:
        if self.drained:
            raise MemraError("draining", code="draining")
        if self.submit_error is not None:
            raise self.submit_error
        h = FakeHandle(self, req)
        with self._lock:
            self.submitted.append(req)
            self._abort_events[req.request_id] = threading.Event()
        threading.Thread(target=self._produce, args=(req, h), daemon=True).start()
        return h

    def _produce(self, req: GenerationRequest, h: FakeHandle) -> None:
        stop_ev = self._abort_events[req.request_id]
        t0 = time.monotonic()
        n = 0
        chunks = iter(self.script(req))
        first = True
        while True:
            if stop_ev.wait(self.delay_s) if self.delay_s else stop_ev.is_set():
                h.q.put(TokenEvent(req.request_id, [], "", "abort", Usage(len(req.prompt_ids), n, 0)))
                self.finished.append(req.request_id)
                return
            if self.forever:
                chunk = "x"
            else:
                chunk = next(chunks, None)
                if chunk is None:
                    break
            if req.max_tokens is not None and n >= req.max_tokens:
                h.q.put(TokenEvent(req.request_id, [], "", "length", Usage(len(req.prompt_ids), n, 0)))
                self.finished.append(req.request_id)
                return
            n += 1
            h.q.put(
                TokenEvent(
                    req.request_id,
                    [ord(chunk[0]) if chunk else 1],
                    chunk,
                    None,
                    ttft_s=(time.monotonic() - t0) if first else None,
                )
            )
            first = False
        h.q.put(TokenEvent(req.request_id, [0], "", self.finish_reason, Usage(len(req.prompt_ids), n, 2)))
        self.finished.append(req.request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.aborted.append(request_id)
            ev = self._abort_events.get(request_id)
        if ev:
            ev.set()

    def drain(self) -> None:
        self.drained = True

    def shutdown(self, timeout_s: float = 10.0) -> None:
        for rid in list(self._abort_events):
            self.abort(rid)
        self.alive = False

    def stats(self) -> FakeStats:
        return FakeStats(running=len(self.submitted) - len(self.finished))

    def check_invariants(self) -> None:
        if self.invariant_error:
            raise AssertionError(self.invariant_error)
