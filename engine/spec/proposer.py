"""Draft proposers behind one interface: prompt lookup (n-gram, no weights) and MTP heads.

A proposer gets, for each decode row that may speculate, the sequence's tokens and how many tokens
it may propose, and returns a Draft (possibly shorter, possibly empty). ``release`` drops any state
kept for a sequence that ended. The draft-model proposer lives in ``engine.spec.draft``.
Pure Python; must not import numpy, CUDA or the engine loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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


class MtpProposer:
    """Multi-token-prediction heads shipped inside the target checkpoint (Qwen3.5/Next hybrids).

    No family memra loads declares MTP tensors yet, so construction fails with one line saying so.
    """

    name = "mtp"

    def __init__(self, model: Any):
        graph = getattr(model, "graph", None)
        tensors = getattr(graph, "tensors", {}) or {}
        family = getattr(graph, "family", "?")
        name = getattr(model, "name", None) or str(getattr(model, "path", "the model"))
        mtp = [t for t in tensors if t.startswith("mtp")]
        if not mtp:
            raise MemraError(
                f"--speculative mtp: {name} ({family} family) has no MTP head; use ngram or draft:PATH",
                param="speculative",
            )
        raise MemraError(  # a family declares MTP tensors but nothing runs them yet
            f"--speculative mtp: the {family} family's MTP head ({', '.join(sorted(mtp))}) is not "
            "wired to a proposer yet; use ngram or draft:PATH",
            param="speculative",
        )

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Draft]:  # pragma: no cover
        raise AssertionError("unreachable: MtpProposer cannot be constructed yet")

    def release(self, seq_id: int) -> None:  # pragma: no cover
        pass
