"""One generation request end to end: prompt build, submit (mapped errors), event polling with keep-alives,
client-disconnect detection, abort on close, tenant slot and metrics bookkeeping.

Must not import falcon; talks to the engine only through submit/RequestHandle.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import replace
from typing import Any

from engine.gen_defaults import with_defaults
from engine.types import GenerationRequest, MemraError, TokenEvent, Usage

from .auth import Tenant
from .errors import ApiError, bad_request, engine_error, from_code, from_memra
from .schemas import ChatSpec, GenSpec
from .state import AppState
from .tool_calls import tool_instruction

POLL_S = 0.25  # how often a waiting request checks for a vanished client


def check_model(state: AppState, name: str | None) -> None:
    mi = state.model_info
    if name and mi is not None and not mi.matches(name):
        raise ApiError(
            404,
            f"The model `{name}` does not exist; this server serves `{mi.id}`",
            code="model_not_found",
            param="model",
            anthropic_type="not_found_error",
        )


def _escape(tok: Any, value: Any) -> Any:
    """Every string inside ``value`` passed through the tokenizer's ``escape_specials`` (so special
    tokens in client text are read as text; only the template emits them)."""
    esc = getattr(tok, "escape_specials", None)
    if esc is None:
        return value
    if isinstance(value, str):
        return esc(value)
    if isinstance(value, dict):  # keys too: tool schemas are rendered with tojson, keys included
        return {(esc(k) if isinstance(k, str) else k): _escape(tok, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_escape(tok, v) for v in value]
    return value


def _text_bytes(value: Any) -> int:
    """UTF-8 bytes of every string inside ``value`` (a bound on the prompt text it becomes)."""
    stack, n = [value], 0
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            n += len(v.encode("utf-8", "surrogatepass"))
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return n


def prompt_byte_limit(state: AppState) -> int:
    """Prompt text refused before tokenising: ``max_prompt_bytes`` or 16 bytes per context token."""
    lim = state.config.max_prompt_bytes
    return lim if lim > 0 else 16 * int(state.model_info.context_length)


def check_prompt_bytes(state: AppState, n: int, param: str) -> None:
    lim = prompt_byte_limit(state)
    if n > lim:
        raise ApiError(
            400,
            f"the prompt text is {n} bytes; this server tokenises at most {lim} bytes "
            f"(context length {state.model_info.context_length} tokens)",
            code="context_length_exceeded",
            param=param,
        )


def cache_salt(tenant: Tenant, request_salt: str = "") -> str:
    """The prefix-cache salt of a request: its tenant's, then the request's own ``cache_salt``."""
    return f"{tenant.cache_salt}\x1f{request_salt}" if request_salt else tenant.cache_salt


def cache_scope(tenant: Tenant, request_salt: str = "") -> tuple[str, str]:
    """Whose caches a request may reuse: (tenant, cache salt), as the prefix cache keys its blocks.
    The tokenizer's piece cache is scoped by it too, so tokenisation time tells one tenant nothing
    of another's prompts."""
    return (tenant.name, cache_salt(tenant, request_salt))


def chat_ids(state: AppState, spec: ChatSpec, tenant: Tenant) -> list[int]:
    """Token ids of the rendered chat prompt: size-checked first, then rendered and tokenised on the
    dedicated tokenizer pool (reusing only ``tenant``'s cached pieces); special tokens inside client
    text are tokenised as text. Sets ``spec.prompt_text`` (the reasoning split and grammar phases
    read where the prompt ends)."""
    n = _text_bytes((spec.messages, spec.tools, spec.template_kwargs))
    check_prompt_bytes(state, n, "messages")
    scope = cache_scope(tenant, spec.cache_salt)

    def work() -> list[int]:
        text = chat_prompt(state, spec)
        check_prompt_bytes(state, len(text.encode("utf-8", "surrogatepass")), "messages")
        spec.prompt_text = text
        return encode(state, text, chat=True, scope=scope)

    with state.admission.preparing():
        return state.tokenize_pool.run(work, size=n)


def text_ids(
    state: AppState,
    text: str,
    scope: tuple[str, str],
    param: str = "prompt",
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of a raw prompt (completions, /tokenize), size-checked before the tokenizer pool runs;
    ``scope`` (``cache_scope``): whose cached pieces it may reuse."""
    n = len(text.encode("utf-8", "surrogatepass"))
    check_prompt_bytes(state, n, param)
    with state.admission.preparing():
        return state.tokenize_pool.run(encode, state, text, param, add_special_tokens, False, scope, size=n)


def chat_prompt(state: AppState, spec: ChatSpec) -> str:
    """Render the chat template (tools included unless tool_choice is none); client strings are
    escaped with the tokenizer's ``escape_specials`` (read back as text by ``encode_chat``)."""
    tok = state.tokenizer
    messages = [_escape(tok, dict(m)) for m in spec.messages]
    tools = _escape(tok, spec.tools) if spec.tool_choice != "none" else None
    if spec.tool_choice in ("required", "named"):
        instr = _escape(tok, tool_instruction(spec.tool_choice, spec.tool_name))
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = (messages[0]["content"] + "\n\n" + instr).strip()
        else:
            messages.insert(0, {"role": "system", "content": instr})
    try:
        return tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, **_escape(tok, spec.template_kwargs)
        )
    except MemraError as exc:
        raise bad_request(f"chat template: {exc.message}", "messages") from None
    except Exception as exc:
        if isinstance(exc, (ValueError, TypeError, LookupError)) or type(exc).__module__.startswith("jinja2"):
            raise bad_request(f"chat template failed: {exc}", "messages") from None
        raise


def encode(
    state: AppState,
    text: str,
    param: str = "messages",
    add_special_tokens: bool = False,
    chat: bool = False,
    scope: tuple[str, str] | None = None,
) -> list[int]:
    """Token ids of ``text``; ``add_special_tokens`` adds BOS where the model wants it (a raw completion
    prompt; a rendered chat template carries its own). ``chat``: a rendered template, through the
    tokenizer's ``encode_chat`` where it has one (escaped client text read back as text). ``scope``
    (``cache_scope``): the piece cache the tokenizer may reuse."""
    tok = state.tokenizer
    enc = getattr(tok, "encode_chat", None) if chat else None
    try:
        if enc is not None:
            return list(enc(text, scope=scope))
        return list(tok.encode(text, add_special_tokens=add_special_tokens, scope=scope))
    except (ValueError, UnicodeError) as exc:  # a tokenizer that cannot represent the text
        raise bad_request(f"the prompt cannot be tokenized: {exc}", param) from None


def constraint_factory(state: AppState, spec: GenSpec) -> Callable[[], Any] | None:
    """What constrains ``spec``'s output, as a maker of one engine.grammar constraint per choice:
    ``response_format`` json_object / json_schema, else (chat) tool_choice required / named forcing
    well-formed ``<tool_call>`` blocks valid against the tools' schemas; None when unconstrained.
    The grammar is compiled here, in the HTTP thread; a bad schema is a 400."""
    rf = spec.response_format
    forced = isinstance(spec, ChatSpec) and spec.tools and spec.tool_choice in ("required", "named")
    if rf is None and not forced:
        return None
    from engine import grammar

    if not grammar.available() or getattr(state.tokenizer, "hf", None) is None:
        if rf is None:  # forced tool calls degrade to the system-prompt instruction alone
            return None
        why = "the llguidance package is not installed" if not grammar.available() else "no grammar support for this tokenizer"
        raise bad_request(f"response_format is unavailable: {why}", "response_format")
    if rf is not None:
        grammar_of = lambda: grammar.json_grammar(rf.get("schema"))  # noqa: E731
        param = "response_format"
    else:
        grammar_of = lambda: grammar.tool_call_grammar(  # noqa: E731
            spec.tools, spec.tool_name if spec.tool_choice == "named" else None, spec.parallel_tool_calls
        )
        param = "tools"
    reasoning = None
    if isinstance(spec, ChatSpec):
        from .reasoning import reasoning_parser_for

        splitter = reasoning_parser_for(state.tokenizer, spec.prompt_text)
        if splitter is not None:
            reasoning = "inside" if splitter.state == "think" else "maybe"
    def compile_first() -> list:
        text = grammar_of()
        return [text, grammar.build_constraint(state.tokenizer, text, reasoning)]

    try:  # on the tokenizer pool, counted as preparing: grammar compilation is prompt-sized work too
        with state.admission.preparing():
            text, constraint = state.tokenize_pool.run(compile_first)
        first = [constraint]
    except MemraError as exc:
        if exc.code == "draining":  # the pool shut down while this request waited
            raise
        raise bad_request(exc.message, param) from None
    except (ValueError, TypeError) as exc:
        raise bad_request(f"invalid schema: {exc}", param) from None

    def make() -> Any:
        return first.pop() if first else grammar.build_constraint(state.tokenizer, text, reasoning)

    return make


class Run:
    """A submitted request. Iterate ``events()``; always call ``close()`` (idempotent)."""

    def __init__(
        self,
        state: AppState,
        tenant: Tenant,
        spec: GenSpec,
        prompt_ids: list[int],
        *,
        param: str,
        disconnected: Callable[[], bool] | None,
        id_prefix: str,
        index: int = 0,
        response_id: str | None = None,
    ):
        self.state = state
        self.index = index  # choice index (n > 1)
        self.constraint = None  # a TokenConstraint (engine.grammar) set before submit, or None
        self.logprobs: list = []  # (logprob, top) per generated token when the request asked for them
        self._pending: list[TokenEvent] = []  # events read ahead by wait_first()
        self.tenant = tenant
        self.spec = spec
        self.prompt_ids = prompt_ids
        self.disconnected = disconnected or (lambda: False)
        self.id = response_id or f"{id_prefix}{uuid.uuid4().hex}"
        self.request_id = self.id if index == 0 else f"{self.id}-{index}"
        self.created = int(time.time())
        self.handle: Any = None
        self.finished = False
        self.finish_reason: str | None = None
        self.client_gone = False
        self.usage = Usage(prompt_tokens=len(prompt_ids))
        self.generated_ids: list[int] = []
        self._closed = False
        self._t0 = time.monotonic()
        self._last = None
        ctx = state.model_info.context_length
        n = len(prompt_ids)
        if n == 0:
            raise bad_request("the prompt is empty", param)
        if n >= ctx:
            raise ApiError(
                400,
                f"This model's maximum context length is {ctx} tokens; the prompt has {n} tokens "
                f"(leaving no room to generate)",
                code="context_length_exceeded",
                param=param,
            )
        room = ctx - n
        self.max_tokens = min(spec.max_tokens, room) if spec.max_tokens else room

    def submit(self) -> None:
        st = self.state
        # n > 1: one HTTP request and one prompt (shared through the prefix cache) for the rate
        # buckets, charged to choice 0; every choice holds its own in-flight slot
        first = self.index == 0
        st.acquire(self.tenant, len(self.prompt_ids) if first else 0, self, new_request=first)
        salt = cache_salt(self.tenant, self.spec.cache_salt)
        sampling = with_defaults(
            self.spec.sampling, self.spec.sampling_given, dict(st.model_info.generation_defaults)
        )
        if self.index and sampling.seed is not None:  # n > 1 with a seed: a distinct stream per choice
            sampling = replace(sampling, seed=(sampling.seed + self.index) & ((1 << 64) - 1))
        req = GenerationRequest(
            request_id=self.request_id,
            prompt_ids=self.prompt_ids,
            sampling=sampling,
            max_tokens=self.max_tokens,
            stop=list(self.spec.stop),
            ignore_eos=self.spec.ignore_eos,
            tenant=self.tenant.name,
            cache_salt=salt,
            constraint=self.constraint,
            speculative=self.spec.speculative,
        )
        try:
            self.handle = st.engine.submit(req)
        except BaseException as exc:
            st.release(self.tenant, 0, self)
            self._closed = True
            if isinstance(exc, MemraError):
                raise from_memra(exc, retry_after_s=st.config.retry_after_s) from None
            raise
        st.metrics.add_in_flight(1)
        self._t0 = time.monotonic()

    def wait_first(self) -> None:
        """Block until the first event (the prompt's KV is then in the prefix cache for the choices
        that follow); it is replayed by ``events()``. Returns early if the client leaves."""
        while not self._pending and not self._closed:
            try:
                self._pending.append(self.handle.get(timeout=POLL_S))
            except queue.Empty:
                if self.disconnected():
                    self.client_gone = True
                    self.close()

    def events(self) -> Iterator[TokenEvent | None]:
        """TokenEvents until the final one; ``None`` when a keep-alive is due. Stops early if the client left."""
        keepalive = self.state.config.keepalive_s
        last_out = last_probe = time.monotonic()
        while True:
            if self._pending:
                ev = self._pending.pop(0)
            elif self._closed:
                return
            else:
                try:
                    ev = self.handle.get(timeout=POLL_S)
                except queue.Empty:
                    ev = None
            now = time.monotonic()
            if now - last_probe >= POLL_S:  # probe even while tokens flow (non-streaming requests)
                last_probe = now
                if self.disconnected():
                    self.client_gone = True
                    self.close()
                    return
            if ev is None:
                if now - last_out >= keepalive:
                    last_out = now
                    yield None
                continue
            k = len(ev.token_ids)
            if k:
                if self._last is None:
                    self.state.metrics.observe_ttft(ev.ttft_s if ev.ttft_s is not None else now - self._t0)
                else:
                    self.state.metrics.observe_itl((now - self._last) / k, k)
                self._last = now
                self.generated_ids.extend(ev.token_ids)
                if ev.logprobs:
                    self.logprobs.extend(ev.logprobs)
            if ev.finish_reason is not None:
                self.finished = True
                self.finish_reason = ev.finish_reason
                if ev.usage is not None:
                    self.usage = ev.usage
                else:
                    self.usage = Usage(len(self.prompt_ids), len(self.generated_ids), 0)
            last_out = now
            yield ev
            if self.finished:
                self.close()
                return

    def abort(self) -> bool:
        """Ask the engine to abort an unfinished request (drain ran out, or the client left); the
        stream still ends with the final event. True when there was one to abort."""
        if self.finished or self.handle is None:
            return False
        try:
            self.handle.cancel()
        except Exception:  # never let one request stop the drain or break response teardown
            pass
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.abort():
            self.client_gone = True
        u = self.usage
        self.state.metrics.finish(
            u.prompt_tokens,
            u.completion_tokens,
            u.cached_tokens,
            time.monotonic() - self._t0,
            self.client_gone,
            self.finish_reason,
        )
        self.state.metrics.add_in_flight(-1)
        self.state.release(self.tenant, len(self.generated_ids), self)


class RunGroup:
    """The ``n`` choices of one request (n >= 1): ``runs[i]`` is choice i. Choice 0 is submitted
    first and the rest once its prompt is prefilled, so they reuse its KV blocks through the prefix
    cache. ``close()`` closes every run."""

    def __init__(self, runs: list[Run]):
        self.runs = runs
        self.id = runs[0].id
        self.created = runs[0].created

    @property
    def usage(self) -> Usage:
        first = self.runs[0].usage
        return Usage(
            prompt_tokens=first.prompt_tokens,
            completion_tokens=sum(r.usage.completion_tokens for r in self.runs),
            cached_tokens=first.cached_tokens,
        )

    def close(self) -> None:
        for r in self.runs:
            r.close()


_END = object()  # interleave(): a choice's events ended


def _pump(gen: Generator[bytes, None, bool], marker: bytes) -> Generator[bytes, None, bool | None]:
    """Forward ``gen``'s chunks until it yields ``marker`` (it wants its next event: None) or ends
    (its return value: True when the choice ended normally)."""
    while True:
        try:
            out = next(gen)
        except StopIteration as stop:
            return bool(stop.value)
        if out is marker:
            return None
        yield out


def interleave(
    group: RunGroup,
    make: Callable[[Run, Iterator[TokenEvent | None]], Generator[bytes, None, bool]],
    keepalive: bytes,
) -> Generator[bytes, None, bool]:
    """Stream a group's choices: ``make(run, events)`` is one choice's chunk generator (it yields
    ``keepalive`` for a None event and returns True when its choice ended normally, False when the
    stream must stop). One choice runs over ``run.events()`` directly; several are drained by one
    thread each into a shared queue, so their chunks interleave as the engine produces them.
    Returns False as soon as a choice fails or its client went away."""
    runs = group.runs
    if len(runs) == 1:
        return (yield from make(runs[0], runs[0].events()))
    q: queue.Queue = queue.Queue()
    feeds: list[list[TokenEvent]] = [[] for _ in runs]

    def feed(pending: list[TokenEvent]) -> Iterator[TokenEvent | None]:
        while True:
            yield pending.pop(0) if pending else None

    def drain(i: int, run: Run) -> None:
        try:
            for ev in run.events():
                if ev is not None:
                    q.put((i, ev))
        finally:
            q.put((i, _END))

    gens = [make(r, feed(feeds[i])) for i, r in enumerate(runs)]
    live = set(range(len(runs)))
    for i in range(len(runs)):  # each choice's opening chunks
        done = yield from _pump(gens[i], keepalive)
        if done is not None:
            live.discard(i)
            if not done:
                return False
    for i, r in enumerate(runs):
        threading.Thread(target=drain, args=(i, r), name=f"memra-choice-{i}", daemon=True).start()
    wait = group.runs[0].state.config.keepalive_s
    while live:
        try:
            i, ev = q.get(timeout=wait)
        except queue.Empty:
            yield keepalive
            continue
        if ev is _END:
            if i in live:  # its events stopped before a final event: the client went away
                return False
            continue
        feeds[i].append(ev)
        done = yield from _pump(gens[i], keepalive)
        if done is not None:
            live.discard(i)
            if not done:
                return False
    return True


def error_of(ev: TokenEvent) -> ApiError:
    if ev.error is not None:
        return from_memra(ev.error)
    if ev.finish_reason == "abort":
        return from_code("draining", "the request was aborted by the server (shutdown)")
    return engine_error("the engine failed this request")
