"""HTTP admission: server-wide and per-tenant queue depth, per-tenant request and token rates.

A request is admitted when the server has fewer than ``max_running + max_waiting`` requests in
flight, its tenant fewer than the key's ``max_concurrency``, and the tenant's request and token
buckets are not empty; otherwise it gets 429 with ``Retry-After`` (seconds until it could pass).
Token buckets hold one minute of budget and refill continuously; the prompt is charged at admission
and the generated tokens when the request ends (so a tenant can overdraw by one request's output).
Must not import falcon, waitress or the engine.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from .errors import ApiError


def too_many(code: str, message: str, retry_after_s: float) -> ApiError:
    return ApiError(
        429,
        message,
        code=code,
        err_type="rate_limit_error",
        anthropic_type="rate_limit_error",
        headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
    )


@dataclass
class Bucket:
    """A token bucket of ``per_minute`` capacity refilled at ``per_minute / 60`` per second."""

    per_minute: int
    level: float = field(default=-1.0)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.level < 0:
            self.level = float(self.per_minute)

    def _refill(self, now: float) -> None:
        self.level = min(float(self.per_minute), self.level + (now - self.stamp) * self.per_minute / 60.0)
        self.stamp = now

    def wait_s(self, need: float, now: float) -> float:
        """Seconds until ``need`` is available (0: now). ``need`` is capped at the capacity."""
        self._refill(now)
        need = min(need, float(self.per_minute))
        return 0.0 if self.level >= need else (need - self.level) * 60.0 / self.per_minute

    def take(self, n: float, now: float) -> None:
        self._refill(now)
        self.level -= n


class Admission:
    """In-flight counts and rate buckets; ``admit`` raises the 429, ``done`` releases the slot."""

    def __init__(self, max_in_flight: int, retry_after_s: int):
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.in_flight = 0
        self.preparing_now = 0  # requests rendering/tokenising their prompt (they hold a thread too)
        self._tenant: dict[str, int] = {}
        self._req_buckets: dict[str, Bucket] = {}
        self._tok_buckets: dict[str, Bucket] = {}

    def _bucket(self, table: dict[str, Bucket], tenant: str, per_minute: int) -> Bucket:
        b = table.get(tenant)
        if b is None or b.per_minute != per_minute:  # new tenant, or its key's limit changed
            b = table[tenant] = Bucket(per_minute)
        return b

    def full(self) -> bool:
        return self.in_flight + self.preparing_now >= self.max_in_flight

    def check_full(self) -> None:
        """The cheap early check (before parsing or tokenising anything)."""
        if self.full():
            raise self._overloaded()

    def check_room(self, tenant, n: int) -> None:
        """Before submitting the ``n`` choices of one request: 429 now when the server or the tenant
        cannot hold them all (rather than after choice 0 has been prefilled). Each choice is still
        admitted on its own by ``admit``."""
        with self.lock:
            if self.in_flight + self.preparing_now + n > self.max_in_flight:
                raise self._overloaded()
            held = self._tenant.get(tenant.name, 0)
            if tenant.max_concurrency and held + n > tenant.max_concurrency:
                raise too_many(
                    "tenant_limit",
                    f"tenant {tenant.name!r} has {held} requests in flight; {n} choices would pass its limit "
                    f"of {tenant.max_concurrency}",
                    self.retry_after_s,
                )

    @contextmanager
    def preparing(self) -> Iterator[None]:
        """Count a request while its prompt is rendered and tokenised: those waiting for the tokenizer
        pool hold HTTP threads too, so they share the ``max_in_flight`` budget (else 429)."""
        with self.lock:
            if self.full():
                raise self._overloaded()
            self.preparing_now += 1
        try:
            yield
        finally:
            with self.lock:
                self.preparing_now -= 1

    def _overloaded(self) -> ApiError:
        return too_many(
            "overloaded",
            f"the server is overloaded ({self.max_in_flight} requests running or queued); retry later",
            self.retry_after_s,
        )

    def admit(self, tenant, prompt_tokens: int, new_request: bool = True) -> None:
        """Take a slot for ``tenant`` (an auth.Tenant) or raise 429 (overloaded / tenant_limit / rate_limited).
        ``new_request`` False: a further choice of an admitted request (n > 1), not charged to the
        request bucket."""
        now = time.monotonic()
        with self.lock:
            if self.in_flight >= self.max_in_flight:
                raise self._overloaded()
            n = self._tenant.get(tenant.name, 0)
            if tenant.max_concurrency and n >= tenant.max_concurrency:
                raise too_many(
                    "tenant_limit",
                    f"tenant {tenant.name!r} already has {n} requests in flight (limit {tenant.max_concurrency})",
                    self.retry_after_s,
                )
            rb = tb = None
            if tenant.requests_per_minute and new_request:
                rb = self._bucket(self._req_buckets, tenant.name, tenant.requests_per_minute)
                w = rb.wait_s(1, now)
                if w > 0:
                    raise too_many(
                        "rate_limited",
                        f"tenant {tenant.name!r} is over its limit of {tenant.requests_per_minute} requests per minute",
                        w,
                    )
            if tenant.tokens_per_minute:
                tb = self._bucket(self._tok_buckets, tenant.name, tenant.tokens_per_minute)
                w = tb.wait_s(prompt_tokens, now)  # a prompt over the whole budget needs a full bucket
                if w > 0:
                    raise too_many(
                        "rate_limited",
                        f"tenant {tenant.name!r} is over its limit of {tenant.tokens_per_minute} tokens per "
                        f"minute (this prompt has {prompt_tokens})",
                        w,
                    )
            if rb is not None:
                rb.take(1, now)
            if tb is not None:
                tb.take(prompt_tokens, now)
            self._tenant[tenant.name] = n + 1
            self.in_flight += 1

    def done(self, tenant, generated_tokens: int = 0) -> None:
        with self.lock:
            self._tenant[tenant.name] = max(0, self._tenant.get(tenant.name, 1) - 1)
            self.in_flight -= 1
            if tenant.tokens_per_minute and generated_tokens:
                self._bucket(self._tok_buckets, tenant.name, tenant.tokens_per_minute).take(
                    generated_tokens, time.monotonic()
                )
            if self.in_flight == 0:
                self.idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self.lock:
            return self.idle.wait_for(lambda: self.in_flight == 0, timeout=timeout)
