"""Kernel geometry without specs: the gemv / coop / q8x layout constants, shared-memory sizes, grids,
the gemv_pair composition rules, L2-prefetch ranges. Part of engine.kernel_catalog. Must not import
CUDA, numpy or gguf.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

from engine.kernel_catalog.contracts import KERNELS, PAIR_PARTS
from engine.kernel_spec import KernelSpec
from engine.storage import row_bytes
from engine.types import ConfigError


def rope_head_blocks(p: Mapping[str, Any]) -> int:
    """grid.y of a rope launch: one warp per head job (q heads, k heads, then the v copies)."""
    return _cdiv(int(p["heads"]) + 2 * int(p["kv_heads"]), int(p["threads"]) // 32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fail(template: str, msg: str) -> ConfigError:
    return ConfigError(f"kernel {template}: {msg}")


GEMV_XSMEM_MAX = 160 * 1024  # dynamic x rows (q8x: bmax * k * 3 / 2 bytes) at most


# storage types of the warp-cooperative gemv layout (kernels/_gemv_coop.cuh.j2)
COOP_TYPES = ("bf16", "q4_k", "q8_0r", "q6_kr", "q4_0r", "q4_1r")


# coop types with a __dp4a path on int8-quantised x rows (gemv_coop.q8x), and its shared memory cap
# (bmax * k * 3 / 2 bytes; above it a spec keeps the f32 path: fewer resident blocks would starve it)
Q8X_TYPES = ("q4_k", "q8_0r", "q6_kr", "q4_0r", "q4_1r")
# the upload types the mma bucket gemv decodes (kernels/_gemv_mmq.cuh.j2)
MMA_TYPES = ("q4_k", "q6_kr", "q8_0r", "q4_0r", "q4_1r")


COOP_Q8X_MAX = 64 * 1024


# wsm: the x rows and the row tile within the 227 KB of shared memory a block may have on sm_90
WSM_SMEM_MAX = 227 * 1024


# file storage type -> the device layout the coop gemv reads (upload_type), and back
COOP_LAYOUTS = {"q8_0": "q8_0r", "q6_k": "q6_kr", "q4_0": "q4_0r", "q4_1": "q4_1r"}


_COOP_FILE_TYPE = {v: k for k, v in COOP_LAYOUTS.items()}


# the file types whose weights a q8x GEMV reads (the keys gemv_coop.q8x_type_tuning may name)
Q8X_FILE_TYPES = tuple(_COOP_FILE_TYPE.get(t, t) for t in Q8X_TYPES)


def gemv_smem(p: Mapping[str, Any]) -> int:
    """The gemv's dynamic shared memory: q8x's int8 x rows (and the wsm row tile); else 0."""
    bmax, k = int(p["bmax"]), int(p["k"])
    if p.get("mma"):
        return mma_smem(p)
    if p.get("q8x"):  # int8 x rows + a (dx, dx * sum q) float2 per 16 elements
        x = bmax * k * 3 // 2
        if not p.get("wsm"):
            return x
        # + the row tile at the next 128-byte boundary (kernels/_gemv_coop.cuh.j2: WSM_OFF)
        return (x + 127) // 128 * 128 + int(p["rows_per_block"]) * row_bytes(p["quant"], k)
    return 0


def mma_smem(p: Mapping[str, Any]) -> int:
    """The mma gemv's dynamic shared memory (kernels/_gemv_mmq.cuh.j2: XQS, XGS, XDS): bmax int8 x
    rows of k + 32 bytes (q4_k; the other types k + 16), per x row a float4 per segment (q4_k 64
    elements, q6_kr 32), a float (q8_0r, 16) or a float2 (q4_0r / q4_1r, 32) in rows of 8 *
    ceil(segments / 8) + 1, then the larger of the staging's (dx, dx * sum q) float2 rows of k / 16 + 4 and the virtual
    lanes' partial sums, f32 [lanes * ksplit][rows_per_block][bmax] (the same bytes, one after
    the other)."""
    bmax, k, q = int(p["bmax"]), int(p["k"]), p["quant"]
    seg = {"q6_kr": 32, "q8_0r": 16, "q4_0r": 32, "q4_1r": 32}.get(q, 64)  # (all but q4_k: 4-byte B loads)
    per_seg = {"q8_0r": 4, "q4_0r": 8, "q4_1r": 8}.get(q, 16)  # a float4 a segment, a float (q8_0r), a float2
    x = bmax * ((k + (32 if seg == 64 else 16)) + ((k // seg + 7) // 8 * 8 + 1) * per_seg)
    part = int(p.get("lanes") or 32) * int(p.get("ksplit") or 1) * int(p["rows_per_block"]) * bmax * 4
    return x + max(bmax * (k // 16 + 4) * 8, part)


def gemv_grid_x(p: Mapping[str, Any]) -> int:
    """The gemv's grid.x: one block per rows_per_block rows, at most grid_cap (where set: a coop
    block then loops over several row tiles)."""
    tiles = _cdiv(int(p["n"]), int(p["rows_per_block"]))
    cap = int(p.get("grid_cap") or 0)
    return min(tiles, cap) if cap else tiles


def pair_spec(a: KernelSpec, b: KernelSpec) -> KernelSpec:
    """The gemv_pair spec running coop gemv specs ``a`` and ``b`` in one launch
    (kernels/gemv_pair.cu.j2): blocks 0 .. blocks_a - 1 run ``a``, the rest ``b``. Both must be coop
    GEMVs of one block shape and batch (threads, min_blocks, bmax), with one block per row tile
    (no grid_cap below the tiles); a ConfigError names the rule broken. The caller decides that they read the same x."""
    for s in (a, b):
        if s.template != "gemv" or not s.params["coop"]:
            raise _fail("gemv_pair", f"{s.entry}: a part must be a coop gemv spec")
        p = s.params
        if p["l2_pf"]:
            raise _fail("gemv_pair", f"{s.entry}: a part takes no l2_pf (L2 prefetch)")
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


# a verify pass's rope-fused direct attention (param vfresh): the most earlier rows of a row's
# sequence in the pass whose keys a block writes and reads itself (engine.spec.config's
# MAX_SPEC_TOKENS drafts before the last row; tests/test_spec_cuda_fake.py checks the two agree)
VERIFY_FRESH_MAX = 16

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


def attention_prefill_smem(p: Mapping[str, Any]) -> int:
    """Dynamic shared memory of an attention_prefill spec: the Q tile and double-buffered K and V
    tiles, rows padded by 8 elements."""
    return (int(p["block_q"]) + 4 * int(p["block_kv"])) * (int(p["head_dim"]) + 8) * 2
