"""Typed tuning: one frozen dataclass per tunable kernel family, with its knobs' defaults.

A device profile's ``tuning:`` section holds, per family, only the knobs it changes; ``schema()``
turns these classes into the engine.schema rules a profile is validated against at load (an unknown
family or knob, or a bad value, is a ConfigError naming the file and the key path), and
``build(section, values)`` makes the frozen instance the lowering reads. An instance is also a
read-only Mapping (``tuning["gemv"]["threads"]``, ``.get``), the form kernel_catalog reads.
docs/kernels.md ("Tuning knobs") lists every knob a profile sets, with its measured gain. Imports
only engine.schema and the catalog's Q8X_FILE_TYPES. Must not import CUDA or numpy.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from engine.kernel_catalog import Q8X_FILE_TYPES  # the file types a q8x GEMV reads
from engine.schema import Field, ListOf, MapOf

# the gemv_coop q8x knobs a file type may set for itself (gemv_coop.q8x_type_tuning; 0 keeps the
# general one). Per file type only (no profile sets them for every type):
# - q8x_ksplit_threads: the threads of the k-split blocks (0: q8x_threads): e.g. 640 = 10 groups of
#   2 rows for 20-row tiles, so n = 2560 takes 128 blocks, one wave on 132 SMs;
# - q8x_ksplit_min_n: no k split below this many rows (a small model's short weights want more,
#   smaller tiles);
# - q8x_b1_rows_per_warp: rows per warp of the bmax-1 q8x GEMVs without the k split (0:
#   q8x_rows_per_warp): fewer registers, so more blocks of q8x_threads fit on an SM;
# - q8x_lanes_per_row: lanes per row (0: 32, a warp per row group): 8 makes a warp four lane
#   groups, each with its rows; a short k then takes whole steps on every lane;
# - q8x_b1_unroll: batch 1, this many segments in flight per lane and row instead of `unroll` (0:
#   `unroll`; a q4_k segment is two loads, so q4_k runs unroll / 2 of them), only where k <=
#   q8x_b1_unroll_max_k (0: any k).
Q8X_TYPE_KNOBS = (
    "q8x_threads", "q8x_rows_per_warp", "q8x_ksplit", "q8x_ksplit_threads", "q8x_ksplit_min_n",
    "q8x_b1_rows_per_warp", "q8x_lanes_per_row", "q8x_wsm_kb", "q8x_b1_unroll", "q8x_b1_unroll_max_k",
)


def positive(v: float) -> str | None:
    return None if v > 0 else f"expected a positive number, got {v}"


def non_negative(v: float) -> str | None:
    return None if v >= 0 else f"expected a number >= 0, got {v}"


TYPE_TUNING = MapOf({k: Field(int, default=0, check=non_negative) for k in Q8X_TYPE_KNOBS})


def q8x_file_types(v: dict) -> str | None:
    bad = sorted(set(v) - set(Q8X_FILE_TYPES))
    return f"unknown file type(s) {bad}; the q8x GEMV reads {', '.join(Q8X_FILE_TYPES)}" if bad else None


def knob(default: Any, check: Any = None, kind: Any = None) -> Any:
    """A knob with a validity ``check`` (value -> error text or None) and, for a nested value, the
    engine.schema ``kind`` it is validated as."""
    meta = {"check": check, "kind": kind}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class Knobs(Mapping):
    """A kernel family's knobs: a frozen dataclass (eq=False: Mapping's equality, so a family
    equals a dict of its knobs), read-only as a Mapping too."""

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:  # type: ignore[attr-defined]
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dataclass_fields__)  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)  # type: ignore[attr-defined]

    def replace(self, **changes: Any) -> Knobs:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True, eq=False)
class Gemv(Knobs):
    # the gate|up GEMV stores silu(gate) * up itself (pairs of rows per block), so the
    # silu_mul launch goes and the down GEMV reads x from the gate half
    fuse_glu: bool = False
    # the staged path (q8_0, q4_0, q4_1, q6_k rows): the next chunk's loads in flight while the
    # current one is decoded
    prefetch: bool = False
    # the GEMVs of weights with n <= short_n_max rows (o, down of a small model) in blocks of
    # b1_short_n_threads (0: threads), at every batch size (batch-invariant bits): more warps per
    # row on a long k
    b1_short_n_threads: int = 0
    short_n_max: int = 0


@dataclass(frozen=True, eq=False)
class GemvCoop(Knobs):
    # the warp-cooperative gemv layout (kernels/_gemv_coop.cuh.j2) for these file storage types
    # (bf16, q4_k, q8_0, q6_k, q4_0, q4_1; q8_0 matrices with k % 256 == 0 and q6_k / q4_0 / q4_1
    # matrices are then uploaded row-planar as q8_0r / q6_kr / q4_0r / q4_1r, kernel_catalog.upload_type);
    # each warp owns one row (q8x: q8x_rows_per_warp), `unroll` 16-byte segments per lane in flight
    types: list[str] = knob([])
    # q8_0 matrices whose k is not a multiple of 256 are uploaded q8_0r too (the d plane padded to
    # 16 bytes) where they have at least this many rows (0: never): a tall short-row lm_head
    q8_0r_min_rows: int = 0
    unroll: int = knob(4, positive)
    # issue the next `unroll` segments' loads before the current ones' FMAs
    pipeline: bool = False
    # with pipeline: a lane's last step of a row tile issues the block's next tile's first loads
    tile_prefetch: bool = False
    # q4_k / q8_0 / q6_k / q4_0 / q4_1: int8-quantised x rows in shared memory and __dp4a
    # dot products, with their own block shape (0: 256 threads, one row a warp)
    q8x: bool = False
    q8x_threads: int = 0
    q8x_rows_per_warp: int = 0
    # per file type (q8_0, q4_k, q6_k, q4_0, q4_1): that type's values of the q8x knobs named
    # in Q8X_TYPE_KNOBS, over the general ones; 0 keeps the general one
    q8x_type_tuning: dict = knob({}, q8x_file_types, kind=TYPE_TUNING)
    # weights of at least q8x_tall_min_n rows (0: none) and rows of at most q8x_tall_max_k values
    # (0: any; a tall, short-row lm_head) take q8x_tall_tuning's values per file type (the
    # q8x_type_tuning knobs) over q8x_type_tuning's and the general ones
    q8x_tall_min_n: int = 0
    q8x_tall_max_k: int = 0
    q8x_tall_tuning: dict = knob({}, q8x_file_types, kind=TYPE_TUNING)
    # decode rmsnorm / silu_mul folded into their readers where every reader is a q8x GEMV
    # (its block stages and quantises x anyway; the norm costs one more pass over x)
    q8x_fuse: bool = False
    # q8x: k split over q8x_ksplit warp groups of a block where the weight has n <=
    # q8x_ksplit_max_n rows (more warps in flight per row on short-n weights), every q8x type
    q8x_ksplit: int = 1
    q8x_ksplit_max_n: int = 0
    # q8x on sm_90, batch 1: a block's row tile of up to this many KB bulk-copied into shared
    # memory (one copy, issued before the block waits for x; 0: off), where the resident
    # blocks hold every tile at once
    q8x_wsm_kb: int = 0
    # q8x: at most q8x_blocks_per_sm * sm_count blocks, each looping over row tiles (it
    # stages and quantises its x rows once, not once per tile); 0: one block per tile
    q8x_blocks_per_sm: int = 0
    # q8x capped grids: at most the blocks of the compiled kernel resident at once (the
    # driver's occupancy x SMs), so no block waits for a second wave
    q8x_resident_grid: bool = False
    # q8x, batch 1, the norm prologue from the staging loads: each thread's norm weights
    # loaded before pdl_wait (weights never change), so only x is read after the wait
    q8x_early_norm_w: bool = False
    # q8x, batch 1: the gate|up GEMV (no k split, no wsm) stores silu(gate) * up itself (with
    # gemv.fuse_glu's pairing), so the down projection stages half the bytes and no silu
    q8x_glu: bool = False


@dataclass(frozen=True, eq=False)
class GemvMmq(Knobs):
    # the bucket decode GEMVs of these file storage types (q4_k, q6_k, q8_0, q4_0, q4_1) on the
    # int8 tensor cores (kernels/_gemv_mmq.cuh.j2; its fixed shape: kernel_catalog.MMA_FIXED)
    # where their q8x coop layout allows it, each row's bits those of its batch-1 coop GEMV; only
    # in decode passes of at least min_rows rows (0: every bucket pass; smaller passes keep the
    # bucket coop GEMV)
    types: list[str] = knob([], q8x_file_types)
    min_rows: int = knob(0, non_negative)


@dataclass(frozen=True, eq=False)
class Gemm(Knobs):
    # the prefill gemm (kernels/gemm.cu.j2; its fixed shape: engine.kernel_catalog.builders.GEMM_FIXED)
    tile_k: int = knob(32, positive)
    swizzle: bool = False  # XOR-swizzled unpadded smem tiles


@dataclass(frozen=True, eq=False)
class GemmWgmma(Knobs):
    # the Hopper prefill GEMM (kernels/gemm_wgmma.cu.j2: TMA + wgmma, warp-specialised) for bf16
    # weights with k % 64 == 0, on sm_90a profiles that enable it; other linears keep "gemm"
    # (its wide and narrow tile shapes: engine.kernel_catalog.builders.GEMM_WGMMA_WIDE / _NARROW)
    enabled: bool = False
    # weights with n < wide_min_n take the narrow tile (no setmaxnreg): more blocks where the
    # wide tile leaves SMs idle (0: always wide)
    wide_min_n: int = 0
    # quantised prefill chunks of at least this many rows dequantise each matrix to a bf16
    # scratch and run this GEMM (shorter ones keep the fused mma.sync gemm; 0: never)
    dequant_min_rows: int = 0


@dataclass(frozen=True, eq=False)
class GemmDecode(Knobs):
    # the same gemm kernel for decode batches of min_rows.. rows (memory-bound: small tile_m, narrow
    # tile_n, in-block split-K over warp groups so the weight is streamed once by many blocks;
    # min_rows, tile_k, warps: engine.kernel_catalog.builders.GEMM_DECODE_FIXED)
    tile_m: int = knob(64, positive)
    tile_n: int = knob(16, positive)
    stages: int = knob(4, positive)
    split_k: int = knob(4, positive)
    swizzle: bool = False
    fragbuf: bool = False  # register double-buffered fragments
    # decode buckets of at least this many rows run quantised linears (GEMM-decodable storage types)
    # as these GEMMs too, dequantising each weight once per bucket (0: quantised weights keep the GEMV)
    quant_min_rows: int = knob(0, non_negative)
    # MoE decode buckets of at least this many rows run the experts as the grouped tensor-core GEMM
    # (moe_sort + moe_gemm; 0: from engine.lowering.moe.GEMM_TOKENS_PER_EXPERT tokens per expert)
    moe_min_rows: int = knob(0, non_negative)


@dataclass(frozen=True, eq=False)
class AttentionPrefill(Knobs):
    # the flash prefill's K/V tile (block_q and warps: kernel_catalog.PREFILL_BLOCK_Q / PREFILL_WARPS)
    block_kv: int = knob(64, positive)
    # the key split (docs/kernels.md "Key-split prefill attention"): a row's keys in spans of this
    # many keys at absolute positions (a multiple of block_kv), each span's partial folded in span
    # order; 0: none. Passes of at most split_rows rows run one block per span (a prefix hit's tail
    # at depth) and the combine, longer ones fold the spans in one block: the same bits per row
    span: int = knob(0, non_negative)
    split_rows: int = knob(64, positive)
    # the split launch as one block per kv head (its warps the GQA group's query heads, 16 rows)
    # where the group is at most 8 and its tiles fit: K/V tiles loaded once per group
    split_gqa: bool = True


@dataclass(frozen=True, eq=False)
class AttentionDecode(Knobs):
    # the split kernels' warps: kernel_catalog.DECODE_WARPS
    split_kv_tokens: int = knob(512, positive)
    vec16: bool = False
    # short-context decode: fold the rope kernel into the direct attention kernel (vec16)
    fuse_rope: bool = False
    # warps of the direct (short-context) kernel; 0: the split kernels' DECODE_WARPS
    direct_warps: int = 0
    # direct kernel: split a kv head's query heads over up to this many blocks (grid z)
    direct_qsplit: int = 1
    # decode kernels: a block stages its first chunk's block-table entries without waiting
    # for the row's position (the two loads in flight together, one round trip less)
    table_first: bool = False
    # batch 1 only (the short pass's SHORT1 launch; b8 / b32 keep theirs): the direct kernel
    # calls pdl_trigger() at its start, so the next kernel (the o GEMV) launches beside it and
    # issues its weight loads / tile copies early
    trigger_b1: bool = False
    # batch 1, short contexts (the SHORT1 launch): the direct kernel prefetches the layer's o
    # projection weight into L2 at its start, so it streams while the attention runs
    l2_prefetch_o: bool = False


@dataclass(frozen=True, eq=False)
class DecodeGraph(Knobs):
    # the launches of a linear op's separately stored weights (a q4_k_m q|k and its q6_k v) on a
    # second stream, concurrently (they read the same x; the next op waits for both)
    fork_linears: bool = False
    # batch-1 coop GEMVs call pdl_trigger() once their first weight loads are out
    early_trigger: bool = False
    # a batch-1 linear op's two coop GEMVs as one kernels/gemv_pair.cu.j2 launch, with this
    # __launch_bounds__ minimum of blocks per SM (0: none)
    pair_linears: bool = False
    pair_min_blocks: int = 0
    # the batch-1 o GEMV prefetches the first KB of the gate|up weight into L2 (0: off)
    o_prefetch_next_kb: int = knob(0, non_negative)
    # the batch-1 attention-window changes (attention_decode.trigger_b1, l2_prefetch_o and
    # o_prefetch_next_kb) only on layers whose o weight has at least / at most this many KB (0: no bound)
    o_window_min_kb: int = knob(0, non_negative)
    o_window_max_kb: int = knob(0, non_negative)
    # b1_rows: decode passes of 2 .. b1_rows rows (a speculative verify pass, the small buckets)
    # run the batch-1 launches for every layer (the bmax-1 GEMVs, one grid row per decode row, with
    # batch 1's folded norms and early triggers; the head keeps the bucket GEMV), where every layer
    # matrix holds at most b1_rows_kb KB (each row's grid row then reads it from L2: launch-bound
    # small models); a row gets batch 1's bits by construction (0: off)
    b1_rows: int = knob(0, non_negative)
    b1_rows_kb: int = knob(0, non_negative)


SECTIONS: dict[str, type[Knobs]] = {
    "gemv": Gemv,
    "gemv_coop": GemvCoop,
    "gemv_mmq": GemvMmq,
    "gemm": Gemm,
    "gemm_wgmma": GemmWgmma,
    "gemm_decode": GemmDecode,
    "attention_prefill": AttentionPrefill,
    "attention_decode": AttentionDecode,
    "decode_graph": DecodeGraph,
}


def _kind(cls: type[Knobs], f: dataclasses.Field) -> Any:
    if f.metadata.get("kind") is not None:
        return f.metadata["kind"]
    hint = typing.get_type_hints(cls)[f.name]
    return ListOf(typing.get_args(hint)[0]) if typing.get_origin(hint) is list else hint


def schema() -> dict[str, Field]:
    """The engine.schema rules of a profile's ``tuning:`` mapping (every family, every knob)."""
    out = {}
    for name, cls in SECTIONS.items():
        fields = {
            f.name: Field(_kind(cls, f), default=getattr(cls(), f.name), check=f.metadata.get("check"))
            for f in dataclasses.fields(cls)
        }
        out[name] = Field(fields, default={k: copy.deepcopy(v.default) for k, v in fields.items()})
    return out


def build(section: str, values: Mapping[str, Any]) -> Knobs:
    """The frozen knobs of ``section`` from validated ``values`` (missing ones at their defaults)."""
    return SECTIONS[section](**values)


def defaults() -> dict[str, Knobs]:
    return {name: cls() for name, cls in SECTIONS.items()}
