"""Device profiles (device_profiles/*.yaml): match rules, arch, roofline numbers, per-kernel tuning.

``select(device)`` picks the named profile whose name patterns and compute capability match the
detected GPU, else the generic profile of that compute capability (with a warning), else the
nearest lower generic one. ``TUNING_SCHEMA`` lists every tuning section a kernel may read, with
defaults, so a profile cannot carry a misspelt knob. Must not import CUDA.
"""

from __future__ import annotations

import copy
import fnmatch
import logging
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from engine import env, paths
from engine.kernel_catalog import Q8X_FILE_TYPES
from engine.schema import Field, ListOf, MapOf, load_yaml, validate
from engine.types import ConfigError, DeviceInfo

log = logging.getLogger("memra.profile")


def _power_of_two(v: int) -> str | None:
    return None if v > 0 and v & (v - 1) == 0 else f"expected a power of two, got {v}"


def _positive(v: float) -> str | None:
    return None if v > 0 else f"expected a positive number, got {v}"


def _non_negative(v: float) -> str | None:
    return None if v >= 0 else f"expected a number >= 0, got {v}"


def _fraction(v: float) -> str | None:
    return None if 0.0 < v <= 1.0 else f"expected a number in (0, 1], got {v}"


def _arch(v: str) -> str | None:
    return (
        None
        if v.startswith("sm_") and v[3:].rstrip("af").isdigit()
        else f"expected an arch like sm_90a, got {v!r}"
    )


def _q8x_file_types(v: dict) -> str | None:
    bad = sorted(set(v) - set(Q8X_FILE_TYPES))
    return f"unknown file type(s) {bad}; the q8x GEMV reads {', '.join(Q8X_FILE_TYPES)}" if bad else None


# the gemv_coop q8x knobs a file type may set for itself (gemv_coop.q8x_type_tuning)
Q8X_TYPE_KNOBS = (
    "q8x_threads",
    "q8x_rows_per_warp",
    "q8x_min_blocks",
    "q8x_ksplit",
    "q8x_ksplit_threads",
    "q8x_ksplit_min_n",
    "q8x_b1_rows_per_warp",
    "q8x_lanes_per_row",
    "q8x_wsm_kb",
    "q8x_wsm_chunks",
    "q8x_wsm_chunk_min_k",
    "q8x_stage_rounds",
    "q8x_stage_rounds_min_k",
    "q8x_b1_unroll",
    "q8x_b1_unroll_max_k",
    "q8x_b1_maxnreg",
    "q8x_b1_maxnreg_min_k",
)


def _knob(default: int) -> Field:
    return Field(int, default=default, check=_positive)


def _section(fields: dict[str, Field]) -> Field:
    """A tuning section: a mapping of ``fields`` whose own default, where a profile leaves the
    section out, is every field's default (copied, so no two profiles share a list)."""
    return Field(fields, default={k: copy.deepcopy(f.default) for k, f in fields.items()})


# Every tuning section a kernel template may read. Adding a knob here is how a kernel gets one.
TUNING_SCHEMA: dict[str, Field] = {
    "gemv": _section(
        {
            "threads": _knob(256),
            "rows_per_block": _knob(4),
            "max_batch": _knob(8),
            "unroll": _knob(2),
            # fold rmsnorm / silu_mul into the decode GEMV's x loads (off: on the H200 the prologues
            # cost more than the kernels they replace, tools/gpu_check_gemv.py, 2026-12-02)
            "fuse_norm": Field(bool, default=False),
            "fuse_silu": Field(bool, default=False),
            # fuse_norm at batch 1 only (decode1: one x row per block is cheap to normalise twice)
            "fuse_norm1": Field(bool, default=False),
            # the gate|up GEMV stores silu(gate) * up itself (pairs of rows per block), so the
            # silu_mul launch goes and the down GEMV reads x from the gate half
            "fuse_glu": Field(bool, default=False),
            # stage the x rows (after a prologue) in shared memory once per block where bmax * k * 2
            # fits (kernel_catalog.GEMV_XSMEM_MAX); prefetch the next chunk on the staged path
            "xsmem": Field(bool, default=False),
            "prefetch": Field(bool, default=False),
            "xf32": Field(bool, default=False),  # xsmem rows as f32 where they fit
            # unstaged path: the first weight units' loads are issued before pdl_wait (they overlap
            # the previous kernel's tail under programmatic dependent launch)
            "early_weights": Field(bool, default=False),
            # the batch-1 GEMVs of weights with n <= short_n_max rows (o, down of a small model) in
            # blocks of b1_short_n_threads (0: threads): more warps per row on a long k
            "b1_short_n_threads": Field(int, default=0),
            "short_n_max": Field(int, default=0),
        }
    ),
    # the warp-cooperative gemv layout (kernels/_gemv_coop.cuh.j2) for these file storage types
    # (bf16, q4_k, q8_0, q6_k, q4_0, q4_1; q8_0 matrices with k % 256 == 0 and q6_k / q4_0 / q4_1
    # matrices are then uploaded row-planar as q8_0r / q6_kr / q4_0r / q4_1r, kernel_catalog.upload_type);
    # each warp owns rows_per_warp rows, `unroll` 16-byte segments per lane in flight
    "gemv_coop": _section(
        {
            "types": Field(ListOf(str), default=[]),
            "threads": _knob(128),
            "rows_per_warp": _knob(1),
            "unroll": _knob(4),
            "xsmem": Field(bool, default=False),  # stage the x rows in shared memory (<= 48 KB)
            # issue the next `unroll` segments' loads before the current ones' FMAs
            "pipeline": Field(bool, default=False),
            # with pipeline: a lane's last step of a row tile issues the block's next tile's first loads
            "tile_prefetch": Field(bool, default=False),
            # q4_k / q8_0 / q6_k / q4_0 / q4_1: int8-quantised x rows in shared memory and __dp4a
            # dot products, with their own block shape (0: threads / rows_per_warp above)
            "q8x": Field(bool, default=False),
            "q8x_threads": Field(int, default=0),
            "q8x_rows_per_warp": Field(int, default=0),
            # per file type (q8_0, q4_k, q6_k, q4_0, q4_1): that type's values of the general q8x
            # knobs named in Q8X_TYPE_KNOBS (described below), over the general ones; 0 keeps the
            # general one
            "q8x_type_tuning": Field(
                MapOf({knob: Field(int, default=0) for knob in Q8X_TYPE_KNOBS}),
                default={},
                check=_q8x_file_types,
            ),
            # decode rmsnorm / silu_mul folded into their readers where every reader is a q8x GEMV
            # (its block stages and quantises x anyway; the norm costs one more pass over x)
            "q8x_fuse": Field(bool, default=False),
            # q8x: k split over q8x_ksplit warp groups of a block where the weight has n <=
            # q8x_ksplit_max_n rows (more warps in flight per row on short-n weights)
            "q8x_ksplit": Field(int, default=1),
            "q8x_ksplit_max_n": Field(int, default=0),
            "q8x_ksplit_types": Field(ListOf(str), default=[]),  # file types; empty: every q8x type
            # the threads of the k-split blocks (0: q8x_threads): e.g. 640 = 10 groups of 2 rows
            # for 20-row tiles, so n = 2560 takes 128 blocks, one wave on 132 SMs
            "q8x_ksplit_threads": Field(int, default=0),
            # no k split below this many rows (a small model's short weights want more, smaller tiles)
            "q8x_ksplit_min_n": Field(int, default=0),
            # rows per warp of the bmax-1 q8x GEMVs without the k split (0: q8x_rows_per_warp):
            # fewer registers, so more blocks of q8x_threads fit on an SM
            "q8x_b1_rows_per_warp": Field(int, default=0),
            # lanes per row of the q8x GEMVs (0: 32, a warp per row group): 8 makes a warp four
            # lane groups, each with its rows; a short k then takes whole steps on every lane
            "q8x_lanes_per_row": Field(int, default=0),
            # q8x on sm_90, batch 1: a block's row tile of up to this many KB bulk-copied into shared
            # memory (one copy, issued before the block waits for x; 0: off), where the resident
            # blocks hold every tile at once and the k is not split over blocks
            "q8x_wsm_kb": Field(int, default=0),
            # wsm: the row tile copied in up to this many k chunks, each counted on its own mbarrier
            # (0 or 1: one copy), so the lanes start on a chunk while the later ones still land
            "q8x_wsm_chunks": Field(int, default=0),
            "q8x_wsm_chunk_min_k": Field(int, default=0),  # k chunks only where k is at least this
            # q8x: at most q8x_blocks_per_sm * sm_count blocks, each looping over row tiles (it
            # stages and quantises its x rows once, not once per tile); 0: one block per tile
            "q8x_blocks_per_sm": Field(int, default=0),
            # q8x capped grids: at most the blocks of the compiled kernel resident at once (the
            # driver's occupancy x SMs), so no block waits for a second wave
            "q8x_resident_grid": Field(bool, default=False),
            # q8x: registers capped so this many blocks fit on an SM (0: the compiler's choice)
            "q8x_min_blocks": Field(int, default=0),
            # q8x: the x-row staging issues this many rounds of loads before quantising them
            "q8x_stage_rounds": Field(int, default=1),
            "q8x_stage_rounds_min_k": Field(int, default=0),  # q8x_stage_rounds only where k >= this
            # q8x, batch 1: this many segments in flight per lane and row instead of `unroll` (0:
            # `unroll`; a q4_k segment is two loads, so q4_k runs unroll / 2 of them)
            "q8x_b1_unroll": Field(int, default=0, check=_non_negative),
            "q8x_b1_unroll_max_k": Field(int, default=0),  # q8x_b1_unroll only where k <= this (0: any k)
            # q8x, batch 1, where k >= q8x_b1_maxnreg_min_k: at most this many registers per thread
            # (__maxnreg__; 0: the compiler's choice), so the next kernel's blocks, launched early
            # under PDL, find registers beside this one's (a q6_k down of 640 threads at 79
            # registers leaves no room for a q|k|v pair block of 320 at 80)
            "q8x_b1_maxnreg": Field(int, default=0, check=_non_negative),
            "q8x_b1_maxnreg_min_k": Field(int, default=0),
            # q8x, batch 1, the norm prologue from the staging loads: each thread's norm weights
            # loaded before pdl_wait (weights never change), so only x is read after the wait
            "q8x_early_norm_w": Field(bool, default=False),
            # q8x, batch 1, k split over warps: a block reads the residual of its first tile's
            # outputs right after pdl_wait instead of with its last store
            "q8x_early_residual": Field(bool, default=False),
            # q8x, batch 1: the gate|up GEMV (no k split, no wsm) stores silu(gate) * up itself (with
            # gemv.fuse_glu's pairing), so the down projection stages half the bytes and no silu
            "q8x_glu": Field(bool, default=False),
            # q8x: k split over q8x_kparts blocks (grid.z) where k >= q8x_kparts_min_k: each stages
            # and streams k / q8x_kparts, the last block of a tile adds the partial sums
            "q8x_kparts": Field(int, default=1),
            "q8x_kparts_min_k": Field(int, default=0),
            "q8x_kparts_types": Field(ListOf(str), default=[]),  # file types; empty: every q8x type
        }
    ),
    "gemm": _section(
        {
            "tile_m": _knob(128),
            "tile_n": _knob(128),
            "tile_k": _knob(32),
            "stages": _knob(3),
            "warps": _knob(8),
            "warps_m": _knob(2),
            "split_k": _knob(1),
            # XOR-swizzled unpadded smem tiles / register double-buffered fragments (kernels/gemm.cu.j2)
            "swizzle": Field(bool, default=False),
            "fragbuf": Field(bool, default=False),
            "qprefetch": Field(bool, default=False),  # GGUF W-tile register prefetch (q4_k, q5_k)
            "raster": Field(bool, default=False),  # grouped block order (8 M tiles) for L2 reuse of W
        }
    ),
    # the Hopper prefill GEMM (kernels/gemm_wgmma.cu.j2: TMA + wgmma, warp-specialised) for bf16
    # weights with k % 64 == 0, on sm_90a profiles that enable it; other linears keep "gemm"
    "gemm_wgmma": _section(
        {
            "enabled": Field(bool, default=False),
            "tile_n": _knob(256),
            "consumers": _knob(2),  # consumer warpgroups, 64 * m_frags rows each
            "m_frags": _knob(1),
            "stages": _knob(4),
            "raster": Field(bool, default=True),
            "maxnreg": Field(bool, default=True),  # setmaxnreg: producer 40, consumers 232 registers
            # weights with n < wide_min_n take the narrow tile (narrow_tile_n, narrow_stages, no
            # setmaxnreg): more blocks where the wide tile leaves SMs idle (0: always wide)
            "wide_min_n": Field(int, default=0),
            "narrow_tile_n": _knob(128),
            "narrow_stages": _knob(6),
            # quantised prefill chunks of at least this many rows dequantise each matrix to a bf16
            # scratch and run this GEMM (shorter ones keep the fused mma.sync gemm; 0: never)
            "dequant_min_rows": Field(int, default=0),
        }
    ),
    # the same gemm kernel for decode batches of min_rows.. rows (memory-bound: small tile_m, narrow
    # tile_n, in-block split-K over warp groups so the weight is streamed once by many blocks)
    "gemm_decode": _section(
        {
            "tile_m": _knob(64),
            "tile_n": _knob(16),
            "tile_k": _knob(128),
            "stages": _knob(4),
            "warps": _knob(8),
            "warps_m": _knob(2),
            "split_k": _knob(4),
            "min_rows": _knob(16),
            "swizzle": Field(bool, default=False),
            "fragbuf": Field(bool, default=False),
            "qprefetch": Field(bool, default=False),  # GGUF W-tile register prefetch (q4_k, q5_k)
            "raster": Field(bool, default=False),  # grouped block order (8 M tiles) for L2 reuse of W
        }
    ),
    "attention_prefill": _section({"block_q": _knob(64), "block_kv": _knob(64), "warps": _knob(4)}),
    "attention_decode": _section(
        {
            "block_kv": _knob(64),
            "warps": _knob(4),
            "split_kv_tokens": _knob(512),
            "vec16": Field(bool, default=False),
            # short-context decode: fold the rope kernel into the direct attention kernel (vec16)
            "fuse_rope": Field(bool, default=False),
            # warps of the direct (short-context) kernel; 0: `warps`, which the split kernels use
            "direct_warps": Field(int, default=0),
            # direct kernel: split a kv head's query heads over up to this many blocks (grid z)
            "direct_qsplit": Field(int, default=1),
            # decode kernels: a block stages its first chunk's block-table entries without waiting
            # for the row's position (the two loads in flight together, one round trip less)
            "table_first": Field(bool, default=False),
            # the direct (short-context) kernel calls pdl_trigger() at its start, so the next kernel
            # (the o GEMV) launches beside it and issues its weight loads / tile copies early
            "trigger": Field(bool, default=False),
            # the same at batch 1 only (the short pass's SHORT1 launch; b8 / b32 keep theirs)
            "trigger_b1": Field(bool, default=False),
            # batch 1, short contexts (the SHORT1 launch): the direct kernel prefetches into L2, at
            # its start, the layer's o projection weight (l2_prefetch_o) and the first
            # l2_prefetch_next_kb KB of the linear after it (gate|up: half from the gate rows, half
            # from the up rows, in its tiles' order), so they stream while the attention runs;
            # l2_prefetch_lines: by per-line prefetch.global.L2 instead of bulk prefetches;
            # l2_prefetch_late: after its pdl_wait (once the q|k|v GEMVs have ended and their
            # weights are in) instead of at its start; l2_prefetch_keep: the lines marked L2
            # evict_last (not pushed out by the streams that pass before they are read)
            "l2_prefetch_o": Field(bool, default=False),
            "l2_prefetch_next_kb": Field(int, default=0, check=_non_negative),
            "l2_prefetch_lines": Field(bool, default=False),
            "l2_prefetch_late": Field(bool, default=False),
            "l2_prefetch_keep": Field(bool, default=False),
        }
    ),
    "elementwise": _section({"threads": _knob(256)}),
    "norm": _section({"threads": _knob(256)}),
    "sampling": _section({"threads": _knob(1024)}),
    # the decode pass's launch order: fork_linears runs the launches of one linear op's separately
    # stored weights (a q4_k_m file's q|k and its q6_k v) on a second stream, concurrently (they
    # read the same x and write their own outputs; the next op waits for both)
    # early_trigger: the batch-1 coop GEMVs call pdl_trigger() once their first weight loads are
    # out, so the next kernel's blocks may launch and start their own loads while they run
    # pair_linears: a batch-1 linear op's two coop GEMVs (a q4_k_m layer's q|k and v) as one
    # launch of kernels/gemv_pair.cu.j2 (before fork_linears, which then has nothing to fork);
    # pair_min_smem_kb: that launch asks for at least this much dynamic shared memory (KB) where
    # all its blocks still fit on the GPU at once, so fewer share an SM (its grid would otherwise
    # pile onto the SMs the previous kernel frees first); pair_min_blocks: its __launch_bounds__
    # minimum blocks per SM (0: none; ptxas then still aims at 3 blocks of 320 threads, 64
    # registers, and spills a q6_kr part: tools/kernel_resources.py)
    # o_prefetch_next_kb: the batch-1 GEMV of each layer's o projection prefetches the first KB of
    # the gate|up weight into L2 once its own row tile has landed (off: 0; nineteenth session)
    "decode_graph": _section(
        {
            "fork_linears": Field(bool, default=False),
            "early_trigger": Field(bool, default=False),
            "pair_linears": Field(bool, default=False),
            "pair_min_smem_kb": Field(int, default=0),
            "pair_min_blocks": Field(int, default=0),
            "o_prefetch_next_kb": Field(int, default=0, check=_non_negative),
            # o_window_min_kb / o_window_max_kb: the batch-1 attention-window changes
            # (attention_decode.trigger_b1 and l2_prefetch_o / l2_prefetch_next_kb, and
            # o_prefetch_next_kb) only on layers whose o projection weight has at least / at most
            # this many KB (0: no bound); the window hides a few MB of prefetch, not a q8_0 or bf16 o
            "o_window_min_kb": Field(int, default=0, check=_non_negative),
            "o_window_max_kb": Field(int, default=0, check=_non_negative),
        }
    ),
}

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
    "memory_gb": Field(float, default=0.0),
    "memory_bandwidth_gbs": Field(float, required=True, check=_positive),
    "tensor_tflops_bf16": Field(float, required=True, check=_positive),
    "kv_memory_fraction": Field(float, default=0.85, check=_fraction),
    "kv_block_size": Field(int, default=16, check=_power_of_two),
    "prefill_chunk_tokens": Field(int, default=2048, check=_positive),
    "max_running": Field(int, default=64, check=_positive),
    "cuda_graph_batch_sizes": Field(ListOf(int), default=[1, 2, 4, 8, 16, 24, 32, 48, 64]),
    # launch kernels with programmatic dependent launch (sm_90+; MEMRA_PDL overrides it)
    "programmatic_launch": Field(bool, default=False),
    "tuning": Field(TUNING_SCHEMA, default={k: f.default for k, f in TUNING_SCHEMA.items()}),
    "notes": Field(MapOf(str), default={}),
}


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    path: Path
    arch: str
    compute_capability: str
    name_patterns: tuple[str, ...]
    generic: bool
    description: str
    sm_count: int
    memory_bandwidth_gbs: float
    tensor_tflops_bf16: float
    kv_memory_fraction: float
    kv_block_size: int
    prefill_chunk_tokens: int
    max_running: int
    cuda_graph_batch_sizes: tuple[int, ...]
    tuning: dict[str, dict[str, Any]] = field(default_factory=dict)
    programmatic_launch: bool = False
    base: str = ""  # the profile whose tuning this one starts from ("" for none)

    def tune(self, section: str) -> dict[str, Any]:
        return dict(self.tuning[section])


def load_profile(path: Path, _chain: tuple[str, ...] = ()) -> DeviceProfile:
    """One profile file; a ``base:`` is loaded from the same directory (``_chain``: the files that
    led here, so a cycle is an error, not a recursion)."""
    raw = load_yaml(path)
    data = validate(raw, PROFILE_SCHEMA, path)
    if data["base"]:
        # the base's tuning (defaults included), then only the knobs this file writes
        tuning = copy.deepcopy(_base(path, data["base"], _chain).tuning)
        for k, v in (raw.get("tuning") or {}).items():
            tuning[k].update({knob: data["tuning"][k][knob] for knob in v})
    else:
        # sections omitted from a partial `tuning:` mapping still get their defaults
        tuning = {k: dict(f.default) for k, f in TUNING_SCHEMA.items()}
        for k, v in data["tuning"].items():
            tuning[k].update(v)
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
    return DeviceProfile(
        name=data["name"],
        path=path,
        arch=data["arch"],
        compute_capability=data["match"]["compute_capability"],
        name_patterns=tuple(data["match"]["names"]),
        generic=data["generic"],
        description=data["description"],
        sm_count=data["sm_count"],
        memory_bandwidth_gbs=float(data["memory_bandwidth_gbs"]),
        tensor_tflops_bf16=float(data["tensor_tflops_bf16"]),
        kv_memory_fraction=float(data["kv_memory_fraction"]),
        kv_block_size=data["kv_block_size"],
        prefill_chunk_tokens=data["prefill_chunk_tokens"],
        max_running=data["max_running"],
        cuda_graph_batch_sizes=tuple(sizes),
        tuning=tuning,
        programmatic_launch=data["programmatic_launch"],
        base=data["base"],
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
    ``;`` (values in YAML: ``gemv.fuse_norm=true; gemv_coop.types=[bf16, q8_0]``), checked against
    TUNING_SCHEMA like a profile file; an unknown knob or a bad value is a ConfigError naming it."""
    data: dict[str, dict[str, Any]] = {}
    for item in (s.strip() for s in spec.split(";")):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        section, dot, knob = key.strip().partition(".")
        if not sep or not dot or not knob:
            raise ConfigError(f"{source}: {item!r}: expected section.knob=value (e.g. gemv.unroll=4)")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: {item!r}: the value is not YAML: {exc}") from exc
        data.setdefault(section, {})[knob] = value
    checked = validate(data, TUNING_SCHEMA, source, "tuning")
    tuning = {k: dict(v) for k, v in profile.tuning.items()}
    for section in data:
        tuning[section].update({k: checked[section][k] for k in data[section]})
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
