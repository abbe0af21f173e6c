"""Prometheus text exposition (hand-written): request counters, token counters, latency histograms, engine gauges.

Thread-safe; must not import prometheus_client, falcon or the engine loop (engine.memstat reads /proc) (engine stats are read
with getattr defaults so a partial EngineStats still renders).
"""

from __future__ import annotations

import threading
from collections import defaultdict

from engine import memstat

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float, n: int = 1) -> None:
        i = 0
        while i < len(self.buckets) and v > self.buckets[i]:
            i += 1
        self.counts[i] += n
        self.sum += v * n
        self.count += n

    def render(self, name: str, help_: str) -> list[str]:
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts, strict=False):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cached_tokens = 0
        self.disconnects = 0
        self.in_flight = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def add_in_flight(self, d: int) -> None:
        with self._lock:
            self.in_flight += d

    def observe_ttft(self, s: float) -> None:
        with self._lock:
            self.ttft.observe(s)

    def observe_itl(self, s: float, n: int) -> None:
        with self._lock:
            self.itl.observe(s, n)

    def finish(self, prompt: int, generated: int, cached: int, e2e_s: float, disconnected: bool) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generated_tokens += generated
            self.cached_tokens += cached
            self.e2e.observe(e2e_s)
            if disconnected:
                self.disconnects += 1

    def render(self, stats: object | None, *, alive: bool, draining: bool) -> str:
        g = lambda name: float(getattr(stats, name, 0) or 0)  # noqa: E731
        with self._lock:
            lines = [
                "# HELP memra_requests_total HTTP requests by endpoint and status code",
                "# TYPE memra_requests_total counter",
            ]
            for (ep, st), n in sorted(self.requests.items()):
                lines.append(f'memra_requests_total{{endpoint="{_esc(ep)}",status="{st}"}} {n}')
            counters = [
                ("memra_prompt_tokens_total", "prompt tokens of finished requests", self.prompt_tokens),
                (
                    "memra_generation_tokens_total",
                    "generated tokens of finished requests",
                    self.generated_tokens,
                ),
                (
                    "memra_cached_prompt_tokens_total",
                    "prompt tokens served from the prefix cache",
                    self.cached_tokens,
                ),
                (
                    "memra_client_disconnects_total",
                    "requests aborted because the client went away",
                    self.disconnects,
                ),
            ]
            for name, h, v in counters:
                lines += [f"# HELP {name} {h}", f"# TYPE {name} counter", f"{name} {v}"]
            lines += self.ttft.render("memra_time_to_first_token_seconds", "time from submit to first token")
            lines += self.itl.render("memra_inter_token_latency_seconds", "time between generated tokens")
            lines += self.e2e.render("memra_request_duration_seconds", "time from submit to last token")
            in_flight = self.in_flight
        total, free, cached = g("kv_blocks_total"), g("kv_blocks_free"), g("kv_blocks_cached")
        q, hit = g("prefix_query_tokens"), g("prefix_hit_tokens")
        gauges = [
            ("memra_requests_in_flight", "HTTP generation requests being served", in_flight),
            ("memra_requests_running", "sequences in the running batch", g("running")),
            ("memra_requests_waiting", "sequences waiting for admission", g("waiting")),
            ("memra_kv_blocks_total", "KV cache blocks", total),
            ("memra_kv_blocks_free", "KV cache blocks free", free),
            ("memra_kv_blocks_cached", "KV blocks holding reusable prefix-cache content", cached),
            (
                "memra_kv_cache_usage_ratio",
                "fraction of KV blocks in use",
                (total - free) / total if total else 0.0,
            ),
            ("memra_prefix_cache_hit_ratio", "prefix-cache hit tokens / query tokens", hit / q if q else 0.0),
            ("memra_engine_alive", "1 while the engine thread runs", 1 if alive else 0),
            ("memra_draining", "1 after SIGTERM", 1 if draining else 0),
            # prometheus_client's ProcessCollector name, so dashboards and a later switch agree
            ("process_resident_memory_bytes", "Resident memory size in bytes.", memstat.rss_bytes()),
            (
                "memra_process_peak_resident_bytes",
                "largest resident set size the server process has had",
                memstat.peak_rss_bytes(),
            ),
        ]
        for name, h, v in gauges:
            lines += [
                f"# HELP {name} {h}",
                f"# TYPE {name} gauge",
                f"{name} {v:g}" if isinstance(v, float) else f"{name} {v}",
            ]
        engine_counters = [
            ("memra_prefix_cache_query_tokens_total", "prompt tokens looked up in the prefix cache", q),
            ("memra_prefix_cache_hit_tokens_total", "prompt tokens found in the prefix cache", hit),
            (
                "memra_engine_prompt_tokens_total",
                "prompt tokens processed by the engine",
                g("prompt_tokens_total"),
            ),
            (
                "memra_engine_generated_tokens_total",
                "tokens generated by the engine",
                g("generated_tokens_total"),
            ),
            ("memra_preemptions_total", "sequences preempted for KV space", g("preemptions")),
            # speculative decoding (engine.spec); vLLM's names too, for dashboards built on them
            ("memra_spec_draft_tokens_total", "speculative tokens proposed and verified", g("spec_draft_tokens")),
            ("memra_spec_accepted_tokens_total", "speculative tokens accepted", g("spec_accepted_tokens")),
            ("memra_spec_verify_rows_total", "sequence steps that verified a draft", g("spec_verify_rows")),
            ("vllm:spec_decode_num_draft_tokens_total", "draft tokens", g("spec_draft_tokens")),
            ("vllm:spec_decode_num_accepted_tokens_total", "accepted tokens", g("spec_accepted_tokens")),
            ("vllm:spec_decode_num_drafts_total", "spec decoding drafts", g("spec_verify_rows")),
        ]
        for name, h, v in engine_counters:
            lines += [f"# HELP {name} {h}", f"# TYPE {name} counter", f"{name} {v:g}"]
        return "\n".join(lines) + "\n"
