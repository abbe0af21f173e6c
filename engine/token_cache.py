"""Tokenise a prompt in time proportional to its new text: the text is cut at special tokens and each
piece's ids come from a bounded LRU, so a prompt sent again, or a conversation that grew by one turn,
only encodes what was not seen before.

Pieces are cached under a ``scope`` (the server passes the tenant and cache salt, as the prefix
cache keys its blocks; ``None``, the default, for the CLI and other single-user callers): one LRU
keyed by (scope, piece) under one global bound, so a piece found in the cache is one its own scope
encoded, and one tenant's tokenisation time never tells whether another sent the same text.

Cutting at a special token is exact because the tokenizers library cuts there itself: it splits
the input on its added tokens before normalising and pre-tokenising each piece on its own. Only
added tokens without lstrip/rstrip/single_word/normalized are cut at (the others stay inside their
piece, which the library then splits as it would have). A tokenizer whose pieces still encode
differently alone (an offset-dependent pre-tokenizer, say) is caught by a probe at construction,
and then only whole texts are cached.

Cached ids are tuples of one shared int object per vocabulary id (``_canonical_ints``): a hit's copy
into the caller's list is a pointer copy (a 16k-token prompt of ids past 256: ~0.02 ms, against
~0.35 ms to make ints out of an ``array``), at 8 bytes a cached id plus one int per vocabulary
entry (a 152k vocabulary: 6 MB).
Must not import numpy, CUDA or other engine modules.
"""

from __future__ import annotations

import functools
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

#: probe texts: special tokens {a} and {b} between pieces that start with spaces, digits,
#: newlines and non-ASCII, as chat templates produce them
_PROBES = (
    "{a}system\nYou are a helpful assistant.{b}\n{a}user\n  Hello,  world 12345!\n{b}\n{a}assistant\n",
    "{a} leading space{b}{b}  two{a}\n\n\tx = 3.14159 # ünïcödé 日本語 😀{b} tail ",
    "plain text first {a}42{b}7 end",
)


class SegmentEncoder:
    """``encode(text) -> ids`` equal to ``hf.encode(text, add_special_tokens=False).ids``, with the
    ids of pieces between special tokens cached per ``scope`` (least recently used dropped past
    ``max_tokens`` cached ids or ``max_entries`` pieces, all scopes together). ``split=False``:
    whole texts are the pieces (never cut at special tokens; for a tokenizer that reads
    special-token strings as text). Thread-safe."""

    def __init__(self, hf: Any, max_tokens: int = 1 << 20, max_entries: int = 1 << 16, *, split: bool = True):
        self.hf = hf
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[Any, str], tuple[int, ...]] = OrderedDict()
        self._canon = _canonical_ints(hf.get_vocab_size(with_added_tokens=True)).__getitem__
        self._cached_tokens = 0
        self.hits = self.misses = 0
        added = [t for t in hf.get_added_tokens_decoder().values() if not t.normalized]
        self._plain = {
            t.content: hf.token_to_id(t.content)
            for t in added
            if t.special and not (t.lstrip or t.rstrip or t.single_word)
        }
        # every non-normalised added token, longest first: the library matches leftmost-longest,
        # so a longer token containing a plain one is never cut inside
        names = sorted({t.content for t in added}, key=len, reverse=True)
        self._split = re.compile("|".join(re.escape(n) for n in names)) if split and self._plain else None
        if self._split is not None and not self._probe():
            self._split = None  # pieces do not encode alone as they do in context: whole texts only

    def encode(self, text: str, scope: Any = None) -> list[int]:
        """The ids of ``text``, reusing only pieces cached under ``scope`` (any hashable value)."""
        if self._split is None:
            ids = self._piece(text, scope)
            return ids if isinstance(ids, list) else list(ids)
        out: list[int] = []
        start = 0
        for m in self._split.finditer(text):
            tid = self._plain.get(m.group())
            if tid is None:
                continue  # an added token with stripping rules: left inside its piece
            if m.start() > start:
                out += self._piece(text[start : m.start()], scope)
            out.append(tid)
            start = m.end()
        if start < len(text):
            out += self._piece(text[start:], scope)
        return out

    def _piece(self, text: str, scope: Any) -> Sequence[int]:
        """The ids of one piece: the tuple cached under ``scope`` (shared: never mutate it) or a new list."""
        key = (scope, text)
        with self._lock:
            ids = self._lru.get(key)
            if ids is not None:
                self._lru.move_to_end(key)
                self.hits += 1
                return ids
            self.misses += 1
        got = self.hf.encode(text, add_special_tokens=False).ids
        if len(got) <= self.max_tokens // 4:  # one huge text must not flush everything else
            try:
                kept = tuple(map(self._canon, got))
            except IndexError:  # (an id past the reported vocabulary: its own ints)
                kept = tuple(got)
            with self._lock:
                if key not in self._lru:
                    self._lru[key] = kept
                    self._cached_tokens += len(got)
                    while self._cached_tokens > self.max_tokens or len(self._lru) > self.max_entries:
                        _, old = self._lru.popitem(last=False)
                        self._cached_tokens -= len(old)
        return got

    def _probe(self) -> bool:
        specials = list(self._plain)
        a, b = specials[0], specials[-1]
        # also words of this vocabulary (so that a difference cannot hide behind unknown tokens)
        n = self.hf.get_vocab_size(with_added_tokens=False)
        ids = [i for i in range(0, n, max(1, n // 24)) if self.hf.id_to_token(i) not in self._plain]
        words = [self.hf.decode([i]) for i in ids]
        vocab_probe = "{a}" + " ".join(words) + "{b}" + "".join(words) + "\n{a}\n" + " ".join(words)
        for probe in (*_PROBES, vocab_probe):
            text = probe.replace("{a}", a).replace("{b}", b)
            if self.encode(text) != self.hf.encode(text, add_special_tokens=False).ids:
                return False
        with self._lock:  # the probes' pieces need not stay
            self._lru.clear()
            self._cached_tokens = self.hits = self.misses = 0
        return True


@functools.lru_cache(maxsize=4)
def _canonical_ints(n: int) -> list[int]:
    """One int object per id below ``n``, shared by every cached piece of a vocabulary that size."""
    return list(range(n))
