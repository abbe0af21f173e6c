"""Draft proposers behind one interface: prompt lookup (n-gram, no weights) and MTP heads.

A proposer gets, for each decode row that may speculate, the sequence's tokens and how many tokens
it may propose, and returns a Draft (possibly shorter, possibly empty). ``release`` drops any state
kept for a sequence that ended. The draft-model proposer lives in ``engine.spec.draft``; the MTP
proposer drives a head runner (engine.spec.mtp_head) it is given. Pure Python; must not import
numpy, CUDA or the engine loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.block_manager import BlockManager
from engine.types import MemraError, SamplingParams


@dataclass
class ProposeRequest:
    """One row to draft for: ``tokens`` is prompt + generated (the last one is the row's input)."""

    seq_id: int
    tokens: Sequence[int]
    k: int
    sampling: SamplingParams
    prompt_len: int = 0


@dataclass
class Draft:
    """Proposed tokens and, for a proposer that sampled them, their distributions ([k, vocab])."""

    tokens: list[int] = field(default_factory=list)
    probs: Any = None


class Proposer(Protocol):
    name: str

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Draft]: ...

    def release(self, seq_id: int) -> None: ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (longest n
    from ``max_n`` down to ``min_n``) and propose the tokens that followed it.

    Each sequence keeps an index {n-gram: end position of its latest occurrence}, extended with the
    tokens appended since the last call, so a step costs O(new tokens x n sizes), not O(length).
    """

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n = min_n
        self.max_n = max_n
        self._index: dict[int, tuple[dict[tuple[int, ...], int], int]] = {}

    def _indexed(self, seq_id: int, tokens: Sequence[int]) -> dict[tuple[int, ...], int]:
        index, upto = self._index.get(seq_id, ({}, 0))
        # n-grams ending at positions < len - 1 only: the suffix itself must not match itself
        end = len(tokens) - 1
        for j in range(upto, end):
            for n in range(self.min_n, self.max_n + 1):
                if j - n + 1 >= 0:
                    index[tuple(tokens[j - n + 1 : j + 1])] = j
        self._index[seq_id] = (index, max(upto, end))
        return index

    def lookup(self, seq_id: int, tokens: Sequence[int], k: int) -> list[int]:
        index = self._indexed(seq_id, tokens)
        n_tok = len(tokens)
        for n in range(min(self.max_n, n_tok), self.min_n - 1, -1):
            j = index.get(tuple(tokens[n_tok - n :]))
            if j is not None:
                return list(tokens[j + 1 : j + 1 + k])
        return []

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Draft]:
        return [Draft(self.lookup(r.seq_id, r.tokens, r.k)) for r in requests]

    def release(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)


@dataclass
class _MtpRow:
    base: int  # the first position the head has seen (its cache position 0)
    done: int  # the head's cache holds positions base .. done - 1 from the target's hidden states


class MtpProposer:
    """Multi-token-prediction heads shipped inside the target checkpoint (Qwen3.5 / Qwen3-Next).

    ``head`` runs the family's ``mtp`` graph (engine.spec.mtp_head) with its own paged KV, and
    ``tap`` (engine.spec.hidden_tap) holds the target's hidden states per position. For a row of n
    tokens (the target has run positions 0..n-2), the head first runs the positions it has not seen,
    ``done .. n-2`` (hidden state of p, token p+1), as one chunk: the last gives the first draft,
    the target's token n. Each further draft feeds the head's own hidden output and the previous
    draft at the next position. The draft positions' cache entries are overwritten by the next call
    (they read the head's hidden state, not the target's). Drafts are greedy (argmax), i.e. point-mass
    proposals for the rejection rule. A model without MTP weights fails construction with one line.
    """

    name = "mtp"

    def __init__(self, model: Any, head: Any = None, tap: Any = None):
        self.check(model)
        if head is None or tap is None:
            raise MemraError("--speculative mtp: no MTP head runner for this backend", param="speculative")
        self.head = head
        self.tap = tap
        self.blocks = BlockManager(head.num_blocks, head.block_size, enable_prefix_cache=False)
        self._rows: dict[int, _MtpRow] = {}

    @staticmethod
    def check(model: Any) -> None:
        """Raise one line unless ``model``'s family declares an MTP head and its file carries it."""
        graph = getattr(model, "graph", None)
        tensors = getattr(graph, "tensors", {}) or {}
        family = getattr(graph, "family", "?")
        name = getattr(model, "name", None) or str(getattr(model, "path", "the model"))
        mtp = [t for t in tensors if t.startswith("mtp")]
        graph_mtp = getattr(graph, "mtp", None)
        dims = getattr(model, "dims", {}) or {}
        layers = int(dims.get(graph_mtp.layers) or 0) if graph_mtp is not None else 0
        has = getattr(model, "has", None)
        if not mtp or graph_mtp is None or not layers or (has is not None and not has("mtp_fc", None)):
            raise MemraError(
                f"--speculative mtp: {name} ({family} family) has no MTP head; use ngram or draft:PATH",
                param="speculative",
            )
        if layers != 1:
            raise MemraError(
                f"--speculative mtp: {name} has {layers} MTP layers; memra runs MTP heads of one layer",
                param="speculative",
            )

    def release(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)
        if self.blocks.has_seq(seq_id):
            self.blocks.free(seq_id)
        self.tap.drop(seq_id)

    def _row(self, seq_id: int, first: int) -> _MtpRow:
        row = self._rows.get(seq_id)
        if row is None or row.done < first:  # new, or the rows it still needed are gone
            if self.blocks.has_seq(seq_id):
                self.blocks.free(seq_id)
            self.blocks.allocate(seq_id, [], b"memra-mtp")
            row = self._rows[seq_id] = _MtpRow(first, first)
        return row

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Draft]:
        out = []
        for r in requests:
            out.append(Draft(self._propose_one(r)))
        return out

    def _propose_one(self, r: ProposeRequest) -> list[int]:
        n = len(r.tokens)
        first, end = self.tap.span(r.seq_id)
        if n < 2 or end < n - 1 or first > n - 2:  # no hidden state of position n-2 (yet)
            return []
        row = self._row(r.seq_id, first)
        # the head already ran n-2 when no token came since (a preempted sequence recomputed, its tap
        # rows written again): run n-2 again for the first draft; its cache entry is rewritten
        lo = min(row.done, n - 2)
        k = min(r.k, self.head.max_model_len - (n - 2 - row.base))
        if k < 1 or not self.blocks.grow(r.seq_id, n - 1 - row.base + k - 1):
            self.release(r.seq_id)
            return []
        table = self.blocks.table(r.seq_id)
        hidden = self.tap.rows(r.seq_id, lo, n - 1)
        tok, _, h = self.head.forward(list(r.tokens[lo + 1 : n]), hidden, lo - row.base, table)
        drafts = [tok]
        for j in range(1, k):
            tok, _, h = self.head.forward([tok], [h], n - 2 + j - row.base, table)
            drafts.append(tok)
        row.done = n - 1
        self.tap.consume(r.seq_id, n - 1)
        return drafts
