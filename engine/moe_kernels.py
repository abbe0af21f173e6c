"""KernelSpec builders for the mixture-of-experts kernels, with each kernel's launch contract.

``topk_kernel``: kernels/moe_topk.cu.j2, top-k softmax routing on the device (router logits in,
expert ids and weights out, fixed-size buffers, no host synchronisation). ``expert_gemv_kernel``:
kernels/moe_gemv.cu.j2, GEMVs over stacked [E, N, K] expert weights indexed by those ids: mode
``glu`` (gate and up of each chosen expert plus the silu_mul) and mode ``down`` (the down projection,
weighted by the router and summed over the chosen experts, plus the residual). Together with the
router's own GEMV (the dense gemv kernel, f32 logits) they run a Qwen3-MoE sparse MLP for a
decode step. The CUDA plan does not call them yet (the MoE lowering lands on the op registry);
``moe_specs`` lists what a family's dims need, for warmup.

Each builder returns a ``MoeKernel``: the spec plus ``args`` ((name, ctype) in order), ``grid(rows)``
and ``block``, the same shape as ``engine.kernel_catalog.KernelChoice`` so launch helpers take
either. Must not import CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.kernel_spec import KernelSpec, entry_name
from engine.types import ConfigError

# storage types the expert GEMV decodes (kernels/_quant.cuh.j2), with their block widths
GEMV_QUANTS = {
    "bf16": 8,
    "f16": 8,
    "f32": 8,
    "q8_0": 32,
    "q4_0": 32,
    "q4_1": 32,
    "q5_0": 32,
    "q5_1": 32,
    "q4_k": 256,
    "q5_k": 256,
    "q6_k": 256,
}
# the templates this module builds, for the catalog-completeness check (tests/test_kernels_compile.py)
KERNELS = {
    "moe_topk": "top-k softmax routing: router logits -> expert ids (int32) and weights (f32) per token",
    "moe_gemv": "expert-indexed GEMV over stacked [E, N, K] weights: glu (gate, up, silu) or down (weighted sum)",
}
MAX_EXPERTS = 256  # moe_topk keeps E / 32 logits per lane in registers
MAX_GRID_Y = 65535


@dataclass(frozen=True)
class MoeKernel:
    """A spec plus how to launch it (``grid(rows)`` -> 3-tuple; rows = tokens)."""

    spec: KernelSpec
    args: tuple[tuple[str, str], ...]
    grid: Callable[..., tuple[int, int, int]]
    block: tuple[int, int, int]
    smem: int = 0


def topk_kernel(experts: int, top_k: int, normalize: bool, warps: int = 4) -> MoeKernel:
    """moe_topk for ``experts`` router logits per token, ``top_k`` chosen, renormalised when
    ``normalize``; one warp per token, ``warps`` tokens per block. Raises ConfigError when
    ``experts`` > 256 or ``top_k`` is outside 1..min(32, experts)."""
    if not 0 < experts <= MAX_EXPERTS:
        raise ConfigError(f"moe_topk: {experts} experts; the kernel handles 1..{MAX_EXPERTS}")
    if not 0 < top_k <= min(32, experts):
        raise ConfigError(f"moe_topk: top_k {top_k} must be in 1..{min(32, experts)}")
    if warps not in (1, 2, 4, 8, 16, 32):
        raise ConfigError(f"moe_topk: warps {warps} must be a power of two up to 32")
    params = {"experts": experts, "top_k": top_k, "normalize": bool(normalize), "warps": warps}
    spec = KernelSpec(
        "moe_topk", entry_name("moe_topk", e=experts, k=top_k, n=int(normalize), w=warps), params
    )
    return MoeKernel(
        spec,
        (("ids", "ptr"), ("weights", "ptr"), ("logits", "ptr"), ("rows", "i32")),
        lambda rows, **_: (-(-rows // warps), 1, 1),
        (32 * warps, 1, 1),
    )


def expert_gemv_kernel(
    mode: str,
    quant: str,
    n: int,
    k: int,
    top_k: int,
    rows_per_block: int = 4,
    residual: bool = False,
) -> MoeKernel:
    """moe_gemv ``mode`` ("glu": gate/up [E, n, k] -> act [rows, top_k, n]; "down": [E, n, k] ->
    out [rows, n], weighted over the top_k slots, + residual when ``residual``) over weights
    stored as ``quant``. Raises ConfigError for an unsupported quant, a k that is not a whole
    number of its blocks, or a bad mode."""
    if mode not in ("glu", "down"):
        raise ConfigError(f"moe_gemv: mode {mode!r} must be glu or down")
    if quant not in GEMV_QUANTS:
        raise ConfigError(f"moe_gemv: storage type {quant!r} is not supported ({', '.join(GEMV_QUANTS)})")
    if k % GEMV_QUANTS[quant]:
        raise ConfigError(f"moe_gemv: a {quant} row of {k} values is not a whole number of {GEMV_QUANTS[quant]}-value blocks")
    if not 0 < top_k <= 32 or n < 1 or rows_per_block not in (1, 2, 4, 8, 16):
        raise ConfigError(f"moe_gemv: bad shape n={n} top_k={top_k} rows_per_block={rows_per_block}")
    res = bool(residual) and mode == "down"
    params = {"mode": mode, "quant": quant, "n": n, "k": k, "top_k": top_k, "rows_per_block": rows_per_block, "residual": res}
    entry = entry_name(f"moe_gemv_{mode}_{quant}", n=n, k=k, top=top_k, r=rows_per_block, **({"res": 1} if res else {}))
    spec = KernelSpec("moe_gemv", entry, params)
    slots = top_k if mode == "glu" else 1

    def grid(rows: int, **_: Any) -> tuple[int, int, int]:
        if rows * slots > MAX_GRID_Y:
            raise ConfigError(f"moe_gemv: {rows} rows x {slots} slots exceed the grid's {MAX_GRID_Y}")
        return (-(-n // rows_per_block), rows * slots, 1)

    if mode == "glu":
        args = (("act", "ptr"), ("wg", "ptr"), ("wu", "ptr"), ("x", "ptr"), ("ids", "ptr"), ("rows", "i32"))
    else:
        args = (
            ("out", "ptr"),
            ("w", "ptr"),
            ("act", "ptr"),
            ("ids", "ptr"),
            ("weights", "ptr"),
            ("residual", "ptr"),
            ("rows", "i32"),
        )
    return MoeKernel(spec, args, grid, (32 * rows_per_block, 1, 1))


def moe_specs(dims: Mapping[str, Any], quants: list[str], rows_per_block: int = 4) -> list[KernelSpec]:
    """Every MoE kernel a family's ``dims`` (experts, experts_used, moe_intermediate, hidden,
    norm_topk_prob) need for each expert storage type in ``quants`` (types the GEMV cannot decode
    are skipped)."""
    e, top, inter, hidden = (int(dims[x]) for x in ("experts", "experts_used", "moe_intermediate", "hidden"))
    specs = [topk_kernel(e, top, bool(dims.get("norm_topk_prob"))).spec]
    for q in quants:
        if q not in GEMV_QUANTS or hidden % GEMV_QUANTS[q] or inter % GEMV_QUANTS[q]:
            continue
        specs.append(expert_gemv_kernel("glu", q, inter, hidden, top, rows_per_block).spec)
        specs.append(expert_gemv_kernel("down", q, hidden, inter, top, rows_per_block, residual=True).spec)
    return list(dict.fromkeys(specs))
