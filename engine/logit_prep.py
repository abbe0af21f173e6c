"""The host side of the device token_mask and logprobs steps (kernels/token_mask.cu.j2,
kernels/logprobs.cu.j2): a step's logit biases, constraint masks and logprobs requests packed into
fixed buffers of the CUDA runner's pinned input block, and the logprobs read back from it.

Layout from ``offset`` (the runner copies it to the device with the step's other inputs, so a
captured decode graph reads the same addresses every replay): ``mask_slot`` int32 [rows] (the
row's flag: -1 = not masked, else its slot in ``mask_words``), ``bias_start`` int32 [rows + 1]
(row r's bias entries are ``bias_start[r] .. bias_start[r + 1] - 1``), ``bias_entries`` int32
[2 * BIAS_CAPACITY] ((token, value as f32 bits) pairs, in each request's order), ``lp_slot`` int32
[rows] (-1, or the row's logprobs slot), ``lp_k`` int32 [LP_SLOTS] (each slot's top_logprobs) and
``mask_words`` uint32 [rows, ceil(vocab / 32)] (the masked rows' words, compacted, so a step uploads
only as many rows of words as it has masked rows); then the logprobs kernel's outputs, copied back
after the step: ``lp_ids`` int32 [LP_SLOTS, LP_TOP] and ``lp_vals`` f32 [LP_SLOTS, LP_TOP + 1]. The
mask's meaning is engine.sampling.mask_words's. Must not import CUDA.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from engine.ir import BIAS_CAPACITY, LP_SLOTS
from engine.kernel_catalog import LP_TOP
from engine.sampling import mask_words
from engine.types import StepItem


def on_device(it: StepItem) -> bool:
    """A sampled row the token_mask step serves: it has a constraint mask, a logit bias or asks for
    logprobs (its raw logits are kept for the logprobs kernel)."""
    return it.sample and (it.allowed is not None or it.sampling.needs_host)


class PrepBlock:
    """The token_mask inputs of up to ``rows`` rows over ``vocab`` logits, at byte ``offset`` of
    the pinned input block: ``offsets`` (input name -> byte offset, for the plan's Args),
    ``nbytes``; ``bind`` attaches the host views, ``pack`` fills them for one step."""

    def __init__(self, rows: int, vocab: int, offset: int, capacity: int = BIAS_CAPACITY):
        self.rows, self.vocab, self.offset, self.capacity = rows, vocab, offset, capacity
        self.width = (vocab + 31) // 32
        sizes = (
            ("mask_slot", rows),
            ("bias_start", rows + 1),
            ("bias_entries", 2 * capacity),
            ("lp_slot", rows),
            ("lp_k", LP_SLOTS),
            ("mask_words", rows * self.width),
            ("lp_ids", LP_SLOTS * LP_TOP),
            ("lp_vals", LP_SLOTS * (LP_TOP + 1)),
        )
        off = offset
        self.offsets: dict[str, int] = {}
        for name, n in sizes:
            self.offsets[name] = off
            off = (off + 4 * n + 15) // 16 * 16
        self.nbytes = off - offset
        self.lp_rows: list[tuple[int, int]] = []  # (row, slot) of the last pack's logprobs rows

    def bind(self, block: np.ndarray) -> None:
        """Views into ``block`` (the whole pinned input block, uint8) at this layout's offsets."""
        o = self.offsets

        def view(name: str, dt: type, n: int) -> np.ndarray:
            return block[o[name] : o[name] + n * np.dtype(dt).itemsize].view(dt)

        self.slot = view("mask_slot", np.int32, self.rows)
        self.start = view("bias_start", np.int32, self.rows + 1)
        self.entries = view("bias_entries", np.int32, 2 * self.capacity).reshape(self.capacity, 2)
        self.words = view("mask_words", np.uint32, self.rows * self.width).reshape(self.rows, self.width)
        self.lp_slot = view("lp_slot", np.int32, self.rows)
        self.lp_k = view("lp_k", np.int32, LP_SLOTS)
        self.lp_ids = view("lp_ids", np.int32, LP_SLOTS * LP_TOP).reshape(LP_SLOTS, LP_TOP)
        self.lp_vals = view("lp_vals", np.float32, LP_SLOTS * (LP_TOP + 1)).reshape(LP_SLOTS, LP_TOP + 1)

    def pack(self, items: Sequence[StepItem], skip: Collection[int] = (), logprobs: bool = False) -> int | None:
        """Fill the views for ``items`` (row r = items[r]; the rows in ``skip`` and every row past
        the items unmasked, no bias; with ``logprobs``, each row asking for them gets a slot, at
        most LP_SLOTS: ValueError past that) and
        return the bytes to copy from ``offset``, or None when the step's bias entries exceed the
        capacity (the runner then samples those rows on the host). Bias tokens outside the
        vocabulary are dropped (the host sampler ignores them too). MemraError (from
        engine.sampling.mask_words) when a mask allows no token of the vocabulary."""
        if len(items) > self.rows:
            raise ValueError(f"{len(items)} rows exceed the token_mask buffers' {self.rows}")
        self.slot[:] = -1
        self.lp_slot[:] = -1
        self.lp_rows = []
        total, slots = 0, 0
        self.start[0] = 0
        for r, it in enumerate(items):
            if r in skip:
                self.start[r + 1] = total
                continue
            if it.sample and it.sampling.logit_bias:
                pairs = [(t, v) for t, v in it.sampling.logit_bias if 0 <= t < self.vocab]
                if total + len(pairs) > self.capacity:
                    return None
                if pairs:
                    toks, vals = zip(*pairs, strict=True)
                    self.entries[total : total + len(pairs), 0] = toks
                    self.entries[total : total + len(pairs), 1] = np.asarray(vals, np.float32).view(np.int32)
                    total += len(pairs)
            self.start[r + 1] = total
            if it.sample and it.allowed is not None:
                self.words[slots] = mask_words(it.allowed, self.vocab)
                self.slot[r] = slots
                slots += 1
            if logprobs and it.sample and it.sampling.logprobs is not None:
                n = len(self.lp_rows)
                if n == LP_SLOTS:
                    raise ValueError(f"more than {LP_SLOTS} rows ask for logprobs")
                self.lp_slot[r], self.lp_k[n] = n, min(int(it.sampling.logprobs), LP_TOP)
                self.lp_rows.append((r, n))
        self.start[len(items) + 1 :] = total
        return self.offsets["mask_words"] - self.offset + 4 * slots * self.width

    def out_range(self) -> tuple[int, int]:
        """Byte range (from the block's start) of the last pack's logprobs outputs to copy back."""
        lo = self.offsets["lp_ids"]
        return lo, self.offsets["lp_vals"] + 4 * (LP_TOP + 1) * len(self.lp_rows)

    def logprobs_out(self, items: Sequence[StepItem]) -> None:
        """Set ``logprobs_out`` of the last pack's logprobs rows from the outputs copied back:
        (the sampled token's logprob, [(token id, logprob), ...] best first)."""
        for r, s in self.lp_rows:
            k = int(self.lp_k[s])
            top = [(int(t), float(v)) for t, v in zip(self.lp_ids[s, :k], self.lp_vals[s, 1 : 1 + k], strict=True)]
            items[r].logprobs_out = (float(self.lp_vals[s, 0]), top)
