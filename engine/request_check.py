"""check_request: the checks the engine makes on a request at submit, before it is queued (what
can be checked without the engine thread): a non-empty prompt of token ids inside the vocabulary,
and a max_tokens that fits the context length and the whole KV cache; it returns the resolved
max_tokens (None: all the room the context and the cache leave). Each failure is a MemraError
naming the parameter (``context_length_exceeded`` where the request does not fit).

Must not import CUDA, numpy or any runner.
"""

from __future__ import annotations

from engine.block_manager import blocks_for
from engine.types import GenerationRequest, MemraError


def check_request(
    req: GenerationRequest, max_model_len: int, num_blocks: int, block_size: int, vocab: int | None
) -> int:
    """``req``'s max_tokens, checked against a context of ``max_model_len`` tokens and a KV cache of
    ``num_blocks`` blocks of ``block_size`` (``vocab``: the tokenizer's size, None: unchecked)."""
    n = len(req.prompt_ids)
    limit = max_model_len
    kv_tokens = num_blocks * block_size
    if n == 0:
        raise MemraError("the prompt is empty", param="prompt")
    if isinstance(vocab, int) and (min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab):
        raise MemraError(f"the prompt holds token ids outside the vocabulary [0, {vocab})", param="prompt")
    if req.max_tokens is None:
        max_tokens = min(limit, kv_tokens) - n
        if max_tokens < 1:
            raise MemraError(
                f"the prompt has {n} tokens, leaving no room to generate: the context length is {limit} "
                f"tokens and the KV cache holds {kv_tokens}",
                code="context_length_exceeded",
                param="messages",
            )
        return max_tokens
    max_tokens = req.max_tokens
    if max_tokens < 1:
        raise MemraError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if n + max_tokens > limit:
        raise MemraError(
            f"this model's maximum context length is {limit} tokens, but the request needs "
            f"{n + max_tokens} ({n} in the prompt + {max_tokens} max_tokens)",
            code="context_length_exceeded",
            param="max_tokens",
        )
    need = blocks_for(n + max_tokens, block_size)
    if need > num_blocks:
        raise MemraError(
            f"the request needs {n + max_tokens} tokens ({n} in the prompt + {max_tokens} max_tokens) = "
            f"{need} KV blocks, but the whole KV cache holds {num_blocks} blocks ({kv_tokens} tokens)",
            code="context_length_exceeded",
            param="max_tokens",
        )
    return max_tokens
