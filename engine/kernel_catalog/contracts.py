"""Kernel contracts: every template's params and argument list (``KERNELS``),
the storage types the kernels decode, and the entry-name rules. Part of engine.kernel_catalog. Must
not import CUDA or numpy (the block sizes are engine.storage's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine import storage

# storage types the gemv/embed decoders handle, with (elements, bytes) per decode unit: a quant
# block or device layout's block (engine.storage), or 8 elements (one vector load) of a float type
QUANTS: dict[str, tuple[int, int]] = {
    t: (8, 8 * storage.BLOCK_SIZES[t][1]) if t in storage.FLOAT_TYPES else storage.BLOCK_SIZES[t]
    for t in ("bf16", "f16", "f32", "q8_0", "q8_0r", "q4_0", "q4_0r", "q4_1", "q4_1r", "q5_0", "q5_1", "q4_k",
              "q5_k", "q6_k", "q6_kr")
}

ROPE_STYLES = ("neox", "interleaved")
GLU_ACTS = ("silu", "gelu_tanh")  # silu_mul's gate activations (SwiGLU, GeGLU with the tanh GELU)


PENALTY_BLOCKS = 64  # the penalties kernel's fixed grid (it loops over however many entries there are)
LP_TOP = 20  # the logprobs kernel's top-k capacity: the most top_logprobs a row may ask for (= MAX_LOGPROBS)


# gemv: stage unaligned GGUF blocks through shared memory (coalesced 16-byte loads) by default?
STAGED_DEFAULT: dict[str, bool] = {
    "bf16": False, "f16": False, "f32": False, "q8_0": True, "q8_0r": False, "q4_0": True, "q4_0r": False,
    "q4_1": True, "q4_1r": False, "q5_0": True, "q5_1": True, "q4_k": False, "q5_k": False, "q6_k": True,
    "q6_kr": False,
}


@dataclass(frozen=True)
class KernelDoc:
    """A template's contract: ``params`` (name -> python type) and ``args`` ((name, ctype) in
    order; ctype is an engine.cuda.ARG_FORMATS key: ptr, i32, f32...), ``name`` the params that
    form the entry name (None: every param but the ``unnamed`` ones). Its grid, block and shared
    memory are computed by engine.kernel_catalog.specs.choice (docs/kernels.md lists them)."""

    params: dict[str, type]
    args: tuple[tuple[str, str], ...]
    name: tuple[str, ...] | None
    defaults: dict[str, Any] | None = None  # optional params, filled in by spec()
    pdl: bool = True  # the body opens with pdl_wait() (or PDL_PRELOAD): KernelSpec.pdl
    unnamed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.name is None:
            object.__setattr__(self, "name", tuple(k for k in self.params if k not in self.unnamed))


P, I32 = "ptr", "i32"


# params left out of the entry name while at these defaults (added after the names in golden plans;
# a switch is named only when on)
_OFF = dict.fromkeys
_DEFAULT_NAME: dict[str, dict[str, Any]] = {
    "attention": {
        "qsplit": 1, "v_stride": 0, "window": 0, "vfresh": 0, **_OFF(("vec16", "rope", "table_first", "trigger"), False),
    },
    "attention_prefill": {"window": 0, "span": 0, "partial": False, "gqa": False, "row_tables": False},
    "attention_combine": {"window": 0, "fold": False},
    "rope": {"v_stride": 0},
    "embed": {"scale": "1.0", "out_dtype": "bf16"},
    "rmsnorm": {"x_dtype": "bf16"},
    "add": {"a_dtype": "bf16"},
    "silu_mul": {"act": "silu"},
    "gemv": {
        "ksplit": 1, "stage_rounds": 1, "min_blocks": 0, "lanes": 32, "glu": 0, "rows_per_warp": 1,
        **_OFF(
            ("prefetch", "coop", "pipeline", "q8x", "tile_pf", "wsm", "trigger", "early_nw", "early_res", "mma"), False
        ),
    },
    "gemm": _OFF(("swizzle", "fragbuf"), False),
}


KERNELS: dict[str, KernelDoc] = {
    "gemv": KernelDoc(
        dict(
            quant=str, n=int, k=int, bmax=int, threads=int, rows_per_block=int, residual=bool, out_dtype=str,
            stage=bool, unroll=int, prologue=str, x_stride=int, eps=float, u_off=int, prefetch=bool,
            coop=bool, pipeline=bool, glu=int, q8x=bool, ksplit=int, grid_cap=int, stage_rounds=int,
            tile_pf=bool, min_blocks=int, lanes=int, wsm=bool, trigger=bool, early_nw=bool, early_res=bool,
            l2_pf=str, mma=bool, rows_per_warp=int,
        ),
        # prologue "norm" adds a trailing ("norm_w", P), l2_pf pf0, pf1 ..: kernel_args()
        (("out", P), ("w", P), ("x", P), ("residual", P), ("rows", I32)),
        None,
        # grid_cap is launch-only (a coop block loops over its row tiles): not in the name
        # stage None: STAGED_DEFAULT[quant]; x_stride 0: k
        {
            "stage": None, "unroll": 2, "prologue": "none", "x_stride": 0, "eps": 0.0, "u_off": 0,
            "prefetch": False, "coop": False, "pipeline": False, "glu": 0, "q8x": False, "ksplit": 1,
            "grid_cap": 0, "stage_rounds": 1, "tile_pf": False, "min_blocks": 0, "lanes": 32, "wsm": False,
            "trigger": False, "early_nw": False, "early_res": False, "l2_pf": "", "mma": False,
            "rows_per_warp": 1,
        },
        unnamed=("eps", "grid_cap", "l2_pf"),
    ),
    "gemm": KernelDoc(
        dict(
            n=int, k=int, tile_m=int, tile_n=int, tile_k=int, stages=int, warps=int, warps_m=int, split_k=int,
            residual=bool, out_dtype=str, quant=str, swizzle=bool, fragbuf=bool,
        ),
        (("out", P), ("a", P), ("w", P), ("residual", P), ("rows", I32)),
        None,
        {
            "warps_m": 2, "split_k": 1, "out_dtype": "bf16", "quant": "bf16", "swizzle": False,
            "fragbuf": False,
        },
    ),
    "gemm_wgmma": KernelDoc(
        dict(
            n=int, k=int, tile_n=int, consumers=int, m_frags=int, stages=int, residual=bool, out_dtype=str,
            raster=bool, maxnreg=bool,
        ),
        # tmap_a / tmap_w: device pointers to CUtensorMaps (plan Arg kind "tmap")
        (("out", P), ("tmap_a", P), ("tmap_w", P), ("residual", P), ("rows", I32)),
        None,
        {"out_dtype": "bf16", "raster": True, "maxnreg": True},
    ),
    "rmsnorm": KernelDoc(
        dict(n=int, eps=float, threads=int, residual=bool, x_dtype=str),
        (("out", P), ("x", P), ("r", P), ("w", P), ("rows", I32)),
        None,
        defaults={"x_dtype": "bf16"},
    ),
    "embed": KernelDoc(
        dict(quant=str, hidden=int, threads=int, scale=float, out_dtype=str),
        (("out", P), ("table", P), ("ids", P), ("rows", I32)),
        None,
        defaults={"scale": 1.0, "out_dtype": "bf16"},
    ),
    "add": KernelDoc(
        dict(n=int, a_stride=int, b_stride=int, threads=int, a_dtype=str),
        (("out", P), ("a", P), ("b", P), ("rows", I32)),
        None,
        defaults={"a_dtype": "bf16"},
    ),
    "rope": KernelDoc(
        dict(
            heads=int, kv_heads=int, head_dim=int, rope_dim=int, theta=float, style=str, q_stride=int,
            kv_stride=int, qk_norm=bool, eps=float, freq_factors=bool, threads=int,
            v_stride=int,
        ),
        (
            ("q", P), ("k", P), ("v", P), ("positions", P), ("q_norm", P), ("k_norm", P), ("freq", P),
            ("k_cache", P), ("v_cache", P), ("slots", P), ("rows", I32),
        ),
        None,
        defaults={"v_stride": 0},
        unnamed=("theta", "eps", "freq_factors", "threads"),
    ),
    "silu_mul": KernelDoc(
        dict(inter=int, in_stride=int, threads=int, act=str),
        (("out", P), ("g", P), ("u", P), ("rows", I32)),
        None,
        defaults={"act": "silu"},
    ),
    "attention": KernelDoc(
        dict(
            heads=int, kv_heads=int, head_dim=int, block_size=int, split=int, scale=float, q_stride=int,
            out_stride=int, direct=bool, warps=int, vec16=bool, rope=bool, rope_dim=int,
            theta=float, style=str, qk_norm=bool, eps=float, freq_factors=bool, kv_stride=int, qsplit=int,
            v_stride=int, table_first=bool, trigger=bool, l2_pf=str, window=int, vfresh=int,
        ),
        # rope=true adds trailing k_in, v_in, q_norm, k_norm, freq, slots; l2_pf adds pf0, pf1 ...:
        # see kernel_args()
        (
            ("out", P), ("part_o", P), ("part_ml", P), ("q", P), ("k_cache", P), ("v_cache", P),
            ("block_tables", P), ("positions", P), ("max_blocks", I32), ("max_splits", I32),
        ),
        None,
        defaults={
            "vec16": False, "rope": False, "rope_dim": 0, "theta": 10000.0, "style": "neox", "qk_norm": False,
            "eps": 0.0, "freq_factors": False, "kv_stride": 0, "qsplit": 1, "v_stride": 0,
            "table_first": False, "trigger": False, "l2_pf": "", "window": 0, "vfresh": 0,
        },
        # the fused rope's params name the entry only with rope (specs.spec)
        unnamed=("scale", "warps", "rope", "rope_dim", "theta", "style", "qk_norm", "eps", "freq_factors",
                 "kv_stride", "v_stride", "l2_pf"),
    ),
    "attention_prefill": KernelDoc(
        dict(
            heads=int, kv_heads=int, head_dim=int, block_size=int, scale=float, q_stride=int, out_stride=int,
            block_q=int, block_kv=int, warps=int, window=int, span=int, partial=bool, gqa=bool, row_tables=bool,
        ),
        # partial adds (part_o, part_ml, max_splits): kernel_args()
        (
            ("out", P), ("q", P), ("k_cache", P), ("v_cache", P), ("block_tables", P), ("positions", P),
            ("seq_starts", P), ("max_blocks", I32),
        ),
        None,
        defaults={"window": 0, "span": 0, "partial": False, "gqa": False, "row_tables": False},
        unnamed=("scale", "warps"),
    ),
    "attention_combine": KernelDoc(
        dict(heads=int, head_dim=int, split=int, out_stride=int, window=int, fold=bool),
        (("out", P), ("part_o", P), ("part_ml", P), ("positions", P), ("max_splits", I32)),
        None,
        defaults={"window": 0, "fold": False},
    ),
    "argmax": KernelDoc(
        dict(vocab=int, ld=int, threads=int),
        (("out", P), ("logits", P), ("rows", I32)),
        None,
    ),
    "sample": KernelDoc(
        dict(vocab=int, ld=int, threads=int),
        (
            ("out", P), ("logits", P), ("temperature", P), ("top_k", P), ("top_p", P), ("min_p", P),
            ("seed", P), ("step", P), ("rows", I32),
        ),
        None,
    ),
    "token_mask": KernelDoc(
        dict(vocab=int, ld=int, threads=int),
        (
            ("logits", P), ("slot", P), ("bias_start", P), ("bias", P), ("words", P), ("lp_slot", P),
            ("raw", P), ("rows", I32),
        ),
        None,
    ),
    "logprobs": KernelDoc(
        dict(vocab=int, threads=int, top=int),
        (("raw", P), ("lp_slot", P), ("lp_k", P), ("ids", P), ("top_ids", P), ("vals", P), ("rows", I32)),
        None,
    ),
    "penalties": KernelDoc(
        dict(ld=int, threads=int),
        (
            ("logits", P), ("entries", P), ("presence", P), ("frequency", P), ("repetition", P),
            ("capacity", I32),
        ),
        None,
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
    {f"{x}{k}": v for x in PAIR_PARTS for k, v in (KERNELS["gemv"].defaults or {}).items()},
)
