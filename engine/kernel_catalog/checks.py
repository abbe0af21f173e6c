"""The shape and option rules each template relies on (``_check``), raised as ConfigErrors naming the
kernel and the rule. Part of engine.kernel_catalog. Must not import CUDA, numpy or gguf.
"""

from __future__ import annotations

from typing import Any

from engine.kernel_catalog.contracts import GLU_ACTS, QUANTS, ROPE_STYLES
from engine.kernel_catalog.layout import (
    COOP_LAYOUTS,
    COOP_TYPES,
    GEMM_SMEM_MAX,
    GEMV_XSMEM_MAX,
    MMA_TYPES,
    Q8X_TYPES,
    WSM_SMEM_MAX,
    _fail,
    attention_prefill_smem,
    gemm_smem,
    gemm_wgmma_smem,
    gemv_smem,
    l2_pf_ranges,
    mma_smem,
)


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
        need(not p["pipeline"] or p["coop"], "pipeline is a coop-layout option (coop=true)")
        need(not p["q8x"] or p["coop"], "q8x is a coop-layout option (coop=true)")
        need(
            not p["tile_pf"] or (p["coop"] and p["pipeline"]),
            "tile_pf is a pipelined coop option (pipeline=true)",
        )
        need(
            not p["min_blocks"] or (p["coop"] and p["min_blocks"] * p["threads"] <= 2048),
            f"min_blocks={p['min_blocks']}: a coop option, at most 2048 threads per SM",
        )
        need(not p["trigger"] or p["coop"], "trigger (an early pdl_trigger) is a coop-layout option")
        need(not p["early_nw"] or p["q8x"], "early_nw (norm weights before pdl_wait) is a q8x coop option")
        need(not p["early_res"] or p["coop"], "early_res (the residual read after pdl_wait) is a coop option")
        need(not p["l2_pf"] or (p["q8x"] and p["bmax"] == 1), "l2_pf (L2 prefetch of later weights) is a batch-1 q8x coop option")
        need(
            not p["wsm"] or (p["q8x"] and not p["tile_pf"]),
            "wsm (the row tile in shared memory) is a q8x coop option without tile_pf",
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
                not p["coop"] or (p["ksplit"] == 1 and not p["wsm"]),
                "glu: a coop gemv without ksplit or wsm (a tile's rows are two ranges)",
            )
        if p["coop"]:
            need(p["rows_per_warp"] == 1, "rows_per_warp is a classic-layout option (coop=false)")
            need(
                q in COOP_TYPES,
                f"coop gemv: storage type {q!r} has no warp-cooperative decoder; supported: {', '.join(COOP_TYPES)}",
            )
            need(
                not (p["stage"] or p["prefetch"]),
                "coop gemv: stage and prefetch are classic-layout options",
            )
            need(
                p["lanes"] in (4, 8, 16, 32),
                f"coop gemv: lanes={p['lanes']} (lanes per row) must be 4, 8, 16 or 32",
            )
            groups = warps // p["ksplit"] * (32 // p["lanes"])  # lanes and ksplit are checked by now
            need(
                p["mma"] or (warps % p["ksplit"] == 0 and p["rows_per_block"] % groups == 0),
                f"coop gemv: rows_per_block={p['rows_per_block']} must be a multiple of threads/32={warps} "
                f"/ ksplit={p['ksplit']} x 32 / lanes={p['lanes']} (the row groups; ksplit must divide threads/32)",
            )
            need(
                not p["q8x"] or q in Q8X_TYPES,
                f"coop gemv: q8x (int8 x rows) is for {', '.join(Q8X_TYPES)}, got {q!r}",
            )
            if p["mma"]:  # kernels/_gemv_mmq.cuh.j2
                _check_mma(p, need)
        else:
            need(not p["mma"], "mma is a coop q8x option (coop=true)")
            rpw = p["rows_per_warp"]
            need(
                rpw == 1 or (q == "bf16" and not p["stage"]),
                f"rows_per_warp={rpw}: more than one row a warp is the unstaged bf16 path's",
            )
            groups = p["rows_per_block"] // rpw if rpw >= 1 and p["rows_per_block"] % rpw == 0 else 0
            need(
                0 < groups <= warps and warps % groups == 0,
                f"rows_per_block={p['rows_per_block']} / rows_per_warp={rpw} must divide threads/32={warps}",
            )
            need(
                p["ksplit"] == 1 and p["grid_cap"] == 0 and p["lanes"] == 32,
                "ksplit, grid_cap and lanes are coop-layout options (coop=true)",
            )
        need(
            gemv_smem({**p, "wsm": False}) <= GEMV_XSMEM_MAX,  # (wsm's tile: its own bound above)
            f"q8x: bmax={p['bmax']} x k={p['k']} x rows exceed {GEMV_XSMEM_MAX} bytes of shared memory",
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
        need(p["x_dtype"] in ("bf16", "f32"), f"x_dtype {p['x_dtype']!r} must be bf16 or f32")
    if template == "embed":
        need(p["out_dtype"] in ("bf16", "f32"), f"out_dtype {p['out_dtype']!r} must be bf16 or f32")
    if template == "silu_mul":
        need(p["inter"] % 8 == 0 and p["in_stride"] % 8 == 0, "inter and in_stride must be multiples of 8")
    if template == "rope":
        need(p["style"] in ROPE_STYLES, f"style {p['style']!r} must be one of {ROPE_STYLES}")
        need(
            p["rope_dim"] % 2 == 0 and p["rope_dim"] <= p["head_dim"],
            f"rope_dim={p['rope_dim']} must be even and <= head_dim",
        )
        need(p["heads"] % p["kv_heads"] == 0, "heads must be a multiple of kv_heads")
    if template in ("attention", "attention_prefill", "attention_combine"):
        need(p["window"] >= 0, f"window={p['window']} must be >= 0 (0: no sliding window)")
    if template == "silu_mul":
        need(p["act"] in GLU_ACTS, f"act {p['act']!r} must be one of {', '.join(GLU_ACTS)}")
    if template == "add":
        need(
            p["n"] % 8 == 0 and p["a_stride"] % 8 == 0 and p["b_stride"] % 8 == 0,
            "n, a_stride and b_stride must be multiples of 8 (16-byte loads)",
        )
        need(p["a_dtype"] in ("bf16", "f32"), f"a_dtype {p['a_dtype']!r} must be bf16 or f32")
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
        need(
            p["span"] >= 0 and p["span"] % p["block_kv"] == 0,
            f"span={p['span']} must be a multiple of block_kv={p['block_kv']} (0: no key split)",
        )
        need(not p["partial"] or p["span"] > 0, "partial (the span partials) needs span > 0")
        need(
            not p["gqa"] or (p["partial"] and p["warps"] == p["heads"] // p["kv_heads"]),
            "gqa (a block per kv head) needs partial and warps = heads / kv_heads",
        )
        need(not p["row_tables"] or p["partial"], "row_tables (a decode pass's tables) needs partial")
    if template == "attention":
        need(p["heads"] % p["kv_heads"] == 0, "heads must be a multiple of kv_heads")
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
        need(
            not (p["window"] and p["table_first"]),
            "table_first stages the table from the range's first key: not with a sliding window",
        )
        need(not p["l2_pf"] or p["direct"], "l2_pf (L2 prefetch of later weights) needs the direct decode kernel")
        need(
            not p["vfresh"] or (p["rope"] and p["direct"]),
            "vfresh (a verify pass's earlier rows' keys) needs the direct kernel with the rope fused in",
        )
        if p["rope"]:  # rope fused into decode attention (kernels/_rope.cuh.j2)
            need(p["vec16"], "rope fusion needs vec16 decode attention")
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


def _check_mma(p: dict, need) -> None:
    """The mma gemv's shape rules (kernels/_gemv_mmq.cuh.j2): an MMA_TYPES q8x spec, 16-row warp tiles whose
    warps split the virtual lanes evenly, bmax a multiple of 8."""
    warps, vl = p["threads"] // 32, p["lanes"] * p["ksplit"]
    need(p["quant"] in MMA_TYPES and p["q8x"], f"mma gemv: {', '.join(MMA_TYPES)} with q8x only, got {p['quant']!r}")
    need(
        not (p["glu"] or p["wsm"] or p["tile_pf"] or p["l2_pf"] or p["trigger"] or p["min_blocks"]),
        "mma gemv: no glu, wsm, tile_pf, l2_pf, trigger or min_blocks",
    )
    need(p["bmax"] % 8 == 0, f"mma gemv: bmax={p['bmax']} must be a multiple of 8 (the mma's n tiles)")
    rpb = p["rows_per_block"]
    need(
        rpb % 16 == 0 and warps % (rpb // 16) == 0 and vl % (warps // (rpb // 16)) == 0,
        f"mma gemv: rows_per_block={rpb} must be 16 per warp tile, the tiles dividing threads/32={warps} "
        f"and their warps dividing lanes * ksplit = {vl}",
    )
    need(mma_smem(p) <= WSM_SMEM_MAX, f"mma gemv: {mma_smem(p)} bytes of shared memory exceed {WSM_SMEM_MAX}")
