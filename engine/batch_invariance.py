"""Which decode launches of a plan could give a row other bits in another bucket (issue #38 item 3).

A decode row's logits must be the same bits whether it runs alone (the plan's ``decode1`` launches,
or ``short`` / ``short1`` below split_kv_tokens) or as one of 2..8 rows (``decode``): speculative
verification runs a draft's positions as rows of one bucket and accepts a token only where plain
batch-1 greedy would have produced it. The kernels make most of their knobs bit-neutral (the same
arithmetic in the same order: kernels/_gemv_coop.cuh.j2's unroll, pipeline, wsm, tile_pf, trigger,
early loads, rows per warp and block shape; a norm or silu prologue stores what the rmsnorm /
silu_mul kernel would, and so does a gate|up GEMV's glu epilogue; attention_combine passes a lone split through, so the split attention of a
row below split equals the direct kernel with the same warps; the rope is one function in both
rope kernels). What is left, and what this module compares per step across the decode modes:

* a GEMV's reduction structure: coop (k split over ``ksplit`` warp groups, ``lanes`` lanes per
  row, int8 x rows or not) or classic (``threads / 32 / rows_per_block`` warps per row), its type
  and shape, residual, output type;
* the decode attention's ``warps`` (which keys each warp sums), ``vec16``, split, scale, window;
* the rmsnorm kernel's threads: the GEMV norm prologue sums in its order for NORM_THREADS;
* every other kernel's params, but for the bit-neutral ones (NEUTRAL).

``mismatches(plan)`` lists the differences as lines (empty: every decode path a verify or a batch
can take gives a row the bits it gets alone). The wide decode (``decode_wide``: bf16 weights as
GEMMs from plan.wide_rows rows) is not compared: it is a different algorithm, by design.
Must not import CUDA or numpy.
"""

from __future__ import annotations

from typing import Any

from engine import kernel_catalog as kc
from engine.ir import SHORT1
from engine.kernel_catalog.contracts import PAIR_PARTS

# the decode modes a row can take at batch 1 and in a bucket of 2..8 rows
MODES = ("decode1", "short", SHORT1, "decode")
# params that change how a kernel runs, never a row's bits (the kernels' own claims)
NEUTRAL = frozenset(
    (
        "bmax", "threads", "rows_per_block", "unroll", "pipeline", "tile_pf", "wsm", "trigger", "early_nw",
        "early_res", "grid_cap", "stage_rounds", "min_blocks", "l2_pf", "prefetch", "stage", "prologue",
        "x_stride", "eps", "u_off", "qsplit", "table_first", "direct", "rope", "rope_dim", "theta", "style",
        "qk_norm", "freq_factors", "kv_stride", "v_stride",
    )
)  # fmt: skip


def gemv_signature(p: dict[str, Any]) -> tuple:
    """What fixes a gemv's per-row bits: its reduction structure, type, shape and epilogue."""
    tail = (p["quant"], p["n"], p["k"], p["residual"], p["out_dtype"])  # (glu: silu_mul's bits)
    if p["coop"]:
        return ("coop", p["q8x"], p["ksplit"], p["lanes"], *tail)
    return ("classic", p["threads"] // 32 // p["rows_per_block"], *tail)


def _gemv_parts(launches) -> list[tuple]:
    out = []
    for la in launches:
        s = la.spec
        if s.template == "gemv":
            out.append(gemv_signature(s.params))
        elif s.template == "gemv_pair":
            for x in PAIR_PARTS:
                out.append(gemv_signature({k[len(x) :]: v for k, v in s.params.items() if k.startswith(x)}))
        else:
            out.append((s.template, _generic(s.params)))
    return sorted(out)


def _generic(p: dict[str, Any]) -> tuple:
    return tuple(sorted((k, v) for k, v in p.items() if k not in NEUTRAL))


def _signature(op: str, launches) -> Any:
    if op == "linear":
        return _gemv_parts(launches)
    out = []
    for la in launches:
        s = la.spec
        if s.template == "attention_combine":
            continue  # (a lone split passed through: the direct kernel's bits)
        out.append((s.template, _generic(s.params)))
    return out


def mismatches(plan: Any) -> list[str]:
    """Lines naming each step whose decode modes could give a row different bits (module docstring)."""
    bad = []
    for i, st in enumerate(plan.steps):
        where = f"step {i} ({st.op.op}, layer {st.layer})"
        for mode in MODES:
            for la in st.launches.get(mode) or ():
                if la.spec.template == "rmsnorm" and la.spec.params["threads"] != kc.NORM_THREADS:
                    bad.append(f"{where}: {mode} rmsnorm threads {la.spec.params['threads']} != NORM_THREADS")
        modes = [m for m in MODES if st.launches.get(m)]
        if st.op.op in ("rmsnorm", "silu_mul") and any(m in st.launches and not st.launches[m] for m in MODES):
            continue  # fused into the GEMVs' prologue somewhere: the same bits (the templates)
        if st.op.op == "rope" and "short" in st.launches and not st.launches["short"]:
            modes = [m for m in modes if m not in ("short", SHORT1)]  # folded into the short attention
        sigs = {m: _signature(st.op.op, st.launches[m]) for m in modes}
        ref = sigs.get("decode")
        for m, sig in sigs.items():
            if ref is not None and sig != ref:
                bad.append(f"{where}: {m} {sig} != decode {ref}")
    return bad
