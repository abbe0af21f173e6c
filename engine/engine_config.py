"""The engine loop's configuration and its stats snapshot: ``EngineConfig`` (scheduling limits,
validated by ``validate``) and ``EngineStats`` (what ``Engine.stats`` returns). Both are imported
by engine.loop, which re-exports them. Must not import engine.loop, numpy or CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.types import ConfigError


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling limits. ``tenant_max_concurrency`` caps running+waiting requests per tenant."""

    max_running: int = 64
    max_waiting: int = 256
    prefill_chunk_tokens: int = 512
    max_step_tokens: int = 2048
    tenant_max_concurrency: dict[str, int] = field(default_factory=dict)
    enable_prefix_cache: bool = True
    # hybrid models: snapshot the recurrent state every this many tokens (a multiple of the KV
    # block size; 0 = every block) and at each prompt's last cacheable block boundary
    state_snapshot_tokens: int = 0
    # overlap decode steps (engine.loop_overlap): queue step n+1 before reading step n's tokens, on a
    # runner that implements engine.types.OverlapRunner; other runners ignore it
    overlap: bool = False

    def validate(self) -> None:
        for name in ("max_running", "max_waiting", "prefill_chunk_tokens", "max_step_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine config: {name} must be >= 1, got {getattr(self, name)}")
        if self.max_step_tokens < self.max_running:
            raise ConfigError(
                f"engine config: max_step_tokens ({self.max_step_tokens}) must be >= max_running "
                f"({self.max_running}) so every running sequence can decode each step"
            )
        if self.state_snapshot_tokens < 0:
            raise ConfigError(
                f"engine config: state_snapshot_tokens must be >= 0, got {self.state_snapshot_tokens}"
            )
        for tenant, cap in self.tenant_max_concurrency.items():
            if cap < 1:
                raise ConfigError(
                    f"engine config: tenant_max_concurrency[{tenant!r}] must be >= 1, got {cap}"
                )


@dataclass(frozen=True)
class EngineStats:
    """A snapshot. KV blocks: ``free`` hold nothing, ``cached`` hold reusable prefix KV with no
    owner (evictable), ``used`` are owned by sequences; free + cached + used == total."""

    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_blocks_used: int
    kv_block_size: int
    prefix_query_tokens: int  # tokens looked up in the prefix cache at admissions
    prefix_hit_tokens: int  # of those, tokens whose prefill was skipped
    prefix_evictions: int
    steps: int
    step_failures: int
    prompt_tokens_total: int
    generated_tokens_total: int
    preemptions: int
    finished: int  # ended by stop or length
    aborted: int
    errors: int  # ended by error
    healthy: bool
    draining: bool
    # hybrid models: recurrent-state slots (live sequences + prefix-cache snapshots)
    state_slots_total: int = 0
    state_slots_live: int = 0
    state_snapshots: int = 0
    state_snapshot_evictions: int = 0
    # speculative decoding (engine.spec; zero without it)
    spec_draft_tokens: int = 0  # proposed and verified
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_verify_rows: int = 0  # rows verified with a draft (each emits accepted + 1 tokens)
