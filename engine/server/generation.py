"""One generation request end to end: prompt build, submit (mapped errors), event polling with keep-alives,
client-disconnect detection, abort on close, tenant slot and metrics bookkeeping.

Must not import falcon; talks to the engine only through submit/RequestHandle.
"""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from engine.types import GenerationRequest, MemraError, TokenEvent, Usage

from .auth import Tenant
from .errors import ApiError, bad_request, from_code, from_memra
from .schemas import ChatSpec, GenSpec
from .state import AppState
from .tool_calls import tool_instruction

POLL_S = 0.25  # how often a waiting request checks for a vanished client

_TEMPLATE_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, KeyError, LookupError)


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


def chat_prompt(state: AppState, spec: ChatSpec) -> str:
    """Render the chat template (tools included unless tool_choice is none)."""
    messages = [dict(m) for m in spec.messages]
    tools = spec.tools if spec.tool_choice != "none" else None
    if spec.tool_choice in ("required", "named"):
        instr = tool_instruction(spec.tool_choice, spec.tool_name)
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = (messages[0]["content"] + "\n\n" + instr).strip()
        else:
            messages.insert(0, {"role": "system", "content": instr})
    try:
        return state.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, **spec.template_kwargs
        )
    except MemraError as exc:
        raise bad_request(f"chat template: {exc.message}", "messages") from None
    except Exception as exc:
        if isinstance(exc, _TEMPLATE_ERRORS) or type(exc).__module__.startswith("jinja2"):
            raise bad_request(f"chat template failed: {exc}", "messages") from None
        raise


def encode(state: AppState, text: str, param: str = "messages", add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text``; ``add_special_tokens`` adds BOS where the model wants it (a raw completion
    prompt; a rendered chat template carries its own)."""
    try:
        return list(state.tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except (ValueError, UnicodeError) as exc:  # a tokenizer that cannot represent the text
        raise bad_request(f"the prompt cannot be tokenized: {exc}", param) from None


def allowed_tools(spec: ChatSpec) -> set[str] | None:
    """Tool names a parsed call may use (None: tool calls are not parsed at all)."""
    if spec.tool_choice == "none" or not spec.tools:
        return None
    if spec.tool_choice == "named":
        return {spec.tool_name or ""}
    return {t["function"]["name"] for t in spec.tools}


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
    ):
        self.state = state
        self.tenant = tenant
        self.spec = spec
        self.prompt_ids = prompt_ids
        self.disconnected = disconnected or (lambda: False)
        self.id = f"{id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.handle: Any = None
        self.finished = False
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
        st.acquire(self.tenant)
        salt = self.tenant.cache_salt
        if self.spec.cache_salt:
            salt = f"{salt}\x1f{self.spec.cache_salt}"
        req = GenerationRequest(
            request_id=self.id,
            prompt_ids=self.prompt_ids,
            sampling=self.spec.sampling,
            max_tokens=self.max_tokens,
            stop=list(self.spec.stop),
            ignore_eos=self.spec.ignore_eos,
            tenant=self.tenant.name,
            cache_salt=salt,
        )
        try:
            self.handle = st.engine.submit(req)
        except MemraError as exc:
            st.release(self.tenant)
            self._closed = True
            raise from_memra(exc, retry_after_s=st.config.retry_after_s) from None
        except BaseException:
            st.release(self.tenant)
            self._closed = True
            raise
        st.metrics.add_in_flight(1)
        self._t0 = time.monotonic()

    def events(self) -> Iterator[TokenEvent | None]:
        """TokenEvents until the final one; ``None`` when a keep-alive is due. Stops early if the client left."""
        keepalive = self.state.config.keepalive_s
        last_out = last_probe = time.monotonic()
        while True:
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
                elif k:
                    self.state.metrics.observe_itl((now - self._last) / k, k)
                self._last = now
                self.generated_ids.extend(ev.token_ids)
            if ev.finish_reason is not None:
                self.finished = True
                if ev.usage is not None:
                    self.usage = ev.usage
                else:
                    self.usage = Usage(len(self.prompt_ids), len(self.generated_ids), 0)
            last_out = now
            yield ev
            if self.finished:
                self.close()
                return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.finished and self.handle is not None:
            try:
                self.handle.cancel()
            except Exception:  # cancel must never break response teardown
                pass
            self.client_gone = True
        u = self.usage
        self.state.metrics.finish(
            u.prompt_tokens,
            u.completion_tokens,
            u.cached_tokens,
            time.monotonic() - self._t0,
            self.client_gone,
        )
        self.state.metrics.add_in_flight(-1)
        self.state.release(self.tenant)


def error_of(ev: TokenEvent) -> ApiError:
    if ev.error is not None:
        return from_memra(ev.error)
    if ev.finish_reason == "abort":
        return from_code("draining", "the request was aborted by the server (shutdown)")
    return ApiError(
        500,
        "the engine failed this request",
        code="engine_error",
        err_type="server_error",
        anthropic_type="api_error",
    )
