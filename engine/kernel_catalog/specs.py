"""(template, params) -> KernelSpec (``spec``: validated, normalised, named) and the launch contract
(``choice``, ``kernel_args``). Part of engine.kernel_catalog. Must not import CUDA, numpy or gguf.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from engine.kernel_catalog.checks import _check
from engine.kernel_catalog.contracts import (
    _DEFAULT_NAME,
    I32,
    KERNELS,
    PAIR_PARTS,
    PENALTY_BLOCKS,
    STAGED_DEFAULT,
    P,
)
from engine.kernel_catalog.layout import (
    ATTENTION_ROPE_ARGS,
    _cdiv,
    _fail,
    _unprefixed,
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
from engine.kernel_spec import KernelSpec, entry_name
from engine.types import ConfigError


def pair_with_min_blocks(parts: Iterable[KernelSpec], min_blocks: int) -> KernelSpec:
    """pair_spec of gemv specs ``parts`` with both parts' __launch_bounds__ minimum of blocks per
    SM set to ``min_blocks`` (0: each keeps its own)."""
    if min_blocks:
        parts = [spec("gemv", **{**p.params, "min_blocks": min_blocks}) for p in parts]
    return pair_spec(*parts)


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
            (template == "gemv" and key in ("x_stride", "u_off", "glu", "grid_cap", "min_blocks"))
            or (template == "attention" and key in ("rope_dim", "kv_stride") and not params.get("rope"))
            or key == "v_stride"  # rope / attention: 0 means v shares k's row stride
            or key == "window"  # attention kernels: 0 means no sliding window
            or (template == "attention_prefill" and key == "span")  # 0: no key split
            or (template == "attention" and key == "vfresh")  # 0: not a verify pass's fused rope
        )
        if typ is int and norm[key] <= 0 and not zero_ok:
            raise _fail(template, f"param {key}={value!r} must be positive")
    _check(template, {k: (float(v) if doc.params[k] is float else v) for k, v in norm.items()})
    parts = {k: (int(v) if isinstance(v, bool) else v) for k, v in norm.items() if k in doc.name}
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


# template -> grid(params, rows, **runtime); every other template: a block per row
_GRID: dict[str, Callable[..., tuple[int, int, int]]] = {
    "gemv": lambda p, rows, **_: (gemv_grid_x(p), _cdiv(rows, p["bmax"]), 1),
    "gemv_pair": lambda p, rows, **_: (p["blocks_a"] + p["blocks_b"], _cdiv(rows, p["a_bmax"]), 1),
    "gemm": lambda p, rows, **_: (_cdiv(p["n"], p["tile_n"]), _cdiv(rows, p["tile_m"]), 1),
    "gemm_wgmma": lambda p, rows, **_: (_cdiv(p["n"], p["tile_n"]), _cdiv(rows, gemm_wgmma_tile_m(p)), 1),
    "rope": lambda p, rows, **_: (rows, rope_head_blocks(p), 1),
    "silu_mul": lambda p, rows, **_: (_cdiv(p["inter"], 8 * p["threads"]), rows, 1),
    "add": lambda p, rows, **_: (_cdiv(p["n"], 8 * p["threads"]), rows, 1),
    "penalties": lambda p, rows, **_: (PENALTY_BLOCKS, 1, 1),
    "attention": lambda p, rows, max_splits=1, **_: (
        rows, p["kv_heads"], p["qsplit"] if p["direct"] else max_splits
    ),
    "attention_prefill": lambda p, rows, max_q=1, nseq=1, max_splits=1, **_: (
        _cdiv(max_q, 16 if p["gqa"] else p["block_q"]),
        p["kv_heads"] if p["gqa"] else p["heads"],
        nseq * (max_splits if p["partial"] else 1),
    ),
    "attention_combine": lambda p, rows, **_: (rows, p["heads"], 1),
}
# template -> threads per block; every other template: its ``threads`` param
_BLOCK: dict[str, Callable[[dict[str, Any]], int]] = {
    "gemv_pair": lambda p: p["a_threads"],
    "gemm": lambda p: p["warps"] * 32,
    "gemm_wgmma": lambda p: (p["consumers"] + 1) * 128,
    "attention": lambda p: p["warps"] * 32,
    "attention_prefill": lambda p: p["warps"] * 32,
    "attention_combine": lambda p: p["head_dim"],
}
# template -> dynamic shared memory bytes; every other template: none
_SMEM: dict[str, Callable[[KernelSpec], int]] = {
    "gemv": lambda s: gemv_smem(s.params),
    "gemv_pair": pair_smem,
    "gemm": lambda s: gemm_smem(s.params),
    "gemm_wgmma": lambda s: gemm_wgmma_smem(s.params),
    "attention_prefill": lambda s: attention_prefill_smem(s.params),
}


def _row_grid(p: dict[str, Any], rows: int, **_: int) -> tuple[int, int, int]:
    return (rows, 1, 1)


def choice(template: str, **params: Any) -> KernelChoice:
    """``spec`` plus the launch contract. ``grid(rows, **runtime)``: runtime is ``max_splits`` for
    split attention, ``max_q`` and ``nseq`` for the flash prefill."""
    s = spec(template, **params)
    p = s.params
    grid = functools.partial(_GRID.get(template, _row_grid), p)
    block = (_BLOCK[template](p) if template in _BLOCK else p["threads"], 1, 1)
    smem = _SMEM[template](s) if template in _SMEM else 0
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
    if s.template == "attention_prefill" and s.params["partial"]:
        args = args + (("part_o", P), ("part_ml", P), ("max_splits", I32))
    if s.template == "attention" and s.params.get("rope"):
        args = args + tuple((a, P) for a in ATTENTION_ROPE_ARGS)
    if s.template in ("gemv", "attention") and s.params.get("l2_pf"):
        args = args + tuple((f"pf{i}", P) for i in range(1 + max(r[0] for r in l2_pf_ranges(s.params["l2_pf"]))))
    return args
