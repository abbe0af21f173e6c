"""Kernel catalog: (template, params) -> KernelSpec, plus each kernel's launch contract.

``spec(template, **params)`` validates a template's parameters (names, types, the divisibility
rules the kernel relies on) and names its entry point; ``choice(...)`` adds the launch contract
(argument list, grid as a function of the row count, block, dynamic shared memory) as a
``KernelChoice``. ``KERNELS`` documents every template: its parameters and its exact argument
list (pointer / int / float, in order), which engine.lowering binds.

Activations are bf16 everywhere (f32 accumulation inside kernels); logits may be f32; norm
weights are f32. Quantised weights are GGUF rows uploaded unchanged. Must not import CUDA, numpy
or gguf (the GPU check script imports this on a machine without gguf).
"""

from __future__ import annotations

from engine.kernel_catalog.builders import (  # noqa: F401
    DECODE_WARPS,
    ELEMENTWISE_THREADS,
    GEMM_DECODE_MIN_ROWS,
    GEMM_FIXED,
    GEMM_WGMMA_NARROW,
    GEMM_WGMMA_TILE,
    GEMM_WGMMA_WIDE,
    GEMV_ROWS_PER_BLOCK,
    MMA_FIXED,
    NORM_THREADS,
    PREFILL_BLOCK_Q,
    PREFILL_WARPS,
    Q8X_STAGE_ROUNDS,
    SAMPLING_THREADS,
    attention_warps,
    decode_bmax,
    direct_qsplit,
    gemm_params,
    gemm_wgmma_params,
    gemv_layout,
    linear_params,
    mma_params,
    one_round,
    prefill_block_kv,
    q8x_applies,
    upload_type,
)
from engine.kernel_catalog.contracts import (  # noqa: F401
    KERNELS,
    LP_TOP,
    PENALTY_BLOCKS,
    QUANTS,
    ROPE_STYLES,
    STAGED_DEFAULT,
)
from engine.kernel_catalog.layout import (  # noqa: F401
    ATTENTION_ROPE_PARAMS,
    COOP_Q8X_MAX,
    COOP_TYPES,
    Q8X_FILE_TYPES,
    Q8X_TYPES,
    VERIFY_FRESH_MAX,
    attention_prefill_smem,
    gemm_smem,
    gemm_wgmma_smem,
    gemm_wgmma_tile_m,
    gemv_grid_x,
    gemv_smem,
    l2_pf_ranges,
    pair_parts,
    pair_smem,
    pair_spec,
    rope_head_blocks,
)
from engine.kernel_catalog.specs import (  # noqa: F401
    KernelChoice,
    choice,
    kernel_args,
    pair_with_min_blocks,
    spec,
)
