"""The engine loop: one thread owns the runner; requests come in through an inbox, tokens go out
through per-request outboxes.

Each step: drain the inbox (submit/abort/shutdown), schedule, ``runner.step``, append sampled tokens,
check stop conditions, detokenize incrementally, push TokenEvents (with ``EngineConfig.overlap`` a
plain decode step is queued before the last one's tokens are read: engine.loop_overlap). The
thread blocks on the inbox only when it has nothing to run. HTTP threads call ``submit``/``abort`` and read ``RequestHandle``s;
they never touch the runner. A runner exception fails only the requests of that step; one with a
true ``fatal`` attribute (or a bug in the loop itself) stops the engine and marks it unhealthy.
Must not import numpy or CUDA.
"""

from __future__ import annotations

import itertools
import logging
import operator
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from engine.block_manager import BlockManager, cache_salt_hash
from engine.engine_config import EngineConfig, EngineStats
from engine.kv_groups import SPEC_HEADROOM, WindowedBlocks
from engine.loop_overlap import OverlapLoop, overlap_capable
from engine.loop_stream import StreamLater
from engine.request_check import CheckedPrompts, check_request
from engine.scheduler import Scheduled, Scheduler, Sequence
from engine.stop import StopChecker
from engine.types import ConfigError, GenerationRequest, MemraError, Runner, StepItem, TokenEvent, Usage

log = logging.getLogger("memra.engine")


class RequestHandle:
    """A request's outbox. Read with ``get``/iteration from any one thread."""

    def __init__(self, engine: Engine, request_id: str):
        self.request_id = request_id
        self._engine = engine
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        self.finished = False

    def get(self, timeout: float | None = None) -> TokenEvent:
        """The next event; raises ``queue.Empty`` after ``timeout`` seconds without one."""
        event = self._events.get(timeout=timeout)
        if event.finish_reason is not None:
            self.finished = True
        return event

    def __iter__(self) -> Iterator[TokenEvent]:
        while not self.finished:
            yield self.get()

    def cancel(self) -> None:
        self._engine.abort(self.request_id)


@dataclass
class _ReqState:
    handle: RequestHandle
    submitted: float
    stop: StopChecker | None = None
    first_event_sent: bool = False


class Engine(OverlapLoop, StreamLater):
    """The public engine API (see docs/engine-loop.md). All methods but the loop are thread-safe."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: Any,
        config: EngineConfig = EngineConfig(),
        *,
        on_step: Callable[[Engine], None] | None = None,
        speculator: Any = None,
        hold_background: bool = False,
    ):
        config.validate()
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.on_step = on_step  # test hook: called in the engine thread after every step
        state_slots = int(getattr(runner, "num_state_slots", 0) or 0)
        if config.state_snapshot_tokens % runner.block_size:
            raise ConfigError(
                f"engine config: state_snapshot_tokens ({config.state_snapshot_tokens}) must be a multiple "
                f"of the KV block size ({runner.block_size})"
            )
        window_blocks = int(getattr(runner, "window_kv_blocks", 0) or 0)
        self.blocks = BlockManager(
            runner.num_blocks,
            runner.block_size,
            config.enable_prefix_cache,
            state_slots=state_slots,
            snapshot_interval=config.state_snapshot_tokens,
            # trailing partial blocks cached (engine.partial_blocks) where the runner copies blocks
            # (engine.types.CopyingRunner), one pool
            partial_blocks=callable(getattr(runner, "copy_blocks", None)) and not window_blocks,
        )
        if window_blocks:  # the window layers' KV in their own pool, released behind the window
            window_group = BlockManager(window_blocks, runner.block_size, config.enable_prefix_cache)
            step = min(config.prefill_chunk_tokens, config.max_step_tokens) + SPEC_HEADROOM
            try:
                self.blocks = WindowedBlocks(self.blocks, window_group, int(runner.kv_window), step)
            except ValueError as e:
                raise ConfigError(f"engine config: {e} (--window-kv-blocks)") from None
        # speculative decoding (engine.spec.speculator.Speculator); the runner must implement verify
        if speculator is not None and not callable(getattr(runner, "verify", None)):
            raise ConfigError(f"speculative decoding: the {runner.backend} runner cannot verify drafts")
        restores = getattr(runner, "verify_restores_state", False) or callable(getattr(runner, "spec_rollback", None))
        if speculator is not None and state_slots and not restores:
            # this runner's verify() would leave the recurrent state advanced past the accepted
            # tokens (the reference restores it: ReferenceRunner._verify_stateful)
            raise ConfigError(
                "speculative decoding: not supported for hybrid models (recurrent state has no rollback of rejected drafts)"
            )
        self.spec = speculator
        windowed = isinstance(self.blocks, WindowedBlocks)
        self._overlap = config.overlap and overlap_capable(runner, speculator, state_slots, windowed)
        self.scheduler = Scheduler(
            self.blocks,
            max_running=config.max_running,
            prefill_chunk_tokens=config.prefill_chunk_tokens,
            max_step_tokens=config.max_step_tokens,
            state_align=int(getattr(runner, "state_align", 1) or 1),
        )
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._lock = threading.Lock()  # engine state (scheduler, blocks, counters) vs stats/invariants
        self._admit_lock = threading.Lock()  # submit-side bookkeeping below
        vocab = getattr(tokenizer, "vocab_size", None)  # prompts found inside it: checked again by new ids only
        self._checked = CheckedPrompts(vocab) if isinstance(vocab, int) else None
        self._seq_ids = itertools.count()
        self._handles: dict[str, RequestHandle] = {}  # in flight: submitted, no final event yet
        self._tenant_inflight: dict[str, int] = {}
        self._inbox_submits = 0
        self._waiting_seen = 0
        self._closed = False
        self._draining = False
        self._crash: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._live: dict[str, Sequence] = {}  # engine thread only
        work = getattr(runner, "background_work", None)  # (engine thread only: it runs on the device)
        self._warm: Iterator[Any] | None = work() if callable(work) else None
        self._warm_go = threading.Event()  # hold_background: set by start_background (the server once ready)
        if not hold_background:
            self._warm_go.set()
        self._cancel_at: float | None = None
        # EngineStats' counters, by their field names
        self._n = dict.fromkeys(("steps", "step_failures", "prompt_tokens_total", "generated_tokens_total",
                                 "finished", "aborted", "errors"), 0)  # fmt: skip

    # ----- public API -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._admit_lock:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(target=self._run, name="memra-engine", daemon=True)
            self._thread.start()

    def start_background(self) -> None:
        """Let the engine thread run the runner's background work (an Engine built with
        ``hold_background``: `memra serve` calls it once /ready answers 200)."""
        if not self._warm_go.is_set():
            self._warm_go.set()
            self._inbox.put(("wake", None))  # (an idle engine thread waits on its inbox)

    @property
    def warming_up(self) -> bool:
        """Whether the runner's background work (graph captures between requests) is still to run."""
        return self._warm is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        return self.alive and self._crash is None

    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Validate and enqueue a request; raises MemraError (context_length_exceeded, overloaded,
        tenant_limit, draining, engine_error, invalid_request_error)."""
        b = self.blocks
        vocab = getattr(self.tokenizer, "vocab_size", None)
        max_tokens = check_request(req, self.runner.max_model_len, b.num_blocks, b.block_size, vocab, self._checked)
        sampling = (
            req.sampling
            if req.sampling.seed is not None
            else replace(req.sampling, seed=secrets.randbits(63))
        )
        with self._admit_lock:
            if self._crash is not None:
                raise MemraError(
                    f"the engine has stopped after an internal error: {self._crash}", code="engine_error"
                )
            if self._draining or self._closed:
                raise MemraError("the engine is draining and accepts no new requests", code="draining")
            if req.request_id in self._handles:
                raise MemraError(f"request id {req.request_id!r} is already in flight", param="request_id")
            if self._inbox_submits + self._waiting_seen >= self.config.max_waiting:
                raise MemraError(
                    f"the server is overloaded ({self.config.max_waiting} requests already waiting); retry later",
                    code="overloaded",
                )
            cap = self.config.tenant_max_concurrency.get(req.tenant)
            if cap is not None and self._tenant_inflight.get(req.tenant, 0) >= cap:
                raise MemraError(
                    f"tenant {req.tenant!r} already has {cap} requests in flight (its limit)",
                    code="tenant_limit",
                )
            seq = Sequence(
                seq_id=next(self._seq_ids),
                request=req,
                sampling=sampling,
                token_ids=list(req.prompt_ids),
                prompt_len=len(req.prompt_ids),
                max_tokens=max_tokens,
                salt=cache_salt_hash(req.tenant, req.cache_salt),
            )
            handle = RequestHandle(self, req.request_id)
            seq.state = _ReqState(handle=handle, submitted=time.perf_counter())
            self._handles[req.request_id] = handle
            self._tenant_inflight[req.tenant] = self._tenant_inflight.get(req.tenant, 0) + 1
            self._inbox_submits += 1
            self._inbox.put(("submit", seq))  # under the lock: inbox order == seq_id (arrival) order
        return handle

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown or finished ids are ignored). Its blocks are freed
        before the next step and its final event has ``finish_reason="abort"``."""
        self._inbox.put(("abort", request_id))

    def drain(self) -> None:
        """Stop admitting: ``submit`` raises ``draining``; in-flight requests continue."""
        with self._admit_lock:
            self._draining = True

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop admitting, let in-flight requests finish, abort whatever is left near the deadline,
        and join the thread; returns within about ``timeout_s`` unless one runner step is longer."""
        deadline = time.monotonic() + timeout_s
        cancel_at = deadline - min(0.5, timeout_s / 4)
        with self._admit_lock:
            self._draining = True
            thread = self._thread
            if thread is None:
                self._closed = True
        if thread is None:
            self._close_out("abort")
            return
        self._inbox.put(("shutdown", cancel_at))
        thread.join(max(0.0, deadline - time.monotonic()))

    def stats(self) -> EngineStats:
        with self._lock:
            s, c, b = self.scheduler, self.scheduler.counters, self.blocks
            return EngineStats(
                running=len(s.running),
                waiting=len(s.waiting) + self._inbox_submits,
                kv_blocks_total=b.num_blocks,
                kv_blocks_free=b.num_free,
                kv_blocks_cached=b.num_cached,
                kv_blocks_used=b.num_used,
                kv_block_size=b.block_size,
                prefix_query_tokens=c.prefix_query_tokens,
                prefix_hit_tokens=c.prefix_hit_tokens,
                prefix_evictions=b.evictions,
                preemptions=c.preemptions,
                **self._n,
                healthy=self.healthy,
                draining=self._draining,
                state_slots_total=b.state_slots,
                state_slots_live=b.num_state_live,
                state_snapshots=b.num_state_snapshots,
                state_snapshot_evictions=b.state_evictions,
                **({} if self.spec is None else self.spec.stats()),
            )

    def check_invariants(self) -> None:
        """Raise AssertionError if the block manager or the queues are inconsistent."""
        with self._lock:
            self.blocks.check_invariants()
            s = self.scheduler
            for name, q in (("running", s.running), ("waiting", s.waiting)):
                assert all(a.seq_id < b.seq_id for a, b in itertools.pairwise(q)), f"{name} not oldest-first"
            assert len(s.running) <= self.config.max_running, "more running sequences than max_running"
            for seq in s.running:
                assert seq.running and self.blocks.has_seq(seq.seq_id), (
                    f"running seq {seq.seq_id} has no blocks"
                )
                covered = len(self.blocks.table(seq.seq_id)) * self.blocks.block_size
                assert covered >= seq.num_computed, (
                    f"seq {seq.seq_id}: table covers {covered} < {seq.num_computed}"
                )
                assert seq.num_computed < len(seq.token_ids), f"seq {seq.seq_id}: nothing left to run"
            for seq in s.waiting:
                assert not seq.running and not self.blocks.has_seq(seq.seq_id), (
                    f"waiting seq {seq.seq_id} holds blocks"
                )
            owners = {seq.seq_id for seq in s.running}
            assert self.blocks.seq_ids() == owners, "block tables exist for sequences that are not running"

    # ----- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        reason = "abort"
        try:
            while True:
                idle = not self.scheduler.has_work() and self._pending is None
                warm = idle and self._warm is not None and self._warm_go.is_set()  # (then no wait on the inbox)
                self._drain_inbox(block=idle and not warm and self._cancel_at is None)
                if self._cancel_at is not None and (
                    not self.scheduler.has_work() or time.monotonic() >= self._cancel_at
                ):
                    break
                if self.scheduler.has_work() or self._pending is not None:
                    self._step()
                elif warm:
                    self._warm_one()
        except BaseException as exc:  # a fatal runner error or a bug in the loop
            log.exception("engine loop stopped")
            self._crash = exc
            reason = "error"
        finally:
            self._drop_pending()  # (an overlapped step still queued: its requests end below)
            with self._admit_lock:
                self._closed = True
            self._close_out(reason)

    def _warm_one(self) -> None:
        """One unit of the runner's background work (``runner.background_work()``: graphs captured
        after the server is ready, engine.runner_warm), run only while no request is scheduled, so a
        request that arrives meanwhile waits for at most this unit. A failed unit ends the
        background work (a request then binds or captures what it needs itself); a fatal one
        stops the engine as a step's would."""
        try:
            next(self._warm)
        except StopIteration:
            self._warm = None
        except Exception as exc:
            if getattr(exc, "fatal", False):
                raise
            log.exception("background warm-up failed; requests capture what they need themselves")
            self._warm = None

    def _close_out(self, reason: str) -> None:
        """End every request still known (live or in the inbox) with ``reason``."""
        error = None
        if reason == "error":
            error = MemraError(f"the engine stopped: {self._crash}", code="engine_error")
        with self._lock:
            for seq in list(self._live.values()):
                try:
                    self._finish(seq, reason, error=error)
                except Exception:  # state may be broken after a crash: still tell the client
                    self._live.pop(seq.request.request_id, None)
                    seq.state.handle._events.put(
                        TokenEvent(
                            seq.request.request_id, [], "", finish_reason=reason, usage=Usage(), error=error
                        )
                    )
            while True:
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "submit":
                    self._take_submit(payload)
                    self._finish(payload, reason, error=error)

    def _take_submit(self, seq: Sequence) -> None:
        """A submitted sequence leaves the inbox: it is live (engine thread) and no longer counted waiting."""
        with self._admit_lock:
            self._inbox_submits -= 1
        self._live[seq.request.request_id] = seq

    def _drain_inbox(self, block: bool) -> None:
        while True:
            if not block and not self._inbox.qsize():  # (cheaper than get_nowait's Empty, every step)
                return
            try:
                kind, payload = self._inbox.get() if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            with self._lock:
                if kind == "submit":
                    self._take_submit(payload)
                    self.scheduler.add(payload)
                    self._n["prompt_tokens_total"] += payload.prompt_len
                elif kind == "abort":
                    seq = self._live.get(payload)
                    if seq is not None:
                        self._finish(seq, "abort")
                elif kind == "shutdown":
                    self._cancel_at = payload
                self._waiting_seen = len(self.scheduler.waiting)

    def _step(self) -> None:
        if self._overlap:
            self._step_overlap()
            return
        batch, items = self._schedule()
        if batch:
            self._run_sync(batch, items)

    def _schedule(self) -> tuple[list[Scheduled], list[StepItem]]:
        with self._lock:
            batch = self.scheduler.schedule()
            self._waiting_seen = len(self.scheduler.waiting)
            items = [self._item(s) for s in batch]
            copies = self.blocks.take_copies()
        if copies:  # partial-block hits' KV, copied before the step that reads it (engine.partial_blocks)
            self.runner.copy_blocks(copies)  # type: ignore[attr-defined]
        if not batch:  # cannot happen with a consistent scheduler; avoid a busy spin if it does
            time.sleep(0.001)
        return batch, items

    def _run_sync(self, batch: list[Scheduled], items: list[StepItem]) -> None:
        if self.spec is not None:
            running, max_len = len(self.scheduler.running), self.runner.max_model_len
            self.spec.attach(batch, items, self.blocks, self._lock, max_model_len=max_len, running=running)
        try:
            sampled = self._run_step(batch, items)
        except Exception as exc:
            self._fail_step(batch, exc)
        else:
            self._stream_deferred()  # (the runner did not call it: engine.loop_stream)
            self._apply(batch, items, sampled)
        if self.on_step is not None:
            self.on_step(self)

    def _fail_step(self, batch: list[Scheduled], exc: Exception) -> None:
        """A runner call raised: a fatal error stops the engine, else the step's requests fail."""
        if getattr(exc, "fatal", False):
            raise exc
        log.exception("runner step failed; failing its %d request(s)", len(batch))
        with self._lock:
            self._n["step_failures"] += 1
            err = MemraError(f"the engine failed while running this request: {exc}", code="engine_error")
            for s in batch:
                self._finish(s.seq, "error", error=err)

    def _apply(self, batch: list[Scheduled], items: list[StepItem], sampled: list[list[int]]) -> None:
        """Post-process a step's results; a row whose request ended meanwhile (an abort while the
        step was in flight, or a stop found one step late by an overlapped step) is dropped."""
        with self._lock:
            self._n["steps"] += 1
            for s, it, tokens in zip(batch, items, sampled, strict=True):
                if self._live.get(s.seq.request.request_id) is not s.seq:
                    continue
                try:
                    self._advance(s, tokens, it)
                except Exception as exc:  # e.g. the tokenizer rejects a token: fail this request only
                    self._decoding_failed(s.seq, exc)

    def _run_step(self, batch: list[Scheduled], items: list[StepItem]) -> list[list[int]]:
        """One runner call; per item the tokens it emits ([] for a prefill chunk that samples nothing).
        A step with speculative drafts goes through ``runner.verify`` (1..k+1 tokens per draft row)."""
        if any(it.draft for it in items):
            return self.spec.verify(self.runner, batch, items, during=self._stream_deferred)
        sampled = self.runner.step(items)
        if len(sampled) != len(items):
            raise RuntimeError(f"runner returned {len(sampled)} results for {len(items)} items")
        # numpy integers are fine; None (or anything else) for a sampled item fails the step
        return [[operator.index(t)] if s.sample else [] for s, t in zip(batch, sampled, strict=True)]

    def _item(self, s: Scheduled) -> StepItem:
        seq = s.seq
        constraint = seq.request.constraint
        slot, restore, snaps = self.blocks.state_for_step(seq.seq_id, s.start, s.count, seq.prompt_len)
        return StepItem(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids[s.start : s.start + s.count],
            start_pos=s.start,
            block_table=list(self.blocks.table(seq.seq_id)),
            sample=s.sample,
            sampling=seq.sampling,
            history=seq.token_ids,  # live list, valid for the duration of the step
            prompt_len=seq.prompt_len,
            prompt_memo=seq.prompt_memo,
            num_generated=seq.num_generated,
            allowed=constraint.allowed() if constraint is not None and s.sample else None,
            state_slot=slot,
            state_restore=restore,
            state_snapshots=snaps,
            window_table=list(b.window_table(seq.seq_id)) if isinstance(b := self.blocks, WindowedBlocks) else None,
        )

    def _advance(self, s: Scheduled, tokens: list[int], it: StepItem | None = None) -> None:
        """Apply one item's result: KV written up to the chunk's end, plus the emitted tokens if any
        (one, or with a speculative draft the accepted drafts and the token after them). Each token
        advances the request's constraint; ``it.logprobs_out`` goes with a single sampled token
        (requests that ask for logprobs or carry a constraint never speculate: engine.spec)."""
        seq = s.seq
        if not tokens:
            seq.num_computed = s.start + s.count
            self.blocks.commit(seq.seq_id, seq.token_ids, seq.num_computed)
            return
        if it is not None and it.draft and self._advance_later(s, tokens, it):
            return  # text and events while the next round's pass runs (engine.loop_stream)
        st: _ReqState = seq.state
        stop = self._stop_of(seq)
        texts: list[str] = []
        reason = None
        constraint = seq.request.constraint
        for token in tokens:  # stop at the first token that ends the request; drop the rest
            seq.token_ids.append(token)
            self._n["generated_tokens_total"] += 1
            if constraint is not None:
                constraint.advance(token)
            text, reason = stop.push(token)
            if reason is None and (
                seq.num_generated >= seq.max_tokens or len(seq.token_ids) >= self.runner.max_model_len
            ):
                tail, matched = stop.finish()
                text += tail
                reason = "stop" if matched else "length"
            texts.append(text)
            if reason is not None:
                break
        kept = len(texts)
        # valid KV: the chunk, plus the accepted draft tokens that were kept (rejected positions'
        # KV is garbage and their blocks go back; they never reach the prefix-cache chain)
        accepted = len(tokens) - 1
        seq.num_computed = s.start + s.count + min(accepted, kept)
        if it is not None and it.draft:
            self.spec.settle(seq.seq_id, len(it.draft), accepted, seq.num_computed, self.blocks, self.runner)
        self.blocks.commit(seq.seq_id, seq.token_ids, seq.num_computed)
        rid = seq.request.request_id
        for token, text in zip(tokens[: kept - 1], texts, strict=False):
            st.handle._events.put(TokenEvent(rid, [token], text, ttft_s=self._ttft(st)))
        lp = it.logprobs_out if it is not None and len(tokens) == 1 else None
        lps = [lp] if lp is not None else None
        if reason is not None:
            self._finish(seq, reason, token_ids=[tokens[kept - 1]], text=texts[-1], logprobs=lps)
        else:
            ev = TokenEvent(rid, [tokens[kept - 1]], texts[-1], ttft_s=self._ttft(st), logprobs=lps)
            st.handle._events.put(ev)

    def _ttft(self, st: _ReqState) -> float | None:
        if st.first_event_sent:
            return None
        st.first_event_sent = True
        return time.perf_counter() - st.submitted

    def _finish(
        self,
        seq: Sequence,
        reason: str,
        *,
        token_ids: list[int] | None = None,
        text: str = "",
        error: MemraError | None = None,
        logprobs: list | None = None,
    ) -> None:
        """Remove the sequence, free its blocks, release its limits, then push its final event."""
        rid = seq.request.request_id
        if self._live.get(rid) is not seq:
            return
        self._stream_deferred(locked=True)  # (its earlier tokens' events first: engine.loop_stream)
        del self._live[rid]
        self.scheduler.remove(seq)
        if self.spec is not None:
            self.spec.release(seq.seq_id)
        st: _ReqState = seq.state
        usage = Usage(
            prompt_tokens=seq.prompt_len,
            completion_tokens=seq.num_generated,
            cached_tokens=seq.cached_tokens or 0,
        )
        key = {"stop": "finished", "length": "finished", "abort": "aborted"}.get(reason, "errors")
        self._n[key] += 1
        with self._admit_lock:
            self._handles.pop(rid, None)
            tenant = seq.request.tenant
            left = self._tenant_inflight.get(tenant, 1) - 1
            if left > 0:
                self._tenant_inflight[tenant] = left
            else:
                self._tenant_inflight.pop(tenant, None)
        st.handle._events.put(
            TokenEvent(
                rid,
                token_ids or [],
                text,
                finish_reason=reason,
                usage=usage,
                error=error,
                ttft_s=self._ttft(st) if seq.num_generated else None,
                logprobs=logprobs,
            )
        )
