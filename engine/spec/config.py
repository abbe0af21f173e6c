"""Speculative-decoding settings: ``--speculative ngram|draft:PATH|mtp`` and ``--spec-tokens K``.

Pure Python; must not import numpy, CUDA or the engine loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.types import ConfigError

METHODS = ("ngram", "draft", "mtp")
DEFAULT_SPEC_TOKENS = 4
MAX_SPEC_TOKENS = 16


@dataclass(frozen=True)
class SpecConfig:
    """What to speculate with and how much.

    ``k``: tokens proposed per row and step at most. ``max_batch``: a step with more decode rows
    than this speculates on none of them (verification then costs more than it saves).
    ``verify_cost``: the cost of one verified draft token relative to a whole decode step, used to
    choose k from the measured acceptance rate (``engine.spec.policy``). ``ngram_min`` /
    ``ngram_max``: the suffix lengths prompt lookup matches.
    """

    method: str
    draft_path: str | None = None
    k: int = DEFAULT_SPEC_TOKENS
    max_batch: int = 8
    verify_cost: float = 0.1
    ngram_min: int = 2
    ngram_max: int = 4

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"--speculative: unknown method {self.method!r}; choose ngram, draft:PATH or mtp")
        if self.method == "draft" and not self.draft_path:
            raise ConfigError("--speculative draft:PATH needs the draft model's path after 'draft:'")
        if not 1 <= self.k <= MAX_SPEC_TOKENS:
            raise ConfigError(f"--spec-tokens must be between 1 and {MAX_SPEC_TOKENS}, got {self.k}")
        if self.max_batch < 1:
            raise ConfigError(f"speculative max_batch must be >= 1, got {self.max_batch}")
        if not 0.0 <= self.verify_cost <= 1.0:
            raise ConfigError(f"speculative verify_cost must be in [0, 1], got {self.verify_cost}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(
                f"speculative ngram sizes need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )


def parse_speculative(value: str | None, k: int | None = None) -> SpecConfig | None:
    """``--speculative`` (None or "" or "off": no speculation) and ``--spec-tokens`` -> SpecConfig."""
    if value is None or value.strip() in ("", "off", "none"):
        if k is not None:
            raise ConfigError("--spec-tokens needs --speculative ngram|draft:PATH|mtp")
        return None
    value = value.strip()
    method, _, rest = value.partition(":")
    cfg = SpecConfig(
        method=method,
        draft_path=rest or None,
        k=DEFAULT_SPEC_TOKENS if k is None else int(k),
    )
    if method != "draft" and rest:
        raise ConfigError(f"--speculative {value!r}: only draft takes a ':PATH'")
    cfg.validate()
    return cfg
