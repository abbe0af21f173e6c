"""Prometheus metrics through prometheus_client: memra's own families plus the vLLM-named ones that
dashboards and the Gateway API Inference Extension's endpoint picker read.

Request-side series (HTTP counts, tokens of finished requests, TTFT/ITL/e2e histograms) are
prometheus_client Counters/Histograms in a per-server registry; engine-side series are read from
``Engine.stats()`` at scrape time by a collector driven by the ``ENGINE_FAMILIES`` table. Another
subsystem adds an engine series with one ``add_engine_family`` call (see its docstring), as the
speculative-decoding counters (``memra_spec_*``, ``vllm:spec_decode_*``) are. Engine stats are
read with getattr defaults, so a partial EngineStats still renders. Thread-safe (prometheus_client is).
Process series (resident memory, CPU) come from prometheus_client's ProcessCollector, the peak
resident set size from ``engine.memstat``. Must not import falcon or the engine loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine import memstat

disable_created_metrics()  # no *_created series: dashboards do not read them

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: ``memra_requests_rejected_total{reason}``: the admission 429 codes and the receive-deadline 408
REJECT_REASONS = ("overloaded", "tenant_limit", "rate_limited", "request_timeout")
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _g(stats: object, name: str) -> float:
    return float(getattr(stats, name, 0) or 0)


def _kv_used_frac(s: object) -> float:
    """Blocks held by live sequences / all blocks (reclaimable prefix-cache blocks count as free)."""
    total = _g(s, "kv_blocks_total")
    if not total:
        return 0.0
    used = getattr(s, "kv_blocks_used", None)
    if used is None:
        used = total - _g(s, "kv_blocks_free") - _g(s, "kv_blocks_cached")
    return float(used) / total


@dataclass(frozen=True)
class EngineFamily:
    """One engine series: ``value(stats)`` read at scrape time; ``kind`` gauge or counter (a counter's
    name ends in ``_total`` in the exposition; give it without). ``model_label``: add
    ``model_name`` as vLLM does for its ``vllm:`` series."""

    name: str
    doc: str
    kind: str
    value: Callable[[object], float]
    model_label: bool = False


ENGINE_FAMILIES: list[EngineFamily] = []


def add_engine_family(name: str, doc: str, kind: str, value: Callable[[object], float] | str, *, model_label: bool | None = None) -> None:
    """Register an engine series for every server (``value``: an EngineStats field name or a function
    of the stats). ``vllm:`` names get the ``model_name`` label unless told otherwise. Example::

        add_engine_family("memra_spec_verify_rows", "sequence steps that verified a draft", "counter",
                          "spec_verify_rows")
    """
    if kind not in ("gauge", "counter"):
        raise ValueError(f"kind must be gauge or counter, got {kind!r}")
    fn = value if callable(value) else (lambda s, f=value: _g(s, f))
    if any(f.name == name for f in ENGINE_FAMILIES):
        raise ValueError(f"engine metric {name!r} is already registered")
    label = name.startswith("vllm:") if model_label is None else model_label
    ENGINE_FAMILIES.append(EngineFamily(name, doc, kind, fn, label))


def _ratio(a: str, b: str) -> Callable[[object], float]:
    return lambda s: _g(s, a) / _g(s, b) if _g(s, b) else 0.0


for _args in (
    ("memra_requests_running", "sequences in the running batch", "gauge", "running"),
    ("memra_requests_waiting", "sequences waiting for admission", "gauge", "waiting"),
    ("memra_kv_blocks_total", "KV cache blocks", "gauge", "kv_blocks_total"),
    ("memra_kv_blocks_free", "KV cache blocks free", "gauge", "kv_blocks_free"),
    ("memra_kv_blocks_cached", "KV blocks holding reusable prefix-cache content", "gauge", "kv_blocks_cached"),
    (
        "memra_kv_cache_usage_ratio",
        "fraction of KV blocks not free (owned or holding cached prefixes)",
        "gauge",
        lambda s: (_g(s, "kv_blocks_total") - _g(s, "kv_blocks_free")) / _g(s, "kv_blocks_total")
        if _g(s, "kv_blocks_total")
        else 0.0,
    ),
    ("memra_prefix_cache_hit_ratio", "prefix-cache hit tokens / query tokens", "gauge", _ratio("prefix_hit_tokens", "prefix_query_tokens")),
    ("memra_prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache", "counter", "prefix_query_tokens"),
    ("memra_prefix_cache_hit_tokens", "prompt tokens found in the prefix cache", "counter", "prefix_hit_tokens"),
    ("memra_engine_prompt_tokens", "prompt tokens processed by the engine", "counter", "prompt_tokens_total"),
    ("memra_engine_generated_tokens", "tokens generated by the engine", "counter", "generated_tokens_total"),
    ("memra_preemptions", "sequences preempted for KV space", "counter", "preemptions"),
    ("vllm:num_requests_running", "Number of requests in model execution batches", "gauge", "running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed", "gauge", "waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent (blocks held by live sequences)", "gauge", _kv_used_frac),
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens", "counter", "prefix_query_tokens"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens", "counter", "prefix_hit_tokens"),
    ("vllm:num_preemptions", "Cumulative number of preemptions from the engine", "counter", "preemptions"),
    # speculative decoding (engine.spec; zero without it), under vLLM's names too for its dashboards
    ("memra_spec_draft_tokens", "speculative tokens proposed and verified", "counter", "spec_draft_tokens"),
    ("memra_spec_accepted_tokens", "speculative tokens accepted", "counter", "spec_accepted_tokens"),
    ("memra_spec_verify_rows", "sequence steps that verified a draft", "counter", "spec_verify_rows"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "counter", "spec_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "counter", "spec_accepted_tokens"),
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "counter", "spec_verify_rows"),
):
    add_engine_family(*_args)


class _EngineCollector:
    """Yields ENGINE_FAMILIES (and the vLLM cache-config info) from a stats getter at scrape time."""

    def __init__(self, owner: Metrics):
        self.owner = owner

    def collect(self):
        o = self.owner
        stats = o.stats_fn()
        model = o.model_name
        for f in ENGINE_FAMILIES:
            labels = ["model_name"] if f.model_label else []
            values = [model] if f.model_label else []
            fam_cls = GaugeMetricFamily if f.kind == "gauge" else CounterMetricFamily
            fam = fam_cls(f.name, f.doc, labels=labels)
            fam.add_metric(values, f.value(stats))
            yield fam
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric(
            [str(int(_g(stats, "kv_block_size"))), str(int(_g(stats, "kv_blocks_total"))), str(o.prefix_caching).lower()],
            1.0,
        )
        yield info
        alive, draining = o.flags_fn()
        for name, doc, v in (
            ("memra_engine_alive", "1 while the engine thread runs", alive),
            ("memra_draining", "1 after SIGTERM", draining),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], 1.0 if v else 0.0)
            yield g


class Metrics:
    """Per-server metrics. ``render(stats, alive=, draining=)`` returns the exposition text."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = ""
        self.prefix_caching = True
        self._stats: object | None = None
        self._render_lock = threading.Lock()
        self._flags = (False, False)
        self.stats_fn = lambda: self._stats
        self.flags_fn = lambda: self._flags
        m = ["model_name"]
        self.requests = Counter("memra_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("memra_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("memra_generation_tokens", "generated tokens of finished requests", registry=r)
        self.cached_tokens = Counter("memra_cached_prompt_tokens", "prompt tokens served from the prefix cache", registry=r)
        self.disconnects = Counter("memra_client_disconnects", "requests aborted because the client went away", registry=r)
        self.rejected = Counter(
            "memra_requests_rejected",
            "requests refused before generation: 429 (overloaded, tenant_limit, rate_limited) or 408 (request_timeout)",
            ["reason"],
            registry=r,
        )
        for reason in REJECT_REASONS:  # every reason present from the first scrape, at 0
            self.rejected.labels(reason)
        self.in_flight = Gauge("memra_requests_in_flight", "HTTP generation requests being served", registry=r)
        self.ttft = Histogram("memra_time_to_first_token_seconds", "time from submit to first token", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("memra_inter_token_latency_seconds", "time between generated tokens", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("memra_request_duration_seconds", "time from submit to last token", buckets=E2E_BUCKETS, registry=r)
        self.v_prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed", m, registry=r)
        self.v_gen = Counter("vllm:generation_tokens", "Number of generation tokens processed", m, registry=r)
        self.v_success = Counter("vllm:request_success", "Count of successfully processed requests", m + ["finished_reason"], registry=r)
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds", m, buckets=TTFT_BUCKETS, registry=r)
        self.v_itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds", m, buckets=ITL_BUCKETS, registry=r)
        self.v_tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds", m, buckets=ITL_BUCKETS, registry=r)
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds", m, buckets=E2E_BUCKETS, registry=r)
        r.register(_EngineCollector(self))
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        Gauge(
            "memra_process_peak_resident_bytes",
            "largest resident set size the server process has had",
            registry=r,
        ).set_function(memstat.peak_rss_bytes)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def count_rejected(self, reason: str) -> None:
        """One request refused with 429 / 408; ``reason`` is the error code (REJECT_REASONS)."""
        self.rejected.labels(reason).inc()

    def add_in_flight(self, d: int) -> None:
        self.in_flight.inc(d)

    def observe_ttft(self, s: float) -> None:
        self.ttft.observe(s)
        self.v_ttft.labels(self.model_name).observe(s)

    def observe_itl(self, s: float, n: int) -> None:
        for _ in range(max(1, n)):
            self.itl.observe(s)
            self.v_itl.labels(self.model_name).observe(s)
            self.v_tpot.labels(self.model_name).observe(s)

    def finish(self, prompt: int, generated: int, cached: int, e2e_s: float, disconnected: bool, reason: str | None = None) -> None:
        self.prompt_tokens.inc(prompt)
        self.generated_tokens.inc(generated)
        self.cached_tokens.inc(cached)
        self.e2e.observe(e2e_s)
        lm = self.model_name
        self.v_prompt.labels(lm).inc(prompt)
        self.v_gen.labels(lm).inc(generated)
        self.v_e2e.labels(lm).observe(e2e_s)
        if disconnected:
            self.disconnects.inc()
        elif reason in ("stop", "length"):
            self.v_success.labels(lm, reason).inc()

    def render(self, stats: object | None, *, alive: bool, draining: bool) -> str:
        with self._render_lock:  # the collector reads the stats this call was given
            self._stats, self._flags = stats, (alive, draining)
            return generate_latest(self.registry).decode()
