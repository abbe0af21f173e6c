"""Shared contracts between the engine's subsystems: sampling parameters, runner steps, requests, events.

This module is the seam between the scheduler/loop, the runners (numpy reference and CUDA) and the
HTTP server. It holds plain dataclasses and Protocols only; it must not import numpy, CUDA or any
other engine module, so every layer can depend on it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class MemraError(Exception):
    """A user-facing error: the message is shown as is (CLI) or sent in an error body (HTTP).

    ``code`` is a stable machine-readable string (``context_length_exceeded``, ``invalid_model`` ...)
    and ``param`` names the offending field when there is one.
    """

    def __init__(self, message: str, *, code: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class ConfigError(MemraError):
    """A YAML/TOML/config.json problem; the message names the file and the key path."""

    def __init__(self, message: str):
        super().__init__(message, code="config_error")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. ``temperature == 0`` means greedy (argmax).

    Penalties follow the OpenAI/vLLM definitions: ``presence_penalty`` and ``frequency_penalty``
    apply to generated tokens; ``repetition_penalty`` (> 1 discourages) applies to prompt and
    generated tokens, dividing positive logits and multiplying negative ones.
    ``seed=None`` means fresh entropy chosen at submission (the engine fills it in so a request's
    random stream never depends on what it is batched with).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    # (token id, bias) pairs added to the logits before penalties and sampling (OpenAI logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: no log probabilities; k >= 0: the sampled token's log probability and the k most likely
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_host(self) -> bool:
        """Features beyond plain sampling (engine.sampling.sample_item): logit bias and log
        probabilities. The CUDA runner does both on the device (kernels token_mask, logprobs);
        such requests never speculate."""
        return bool(self.logit_bias) or self.logprobs is not None


@dataclass
class StepItem:
    """One sequence's share of a runner step: a prefill chunk or a single decode token.

    ``token_ids`` are the new tokens to run, at positions ``start_pos .. start_pos+len-1``. The KV of
    positions ``< start_pos`` is already in the cache blocks listed in ``block_table`` (a prefix-cache
    hit or earlier chunks); the runner writes the new positions' KV into the same table, which the
    scheduler has sized to cover ``start_pos + len(token_ids)``.
    ``sample`` is true when the last token's logits must be sampled (last prefill chunk or decode).
    ``history`` is every token id of the sequence so far (prompt + generated), used for penalties;
    ``num_generated`` counts generated tokens so far (the sampler's random-stream counter);
    ``prompt_len`` splits history into prompt and generated parts.
    ``allowed`` (constrained decoding) is a packed int32 bitmask of ceil(vocab / 32) words, bit
    ``t % 32`` of word ``t // 32`` set when token ``t`` may be sampled; None allows every token.
    A runner that samples an item with ``sampling.logprobs`` set stores the result in
    ``logprobs_out``: ``(sampled token's logprob, [(token id, logprob), ...] best first)``.
    """

    seq_id: int
    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    sample: bool
    sampling: SamplingParams
    history: Sequence[int] = ()
    prompt_len: int = 0
    num_generated: int = 0
    allowed: object | None = None
    logprobs_out: tuple[float, list[tuple[int, float]]] | None = None
    # --- recurrent state (hybrid models; runners without it ignore these) -------------------
    # The sequence's live state slot. Its state continues from the previous item of the sequence,
    # starts from zeros when ``start_pos == 0``, or is first copied from ``state_restore`` (a
    # prefix-cache snapshot slot holding the state after ``start_pos`` tokens).
    state_slot: int | None = None
    state_restore: int | None = None
    # (n, slot): after the first n tokens of this item, also store the state into ``slot`` (a
    # snapshot at a block boundary, for the prefix cache).
    state_snapshots: Sequence[tuple[int, int]] = ()
    # --- sliding-window KV group (engine.kv_groups; runners with ``window_kv_blocks`` > 0) ---------
    # The block table of the window layers' KV in the runner's window pool (entries before the
    # window are block_manager.RELEASED and never read); None: every layer uses ``block_table``.
    window_table: Sequence[int] | None = None
    # Speculative decoding (engine.spec): the last ``len(draft)`` entries of ``token_ids`` are proposed
    # tokens to verify. ``draft_probs`` is the proposer's distribution for each of them ([k, vocab]
    # array) when it sampled them, or None when it chose them deterministically (n-gram, greedy draft).
    draft: Sequence[int] = ()
    draft_probs: Any = None
    # Overlapped decode (OverlapRunner.launch): the input token is the id the previous launch sampled
    # for its row ``prev_row``, still on the device; ``token_ids`` then holds one placeholder (-1) and
    # ``history`` ends before that token (the host learns it one step later).
    prev_row: int | None = None
    # Values the runner derives from the sequence's prompt (``history[:prompt_len]``, fixed for the
    # sequence), kept for its later steps: the penalties' distinct prompt ids (engine.sampling
    # .penalty_entries). The engine gives each sequence one dict; None: derived again each step.
    prompt_memo: dict | None = None


class TokenConstraint(Protocol):
    """Per-request constrained decoding (engine.grammar builds one). The engine thread calls
    ``allowed()`` before each sampled step (a packed bitmask as in StepItem.allowed, or None for
    no constraint at this step) and ``advance(token)`` with every generated token; ``advance``
    raises MemraError when the token breaks the constraint."""

    def allowed(self) -> object | None: ...

    def advance(self, token: int) -> None: ...


@runtime_checkable
class Runner(Protocol):
    """Executes model steps over a paged KV cache. Implemented by ReferenceRunner and CudaRunner.

    The runner owns the KV memory (``num_blocks`` blocks of ``block_size`` tokens); the scheduler owns
    which block belongs to whom. ``step`` returns one sampled token id per item (``None`` where
    ``item.sample`` is false). A runner must produce the same greedy tokens for an item whether it is
    stepped alone or together with others.
    """

    block_size: int
    num_blocks: int
    max_model_len: int
    backend: str  # "reference" | "cuda"
    # A hybrid model's runner also has ``num_state_slots`` (> 0): recurrent-state slots, each one
    # sequence's live state or one prefix-cache snapshot, handed out by the block manager.

    def step(self, items: Sequence[StepItem]) -> list[int | None]: ...


@runtime_checkable
class VerifyingRunner(Runner, Protocol):
    """A Runner that can verify speculative drafts in one step (engine.spec).

    ``verify`` runs the items like ``step`` (writing the KV of every token, drafts included) and
    returns, per item, the tokens it emits: for an item with a draft of k tokens it scores the k+1
    positions from the one before the draft to the last draft token (logits for every verify
    position), applies ``engine.spec.accept`` (greedy: longest prefix equal to the argmax; sampling:
    the rejection rule) and returns the accepted drafts plus one token (1..k+1 ids). Items without a
    draft give ``[token]`` when sampled, else ``[]``. The engine then rolls the KV of the rejected
    positions back (block manager truncation); a runner with per-sequence state beside the paged KV
    (recurrent layers) either has ``verify_restores_state = True`` (its verify leaves the state at
    the last accepted position) or implements ``spec_rollback(seq_id, num_tokens)``
    (docs/speculative.md, "One step"). A runner whose pass runs asynchronously may set
    ``verify_during = True`` and take ``verify(items, during=f)``: it calls ``f()`` once, after
    queueing its first verify pass and before waiting for it (engine.loop_stream).
    """

    def verify(self, items: Sequence[StepItem]) -> list[list[int]]: ...


@runtime_checkable
class CopyingRunner(Runner, Protocol):
    """A Runner that copies KV blocks: the prefix cache's partial-block hits (engine.partial_blocks).

    ``copy_blocks(pairs)`` makes, in order, each destination block's KV (every layer's K and V, all
    of its slots) a copy of the source block's, before any step called after it reads or writes
    them (a device runner queues the copies on its step stream). Called between steps, never while
    an overlapped launch is uncollected.
    """

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None: ...


@runtime_checkable
class OverlapRunner(Runner, Protocol):
    """A Runner that can queue a decode step without waiting for it (engine.loop_overlap).

    ``can_launch(items)``: whether ``launch`` takes these items (decode rows the device samples
    alone). ``launch(items)`` queues the step and returns a handle at once; an item with
    ``prev_row`` set reads its input token from the previous launch's sampled ids on the device.
    ``collect(handle)`` waits for that step and returns its ids like ``step``. Handles are collected
    in launch order, at most two launches are uncollected at once, and ``step``/``verify`` are only
    called with none uncollected.
    """

    def can_launch(self, items: Sequence[StepItem]) -> bool: ...

    def launch(self, items: Sequence[StepItem]) -> Any: ...

    def collect(self, handle: Any) -> list[int | None]: ...


@dataclass
class GenerationRequest:
    """What a client asked the engine for, already tokenized."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: up to the context length
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    tenant: str = "default"
    cache_salt: str = ""  # extra isolation inside a tenant (vLLM's cache_salt)
    constraint: TokenConstraint | None = None  # constrained decoding (structured output, forced tools)
    speculative: bool = True  # False: never speculate for this request (when the engine does)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class TokenEvent:
    """Pushed to a request's outbox after each engine step that produced output for it.

    ``text`` is the newly releasable text (valid UTF-8; stop-string candidates held back).
    The last event of a request has ``finish_reason`` set: ``stop`` (EOS or stop string),
    ``length`` (max_tokens or context), ``abort`` (client gone / shutdown) or ``error``
    (then ``error`` holds a MemraError).
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    error: MemraError | None = None
    ttft_s: float | None = None  # set on the first event: seconds from submit to first token
    # per token of token_ids when the request asked for logprobs: (logprob, [(id, logprob), ...])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # time.perf_counter() when the engine produced the event (readers may drain the queue late)
    created_s: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class DeviceInfo:
    """What the driver says about a GPU (filled by engine.cuda; plain data here)."""

    name: str
    compute_capability: tuple[int, int]
    sm_count: int = 0
    total_memory: int = 0  # bytes

    @property
    def cc(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"
