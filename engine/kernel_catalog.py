"""Kernel catalog: (template, params) -> KernelSpec, plus each kernel's launch contract.

``spec(template, **params)`` validates a template's parameters (names, types, the divisibility
rules the kernel relies on) and names its entry point; ``choice(...)`` adds the launch contract
(argument list, grid as a function of the row count, block, dynamic shared memory) as a
``KernelChoice``. ``KERNELS`` documents every template: its parameters and its exact argument
list (pointer / int / float, in order), which engine.lowering binds.
``all_specs(dims, storage_types, profile)`` enumerates what a model needs (CI compile test, warmup).

Activations are bf16 everywhere (f32 accumulation inside kernels); logits may be f32; norm
weights are f32. Quantised weights are GGUF rows uploaded unchanged. Must not import CUDA, numpy
or gguf (the GPU check script imports this on a machine without gguf).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.kernel_spec import KernelSpec, entry_name
from engine.quant import row_bytes
from engine.types import ConfigError

# storage types the gemv/embed decoders handle, with (elements, bytes) per GGUF block
QUANTS: dict[str, tuple[int, int]] = {
    "bf16": (8, 16),
    "f16": (8, 16),
    "f32": (8, 32),
    "q8_0": (32, 34),
    "q8_0r": (32, 34),  # q8_0 rows repacked at upload: k/32 f16 scales, then k int8 (quant.repack)
    "q4_0": (32, 18),
    "q4_0r": (32, 18),  # q4_0 rows repacked at upload: a qs plane, then a d plane; 16-byte pitch
    "q4_1": (32, 20),
    "q4_1r": (32, 20),  # q4_1 rows repacked at upload: a qs plane, then a (d, m) plane; 16-byte pitch
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
    "q6_kr": (256, 210),  # q6_k rows repacked at upload: ql, qh, scales, d planes; 16-byte pitch
}
ROPE_STYLES = ("neox", "interleaved")
PENALTY_BLOCKS = 64  # the penalties kernel's fixed grid (it loops over however many entries there are)
# gemv: stage unaligned GGUF blocks through shared memory (coalesced 16-byte loads) by default?
STAGED_DEFAULT: dict[str, bool] = {
    "bf16": False,
    "f16": False,
    "f32": False,
    "q8_0": True,
    "q8_0r": False,
    "q4_0": True,
    "q4_0r": False,
    "q4_1": True,
    "q4_1r": False,
    "q5_0": True,
    "q5_1": True,
    "q4_k": False,
    "q5_k": False,
    "q6_k": True,
    "q6_kr": False,
}


@dataclass(frozen=True)
class KernelDoc:
    """A template's contract: ``params`` (name -> python type) and ``args`` ((name, ctype) in
    order; ctype is an engine.cuda.ARG_FORMATS key: ptr, i32, f32...), ``name`` the params that
    form the entry name, ``grid``/``block``/``smem`` in words (the builders below compute them)."""

    params: dict[str, type]
    args: tuple[tuple[str, str], ...]
    name: tuple[str, ...]
    grid: str
    block: str
    smem: str = "static only"
    defaults: dict[str, Any] | None = None  # optional params, filled in by spec()
    pdl: bool = True  # the body opens with pdl_wait() (or PDL_PRELOAD): KernelSpec.pdl


P, I32 = "ptr", "i32"
# bool params left out of the entry name while false (added after the names in golden plans)
_QUIET_NAME: dict[str, tuple[str, ...]] = {
    "gemv": (
        "xsmem", "prefetch", "xf32", "coop", "pipeline", "glu", "q8x", "early_w", "tile_pf", "wsm", "trigger",
        "early_nw", "early_res", "l2_pf_lines", "l2_pf_keep",
    ),
    "gemm": ("swizzle", "fragbuf", "qprefetch", "raster"),
    "attention": ("vec16", "rope", "table_first", "trigger", "l2_pf_lines", "l2_pf_late", "l2_pf_keep"),
}
# params left out of the entry name while at these defaults (added after the names in golden plans)
_DEFAULT_NAME: dict[str, dict[str, Any]] = {
    "attention": {"qsplit": 1, "v_stride": 0},
    "rope": {"v_stride": 0},
    "gemv": {"ksplit": 1, "stage_rounds": 1, "kparts": 1, "min_blocks": 0, "lanes": 32, "wsm_chunk": 0, "maxnreg": 0},
}
KERNELS: dict[str, KernelDoc] = {
    "gemv": KernelDoc(
        dict(
            quant=str,
            n=int,
            k=int,
            bmax=int,
            threads=int,
            rows_per_block=int,
            residual=bool,
            out_dtype=str,
            stage=bool,
            unroll=int,
            prologue=str,
            x_stride=int,
            eps=float,
            u_off=int,
            xsmem=bool,
            prefetch=bool,
            xf32=bool,
            coop=bool,
            pipeline=bool,
            glu=int,
            q8x=bool,
            ksplit=int,
            grid_cap=int,
            stage_rounds=int,
            early_w=bool,
            kparts=int,
            tile_pf=bool,
            min_blocks=int,
            maxnreg=int,
            lanes=int,
            wsm=bool,
            trigger=bool,
            wsm_chunk=int,
            early_nw=bool,
            early_res=bool,
            l2_pf=str,
            l2_pf_lines=bool,
            l2_pf_keep=bool,
        ),
        # prologue "norm" adds a trailing ("norm_w", P), kparts > 1 (kpart_sum, kpart_count), l2_pf
        # pf0, pf1 ..: kernel_args()
        (("out", P), ("w", P), ("x", P), ("residual", P), ("rows", I32)),
        (
            "quant",
            "n",
            "k",
            "bmax",
            "threads",
            "rows_per_block",
            "residual",
            "out_dtype",
            "stage",
            "unroll",
            "prologue",
            "x_stride",
            "u_off",
            "xsmem",
            "prefetch",
            "xf32",
            "coop",
            "pipeline",
            "glu",
            "q8x",
            "ksplit",
            "stage_rounds",
            "early_w",
            "kparts",
            "tile_pf",
            "min_blocks",
            "maxnreg",
            "lanes",
            "wsm",
            "trigger",
            "wsm_chunk",
            "early_nw",
            "early_res",
            "l2_pf_lines",
            "l2_pf_keep",
        ),
        # grid_cap is launch-only (a coop block loops over its row tiles): not in the name
        "(min(ceil(n / rows_per_block), grid_cap or inf), ceil(rows / bmax), kparts)",
        "(threads,)",
        "static: 1 KB reduction (+ warps * (chunk + 32) bytes when stage); dynamic bmax * k * 2 when xsmem, "
        "bmax * k * 3 / 2 when q8x",
        # stage None: STAGED_DEFAULT[quant]; x_stride 0: k
        {
            "stage": None,
            "unroll": 2,
            "prologue": "none",
            "x_stride": 0,
            "eps": 0.0,
            "u_off": 0,
            "xsmem": False,
            "prefetch": False,
            "xf32": False,
            "coop": False,
            "pipeline": False,
            "glu": 0,
            "q8x": False,
            "ksplit": 1,
            "grid_cap": 0,
            "stage_rounds": 1,
            "early_w": False,
            "kparts": 1,
            "tile_pf": False,
            "min_blocks": 0,
            "maxnreg": 0,
            "lanes": 32,
            "wsm": False,
            "trigger": False,
            "wsm_chunk": 0,
            "early_nw": False,
            "early_res": False,
            "l2_pf": "",
            "l2_pf_lines": False,
            "l2_pf_keep": False,
        },
    ),
    "gemm": KernelDoc(
        dict(
            n=int,
            k=int,
            tile_m=int,
            tile_n=int,
            tile_k=int,
            stages=int,
            warps=int,
            warps_m=int,
            split_k=int,
            residual=bool,
            out_dtype=str,
            quant=str,
            swizzle=bool,
            fragbuf=bool,
            qprefetch=bool,
            raster=bool,
        ),
        (("out", P), ("a", P), ("w", P), ("residual", P), ("rows", I32)),
        (
            "quant",
            "n",
            "k",
            "tile_m",
            "tile_n",
            "tile_k",
            "stages",
            "warps",
            "warps_m",
            "split_k",
            "residual",
            "out_dtype",
            "swizzle",
            "fragbuf",
            "qprefetch",
            "raster",
        ),
        "(ceil(n / tile_n), ceil(rows / tile_m))",
        "(warps * 32,)",
        "max(stages * (tile_m + tile_n) * (tile_k + (0 if swizzle else 8)) * 2,"
        " (split_k - 1) * tile_m * tile_n * 4) bytes dynamic (opt-in above 48 KB)",
        {
            "warps_m": 2,
            "split_k": 1,
            "out_dtype": "bf16",
            "quant": "bf16",
            "swizzle": False,
            "fragbuf": False,
            "qprefetch": False,
            "raster": False,
        },
    ),
    "gemm_wgmma": KernelDoc(
        dict(
            n=int,
            k=int,
            tile_n=int,
            consumers=int,
            m_frags=int,
            stages=int,
            residual=bool,
            out_dtype=str,
            raster=bool,
            maxnreg=bool,
        ),
        # tmap_a / tmap_w: device pointers to CUtensorMaps (plan Arg kind "tmap")
        (("out", P), ("tmap_a", P), ("tmap_w", P), ("residual", P), ("rows", I32)),
        ("n", "k", "tile_n", "consumers", "m_frags", "stages", "residual", "out_dtype", "raster", "maxnreg"),
        "(ceil(n / tile_n), ceil(rows / (64 * m_frags * consumers)))",
        "((consumers + 1) * 128,)",
        "stages * (64 * m_frags * consumers + tile_n) * 128 + 1024 bytes dynamic (opt-in above 48 KB)",
        {"out_dtype": "bf16", "raster": True, "maxnreg": True},
    ),
    "rmsnorm": KernelDoc(
        dict(n=int, eps=float, threads=int, residual=bool),
        (("out", P), ("x", P), ("r", P), ("w", P), ("rows", I32)),
        ("n", "eps", "threads", "residual"),
        "(rows,)",
        "(threads,)",
    ),
    "embed": KernelDoc(
        dict(quant=str, hidden=int, threads=int),
        (("out", P), ("table", P), ("ids", P), ("rows", I32)),
        ("quant", "hidden", "threads"),
        "(rows,)",
        "(threads,)",
    ),
    "rope": KernelDoc(
        dict(
            heads=int,
            kv_heads=int,
            head_dim=int,
            rope_dim=int,
            theta=float,
            style=str,
            q_stride=int,
            kv_stride=int,
            qk_norm=bool,
            eps=float,
            freq_factors=bool,
            kv_write=bool,
            threads=int,
            v_stride=int,
        ),
        (
            ("q", P),
            ("k", P),
            ("v", P),
            ("positions", P),
            ("q_norm", P),
            ("k_norm", P),
            ("freq", P),
            ("k_cache", P),
            ("v_cache", P),
            ("slots", P),
            ("rows", I32),
        ),
        (
            "heads",
            "kv_heads",
            "head_dim",
            "rope_dim",
            "style",
            "q_stride",
            "kv_stride",
            "qk_norm",
            "kv_write",
            "v_stride",
        ),
        "(rows, ceil((heads + 2 * kv_heads) / (threads / 32)))",
        "(threads,)",
        defaults={"v_stride": 0},
    ),
    "silu_mul": KernelDoc(
        dict(inter=int, in_stride=int, threads=int),
        (("out", P), ("g", P), ("u", P), ("rows", I32)),
        ("inter", "in_stride", "threads"),
        "(ceil(inter / (8 * threads)), rows)",
        "(threads,)",
    ),
    "attention": KernelDoc(
        dict(
            heads=int,
            kv_heads=int,
            head_dim=int,
            block_size=int,
            split=int,
            scale=float,
            q_stride=int,
            out_stride=int,
            mode=str,
            direct=bool,
            warps=int,
            vec16=bool,
            rope=bool,
            rope_dim=int,
            theta=float,
            style=str,
            qk_norm=bool,
            eps=float,
            freq_factors=bool,
            kv_stride=int,
            qsplit=int,
            v_stride=int,
            table_first=bool,
            trigger=bool,
            l2_pf=str,
            l2_pf_lines=bool,
            l2_pf_late=bool,
            l2_pf_keep=bool,
        ),
        # rope=true adds trailing k_in, v_in, q_norm, k_norm, freq, slots; l2_pf adds pf0, pf1 ...:
        # see kernel_args()
        (
            ("out", P),
            ("part_o", P),
            ("part_ml", P),
            ("q", P),
            ("k_cache", P),
            ("v_cache", P),
            ("block_tables", P),
            ("positions", P),
            ("max_blocks", I32),
            ("max_splits", I32),
        ),
        (
            "heads",
            "kv_heads",
            "head_dim",
            "block_size",
            "split",
            "q_stride",
            "out_stride",
            "mode",
            "direct",
            "vec16",
            "qsplit",
            "table_first",
            "trigger",
            "l2_pf_lines",
            "l2_pf_late",
            "l2_pf_keep",
        ),
        "(rows, kv_heads, qsplit if direct else max_splits)",
        "(warps * 32,)",
        defaults={
            "vec16": False,
            "rope": False,
            "rope_dim": 0,
            "theta": 10000.0,
            "style": "neox",
            "qk_norm": False,
            "eps": 0.0,
            "freq_factors": False,
            "kv_stride": 0,
            "qsplit": 1,
            "v_stride": 0,
            "table_first": False,
            "trigger": False,
            "l2_pf": "",
            "l2_pf_lines": False,
            "l2_pf_late": False,
            "l2_pf_keep": False,
        },
    ),
    "attention_prefill": KernelDoc(
        dict(
            heads=int,
            kv_heads=int,
            head_dim=int,
            block_size=int,
            scale=float,
            q_stride=int,
            out_stride=int,
            block_q=int,
            block_kv=int,
            warps=int,
        ),
        (
            ("out", P),
            ("q", P),
            ("k_cache", P),
            ("v_cache", P),
            ("block_tables", P),
            ("positions", P),
            ("seq_starts", P),
            ("max_blocks", I32),
        ),
        ("heads", "kv_heads", "head_dim", "block_size", "q_stride", "out_stride", "block_q", "block_kv"),
        "(ceil(max_q / block_q), heads, nseq)",
        "(warps * 32,)",
    ),
    "attention_combine": KernelDoc(
        dict(heads=int, head_dim=int, split=int, out_stride=int),
        (("out", P), ("part_o", P), ("part_ml", P), ("positions", P), ("max_splits", I32)),
        ("heads", "head_dim", "split", "out_stride"),
        "(rows, heads)",
        "(head_dim,)",
    ),
    "argmax": KernelDoc(
        dict(vocab=int, ld=int, threads=int),
        (("out", P), ("logits", P), ("rows", I32)),
        ("vocab", "ld", "threads"),
        "(rows,)",
        "(threads,)",
    ),
    "sample": KernelDoc(
        dict(vocab=int, ld=int, threads=int),
        (
            ("out", P),
            ("logits", P),
            ("temperature", P),
            ("top_k", P),
            ("top_p", P),
            ("min_p", P),
            ("seed", P),
            ("step", P),
            ("rows", I32),
        ),
        ("vocab", "ld", "threads"),
        "(rows,)",
        "(threads,)",
    ),
    "penalties": KernelDoc(
        dict(ld=int, threads=int),
        (
            ("logits", P),
            ("entries", P),
            ("presence", P),
            ("frequency", P),
            ("repetition", P),
            ("capacity", I32),
        ),
        ("ld", "threads"),
        "(PENALTY_BLOCKS,)  (a grid-stride loop over the entry count read from entries[0])",
        "(threads,)",
    ),
}
# the two parts of a gemv_pair spec: each part's gemv params under its prefix
PAIR_PARTS = ("a_", "b_")
KERNELS["gemv_pair"] = KernelDoc(
    {
        **{f"{x}{k}": t for x in PAIR_PARTS for k, t in KERNELS["gemv"].params.items()},
        "blocks_a": int,
        "blocks_b": int,
    },
    # each part's gemv args, a's then b's (a norm prologue adds its norm_w): kernel_args()
    tuple((f"{x}{name}", c) for x in PAIR_PARTS for name, c in KERNELS["gemv"].args),
    (),  # named by pair_spec: both parts' type and shape, and a hash of their entries
    "(blocks_a + blocks_b, ceil(rows / bmax))  (pair_spec: each part one block per row tile)",
    "(a_threads,)  (both parts' threads)",
    "dynamic: the larger part's (gemv_smem)",
    {f"{x}{k}": v for x in PAIR_PARTS for k, v in (KERNELS["gemv"].defaults or {}).items()},
)


def rope_head_blocks(p: Mapping[str, Any]) -> int:
    """grid.y of a rope launch: one warp per head job (q heads, k heads, then the v copies)."""
    return _cdiv(int(p["heads"]) + 2 * int(p["kv_heads"]), int(p["threads"]) // 32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fail(template: str, msg: str) -> ConfigError:
    return ConfigError(f"kernel {template}: {msg}")


GEMV_XSMEM_MAX = 160 * 1024  # dynamic x rows (bmax * k * 2 bytes); above it a spec keeps xsmem off


def gemv_options(
    g: Mapping[str, Any], stage: bool, bmax: int, k: int, quant: str = "bf16"
) -> dict[str, bool]:
    """The gemv tuning's xsmem / xf32 / prefetch / early_w switches for one spec (xsmem only where
    the x rows fit, f32 rows where those fit, prefetch only on the staged path, early_w (tuning
    early_weights) only on the unstaged one); empty when all are off (the default entry names)."""
    out = {}
    p = {"bmax": bmax, "k": k, "quant": quant, "threads": g["threads"], "stage": stage, "xsmem": True}
    if g.get("xsmem") and gemv_smem(p) <= GEMV_XSMEM_MAX:
        out["xsmem"] = True
        if g.get("xf32") and gemv_smem({**p, "xf32": True}) <= GEMV_XSMEM_MAX:
            out["xf32"] = True
    if g.get("prefetch") and stage:
        out["prefetch"] = True
    if g.get("early_weights") and not stage:
        out["early_w"] = True
    return out


GEMV_MIN_TYPES = ("q4_1", "q4_1r", "q4_k", "q5_1", "q5_k")  # x = q*d + m: the dot needs sum(x) per unit
# storage types of the warp-cooperative gemv layout (kernels/_gemv_coop.cuh.j2)
COOP_TYPES = ("bf16", "q4_k", "q8_0r", "q6_kr", "q4_0r", "q4_1r")
COOP_XSMEM_MAX = 48 * 1024  # coop x rows staged in shared memory (gemv_coop.xsmem) up to this size
# coop types with a __dp4a path on int8-quantised x rows (gemv_coop.q8x), and its shared memory cap
# (bmax * k * 3 / 2 bytes; above it a spec keeps the f32 path: fewer resident blocks would starve it)
Q8X_TYPES = ("q4_k", "q8_0r", "q6_kr", "q4_0r", "q4_1r")
COOP_Q8X_MAX = 64 * 1024
# wsm: the x rows and the row tile within the 227 KB of shared memory a block may have on sm_90
WSM_SMEM_MAX = 227 * 1024
# kparts (k split over blocks): the elements a part must hold whole. A q8x x group is 32; a q4_k
# segment 64 consecutive elements; a q6_kr segment reads elements i and i + 64 of a 128-element
# half of its super-block, so a part must hold whole halves.
KPARTS_GRAIN = {"q4_k": 64, "q6_kr": 128}
# file storage type -> the device layout the coop gemv reads (upload_type), and back
COOP_LAYOUTS = {"q8_0": "q8_0r", "q6_k": "q6_kr", "q4_0": "q4_0r", "q4_1": "q4_1r"}
_COOP_FILE_TYPE = {v: k for k, v in COOP_LAYOUTS.items()}
# the file types whose weights a q8x GEMV reads (the keys gemv_coop.q8x_type_tuning may name)
Q8X_FILE_TYPES = tuple(_COOP_FILE_TYPE.get(t, t) for t in Q8X_TYPES)


def gemv_smem(p: Mapping[str, Any]) -> int:
    """The gemv's dynamic shared memory: the staged x rows (xsmem; f32 when xf32) and, for the
    formats with a min, each unit's sum(x); else 0."""
    bmax, k = int(p["bmax"]), int(p["k"])
    if p.get("q8x"):  # int8 x rows + a (dx, dx * sum q) float2 per 16 elements
        x = bmax * k * 3 // 2
        if not p.get("wsm"):
            return x
        # + the row tile at the next 128-byte boundary (kernels/_gemv_coop.cuh.j2: WSM_OFF)
        return (x + 127) // 128 * 128 + int(p["rows_per_block"]) * row_bytes(p["quant"], k)
    if not p.get("xsmem"):
        return 0
    if p.get("coop"):  # the coop layout stages only the bf16 x rows
        return bmax * k * 2
    sums = (bmax * (k // 32) * 4 + 15) // 16 * 16 if p["quant"] in GEMV_MIN_TYPES else 0
    # with xsmem the staged chunks and the reduction live in the same dynamic buffer (no static)
    return bmax * k * (4 if p.get("xf32") else 2) + sums + gemv_static_smem(p)


# k elements of one coop segment (a lane's unit of work per row) per storage type, off the q8x q4_k
# path (64 there: two sub-blocks); kernels/_gemv_coop.cuh.j2's SEG
COOP_SEG = {"bf16": 8, "q4_k": 32, "q8_0r": 16, "q6_kr": 32, "q4_0r": 32, "q4_1r": 32}
WSM_CHUNKS_MAX = 16  # wsm_chunk: at most this many k chunks (one mbarrier each) per row tile


def coop_step_elems(p: Mapping[str, Any]) -> int:
    """The k elements one step of a coop GEMV's lanes covers: lanes x segments in flight x k
    groups x a segment's elements (every step starts at a multiple of this)."""
    q4c = p["quant"] == "q4_k" and p.get("q8x")
    upt = max(1, int(p["unroll"]) // 2) if q4c else int(p["unroll"])
    seg = 64 if q4c else COOP_SEG.get(p["quant"], 32)
    return int(p.get("lanes") or 32) * upt * int(p.get("ksplit") or 1) * seg


def wsm_chunk_elems(step: int, k: int, chunks: int) -> int:
    """The k elements per chunk copy of a wsm row tile cut into at most ``chunks`` k chunks: the
    smallest multiple of both the lanes' step and 256 (whole super-blocks, 16-byte plane pieces)
    that needs no more chunks; 0 (one copy) where one chunk would hold all of k."""
    if k % 256:  # (a chunk's plane pieces need whole super-blocks)
        return 0
    chunks = min(chunks, WSM_CHUNKS_MAX)
    unit = step * 256 // math.gcd(step, 256)
    m = unit * max(1, _cdiv(_cdiv(k, chunks), unit))
    return m if chunks > 1 and m < k else 0


def gemv_grid_x(p: Mapping[str, Any]) -> int:
    """The gemv's grid.x: one block per rows_per_block rows, at most grid_cap (where set: a coop
    block then loops over several row tiles)."""
    tiles = _cdiv(int(p["n"]), int(p["rows_per_block"]))
    cap = int(p.get("grid_cap") or 0)
    return min(tiles, cap) if cap else tiles


def pair_spec(a: KernelSpec, b: KernelSpec) -> KernelSpec:
    """The gemv_pair spec running coop gemv specs ``a`` and ``b`` in one launch
    (kernels/gemv_pair.cu.j2): blocks 0 .. blocks_a - 1 run ``a``, the rest ``b``. Both must be coop
    GEMVs of one block shape and batch (threads, min_blocks, bmax), without a k split over blocks
    (kparts) and with one block per row tile (no grid_cap below the tiles); a ConfigError names
    the rule broken. The caller decides that they read the same x."""
    for s in (a, b):
        if s.template != "gemv" or not s.params["coop"]:
            raise _fail("gemv_pair", f"{s.entry}: a part must be a coop gemv spec")
        p = s.params
        if p["kparts"] != 1:
            raise _fail("gemv_pair", f"{s.entry}: kparts={p['kparts']} (a k split over blocks) cannot pair")
        if p["l2_pf"]:
            raise _fail("gemv_pair", f"{s.entry}: a part takes no l2_pf (L2 prefetch)")
        if p["maxnreg"]:
            raise _fail("gemv_pair", f"{s.entry}: a part takes no maxnreg (the pair's bound is pair_min_blocks)")
        if gemv_grid_x(p) != _cdiv(p["n"], p["rows_per_block"]):
            raise _fail("gemv_pair", f"{s.entry}: grid_cap={p['grid_cap']} below its row tiles (a part has one block per tile)")
    pa, pb = a.params, b.params
    for key in ("threads", "min_blocks", "bmax"):
        if pa[key] != pb[key]:
            raise _fail("gemv_pair", f"the parts' {key} differ ({pa[key]} and {pb[key]}): one launch has one")
    smem = max(gemv_smem(pa), gemv_smem(pb))
    if smem > WSM_SMEM_MAX:
        raise _fail("gemv_pair", f"{smem} bytes of dynamic shared memory exceed {WSM_SMEM_MAX}")
    params: dict[str, Any] = {f"a_{k}": v for k, v in pa.items()}
    params.update({f"b_{k}": v for k, v in pb.items()})
    params.update(blocks_a=gemv_grid_x(pa), blocks_b=gemv_grid_x(pb))
    tag = zlib.crc32(f"{a.entry} {b.entry}".encode())
    short = [f"{p['quant'].replace('_', '')}_n{p['n']}_k{p['k']}" for p in (pa, pb)]
    return KernelSpec("gemv_pair", f"gemv_pair__{short[0]}__{short[1]}__h{tag:08x}", params, pdl=KERNELS["gemv_pair"].pdl)


def pair_with_min_blocks(parts: Iterable[KernelSpec], min_blocks: int) -> KernelSpec:
    """pair_spec of gemv specs ``parts`` with both parts' __launch_bounds__ minimum of blocks per
    SM set to ``min_blocks`` (0: each keeps its own). A part's maxnreg is dropped: the pair kernel
    has one register bound, its __launch_bounds__."""
    parts = [spec("gemv", **{**p.params, "maxnreg": 0}) if p.params["maxnreg"] else p for p in parts]
    if min_blocks:
        parts = [spec("gemv", **{**p.params, "min_blocks": min_blocks}) for p in parts]
    return pair_spec(*parts)


def pair_parts(s: KernelSpec) -> tuple[KernelSpec, KernelSpec]:
    """The two gemv specs of gemv_pair spec ``s`` (entry "part", as kernels/gemv_pair.cu.j2
    renders them)."""
    return tuple(KernelSpec("gemv", "part", _unprefixed(s.params, x)) for x in PAIR_PARTS)  # type: ignore[return-value]


def _unprefixed(params: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The params named ``prefix``* of a composed spec (a gemv_pair part's), the prefix dropped."""
    return {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}


def pair_smem(s: KernelSpec) -> int:
    """A gemv_pair launch's dynamic shared memory: the larger part's."""
    return max(gemv_smem(p.params) for p in pair_parts(s))


def gemv_static_smem(p: Mapping[str, Any]) -> int:
    """The gemv's static shared memory in bytes (reduction, staged chunks)."""
    warps = int(p["threads"]) // 32
    elems, nbytes = QUANTS[p["quant"]]
    chunk = {8: 32 * nbytes, 32: 32 * nbytes, 256: 4 * nbytes}[elems]
    total = warps * int(p["bmax"]) * 4
    if p.get("stage"):
        total += warps * ((chunk + 32 + 15) // 16 * 16)
    return total


def _check(template: str, p: dict[str, Any]) -> None:
    """The shape rules each kernel relies on; a violation is a ConfigError naming the parameter."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise _fail(template, msg)

    if "threads" in p:
        need(
            p["threads"] % 32 == 0 and 32 <= p["threads"] <= 1024,
            f"threads={p['threads']} must be 32..1024, a multiple of 32",
        )
    if template in ("gemv", "embed", "gemm") and p.get("quant") == "q8_0r":
        cols = p["hidden"] if template == "embed" else p["k"]
        need(cols % 256 == 0, f"q8_0r rows need k % 256 == 0 (16-byte aligned planes), got {cols}")
    if template == "gemv" and p.get("quant") in COOP_LAYOUTS.values():
        need(
            not p["stage"],
            f"{p['quant']}: a plane layout cannot be staged in chunks of whole blocks (stage=false)",
        )
    if template in ("gemv", "embed"):
        q = p["quant"]
        need(q in QUANTS, f"storage type {q!r} has no kernel; supported: {', '.join(QUANTS)}")
        cols = p["k"] if template == "gemv" else p["hidden"]
        need(
            cols % QUANTS[q][0] == 0 and cols % 32 == 0 or (q in ("bf16", "f16", "f32") and cols % 8 == 0),
            f"row length {cols} is not a multiple of the {q} block ({QUANTS[q][0]})",
        )
    if template in ("gemv", "attention"):  # l2_pf: kernels/_l2_prefetch.cuh.j2
        if p["l2_pf"]:
            try:
                need(bool(l2_pf_ranges(p["l2_pf"])), "l2_pf names no range")
            except ValueError as e:
                raise _fail(template, f"l2_pf={p['l2_pf']!r}: {e}") from None
        need(not (p["l2_pf_lines"] or p["l2_pf_keep"]) or p["l2_pf"], "l2_pf_lines / l2_pf_keep need l2_pf")
    if template == "gemv":
        need(1 <= p["unroll"] <= 8, f"unroll={p['unroll']} must be 1..8")
        pro, xs = p["prologue"], p["x_stride"] or p["k"]
        need(pro in ("none", "norm", "silu"), f"prologue {pro!r} must be none, norm or silu")
        need(
            p["x_stride"] >= 0 and p["u_off"] >= 0 and xs % 8 == 0 and xs >= p["k"],
            f"x_stride={xs} must be a multiple of 8 and >= k={p['k']}",
        )
        if pro == "norm":
            need(p["eps"] > 0, f"the norm prologue needs eps > 0, got {p['eps']}")
        if pro == "silu":
            need(
                p["u_off"] % 8 == 0 and p["u_off"] >= p["k"] and p["u_off"] + p["k"] <= xs,
                f"silu prologue: u_off={p['u_off']} must be a multiple of 8 in [k, x_stride - k]",
            )
        warps = p["threads"] // 32
        need(p["out_dtype"] in ("bf16", "f32"), f"out_dtype {p['out_dtype']!r} must be bf16 or f32")
        need(1 <= p["bmax"] <= 32, f"bmax={p['bmax']} must be 1..32")
        # the residual is bf16 and may alias out: an f32 out would be read as bf16 and overrun it
        need(not (p["residual"] and p["out_dtype"] == "f32"), "residual needs out_dtype bf16")
        need(not p["prefetch"] or p["stage"], "prefetch is a staged-path option (stage=true)")
        need(not p["xf32"] or p["xsmem"], "xf32 is an xsmem option (f32 x rows in shared memory)")
        need(not p["pipeline"] or p["coop"], "pipeline is a coop-layout option (coop=true)")
        need(not p["q8x"] or p["coop"], "q8x is a coop-layout option (coop=true)")
        need(
            not p["early_w"] or not (p["stage"] or p["coop"]),
            "early_w is an unstaged classic-layout option (stage=false, coop=false)",
        )
        if p["kparts"] != 1:  # k split over grid.z (the coop q8x layout: kernels/_gemv_coop.cuh.j2)
            need(p["q8x"] and p["kparts"] > 1, f"kparts={p['kparts']}: a q8x coop option, > 1")
            gran = KPARTS_GRAIN.get(q, 32)
            need(
                p["k"] % (p["kparts"] * gran) == 0,
                f"kparts={p['kparts']}: k={p['k']} must split into parts of whole {gran}-element units of {q}",
            )
        need(
            not p["tile_pf"] or (p["coop"] and p["pipeline"]),
            "tile_pf is a pipelined coop option (pipeline=true)",
        )
        need(
            not p["min_blocks"] or (p["coop"] and p["min_blocks"] * p["threads"] <= 2048),
            f"min_blocks={p['min_blocks']}: a coop option, at most 2048 threads per SM",
        )
        need(
            not p["maxnreg"] or (p["coop"] and not p["min_blocks"] and 24 <= p["maxnreg"] <= 255),
            f"maxnreg={p['maxnreg']}: a coop option in 24 .. 255, not with min_blocks "
            "(__maxnreg__ and __launch_bounds__ cannot both qualify a kernel)",
        )
        need(not p["trigger"] or p["coop"], "trigger (an early pdl_trigger) is a coop-layout option")
        need(not p["early_nw"] or p["q8x"], "early_nw (norm weights before pdl_wait) is a q8x coop option")
        need(not p["early_res"] or p["coop"], "early_res (the residual read after pdl_wait) is a coop option")
        need(not p["l2_pf"] or (p["q8x"] and p["bmax"] == 1), "l2_pf (L2 prefetch of later weights) is a batch-1 q8x coop option")
        need(
            not p["wsm"] or (p["q8x"] and p["kparts"] == 1 and not p["tile_pf"]),
            "wsm (the row tile in shared memory) is a q8x coop option without kparts or tile_pf",
        )
        if p["wsm_chunk"]:
            wc, step = p["wsm_chunk"], coop_step_elems(p)
            need(
                p["wsm"]
                and wc % 256 == 0
                and wc % step == 0
                and p["k"] % 256 == 0
                and wc < p["k"] <= wc * WSM_CHUNKS_MAX,
                f"wsm_chunk={wc}: a wsm option, a multiple of 256 and of the lanes' step ({step} "
                f"elements) below k={p['k']} (a multiple of 256), at most {WSM_CHUNKS_MAX} chunks",
            )
        need(
            not p["wsm"] or gemv_smem(p) <= WSM_SMEM_MAX,
            f"wsm: {gemv_smem(p)} bytes of shared memory (x rows and a {p['rows_per_block']}-row tile) "
            f"exceed {WSM_SMEM_MAX}",
        )
        need(
            1 <= p["stage_rounds"] <= 8 and (p["stage_rounds"] == 1 or p["q8x"]),
            f"stage_rounds={p['stage_rounds']} must be 1..8, and above 1 only with q8x",
        )
        if p["glu"]:  # silu(gate) * up stored in the gate half
            need(p["n"] == 2 * p["glu"], f"glu={p['glu']} needs n = 2 * glu, got n={p['n']}")
            need(not p["residual"], "glu: no residual")
            need(
                p["rows_per_block"] % 2 == 0 and p["out_dtype"] == "bf16",
                "glu: even rows_per_block, bf16 out",
            )
            need(
                not p["coop"] or (p["ksplit"] == 1 and p["kparts"] == 1 and not p["wsm"]),
                "glu: a coop gemv without ksplit, kparts or wsm (a tile's rows are two ranges)",
            )
        if p["coop"]:
            need(
                q in COOP_TYPES,
                f"coop gemv: storage type {q!r} has no warp-cooperative decoder; supported: {', '.join(COOP_TYPES)}",
            )
            need(
                not (p["stage"] or p["xf32"] or p["prefetch"]),
                "coop gemv: stage, xf32 and prefetch are classic-layout options",
            )
            need(
                p["lanes"] in (4, 8, 16, 32),
                f"coop gemv: lanes={p['lanes']} (lanes per row) must be 4, 8, 16 or 32",
            )
            groups = warps // p["ksplit"] * (32 // p["lanes"])  # lanes and ksplit are checked by now
            need(
                warps % p["ksplit"] == 0 and p["rows_per_block"] % groups == 0,
                f"coop gemv: rows_per_block={p['rows_per_block']} must be a multiple of threads/32={warps} "
                f"/ ksplit={p['ksplit']} x 32 / lanes={p['lanes']} (the row groups; ksplit must divide threads/32)",
            )
            need(
                not p["q8x"] or (q in Q8X_TYPES and not p["xsmem"]),
                f"coop gemv: q8x (int8 x rows) is for {', '.join(Q8X_TYPES)} and replaces xsmem, got {q!r}"
                f"{' with xsmem' if p['xsmem'] else ''}",
            )
        else:
            need(
                p["rows_per_block"] <= warps and warps % p["rows_per_block"] == 0,
                f"rows_per_block={p['rows_per_block']} must divide threads/32={warps}",
            )
            need(
                p["ksplit"] == 1 and p["grid_cap"] == 0 and p["lanes"] == 32,
                "ksplit, grid_cap and lanes are coop-layout options (coop=true)",
            )
        need(
            gemv_smem({**p, "wsm": False}) <= GEMV_XSMEM_MAX,  # (wsm's tile: its own bound above)
            f"xsmem: bmax={p['bmax']} x k={p['k']} x rows exceed {GEMV_XSMEM_MAX} bytes of shared memory",
        )
    if template == "gemm_wgmma":
        tn, cons, mf = p["tile_n"], p["consumers"], p["m_frags"]
        need(p["k"] % 64 == 0, f"k={p['k']} must be a multiple of 64 (the 128-byte swizzled k tile)")
        need(p["n"] % 8 == 0, f"n={p['n']} must be a multiple of 8 (paired, aligned stores)")
        need(tn % 64 == 0 and 64 <= tn <= 256, f"tile_n={tn} must be 64, 128, 192 or 256 (wgmma n, TMA box)")
        need(cons in (1, 2) and mf in (1, 2), f"consumers={cons} and m_frags={mf} must each be 1 or 2")
        need(mf * tn // 2 <= 128, f"m_frags * tile_n / 2 = {mf * tn // 2} accumulators per thread exceed 128")
        need(p["stages"] >= 2, f"stages={p['stages']} must be >= 2")
        need(p["out_dtype"] in ("bf16", "f32"), f"out_dtype {p['out_dtype']!r} must be bf16 or f32")
        need(
            gemm_wgmma_smem(p) <= GEMM_SMEM_MAX,
            f"{p['stages']} stages of {64 * mf * cons}x{tn} tiles need {gemm_wgmma_smem(p)} bytes of shared "
            f"memory, above {GEMM_SMEM_MAX}",
        )
    if template == "gemm":
        q, wm, ks = p["quant"], p["warps_m"], p["split_k"]
        need(
            q in QUANTS,
            f"storage type {q!r} has no fused GEMM decoder; supported: {', '.join(QUANTS)}",
        )
        need(p["out_dtype"] in ("bf16", "f32"), f"out_dtype {p['out_dtype']!r} must be bf16 or f32")
        need(
            1 <= p["warps"] <= 16 and p["warps"] % (wm * ks) == 0,
            f"warps={p['warps']} must be 1..16, a multiple of warps_m * split_k = {wm * ks}",
        )
        wn = p["warps"] // (wm * ks)
        need(
            p["tile_k"] % (16 * ks) == 0 and p["k"] % p["tile_k"] == 0,
            f"k={p['k']} must be a multiple of tile_k={p['tile_k']}, itself a multiple of 16 * split_k",
        )
        need(
            p["tile_m"] % (16 * wm) == 0 and p["tile_n"] % (16 * wn) == 0,
            f"tiles {p['tile_m']}x{p['tile_n']} do not split into 16-multiples over {wm}x{wn} warps",
        )
        if q != "bf16":
            need(
                p["tile_k"] % 32 == 0 and p["k"] % QUANTS[q][0] == 0,
                f"{q} weights need tile_k a multiple of 32 and k a multiple of {QUANTS[q][0]}",
            )
        need(p["stages"] >= 2, "stages must be >= 2")
        need(gemm_smem(p) <= GEMM_SMEM_MAX, f"{gemm_smem(p)} bytes of shared memory > {GEMM_SMEM_MAX}")
    if template == "rmsnorm":
        need(p["n"] % 8 == 0, f"n={p['n']} must be a multiple of 8")
    if template == "silu_mul":
        need(p["inter"] % 8 == 0 and p["in_stride"] % 8 == 0, "inter and in_stride must be multiples of 8")
    if template == "rope":
        need(p["style"] in ROPE_STYLES, f"style {p['style']!r} must be one of {ROPE_STYLES}")
        need(
            p["rope_dim"] % 2 == 0 and p["rope_dim"] <= p["head_dim"],
            f"rope_dim={p['rope_dim']} must be even and <= head_dim",
        )
        need(p["heads"] % p["kv_heads"] == 0, "heads must be a multiple of kv_heads")
    if template in ("attention", "attention_combine"):
        need(
            p["head_dim"] % 32 == 0 and p["head_dim"] <= 256,
            f"head_dim={p['head_dim']} must be a multiple of 32, <= 256",
        )
    if template == "attention_prefill":
        need(p["heads"] % p["kv_heads"] == 0, "heads must be a multiple of kv_heads")
        need(
            p["head_dim"] % 16 == 0 and p["head_dim"] <= 256,
            f"head_dim={p['head_dim']} must be a multiple of 16, <= 256",
        )
        need(p["block_q"] == 16 * p["warps"], f"block_q={p['block_q']} must be 16 * warps (16 rows per warp)")
        need(
            p["block_kv"] % 16 == 0 and p["block_kv"] >= 16,
            f"block_kv={p['block_kv']} must be a multiple of 16",
        )
        need(
            p["q_stride"] % 8 == 0 and p["out_stride"] % 2 == 0,
            "q_stride must be a multiple of 8 (16-byte loads), out_stride even",
        )
        need(attention_prefill_smem(p) <= 99 * 1024, "block_q/block_kv/head_dim too large for shared memory")
    if template == "attention":
        need(p["heads"] % p["kv_heads"] == 0, "heads must be a multiple of kv_heads")
        need(p["mode"] in ("decode", "prefill"), f"mode {p['mode']!r} must be decode or prefill")
        group = p["heads"] // p["kv_heads"]
        need(
            p["qsplit"] == 1 or (p["direct"] and group % p["qsplit"] == 0),
            f"qsplit={p['qsplit']} (grid z over a kv head's query heads) needs direct and to divide {group}",
        )
        need(
            p["warps"] * group * (p["head_dim"] + 2) * 4 <= 48 * 1024,
            "warps * group * head_dim too large for shared memory",
        )
        need(p["split"] % (4 * p["warps"]) == 0, f"split={p['split']} must be a multiple of 4 * warps")
        if p["vec16"]:  # 16-byte loads: head_dim / 8 lanes per key must divide the warp, 8 keys a warp step
            need(p["head_dim"] in (32, 64, 128, 256), "vec16 needs head_dim 32, 64, 128 or 256")
            need(p["q_stride"] % 8 == 0, "vec16 needs q_stride a multiple of 8")
            need(
                p["split"] % (8 * p["warps"]) == 0,
                f"vec16: split={p['split']} must be a multiple of 8 * warps",
            )
        need(not p["l2_pf"] or (p["direct"] and p["mode"] == "decode"), "l2_pf (L2 prefetch of later weights) needs the direct decode kernel")
        need(not p["l2_pf_late"] or p["l2_pf"], "l2_pf_late needs l2_pf")
        need(not p["l2_pf_late"] or p["vec16"], "l2_pf_late (the prefetch after pdl_wait) needs vec16")
        if p["rope"]:  # rope fused into decode attention (kernels/_rope.cuh.j2)
            need(p["vec16"] and p["mode"] == "decode", "rope fusion needs vec16 decode attention")
            need(
                p["style"] in ROPE_STYLES,
                f"rope style {p['style']!r} must be one of {', '.join(ROPE_STYLES)}",
            )
            need(
                p["rope_dim"] % 2 == 0 and 0 < p["rope_dim"] <= p["head_dim"],
                f"rope_dim={p['rope_dim']} must be even and <= head_dim",
            )
            need(p["kv_stride"] % 8 == 0, "rope fusion needs kv_stride a multiple of 8")
            need(p["v_stride"] % 8 == 0, "rope fusion needs v_stride a multiple of 8")
            need(not p["qk_norm"] or p["eps"] > 0, "qk_norm needs eps > 0")


def spec(template: str, **params: Any) -> KernelSpec:
    """The KernelSpec of ``template`` with ``params`` (exactly the template's documented params).
    Floats are rendered through ``repr(float(x))`` so "1e-6", 1e-06 and 1.0e-6 give one spec."""
    doc = KERNELS.get(template)
    if doc is None:
        raise ConfigError(f"no kernel template {template!r}; available: {', '.join(KERNELS)}")
    if template == "gemv_pair":  # each part through spec(), then the rules
        extra = set(params) - set(doc.params)
        if extra:
            raise _fail(template, f"unknown params {sorted(extra)}")
        return pair_spec(*(spec("gemv", **_unprefixed(params, x)) for x in PAIR_PARTS))
    params = dict(params)
    for key, value in (doc.defaults or {}).items():
        params.setdefault(key, value)
    if template == "gemv" and params.get("stage") is None and params.get("quant") in STAGED_DEFAULT:
        params["stage"] = STAGED_DEFAULT[params["quant"]]
    missing = set(doc.params) - set(params)
    extra = set(params) - set(doc.params)
    if missing or extra:
        raise _fail(template, f"missing params {sorted(missing)}, unknown params {sorted(extra)}")
    norm: dict[str, Any] = {}
    for key, typ in doc.params.items():
        value = params[key]
        try:
            if typ is float:
                norm[key] = repr(float(value))
            elif typ is bool:
                norm[key] = bool(value)
            elif typ is int:
                if isinstance(value, bool) or int(value) != value:
                    raise ValueError
                norm[key] = int(value)
            else:
                norm[key] = str(value)
        except (TypeError, ValueError):
            raise _fail(template, f"param {key}={value!r} is not a {typ.__name__}") from None
        zero_ok = (
            (template == "gemv" and key in ("x_stride", "u_off", "glu", "grid_cap", "min_blocks", "wsm_chunk", "maxnreg"))
            or (template == "attention" and key in ("rope_dim", "kv_stride") and not params.get("rope"))
            or key == "v_stride"  # rope / attention: 0 means v shares k's row stride
        )
        if typ is int and norm[key] <= 0 and not zero_ok:
            raise _fail(template, f"param {key}={value!r} must be positive")
    _check(template, {k: (float(v) if doc.params[k] is float else v) for k, v in norm.items()})
    parts = {k: (int(v) if isinstance(v, bool) else v) for k, v in norm.items() if k in doc.name}
    for key in _QUIET_NAME.get(template, ()):  # off by default: named only when on
        if not norm[key]:
            parts.pop(key, None)
    for key, default in _DEFAULT_NAME.get(template, {}).items():
        if norm[key] == default:
            parts.pop(key, None)
    if template == "attention" and norm["rope"]:  # the fused rope's shape params name it too
        parts.update(
            rope_dim=norm["rope_dim"],
            style=norm["style"],
            qk_norm=int(norm["qk_norm"]),
            ff=int(norm["freq_factors"]),
            kv_stride=norm["kv_stride"],
            **({"v_stride": norm["v_stride"]} if norm["v_stride"] else {}),
        )
    if template in ("gemv", "attention") and norm["l2_pf"]:  # the prefetch ranges, by a hash (they are long)
        parts["pf"] = f"{zlib.crc32(norm['l2_pf'].encode()):08x}"
    name = entry_name(template, **parts)
    return KernelSpec(template, name, norm, pdl=doc.pdl)


@dataclass(frozen=True)
class KernelChoice:
    """A spec plus how to launch it: ``args`` ((name, ctype) in order), ``grid(rows)`` -> 3-tuple,
    ``block`` and dynamic ``smem`` bytes (raise the function's max-dynamic-smem attribute first
    when > 48 KB)."""

    spec: KernelSpec
    args: tuple[tuple[str, str], ...]
    grid: Callable[..., tuple[int, int, int]]
    block: tuple[int, int, int]
    smem: int = 0


GEMM_SMEM_MAX = 227 * 1024  # the sm_90 per-block opt-in limit; consumer profiles keep tiles near 100 KB


def gemm_smem(p: Mapping[str, Any]) -> int:
    """The gemm's dynamic shared memory: the pipeline, or the split-K reduction if larger."""
    pad = 0 if p.get("swizzle") else 8
    pipe = int(p["stages"]) * (int(p["tile_m"]) + int(p["tile_n"])) * (int(p["tile_k"]) + pad) * 2
    red = (int(p.get("split_k", 1)) - 1) * int(p["tile_m"]) * int(p["tile_n"]) * 4
    return max(pipe, red)


def gemm_wgmma_tile_m(p: Mapping[str, Any]) -> int:
    return 64 * int(p["m_frags"]) * int(p["consumers"])


def gemm_wgmma_smem(p: Mapping[str, Any]) -> int:
    """The wgmma gemm's dynamic shared memory: the stage ring (A and W tiles of 64 bf16 = 128-byte
    rows) plus 1024 bytes to align it to the swizzle atom."""
    return int(p["stages"]) * (gemm_wgmma_tile_m(p) + int(p["tile_n"])) * 128 + 1024


def choice(template: str, **params: Any) -> KernelChoice:
    """``spec`` plus the launch contract. ``grid(rows, **runtime)``: runtime is ``max_splits`` for
    split attention."""
    s = spec(template, **params)
    p = s.params
    smem = 0
    if template == "gemv":

        def grid(rows: int, **_: int) -> tuple[int, int, int]:
            return (gemv_grid_x(p), _cdiv(rows, p["bmax"]), int(p["kparts"]))

        block = (p["threads"], 1, 1)
        smem = gemv_smem(p)
    elif template == "gemv_pair":

        def grid(rows: int, **_: int) -> tuple[int, int, int]:
            return (p["blocks_a"] + p["blocks_b"], _cdiv(rows, p["a_bmax"]), 1)

        block = (p["a_threads"], 1, 1)
        smem = pair_smem(s)
    elif template == "gemm":

        def grid(rows: int, **_: int) -> tuple[int, int, int]:
            return (_cdiv(p["n"], p["tile_n"]), _cdiv(rows, p["tile_m"]), 1)

        block = (p["warps"] * 32, 1, 1)
        smem = gemm_smem(p)
    elif template == "gemm_wgmma":

        def grid(rows: int, **_: int) -> tuple[int, int, int]:
            return (_cdiv(p["n"], p["tile_n"]), _cdiv(rows, gemm_wgmma_tile_m(p)), 1)

        block = ((p["consumers"] + 1) * 128, 1, 1)
        smem = gemm_wgmma_smem(p)
    elif template == "rope":

        def grid(rows: int, **_: int) -> tuple[int, int, int]:
            return (rows, rope_head_blocks(p), 1)

        block = (p["threads"], 1, 1)
    elif template == "silu_mul":

        def grid(rows: int, **_: int) -> tuple[int, int, int]:
            return (_cdiv(p["inter"], 8 * p["threads"]), rows, 1)

        block = (p["threads"], 1, 1)
    elif template == "penalties":

        def grid(rows: int, **_: int) -> tuple[int, int, int]:
            return (PENALTY_BLOCKS, 1, 1)

        block = (p["threads"], 1, 1)
    elif template == "attention":

        def grid(rows: int, max_splits: int = 1, **_: int) -> tuple[int, int, int]:
            return (rows, p["kv_heads"], p["qsplit"] if p["direct"] else max_splits)

        block = (p["warps"] * 32, 1, 1)
    elif template == "attention_prefill":

        def grid(rows: int, max_q: int = 1, nseq: int = 1, **_: int) -> tuple[int, int, int]:
            return (_cdiv(max_q, p["block_q"]), p["heads"], nseq)

        block = (p["warps"] * 32, 1, 1)
        smem = attention_prefill_smem(p)
    elif template == "attention_combine":

        def grid(rows: int, **_: int) -> tuple[int, int, int]:
            return (rows, p["heads"], 1)

        block = (p["head_dim"], 1, 1)
    else:  # one block per row

        def grid(rows: int, **_: int) -> tuple[int, int, int]:
            return (rows, 1, 1)

        block = (p["threads"], 1, 1)
    return KernelChoice(s, kernel_args(s), grid, block, smem)


def kernel_args(s: KernelSpec) -> tuple[tuple[str, str], ...]:
    """The spec's argument list: KERNELS[template].args, plus norm_w for a norm-prologue gemv; a
    gemv_pair's: its parts' lists, a's then b's, each name prefixed with its part."""
    if s.template == "gemv_pair":
        parts = zip(PAIR_PARTS, pair_parts(s), strict=True)
        return tuple((f"{x}{name}", c) for x, part in parts for name, c in kernel_args(part))
    args = KERNELS[s.template].args
    if s.template == "gemv" and s.params.get("prologue") == "norm":
        args = args + (("norm_w", P),)
    if s.template == "gemv" and int(s.params.get("kparts", 1)) > 1:
        args = args + (("kpart_sum", P), ("kpart_count", P))
    if s.template == "attention" and s.params.get("rope"):
        args = args + tuple((a, P) for a in ATTENTION_ROPE_ARGS)
    if s.template in ("gemv", "attention") and s.params.get("l2_pf"):
        args = args + tuple((f"pf{i}", P) for i in range(1 + max(r[0] for r in l2_pf_ranges(s.params["l2_pf"]))))
    return args


# l2_pf: at most this many weights (pointer args pf0 ..) per launch (attention or gemv)
L2_PF_MAX_ARGS = 8


def l2_pf_ranges(text: str) -> tuple[tuple[int, int, int], ...]:
    """The ranges of an attention or gemv spec's ``l2_pf`` param: "A:OFF:BYTES" items joined by ",", each
    BYTES bytes from byte OFF of pointer arg pfA, OFF and BYTES multiples of 16 (the bulk L2
    prefetch's alignment), BYTES > 0. Raises ValueError naming the bad item."""
    out = []
    for item in filter(None, text.split(",")):
        bits = item.split(":")
        if len(bits) != 3 or not all(b.isdigit() for b in bits):
            raise ValueError(f"{item!r} is not A:OFF:BYTES")
        a, off, n = (int(b) for b in bits)
        if a >= L2_PF_MAX_ARGS or off % 16 or n % 16 or n <= 0:
            raise ValueError(f"{item!r}: A < {L2_PF_MAX_ARGS}, OFF and BYTES multiples of 16, BYTES > 0")
        out.append((a, off, n))
    return tuple(out)


# the rope-fused decode attention's extra args: raw k / v rows of the step (k_in, v_in: kv_stride
# apart), the qk-norm weights, the rope frequency divisors and the cache slots (rope.cu.j2's)
ATTENTION_ROPE_ARGS = ("k_in", "v_in", "q_norm", "k_norm", "freq", "slots")
# the rope spec params the rope-fused attention takes over (with rope=true)
ATTENTION_ROPE_PARAMS = (
    "rope_dim",
    "theta",
    "style",
    "qk_norm",
    "eps",
    "freq_factors",
    "kv_stride",
    "v_stride",
)
# ---- builders from dims + profile tuning (what plan.py and the tests use) ----


def linear_params(
    quant: str,
    n: int,
    k: int,
    tuning: Mapping[str, Any],
    *,
    residual: bool = False,
    out_dtype: str = "bf16",
    bmax: int | None = None,
    stage: bool | None = None,
    sm_count: int = 0,
    threads: int = 0,
) -> dict[str, Any]:
    """A decode gemv's params for a weight uploaded as ``quant`` (a prologue may be added after);
    ``sm_count`` sizes a capped coop grid, ``threads`` forces a coop q8x block shape (coop_options)."""
    g = tuning["gemv"]
    st = STAGED_DEFAULT.get(quant, False) if stage is None else stage
    bmax = bmax or g["max_batch"]
    layout = gemv_layout(quant, tuning, n=n, bmax=bmax)
    opts = (
        coop_options(tuning, bmax, k, quant, n=n, sm_count=sm_count, threads=threads)
        if layout.get("coop")
        else gemv_options({**g, "threads": layout["threads"]}, st, bmax, k, quant)
    )
    return dict(
        {**layout, **opts},
        stage=False if layout.get("coop") else st,
        quant=quant,
        n=n,
        k=k,
        bmax=bmax,
        residual=residual,
        out_dtype=out_dtype,
    )


def upload_type(dtype: str, cols: int, tuning: Mapping[str, Any]) -> str:
    """The layout a [rows, cols] matrix stored as ``dtype`` in the file is uploaded in, where the
    coop gemv takes that type (tuning gemv_coop.types): q8_0 becomes the row-planar q8_0r when
    cols % 256 == 0, q6_k / q4_0 / q4_1 the row-planar q6_kr / q4_0r / q4_1r (engine.quant.repack);
    else the file's layout."""
    types = (tuning.get("gemv_coop") or {}).get("types", ())
    layout = COOP_LAYOUTS.get(dtype)
    if layout is None or dtype not in types or (layout == "q8_0r" and cols % 256):
        return dtype
    return layout


def coop_options(
    tuning: Mapping[str, Any],
    bmax: int,
    k: int,
    quant: str,
    *,
    n: int = 0,
    sm_count: int = 0,
    threads: int = 0,
) -> dict[str, Any]:
    """The coop gemv's switches for one spec on a [n, k] weight uploaded as ``quant`` (empty where
    all are off: the default entry names). The knobs are gemv_coop's; the file type's
    q8x_type_tuning entry overrides the general ones.

    - q8x (int8 x rows, dp4a) where gemv_coop.q8x asks, the type has a dp4a path and the x rows fit
      COOP_Q8X_MAX. Then:
      - block shape q8x_threads / q8x_rows_per_warp where set (as threads / rows_per_block);
      - k split over q8x_ksplit warp groups where q8x_ksplit_min_n <= n <= q8x_ksplit_max_n and the
        file type is in q8x_ksplit_types (empty: every type), in blocks of q8x_ksplit_threads;
        the weights without it take q8x_b1_rows_per_warp rows per warp at bmax 1;
      - q8x_lanes_per_row lanes per row (32 / lanes lane groups per warp, rpw rows each);
      - the grid capped at q8x_blocks_per_sm * sm_count blocks, each looping over row tiles;
      - k split over q8x_kparts blocks (grid.z) where k >= q8x_kparts_min_k, the file type is in
        q8x_kparts_types (empty: every type) and k divides into whole segments;
      - q8x_stage_rounds rounds of x loads in flight while staging; q8x_min_blocks, else at bmax 1
        q8x_b1_maxnreg registers per thread where k >= q8x_b1_maxnreg_min_k (__maxnreg__);
      - at bmax 1, q8x_b1_unroll (set per file type) segments in flight per lane and row instead
        of gemv_coop.unroll (q4_k: half as many steps, a q4_k segment being two loads), where k
        is at most q8x_b1_unroll_max_k (0: any k);
      - wsm (bmax 1): the row tile bulk-copied into shared memory where it is at most q8x_wsm_kb
        KB, k is not split over blocks and the blocks that fit at once (the smaller of
        q8x_blocks_per_sm and 227 KB over the block's shared memory, per SM) hold every tile.
    - else xsmem where gemv_coop.xsmem asks and the bf16 x rows fit COOP_XSMEM_MAX.
    - pipeline where gemv_coop.pipeline asks; tile_pf where tile_prefetch does too (not with wsm).

    ``threads`` (q8x): the block shape of another GEMV to share a launch with (a gemv_pair part)
    instead of the tuning's; the k split is then the largest up to the tuning's that divides
    those warps (q4_k's 4 becomes 2 in 320-thread blocks).
    """
    c = tuning.get("gemv_coop") or {}
    file_type = _COOP_FILE_TYPE.get(quant, quant)  # what the *_types knobs and q8x_type_tuning name
    # the file type's own q8x block shape (gemv_coop.q8x_type_tuning; 0 keeps the general knob)
    per_type = (c.get("q8x_type_tuning") or {}).get(file_type) or {}
    c = {**c, **{key: v for key, v in per_type.items() if v}}
    out: dict[str, Any] = {}
    if q8x_applies(tuning, bmax, k, quant):
        out["q8x"] = True
        forced = threads
        threads = forced or c.get("q8x_threads") or c["threads"]
        rpw = c.get("q8x_rows_per_warp") or c["rows_per_warp"]
        ksplit = int(c.get("q8x_ksplit") or 1)
        kst = c.get("q8x_ksplit_types") or ()
        if forced and ksplit > 1:  # the largest k split up to the tuning's that divides the warps
            ksplit = max(d for d in range(1, ksplit + 1) if (forced // 32) % d == 0)
        if (
            ksplit > 1
            and n
            and int(c.get("q8x_ksplit_min_n") or 0) <= n <= int(c.get("q8x_ksplit_max_n") or 0)
            and (not kst or file_type in kst)
        ):
            out["ksplit"] = ksplit
            threads = forced or c.get("q8x_ksplit_threads") or threads
        else:
            ksplit = 1
            if bmax == 1 and c.get("q8x_b1_rows_per_warp"):
                rpw = c["q8x_b1_rows_per_warp"]
        lanes = int(c.get("q8x_lanes_per_row") or 32)
        unroll = int(c["unroll"])
        b1_unroll = int(c.get("q8x_b1_unroll") or 0)
        if bmax == 1 and b1_unroll and b1_unroll != unroll and k <= int(c.get("q8x_b1_unroll_max_k") or k):
            unroll = out["unroll"] = b1_unroll  # segments in flight per lane and row
        if (threads, rpw, ksplit, lanes) != (c["threads"], c["rows_per_warp"], 1, 32):
            out.update(threads=threads, rows_per_block=threads // 32 // ksplit * (32 // lanes) * rpw)
        if lanes != 32:
            out["lanes"] = lanes
        if c.get("q8x_blocks_per_sm") and sm_count:
            out["grid_cap"] = int(c["q8x_blocks_per_sm"]) * sm_count
        parts = int(c.get("q8x_kparts") or 1)
        kpt = c.get("q8x_kparts_types") or ()
        if (
            parts > 1
            and (not kpt or file_type in kpt)
            and k >= int(c.get("q8x_kparts_min_k") or 0)
            and k % (parts * KPARTS_GRAIN.get(quant, 32)) == 0
        ):
            out["kparts"] = parts
        if int(c.get("q8x_stage_rounds") or 1) > 1 and k >= int(c.get("q8x_stage_rounds_min_k") or 0):
            out["stage_rounds"] = int(c["q8x_stage_rounds"])
        if c.get("q8x_early_norm_w") and bmax == 1 and out.get("kparts", 1) == 1:
            out["early_nw"] = True  # (the kernel uses it only with the norm from the staging loads)
        if c.get("q8x_early_residual") and bmax == 1 and ksplit > 1 and out.get("kparts", 1) == 1:
            out["early_res"] = True  # (read by the k-split epilogue; the plan keeps it where a residual is)
        if int(c.get("q8x_min_blocks") or 0) > 0:
            out["min_blocks"] = int(c["q8x_min_blocks"])
        elif bmax == 1 and int(c.get("q8x_b1_maxnreg") or 0) and k >= int(c.get("q8x_b1_maxnreg_min_k") or 0):
            out["maxnreg"] = int(c["q8x_b1_maxnreg"])  # registers capped: room for the next kernel's blocks
        wkb = int(c.get("q8x_wsm_kb") or 0)
        if wkb and n and bmax == 1 and out.get("kparts", 1) == 1:  # the row tile in shared memory
            rpb = int(out.get("rows_per_block") or c["threads"] // 32 * c["rows_per_warp"])
            tile = rpb * row_bytes(quant, k)
            wp = {"q8x": True, "wsm": True, "bmax": bmax, "k": k, "rows_per_block": rpb, "quant": quant}
            smem = gemv_smem(wp)
            # every tile in one round of resident blocks (a block with a second tile would wait
            # for its copy after the first: the gate|up GEMV was slower so, 11.5 -> 12.4 us)
            if tile <= wkb * 1024 and one_round(tuning, smem, _cdiv(n, rpb), sm_count):
                out["wsm"] = True
                if int(c.get("q8x_wsm_chunks") or 0) > 1 and k >= int(c.get("q8x_wsm_chunk_min_k") or 0):
                    # the tile in k chunks, one mbarrier each
                    step = coop_step_elems(
                        {"quant": quant, "q8x": True, "unroll": unroll, "lanes": lanes, "ksplit": ksplit}
                    )
                    wc = wsm_chunk_elems(step, k, int(c["q8x_wsm_chunks"]))
                    if wc:
                        out["wsm_chunk"] = wc
    elif c.get("xsmem") and bmax * k * 2 <= COOP_XSMEM_MAX:
        out["xsmem"] = True
    if c.get("pipeline"):
        out["pipeline"] = True
        if c.get("tile_prefetch") and not out.get("wsm"):  # (wsm: the next tile is a bulk copy)
            out["tile_pf"] = True
    return out


def spread_smem(tuning: Mapping[str, Any], smem: int, blocks: int, sm_count: int) -> int:
    """The dynamic shared memory of a gemv_pair launch of ``blocks`` blocks that needs ``smem``: at
    least decode_graph.pair_min_smem_kb KB where all its blocks still fit at once at that size
    (fewer blocks per SM, none waiting for a second round), else ``smem``."""
    floor = min(int((tuning.get("decode_graph") or {}).get("pair_min_smem_kb") or 0) * 1024, WSM_SMEM_MAX)
    if floor <= smem or not sm_count:
        return smem
    return floor if one_round(tuning, floor, blocks, sm_count) else smem


def one_round(tuning: Mapping[str, Any], smem: int, blocks: int, sm_count: int) -> bool:
    """Whether ``blocks`` q8x GEMV blocks of ``smem`` bytes of dynamic shared memory are all on
    the GPU at once: at most gemv_coop.q8x_blocks_per_sm (32 where unset) and 227 KB over ``smem``
    blocks per SM, times ``sm_count`` (True where the SM count is unknown, 0)."""
    per_sm = min(int((tuning.get("gemv_coop") or {}).get("q8x_blocks_per_sm") or 32), WSM_SMEM_MAX // smem)
    return not sm_count or blocks <= per_sm * sm_count


def q8x_applies(tuning: Mapping[str, Any], bmax: int, k: int, quant: str) -> bool:
    """Whether a coop decode gemv of bmax rows on a [*, k] weight uploaded as ``quant`` takes the
    int8-x path: gemv_coop.q8x on, a type with a dp4a decoder, its x rows within COOP_Q8X_MAX."""
    c = tuning.get("gemv_coop") or {}
    return (
        bool(c.get("q8x"))
        and quant in Q8X_TYPES
        and gemv_smem({"q8x": True, "bmax": bmax, "k": k}) <= COOP_Q8X_MAX
    )


def gemv_layout(quant: str, tuning: Mapping[str, Any], *, n: int = 0, bmax: int = 0) -> dict[str, Any]:
    """threads / rows_per_block / unroll (and coop=True) of a decode gemv on a [n, k] weight
    uploaded as ``quant``: the warp-cooperative layout where tuning gemv_coop.types names the file
    type, else the classic gemv tuning, whose bmax-1 GEMVs with n <= gemv.short_n_max take
    gemv.b1_short_n_threads threads where set (more warps per row on the short, long-k weights)."""
    c = tuning.get("gemv_coop") or {}
    file_type = _COOP_FILE_TYPE.get(quant, quant)
    if quant in COOP_TYPES and file_type in c.get("types", ()):
        return dict(
            coop=True,
            threads=c["threads"],
            rows_per_block=c["threads"] // 32 * c["rows_per_warp"],
            unroll=c["unroll"],
        )
    g = tuning["gemv"]
    threads = g["threads"]
    if bmax == 1 and n and g.get("b1_short_n_threads") and n <= int(g.get("short_n_max") or 0):
        threads = int(g["b1_short_n_threads"])
    return dict(threads=threads, rows_per_block=g["rows_per_block"], unroll=g.get("unroll", 2))


# bools last: swizzle / fragbuf / qprefetch (kernels/gemm.cu.j2)
GEMM_KNOBS = ("tile_m", "tile_n", "tile_k", "stages", "warps", "warps_m", "split_k")
GEMM_KNOBS += ("swizzle", "fragbuf", "qprefetch", "raster")


def gemm_params(
    n: int,
    k: int,
    tuning: Mapping[str, Any],
    *,
    residual: bool = False,
    out_dtype: str = "bf16",
    quant: str = "bf16",
    section: str = "gemm",
) -> dict[str, Any]:
    """gemm params from the profile's ``section`` ("gemm": prefill, "gemm_decode": wide decode
    batches). A k that tile_k does not divide falls back to the largest of 64/32/16 (times
    split_k) that divides it (the check still rejects a k no tile fits)."""
    off = {"swizzle": False, "fragbuf": False, "qprefetch": False, "raster": False}
    g = {"warps_m": 2, "split_k": 1, **off, **dict(tuning[section])}
    if k % g["tile_k"]:
        for tk in (64 * g["split_k"], 32 * g["split_k"], 16 * g["split_k"]):
            if k % tk == 0 and (quant == "bf16" or tk % 32 == 0):
                g["tile_k"] = tk
                break
    return dict(
        n=n, k=k, residual=residual, out_dtype=out_dtype, quant=quant, **{x: g[x] for x in GEMM_KNOBS}
    )


GEMM_WGMMA_KNOBS = ("tile_n", "consumers", "m_frags", "stages", "raster", "maxnreg")


def gemm_wgmma_params(
    n: int, k: int, tuning: Mapping[str, Any], *, residual: bool = False, out_dtype: str = "bf16"
) -> dict[str, Any] | None:
    """gemm_wgmma params for a bf16 weight of n x k from the profile's ``gemm_wgmma`` section, or
    None where it does not apply (off on this profile, k % 64, n % 8): the caller keeps "gemm"."""
    g = tuning.get("gemm_wgmma") or {}
    if not g.get("enabled") or k % 64 or n % 8:
        return None
    p = {x: g[x] for x in GEMM_WGMMA_KNOBS}
    if n < int(g.get("wide_min_n") or 0):  # few wide tiles: narrower ones keep every SM busy
        p.update(tile_n=g["narrow_tile_n"], stages=g["narrow_stages"], maxnreg=False)
    return dict(n=n, k=k, residual=residual, out_dtype=out_dtype, **p)


def attention_prefill_smem(p: Mapping[str, Any]) -> int:
    """Dynamic shared memory of an attention_prefill spec: the Q tile and double-buffered K and V
    tiles, rows padded by 8 elements."""
    return (int(p["block_q"]) + 4 * int(p["block_kv"])) * (int(p["head_dim"]) + 8) * 2


def attention_prefill_params(
    dims: Mapping[str, Any], tuning: Mapping[str, Any], block_size: int, *, q_stride: int, out_stride: int
) -> dict[str, Any]:
    a = tuning["attention_prefill"]
    return dict(
        heads=dims["heads"],
        kv_heads=dims["kv_heads"],
        head_dim=dims["head_dim"],
        block_size=block_size,
        scale=float(dims["head_dim"]) ** -0.5,
        q_stride=q_stride,
        out_stride=out_stride,
        block_q=a["block_q"],
        block_kv=a["block_kv"],
        warps=a["warps"],
    )


def attention_params(
    dims: Mapping[str, Any],
    tuning: Mapping[str, Any],
    block_size: int,
    *,
    mode: str,
    direct: bool,
    q_stride: int,
    out_stride: int,
) -> dict[str, Any]:
    a = tuning["attention_decode"]
    warps = (a.get("direct_warps") or a["warps"]) if direct else a["warps"]
    vec16 = bool(a.get("vec16", False)) and dims["head_dim"] in (32, 64, 128, 256)
    step = (8 if vec16 else 4) * warps
    split = max(step, a["split_kv_tokens"] // step * step)
    return dict(
        qsplit=direct_qsplit(dims["heads"] // dims["kv_heads"], tuning) if direct and mode == "decode" else 1,
        heads=dims["heads"],
        kv_heads=dims["kv_heads"],
        head_dim=dims["head_dim"],
        block_size=block_size,
        split=split,
        scale=float(dims["head_dim"]) ** -0.5,
        q_stride=q_stride,
        out_stride=out_stride,
        mode=mode,
        direct=direct,
        warps=warps,
        vec16=vec16,
    )


def direct_qsplit(group: int, tuning: Mapping[str, Any]) -> int:
    """The direct decode attention's split of a kv head's ``group`` query heads over grid z: the
    largest divisor of group up to tuning attention_decode.direct_qsplit (1: one block per kv head)."""
    cap = int((tuning.get("attention_decode") or {}).get("direct_qsplit", 1) or 1)
    return max(q for q in range(1, min(cap, group) + 1) if group % q == 0)


def rope_params(
    dims: Mapping[str, Any],
    tuning: Mapping[str, Any],
    style: str,
    *,
    q_stride: int,
    kv_stride: int,
    qk_norm: bool,
    kv_write: bool = True,
    freq_factors: bool = False,
) -> dict[str, Any]:
    return dict(
        heads=dims["heads"],
        kv_heads=dims["kv_heads"],
        head_dim=dims["head_dim"],
        rope_dim=dims.get("rope_dim") or dims["head_dim"],
        theta=float(dims["rope_theta"]),
        style=style,
        q_stride=q_stride,
        kv_stride=kv_stride,
        qk_norm=qk_norm,
        eps=float(dims["rms_eps"]),
        freq_factors=freq_factors,
        kv_write=kv_write,
        threads=tuning["elementwise"]["threads"],
    )


def _pair_of(a: dict[str, Any], b_of: Callable[[int], dict[str, Any]], extra: dict[str, Any]) -> KernelSpec | None:
    """The gemv_pair of gemv params ``a`` and ``b_of(a's threads)`` (each with ``extra``), or None
    where either is not a coop q8x GEMV or pair_spec refuses them."""
    if not (a.get("coop") and a.get("q8x")):
        return None
    b = b_of(int(a["threads"]))
    if not (b.get("coop") and b.get("q8x")):
        return None
    try:
        return pair_spec(spec("gemv", **a, **extra), spec("gemv", **b, **extra))
    except ConfigError:
        return None


def all_specs(
    dims: Mapping[str, Any],
    storage_types: Iterable[str],
    tuning: Mapping[str, Any],
    *,
    block_size: int = 16,
    rope_styles: Iterable[str] = ROPE_STYLES,
    qk_norm: bool = False,
) -> list[KernelSpec]:
    """Every kernel a model of ``dims`` can use with weights in ``storage_types`` (only the types
    this catalog supports; others are skipped), deduplicated, in a stable order."""
    d = dict(dims)
    d.setdefault("rope_dim", d["head_dim"])
    hidden, inter, vocab = d["hidden"], d["intermediate"], d["vocab"]
    q_dim, kv_dim = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    qkv = q_dim + 2 * kv_dim
    types = [t for t in dict.fromkeys(storage_types) if t in QUANTS]
    shapes = [(qkv, hidden, False), (hidden, q_dim, True), (2 * inter, hidden, False), (hidden, inter, True)]
    out: dict[KernelSpec, None] = {}
    el, nm, sm = tuning["elementwise"]["threads"], tuning["norm"]["threads"], tuning["sampling"]["threads"]
    for t in types:
        ok = QUANTS[t][0]
        th = upload_type(t, hidden, tuning)
        if hidden % ok == 0:
            out[spec("embed", quant=th, hidden=hidden, threads=el)] = None
        for n, k, res in shapes:
            if k % ok == 0:
                tk = upload_type(t, k, tuning)
                out[spec("gemv", **linear_params(tk, n, k, tuning, residual=res))] = None
                out[spec("gemv", **linear_params(tk, n, k, tuning, residual=res, bmax=1))] = None
        if hidden % ok == 0:
            out[spec("gemv", **linear_params(th, vocab, hidden, tuning, out_dtype="f32"))] = None
            out[spec("gemv", **linear_params(th, vocab, hidden, tuning, out_dtype="f32", bmax=1))] = None
        # the decode GEMVs with fused prologues: rmsnorm before qkv / gate|up / lm_head, SiLU-mul
        # before the down projection (x = the fused gate|up buffer)
        norm = dict(prologue="norm", x_stride=hidden, eps=d["rms_eps"])
        silu = dict(prologue="silu", x_stride=2 * inter, u_off=inter)
        for bm in (None, 1):
            if hidden % ok == 0:
                for n, od in ((qkv, "bf16"), (2 * inter, "bf16"), (vocab, "f32")):
                    p = linear_params(th, n, hidden, tuning, out_dtype=od, bmax=bm)
                    out[spec("gemv", **p, **norm)] = None
            if inter % ok == 0:
                p = linear_params(
                    upload_type(t, inter, tuning), hidden, inter, tuning, residual=True, bmax=bm
                )
                out[spec("gemv", **p, **silu)] = None
            if tuning["gemv"].get("fuse_glu") and hidden % ok == 0:  # gate|up storing silu(g) * u
                p = linear_params(th, 2 * inter, hidden, tuning, bmax=bm)
                if not p.get("coop") and p["rows_per_block"] % 2 == 0:
                    out[spec("gemv", **p, glu=inter)] = None
        if (tuning.get("decode_graph") or {}).get("pair_linears") and hidden % ok == 0:
            # q|k and a separately stored v (this type, or a q4_k_m file's q6_k) in one launch
            for u in dict.fromkeys((t, "q6_k")):
                if u in types and hidden % QUANTS[u][0] == 0:
                    pair = _pair_of(
                        linear_params(th, q_dim + kv_dim, hidden, tuning, bmax=1),
                        lambda threads, u=u: linear_params(
                            upload_type(u, hidden, tuning), kv_dim, hidden, tuning, bmax=1, threads=threads
                        ),
                        norm,
                    )
                    if pair is not None:
                        out[pair] = None
    for n, k, res in shapes:
        wg = gemm_wgmma_params(n, k, tuning, residual=res)
        if wg is not None:  # bf16 prefill on sm_90a (the mma.sync gemm stays for the rest)
            out[spec("gemm_wgmma", **wg)] = None
        out[spec("gemm", **gemm_params(n, k, tuning, residual=res))] = None
        if "gemm_decode" in tuning:
            out[spec("gemm", **gemm_params(n, k, tuning, residual=res, section="gemm_decode"))] = None
        for t in types:  # the fused quantised prefill GEMM (W tiles decoded into shared memory)
            if (
                t != "bf16"
                and k % QUANTS[t][0] == 0
                and wg is not None
                and tuning["gemm_wgmma"]["dequant_min_rows"]
            ):
                # long chunks: the matrix dequantised to bf16 (embed over ids 0..n-1), then gemm_wgmma
                out[spec("embed", quant=upload_type(t, k, tuning), hidden=k, threads=el)] = None
            if t != "bf16" and k % QUANTS[t][0] == 0:
                out[
                    spec("gemm", **gemm_params(n, k, tuning, residual=res, quant=upload_type(t, k, tuning)))
                ] = None
    for res in (False, True):
        out[spec("rmsnorm", n=hidden, eps=d["rms_eps"], threads=nm, residual=res)] = None
    out[spec("silu_mul", inter=inter, in_stride=2 * inter, threads=el)] = None
    for style in rope_styles:
        out[spec("rope", **rope_params(d, tuning, style, q_stride=qkv, kv_stride=qkv, qk_norm=qk_norm))] = (
            None
        )
    for mode in ("decode", "prefill"):
        for direct in (True, False):
            p = attention_params(
                d, tuning, block_size, mode=mode, direct=direct, q_stride=qkv, out_stride=q_dim
            )
            out[spec("attention", **p)] = None
            if mode == "decode" and direct and p["vec16"] and tuning["attention_decode"].get("fuse_rope"):
                for style in rope_styles:  # rope folded into decode attention
                    rp = rope_params(d, tuning, style, q_stride=qkv, kv_stride=qkv, qk_norm=qk_norm)
                    fused = {k: rp[k] for k in ATTENTION_ROPE_PARAMS if k in rp}
                    out[spec("attention", **p, **fused, rope=True)] = None
    out[
        spec(
            "attention_prefill",
            **attention_prefill_params(d, tuning, block_size, q_stride=qkv, out_stride=q_dim),
        )
    ] = None
    split = attention_params(
        d, tuning, block_size, mode="decode", direct=False, q_stride=qkv, out_stride=q_dim
    )["split"]
    out[
        spec("attention_combine", heads=d["heads"], head_dim=d["head_dim"], split=split, out_stride=q_dim)
    ] = None
    out[spec("argmax", vocab=vocab, ld=vocab, threads=sm)] = None
    out[spec("sample", vocab=vocab, ld=vocab, threads=sm)] = None
    out[spec("penalties", ld=vocab, threads=el)] = None
    return list(out)
