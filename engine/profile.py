"""Device profiles (device_profiles/*.yaml): match rules, arch, roofline numbers, per-kernel tuning.

``select(device)`` picks the named profile whose name patterns and compute capability match the
detected GPU, else the generic profile of that compute capability (with a warning), else the
nearest lower generic one. ``TUNING_SCHEMA`` lists every tuning section a kernel may read, with
defaults, so a profile cannot carry a misspelt knob. Must not import CUDA.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from engine import env, paths
from engine import tuning as tuning_mod
from engine.schema import Field, ListOf, load_yaml, validate
from engine.types import ConfigError, DeviceInfo

log = logging.getLogger("memra.profile")


def _power_of_two(v: int) -> str | None:
    return None if v > 0 and v & (v - 1) == 0 else f"expected a power of two, got {v}"


def _fraction(v: float) -> str | None:
    return None if 0.0 < v <= 1.0 else f"expected a number in (0, 1], got {v}"


def _arch(v: str) -> str | None:
    return (
        None
        if v.startswith("sm_") and v[3:].rstrip("af").isdigit()
        else f"expected an arch like sm_90a, got {v!r}"
    )


# Every tuning section a kernel template may read (engine.tuning: one dataclass per family).
TUNING_SCHEMA: dict[str, Field] = tuning_mod.schema()

PROFILE_SCHEMA: dict[str, Field] = {
    "name": Field(str, required=True),
    # base: another profile of the same directory whose tuning this one starts from (knob by knob:
    # a knob written here replaces the base's); the other top-level fields are always this file's
    "base": Field(str, default=""),
    "description": Field(str, default=""),
    "generic": Field(bool, default=False),
    "match": Field(
        {
            "names": Field(ListOf(str), default=[]),
            "compute_capability": Field(str, required=True),
        },
        required=True,
    ),
    "arch": Field(str, required=True, check=_arch),
    "sm_count": Field(int, default=0),
    "memory_bandwidth_gbs": Field(float, required=True, check=tuning_mod.positive),
    "tensor_tflops_bf16": Field(float, required=True, check=tuning_mod.positive),
    "kv_memory_fraction": Field(float, default=0.85, check=_fraction),
    "kv_block_size": Field(int, default=16, check=_power_of_two),
    "prefill_chunk_tokens": Field(int, default=2048, check=tuning_mod.positive),
    "max_running": Field(int, default=64, check=tuning_mod.positive),
    "cuda_graph_batch_sizes": Field(ListOf(int), default=[1, 2, 4, 8, 16, 24, 32, 48, 64]),
    # launch kernels with programmatic dependent launch (sm_90+; MEMRA_PDL overrides it)
    "programmatic_launch": Field(bool, default=False),
    "tuning": Field(TUNING_SCHEMA, default={k: f.default for k, f in TUNING_SCHEMA.items()}),
}


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    path: Path
    arch: str
    compute_capability: str
    name_patterns: tuple[str, ...]
    generic: bool
    sm_count: int
    memory_bandwidth_gbs: float
    tensor_tflops_bf16: float
    kv_memory_fraction: float
    kv_block_size: int
    prefill_chunk_tokens: int
    max_running: int
    cuda_graph_batch_sizes: tuple[int, ...]
    # family -> its frozen knobs (engine.tuning; a read-only Mapping each)
    tuning: dict[str, Any] = field(default_factory=tuning_mod.defaults)
    programmatic_launch: bool = False
    base: str = ""  # the profile whose tuning this one starts from ("" for none)

    def tune(self, section: str) -> dict[str, Any]:
        return dict(self.tuning[section])


def load_profile(path: Path, _chain: tuple[str, ...] = ()) -> DeviceProfile:
    """One profile file; a ``base:`` is loaded from the same directory (``_chain``: the files that
    led here, so a cycle is an error, not a recursion)."""
    raw = load_yaml(path)
    data = validate(raw, PROFILE_SCHEMA, path)
    # the base's tuning (or the defaults), then only the knobs this file writes
    tuning = dict(_base(path, data["base"], _chain).tuning) if data["base"] else tuning_mod.defaults()
    for k, v in (raw.get("tuning") or {}).items():
        tuning[k] = tuning[k].replace(**{knob: data["tuning"][k][knob] for knob in v})
    sizes = sorted(set(data["cuda_graph_batch_sizes"]))
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"{path}: cuda_graph_batch_sizes: expected positive batch sizes, got {sizes}")
    if data["name"] != path.stem:
        raise ConfigError(f"{path}: name: {data['name']!r} must equal the file name {path.stem!r}")
    if data["programmatic_launch"] and arch_number(data["arch"]) < 90:
        raise ConfigError(
            f"{path}: programmatic_launch: programmatic dependent launch needs sm_90 or newer, "
            f"but arch is {data['arch']}"
        )
    if tuning["gemm_wgmma"]["enabled"] and data["arch"] != "sm_90a":
        raise ConfigError(
            f"{path}: tuning.gemm_wgmma.enabled: wgmma and setmaxnreg exist on sm_90a only, "
            f"but arch is {data['arch']}"
        )
    same = ("name", "arch", "generic", "sm_count", "kv_block_size", "prefill_chunk_tokens",
            "max_running", "programmatic_launch", "base")  # fmt: skip
    return DeviceProfile(
        path=path,
        compute_capability=data["match"]["compute_capability"],
        name_patterns=tuple(data["match"]["names"]),
        cuda_graph_batch_sizes=tuple(sizes),
        tuning=tuning,
        **{k: data[k] for k in same},
        **{k: float(data[k]) for k in ("memory_bandwidth_gbs", "tensor_tflops_bf16", "kv_memory_fraction")},
    )


def _base(path: Path, name: str, chain: tuple[str, ...]) -> DeviceProfile:
    """The profile ``name`` that ``path`` names as its base: a file beside it, not in ``chain``."""
    chain = (*chain, path.stem)
    if name in chain:
        raise ConfigError(f"{path}: base: {name!r} leads back to itself ({' -> '.join((*chain, name))})")
    base = path.parent / f"{name}.yaml"
    if not base.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise ConfigError(f"{path}: base: unknown profile {name!r}; available: {known}")
    return load_profile(base, chain)


def arch_number(arch: str) -> int:
    """sm_90a -> 90 (the arch was validated by _arch)."""
    return int(arch[3:].rstrip("af"))


@lru_cache(maxsize=4)
def _load_all(root: str) -> dict[str, DeviceProfile]:
    profiles = {}
    for path in sorted(Path(root).glob("*.yaml")):
        p = load_profile(path)
        profiles[p.name] = p
    return profiles


def all_profiles(root: Path | None = None) -> dict[str, DeviceProfile]:
    return _load_all(str(root or paths.profiles_dir()))


def get_profile(name: str, root: Path | None = None) -> DeviceProfile:
    profiles = all_profiles(root)
    if name not in profiles:
        raise ConfigError(f"unknown device profile {name!r}; available: {', '.join(sorted(profiles))}")
    return profiles[name]


def with_tuning(profile: DeviceProfile, spec: str, source: str = "MEMRA_TUNE") -> DeviceProfile:
    """``profile`` with tuning knobs replaced: ``spec`` is ``section.knob=value`` items separated by
    ``;`` (values in YAML: ``gemv_coop.unroll=4; gemv_coop.types=[bf16, q8_0]``), checked against
    TUNING_SCHEMA like a profile file; an unknown knob or a bad value is a ConfigError naming it."""
    data: dict[str, dict[str, Any]] = {}
    for item in (s.strip() for s in spec.split(";")):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        section, dot, knob = key.strip().partition(".")
        if not sep or not dot or not knob:
            raise ConfigError(f"{source}: {item!r}: expected section.knob=value (e.g. gemv_coop.unroll=4)")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: {item!r}: the value is not YAML: {exc}") from exc
        data.setdefault(section, {})[knob] = value
    checked = validate(data, TUNING_SCHEMA, source, "tuning")
    tuning = dict(profile.tuning)
    for section in data:
        tuning[section] = tuning_mod.build(section, {**tuning[section], **{k: checked[section][k] for k in data[section]}})
    log.info("%s: tuning overrides %s", source, spec)
    return replace(profile, tuning=tuning)


def select(device: DeviceInfo, override: str | None = None, root: Path | None = None) -> DeviceProfile:
    """The profile for ``device``: ``override`` if given, else a named match, else a generic one;
    with the device's own SM count where the driver gave one (the plan sizes resident grids and
    decides what fits in one round of blocks from it: an H100 PCIe has 114 SMs, the SXM 132); then
    MEMRA_TUNE's knob overrides (``with_tuning``) when set."""
    chosen = _select(device, override, root)
    if device.sm_count and device.sm_count != chosen.sm_count:
        if chosen.sm_count:
            log.info("%s has %d SMs; profile %s says %d: using %d", device.name, device.sm_count,
                     chosen.name, chosen.sm_count, device.sm_count)
        chosen = replace(chosen, sm_count=device.sm_count)
    spec = env.MEMRA_TUNE.get()
    return with_tuning(chosen, spec) if spec.strip() else chosen


def _select(device: DeviceInfo, override: str | None, root: Path | None) -> DeviceProfile:
    if override:
        return get_profile(override, root)
    profiles = all_profiles(root).values()
    for p in profiles:
        if not p.generic and p.compute_capability == device.cc:
            if any(fnmatch.fnmatch(device.name.lower(), f"*{pat.lower()}*") for pat in p.name_patterns):
                return p
    generics = sorted((p for p in profiles if p.generic), key=lambda p: _cc_tuple(p.compute_capability))
    exact = [p for p in generics if p.compute_capability == device.cc]
    if exact:
        log.warning(
            "no tuned profile for %s (cc %s); using generic profile %s", device.name, device.cc, exact[0].name
        )
        return exact[0]
    lower = [p for p in generics if _cc_tuple(p.compute_capability) <= device.compute_capability]
    if lower:
        chosen = lower[-1]
        log.warning("no profile for %s (cc %s); falling back to %s", device.name, device.cc, chosen.name)
        return chosen
    raise ConfigError(
        f"GPU {device.name} (compute capability {device.cc}) is older than every memra profile (sm_80+)"
    )


def _cc_tuple(cc: str) -> tuple[int, int]:
    major, minor = cc.split(".")
    return int(major), int(minor)
