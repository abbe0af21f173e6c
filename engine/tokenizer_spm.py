"""A GGUF SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``: Gemma, Llama 2, Mistral) as a
``tokenizers`` BPE with byte fallback.

llama.cpp's SPM tokenizer starts from the UTF-8 characters of the text (spaces replaced by U+2581,
one prepended when ``add_space_prefix``), then repeatedly merges the adjacent pair whose
concatenation is the highest-scoring vocabulary token (leftmost first), and spells characters that
are not tokens as their ``<0xXX>`` byte tokens. A BPE whose merges are every split ``a + b = t`` of
every normal token ``t`` (``a``, ``b`` tokens too), ranked by ``t``'s score, performs exactly those
merges, so ``tokenizers`` runs it. Control tokens (type 3) are special added tokens, user-defined
ones (type 4: Gemma's newline and tab runs) plain added tokens, both matched in the raw text.
Must not import numpy, CUDA or the model graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers

SPACE = "\u2581"
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


def spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """Every (a, b) with a, b and a+b tokens and a+b normal, best-scoring a+b first (ties: lower id)."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, t in enumerate(tokens):
        if types[i] != NORMAL or len(t) < 2 or vocab[t] != i:
            continue
        for cut in range(1, len(t)):
            a, b = t[:cut], t[cut:]
            if a in vocab and b in vocab:
                ranked.append((-float(scores[i]), i, cut, a, b))
    ranked.sort()
    return [(a, b) for _, _, _, a, b in ranked]


def spm_tokenizer(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], *, add_space_prefix: bool
) -> tokenizers.Tokenizer:
    """The ``tokenizers.Tokenizer`` for a GGUF SPM vocabulary (see the module docstring)."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk = next((t for i, t in enumerate(tokens) if t == "<unk>"), None)
    tk = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types), unk_token=unk, byte_fallback=True)
    )
    norm = [normalizers.Replace(" ", SPACE)]
    dec = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend(SPACE))
        dec.append(decoders.Strip(" ", 1, 0))
    tk.normalizer = normalizers.Sequence(norm)
    tk.decoder = decoders.Sequence(dec)
    tk.add_tokens(
        [
            AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
            for i in range(len(tokens))
            if types[i] in (CONTROL, USER_DEFINED)
        ]
    )
    return tk
