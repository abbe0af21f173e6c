"""The params of gemv_mma, the tensor-core batched decode linear (kernels/gemv_mma.cu.j2; in no plan
yet, docs/kernels.md says why): its row buckets and its one shape rule. Imports only the catalog's
contracts and layout. Must not import CUDA.
"""

from __future__ import annotations

from typing import Any

from engine.kernel_catalog.contracts import QUANTS
from engine.kernel_catalog.layout import _cdiv
from engine.storage import row_bytes

# the gemv_mma launches of a decode linear: (bmax, fewest rows, most rows (0: any)) -- a pass of
# rows runs the first whose range holds it (more than 64 rows: bmax 64 per grid row)
MMA_BUCKETS = ((8, 0, 8), (16, 9, 16), (32, 17, 32), (64, 33, 0))
MMA_WARPS = 4
# bmax -> (m tiles per warp, warps side by side over rows, blocks per SM to aim the k split at)
MMA_SHAPES = {8: (1, 4, 4), 16: (2, 2, 4), 32: (2, 4, 3), 64: (4, 4, 2)}


def gemv_mma_params(
    quant: str,
    n: int,
    k: int,
    bmax: int,
    *,
    sm_count: int = 0,
    residual: bool = False,
    out_dtype: str = "bf16",
    x_stride: int = 0,
    glu: int = 0,
) -> dict[str, Any] | None:
    """The gemv_mma params of a decode linear on a [n, k] weight uploaded as ``quant`` for passes of
    up to ``bmax`` rows, or None where the kernel does not apply (a type without a decoder, k not a
    multiple of 64, x rows not 16-byte aligned). ``glu``: a gate|up weight storing silu(gate) * up
    (m tiles in gate / up pairs: mt 1 becomes 2 with half the warps over rows). One shape rule, no tuning (MMA_SHAPES): the m tiles
    per warp and the warps over rows grow with the batch, so each x fragment feeds mt mma and the
    wm warps of a block share x through L1 (x bytes read from L2 at most about the weight bytes);
    the warps left over split k inside the block; k is split over blocks (kparts) until the blocks
    fill the SMs (``sm_count``; 132 where unknown) at the shape's blocks per SM, keeping a full
    round of steps per k group and the f32 partial sums of a row within its weight bytes."""
    if quant not in QUANTS or k % 64 or k % QUANTS[quant][0] or x_stride % 8:
        return None
    mt, wm, per_sm = MMA_SHAPES[bmax]
    if glu and mt % 2:
        mt, wm = 2 * mt, max(1, wm // 2)
    tiles = _cdiv(n, 16 * mt * wm)
    rounds = k // 64 // (MMA_WARPS // wm * (4 // mt))
    partial_cap = row_bytes(quant, k) // (4 * bmax)  # f32 partial sums of a row <= its weight bytes
    kparts = max(1, min(_cdiv(per_sm * (sm_count or 132), tiles), rounds, partial_cap))
    return dict(
        quant=quant,
        n=n,
        k=k,
        bmax=bmax,
        mt=mt,
        warps=MMA_WARPS,
        wm=wm,
        kparts=kparts,
        residual=residual,
        out_dtype=out_dtype,
        x_stride=x_stride,
        glu=glu,
    )
