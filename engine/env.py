"""Every MEMRA_* environment variable, in one typed registry (name, type, default).

Read a variable through its entry (``env.MEMRA_NO_COMPILE.get()``); docs/flags.md says what each
one means (tests/test_docs.py keeps its list equal to ``REGISTRY``). Must not import other engine
modules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

REGISTRY: dict[str, EnvVar] = {}
TRUE_WORDS = ("1", "true", "yes", "on")  # what a bool variable accepts as true (and as false:)
FALSE_WORDS = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    kind: type
    default: T

    def __post_init__(self) -> None:
        REGISTRY[self.name] = self

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        if self.kind is bool:
            return raw.strip().lower() in TRUE_WORDS  # type: ignore[return-value]
        try:
            return self.kind(raw)  # type: ignore[no-any-return]
        except ValueError as exc:
            raise ValueError(
                f"environment variable {self.name}={raw!r}: expected {self.kind.__name__}"
            ) from exc


MEMRA_CACHE_DIR: EnvVar[str] = EnvVar("MEMRA_CACHE_DIR", str, os.path.join("~", ".cache", "memra"))
MEMRA_NO_COMPILE: EnvVar[bool] = EnvVar("MEMRA_NO_COMPILE", bool, False)
MEMRA_COMPILE_JOBS: EnvVar[int] = EnvVar("MEMRA_COMPILE_JOBS", int, 0)
MEMRA_DEVICE_PROFILE: EnvVar[str] = EnvVar("MEMRA_DEVICE_PROFILE", str, "")
MEMRA_DEFAULT_MODEL: EnvVar[str] = EnvVar("MEMRA_DEFAULT_MODEL", str, "")
MEMRA_MODELS: EnvVar[str] = EnvVar("MEMRA_MODELS", str, "")
MEMRA_LOG_LEVEL: EnvVar[str] = EnvVar("MEMRA_LOG_LEVEL", str, "INFO")
MEMRA_PDL: EnvVar[str] = EnvVar("MEMRA_PDL", str, "")
MEMRA_TRACE: EnvVar[bool] = EnvVar("MEMRA_TRACE", bool, False)
MEMRA_TUNE: EnvVar[str] = EnvVar("MEMRA_TUNE", str, "")
