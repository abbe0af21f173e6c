"""A scripted, deterministic Runner and a tiny tokenizer for engine/server tests (no model, no numpy).

``FakeRunner`` models a paged KV cache whose "KV" at position p is a chained hash of the
sequence's tokens ``0..p``. Each step it checks that the block table covers the positions, that
every position < start_pos it reads holds exactly the value this sequence's history implies (KV
written by another sequence, a stale block or a missing write fails an assertion), then writes the
new positions and derives the next token from the hash it READ, so a KV bug also changes output.
Greedy output depends only on the sequence's own tokens; sampled output on (tokens, seed,
num_generated), so both are independent of batching. ``reference_generate`` replays the same rule
without any KV, as the oracle for tests. It is also an OverlapRunner (engine.types): ``launch``
snapshots a step's inputs and queues it, and the queue runs in order, like a device stream, when a
later launch or ``collect`` needs it, so KV writes land after the engine has moved on (an item's
``prev_row`` token comes from the previous launch's outputs). Must not import numpy or CUDA.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Sequence
from dataclasses import replace

from engine.step_check import check_step_item
from engine.types import SamplingParams, StepItem

_M = (1 << 64) - 1
_ROOT = 0x6A09E667F3BCC908


def _mix(h: int, t: int) -> int:
    h = ((h ^ (t + 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9) & _M
    return h ^ (h >> 31)


class FatalRunnerError(RuntimeError):
    """Raised by the fake runner to simulate an unrecoverable device error (``fatal = True``)."""

    fatal = True


class FakeRunner:
    """A Runner over a simulated paged KV cache; see the module docstring."""

    backend = "fake"

    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 256,
        vocab_size: int = 128,
        *,
        fail_steps: Sequence[int] = (),
        fatal_steps: Sequence[int] = (),
        step_delay_s: float = 0.0,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.fail_steps = set(fail_steps)  # 1-based step numbers that raise RuntimeError
        self.fatal_steps = set(fatal_steps)  # ... that raise FatalRunnerError
        self.step_delay_s = step_delay_s
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.steps = 0
        self.tokens_run = 0
        self.prefill_tokens = 0  # tokens of items that are not single-token decode rows
        self.max_items = 0
        self.launches = 0  # overlapped steps queued (engine.loop_overlap)
        self._queue: list[list] = []  # launched steps: [items, outputs or None]
        self._uncollected: list[list] = []
        self._last_out: list[int | None] | None = None  # the last executed launch's outputs

    @staticmethod
    def next_token(state: int, sampling: SamplingParams, num_generated: int, vocab_size: int) -> int:
        """The token sampled after a position whose KV hash is ``state``."""
        if sampling.greedy:
            return _mix(state, 7) % vocab_size
        return _mix(_mix(_mix(state, 11), sampling.seed or 0), num_generated) % vocab_size

    @classmethod
    def reference_generate(
        cls,
        prompt: Sequence[int],
        n: int,
        sampling: SamplingParams = SamplingParams(temperature=0.0),
        vocab_size: int = 128,
    ) -> list[int]:
        """The ``n`` tokens the fake runner produces for ``prompt`` (no stop conditions applied)."""
        h = _ROOT
        for t in prompt:
            h = _mix(h, t)
        out: list[int] = []
        for _ in range(n):
            t = cls.next_token(h, sampling, len(out), vocab_size)
            out.append(t)
            h = _mix(h, t)
        return out

    def step(self, items: Sequence[StepItem]) -> list[int | None]:
        assert not self._uncollected, "step() while launched steps are not collected"
        self._last_out = None  # (a later launch's prev_row may only refer to a launch)
        return self._execute(items)

    def can_launch(self, items: Sequence[StepItem]) -> bool:
        return all(len(it.token_ids) == 1 and it.start_pos > 0 and it.sample for it in items)

    def launch(self, items: Sequence[StepItem]) -> list:
        """Queue a step (engine.types.OverlapRunner); the handle is collected in launch order."""
        assert self.can_launch(items), "launch of items that are not plain decode rows"
        assert len(self._uncollected) < 2, "more than two launched steps uncollected"
        for it in items:
            if it.prev_row is not None:
                assert list(it.token_ids) == [-1] and len(it.history) == it.start_pos, (
                    f"seq {it.seq_id}: an overlapped row's history must end before its pending token"
                )
        self.launches += 1
        # the inputs as they are now (a device step reads its packed copy, not the live lists)
        snap = [replace(it, history=list(it.history), block_table=list(it.block_table)) for it in items]
        entry = [snap, None]
        self._queue.append(entry)
        self._uncollected.append(entry)
        if self.steps + len(self._queue) in self.fail_steps | self.fatal_steps:
            try:
                self._run_queue()  # (a scripted failure raises from launch, which then queued nothing)
            except BaseException:
                self._uncollected.remove(entry)
                raise
        return entry

    def collect(self, handle: list) -> list[int | None]:
        assert self._uncollected and self._uncollected[0] is handle, "collect out of launch order"
        self._uncollected.pop(0)
        self._run_queue()
        return handle[1]

    def _run_queue(self) -> None:
        """Run the queued steps in order (a step whose prev_row input the previous one sampled)."""
        while self._queue:
            entry = self._queue.pop(0)
            items = entry[0]
            prev = self._last_out
            for i, it in enumerate(items):
                if it.prev_row is not None:
                    assert prev is not None and it.prev_row < len(prev), "prev_row without a previous launch"
                    tok = prev[it.prev_row]
                    items[i] = replace(it, token_ids=[tok], history=[*it.history, tok], prev_row=None)
            try:
                entry[1] = self._execute(items)
            except BaseException:
                self._queue.clear()
                raise
            self._last_out = entry[1]

    def _execute(self, items: Sequence[StepItem]) -> list[int | None]:
        self.steps += 1
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.steps in self.fatal_steps:
            raise FatalRunnerError(f"scripted fatal failure at step {self.steps}")
        if self.steps in self.fail_steps:
            raise RuntimeError(f"scripted failure at step {self.steps}")
        self.max_items = max(self.max_items, len(items))
        seen: set[int] = set()
        bs = self.block_size
        out: list[int | None] = []
        for item in items:
            assert item.seq_id not in seen, f"sequence {item.seq_id} twice in one step"
            seen.add(item.seq_id)
            check_step_item(
                item, max_model_len=self.max_model_len, block_size=bs, num_blocks=self.num_blocks, vocab=self.vocab_size
            )
            n = len(item.token_ids)
            end = item.start_pos + n
            assert len(set(item.block_table)) == len(item.block_table), "block repeated in a table"
            history = item.history
            assert list(history[item.start_pos : end]) == list(item.token_ids), (
                "token_ids differ from history"
            )
            assert item.num_generated == len(history) - item.prompt_len, "num_generated inconsistent"
            # Verify every KV position this item attends to.
            expect = _ROOT
            for p in range(item.start_pos):
                expect = _mix(expect, history[p])
                got = self.kv[item.block_table[p // bs]][p % bs]
                assert got == expect, (
                    f"seq {item.seq_id} reads wrong KV at position {p} (block {item.block_table[p // bs]})"
                )
            state = (
                self.kv[item.block_table[(item.start_pos - 1) // bs]][(item.start_pos - 1) % bs]
                if item.start_pos
                else _ROOT
            )
            for i, t in enumerate(item.token_ids):
                p = item.start_pos + i
                state = _mix(state, t)  # type: ignore[arg-type]
                self.kv[item.block_table[p // bs]][p % bs] = state
            self.tokens_run += n
            if n > 1 or item.start_pos < item.prompt_len:
                self.prefill_tokens += n
            if item.sample:
                assert end == len(history), "sampling before the end of the sequence"
                out.append(self.next_token(state, item.sampling, item.num_generated, self.vocab_size))  # type: ignore[arg-type]
            else:
                out.append(None)
        return out


class FakeTokenizer:
    """128 ids: 0 pad and 1 EOS (special), 2..96 the ASCII chars ' '..'~', 97+98 = 'é' and 99+100 = '€'
    (multi-byte UTF-8 split across tokens), 101..127 the words ``"w<id> "``."""

    PAD, EOS = 0, 1
    vocab_size = 128

    def __init__(self, eos_token_ids: frozenset[int] = frozenset({1})):
        self.eos_token_ids = frozenset(eos_token_ids)

    def piece(self, t: int, skip_special_tokens: bool = True) -> bytes:
        if t == self.PAD:
            return b"" if skip_special_tokens else b"<pad>"
        if t == self.EOS:
            return b"" if skip_special_tokens else b"</s>"
        if 2 <= t <= 96:
            return bytes([t + 30])
        if 97 <= t <= 100:
            return {97: b"\xc3", 98: b"\xa9", 99: b"\xe2\x82", 100: b"\xac"}[t]
        return f"w{t} ".encode()

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for ch in text:
            if ch == "é":
                ids += [97, 98]
            elif ch == "€":
                ids += [99, 100]
            elif 32 <= ord(ch) <= 126:
                ids.append(ord(ch) - 30)
            else:
                raise ValueError(f"FakeTokenizer cannot encode {ch!r}")
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.piece(t, skip_special_tokens) for t in ids).decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special_tokens: bool = True) -> _IncrementalDecoder:
        return _IncrementalDecoder(self, skip_special_tokens)


class _IncrementalDecoder:
    def __init__(self, tok: FakeTokenizer, skip_special_tokens: bool):
        self._tok = tok
        self._skip = skip_special_tokens
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: list[int]) -> str:
        return self._dec.decode(b"".join(self._tok.piece(t, self._skip) for t in ids))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
