"""Every MEMRA_* environment variable, in one typed registry (name, type, default, meaning).

Read a variable through its entry (``env.MEMRA_NO_COMPILE.get()``) so that `memra --help-env` and
docs/flags.md list them all. Must not import other engine modules.
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
    help: str

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


MEMRA_CACHE_DIR: EnvVar[str] = EnvVar(
    "MEMRA_CACHE_DIR",
    str,
    os.path.join("~", ".cache", "memra"),
    "root of the cubin cache and downloaded models",
)
MEMRA_NO_COMPILE: EnvVar[bool] = EnvVar(
    "MEMRA_NO_COMPILE",
    bool,
    False,
    "a kernel-cache miss is an error instead of an NVRTC compile (proves warmup)",
)
MEMRA_COMPILE_JOBS: EnvVar[int] = EnvVar(
    "MEMRA_COMPILE_JOBS", int, 0, "parallel NVRTC compiles on a cache miss (0 = number of CPUs)"
)
MEMRA_DEVICE_PROFILE: EnvVar[str] = EnvVar(
    "MEMRA_DEVICE_PROFILE", str, "", "device profile name, overriding auto-detection (like --device-profile)"
)
MEMRA_DEFAULT_MODEL: EnvVar[str] = EnvVar(
    "MEMRA_DEFAULT_MODEL",
    str,
    "",
    "path used instead of the embedded default model (SmolLM2-135M-Instruct Q4_1)",
)
MEMRA_MODELS: EnvVar[str] = EnvVar(
    "MEMRA_MODELS", str, "", "model aliases for `memra serve`: alias=path,alias2=path2"
)
MEMRA_LOG_LEVEL: EnvVar[str] = EnvVar(
    "MEMRA_LOG_LEVEL", str, "INFO", "log level: DEBUG, INFO, WARNING, ERROR"
)
MEMRA_PDL: EnvVar[str] = EnvVar(
    "MEMRA_PDL",
    str,
    "",
    "1/0 forces programmatic dependent launch on/off (default: the device profile's programmatic_launch)",
)
MEMRA_TRACE: EnvVar[bool] = EnvVar(
    "MEMRA_TRACE",
    bool,
    False,
    "compile every kernel with the block timeline trace (tools/gpu_trace_decode.py; slower, never for serving)",
)
MEMRA_TUNE: EnvVar[str] = EnvVar(
    "MEMRA_TUNE",
    str,
    "",
    "device-profile tuning overrides, section.knob=value items separated by ';' "
    "(e.g. 'gemv.fuse_glu=false; gemv_coop.unroll=4'), checked like a profile file",
)
