"""Reference (numpy, float32) implementations of every graph op: the oracle for the CUDA kernels.

One pure function per op of ``engine.ops.OPS`` plus the small pieces they are built from (RoPE
frequency tables, the paged-KV write and gather). Activations are 2-D ``[tokens, features]``
float32 arrays in token order; weights are row-major ``[out, in]`` float32 as the weight readers
return them. Nothing here keeps state: the KV cache arrays are passed in and written in place.

Must not import CUDA or any engine module other than ``engine.types`` (kernel tests import this
module on machines with and without a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engine.types import ConfigError

F32 = np.float32


def bf16_bits(x: Any) -> np.ndarray:
    """f32 values as bf16 raw bits (uint16), rounded to nearest even as the GPU's __float2bfloat16_rn
    rounds finite values: what a kernel storing ``x`` as bf16 writes."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def embed(ids: Sequence[int] | np.ndarray, table: np.ndarray) -> np.ndarray:
    """``out[t] = table[ids[t]]``: ``ids`` [T] ints, ``table`` [vocab, hidden] -> [T, hidden] f32."""
    idx = np.asarray(ids, dtype=np.int64)
    return np.asarray(table[idx], dtype=F32)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * w``; x [T, H], w [H] -> [T, H]."""
    x = np.asarray(x, dtype=F32)
    ms = np.mean(np.square(x), axis=-1, keepdims=True, dtype=F32)
    return (x * (1.0 / np.sqrt(ms + F32(eps)))).astype(F32) * np.asarray(w, dtype=F32)


def head_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, head_dim: int) -> np.ndarray:
    """RMSNorm of every ``head_dim`` slice (Qwen3 q/k norm): x [T, n*head_dim], w [head_dim]."""
    t, width = x.shape
    if width % head_dim:
        raise ValueError(f"head_rmsnorm: width {width} is not a multiple of head_dim {head_dim}")
    out = rmsnorm(x.reshape(t, width // head_dim, head_dim), w, eps)
    return out.reshape(t, width)


def linear(x: np.ndarray, w: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """``x @ w.T (+ residual)``: x [T, in], w [out, in], residual [T, out] -> [T, out] f32."""
    out = np.matmul(x, w.T)
    if residual is not None:
        out = out + residual
    return out.astype(F32, copy=False)


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """SwiGLU gate: ``silu(g) * u`` with ``silu(g) = g * sigmoid(g)``; same shapes in and out."""
    g = np.asarray(g, dtype=F32)
    sig = F32(0.5) * (F32(1.0) + np.tanh(F32(0.5) * g))  # overflow-free sigmoid
    return (g * sig * u).astype(F32, copy=False)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (PyTorch ``approximate="tanh"``, HF ``gelu_pytorch_tanh``):
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, float32."""
    x = np.asarray(x, dtype=F32)
    inner = F32(math.sqrt(2.0 / math.pi)) * (x + F32(0.044715) * x * x * x)
    return (F32(0.5) * x * (F32(1.0) + np.tanh(inner))).astype(F32, copy=False)


def gelu_tanh_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """GeGLU gate (Gemma): ``gelu_tanh(g) * u``; same shapes in and out."""
    return (gelu_tanh(g) * np.asarray(u, dtype=F32)).astype(F32, copy=False)


# ---------------------------------------------------------------------------------------------
# RoPE


def rope_inv_freq(
    rope_dim: int,
    theta: float,
    rope_scaling: Mapping[str, Any] | None = None,
    freq_factors: np.ndarray | None = None,
) -> np.ndarray:
    """Inverse frequencies ``theta ** (-2i / rope_dim)`` for ``i < rope_dim/2``, as float64.

    ``rope_scaling`` is a HF config ``rope_scaling`` mapping: ``rope_type``/``type`` ``default``,
    ``linear`` (``factor``) or ``llama3`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``), computed exactly as transformers does. ``freq_factors``
    is the GGUF ``rope_freqs`` tensor [rope_dim/2]: llama.cpp divides each frequency by it (this is
    how GGUF files carry Llama-3 scaling). Raises ConfigError for an unsupported scaling type.
    """
    if rope_dim % 2:
        raise ConfigError(f"rope_dim must be even, got {rope_dim}")
    inv = 1.0 / (float(theta) ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
    if rope_scaling:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if kind in ("default", "none"):  # "none": GGUF rope.scaling.type
            pass
        elif kind == "linear":
            inv = inv / float(rope_scaling["factor"])
        elif kind == "llama3":
            inv = _llama3_inv_freq(inv, rope_scaling)
        else:
            raise ConfigError(
                f"rope_scaling.rope_type {kind!r} is not supported (supported: default, linear, llama3)"
            )
    if freq_factors is not None:
        ff = np.asarray(freq_factors, dtype=np.float64).reshape(-1)
        if ff.shape[0] != inv.shape[0]:
            raise ConfigError(f"rope_freqs has {ff.shape[0]} entries, expected rope_dim/2 = {inv.shape[0]}")
        inv = inv / ff
    return inv


def _llama3_inv_freq(inv: np.ndarray, cfg: Mapping[str, Any]) -> np.ndarray:
    try:
        factor = float(cfg["factor"])
        low = float(cfg["low_freq_factor"])
        high = float(cfg["high_freq_factor"])
        old_len = float(cfg["original_max_position_embeddings"])
    except KeyError as exc:
        raise ConfigError(f"rope_scaling (llama3) is missing key {exc.args[0]!r}") from None
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def rope_tables(positions: Sequence[int] | np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``cos``/``sin`` of ``pos * inv_freq``: [P, rope_dim/2] float32 each (angles in float64)."""
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


def rope_apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, head_dim: int, style: str) -> np.ndarray:
    """Rotate the first ``rope_dim = 2 * cos.shape[1]`` dims of every head of x [T, n*head_dim].

    ``cos``/``sin`` are the per-token rows [T, rope_dim/2] (see ``rope_tables``). ``style``:
    ``neox`` pairs dim ``i`` with ``i + rope_dim/2`` (HF rotate_half); ``interleaved`` pairs
    ``2i`` with ``2i+1`` (GGUF llama, whose converter permuted the q/k rows). Dims past rope_dim
    pass through. Returns a new array.
    """
    t, width = x.shape
    half = cos.shape[1]
    xh = x.reshape(t, width // head_dim, head_dim)
    out = xh.copy()
    c = cos[:, None, :]
    s = sin[:, None, :]
    if style == "neox":
        a, b = xh[..., :half], xh[..., half : 2 * half]
        out[..., :half] = a * c - b * s
        out[..., half : 2 * half] = b * c + a * s
    elif style == "interleaved":
        a, b = xh[..., 0 : 2 * half : 2], xh[..., 1 : 2 * half : 2]
        out[..., 0 : 2 * half : 2] = a * c - b * s
        out[..., 1 : 2 * half : 2] = b * c + a * s
    else:
        raise ConfigError(f"unknown rope style {style!r} (expected neox or interleaved)")
    return out.reshape(t, width)


# ---------------------------------------------------------------------------------------------
# paged KV cache and attention


def slot_indices(
    block_table: Sequence[int], positions: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(block, offset) of each position: ``block_table[pos // block_size]``, ``pos % block_size``."""
    table = np.asarray(block_table, dtype=np.int64)
    pos = np.asarray(positions, dtype=np.int64)
    need = int(pos.max()) // block_size + 1 if pos.size else 0
    if need > table.shape[0]:
        raise ValueError(
            f"block_table has {table.shape[0]} blocks of {block_size}; position {int(pos.max())} needs {need}"
        )
    return table[pos // block_size], pos % block_size


def write_kv(
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    block_table: Sequence[int],
    start_pos: int,
) -> None:
    """Store k, v [T, kv_heads*hd] at positions ``start_pos..start_pos+T-1`` of the paged cache.

    ``k_cache``/``v_cache`` are one layer's [num_blocks, block_size, kv_heads, head_dim]; written
    in place.
    """
    _, block_size, kvh, hd = k_cache.shape
    t = k.shape[0]
    blocks, offs = slot_indices(block_table, np.arange(start_pos, start_pos + t), block_size)
    k_cache[blocks, offs] = k.reshape(t, kvh, hd)
    v_cache[blocks, offs] = v.reshape(t, kvh, hd)


def gather_kv(
    k_cache: np.ndarray, v_cache: np.ndarray, block_table: Sequence[int], length: int, first_block: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``first_block*block_size .. length-1`` of one sequence as contiguous
    [length - first_block*block_size, kv_heads, head_dim] arrays (entries before ``first_block``
    are not read)."""
    block_size = k_cache.shape[1]
    nb = -(-length // block_size)
    table = np.asarray(block_table[first_block:nb], dtype=np.int64)
    if table.shape[0] < nb - first_block:
        raise ValueError(f"block_table has {len(block_table)} blocks; length {length} needs {nb}")
    kvh, hd = k_cache.shape[2:]
    n = (nb - first_block) * block_size
    k = k_cache[table].reshape(n, kvh, hd)[: length - first_block * block_size]
    v = v_cache[table].reshape(n, kvh, hd)[: length - first_block * block_size]
    return k, v


ATTN_QUERY_CHUNK = 256  # queries per score block: bounds memory at [kv_heads, 256*group, L] floats


def window_start(pos: int, window: int | None) -> int:
    """The first key position a query at ``pos`` sees: ``pos - window + 1`` (clamped at 0) under a
    sliding window of ``window`` keys (the query's own included, as transformers' and llama.cpp's
    masks: key ``k`` is visible iff ``pos - window < k <= pos``); 0 without a window (None or 0)."""
    return max(0, pos - window + 1) if window else 0


def attention_dense(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start_pos: int,
    scale: float,
    window: int | None = None,
    key_start: int = 0,
) -> np.ndarray:
    """Causal GQA attention of T queries at positions ``start_pos..`` over the keys up to start_pos+T.

    q [T, heads, hd], k/v [L, kv_heads, hd] hold key positions ``key_start .. key_start+L-1``
    (L = start_pos + T - key_start; heads a multiple of kv_heads; query head ``h`` reads kv head
    ``h // (heads // kv_heads)``). Query ``t`` sees keys ``window_start(start_pos+t, window) ..
    start_pos+t`` (all earlier keys without a window); ``key_start`` must not exceed the first
    query's window start. Softmax in float32 with the row max subtracted; queries are processed
    ATTN_QUERY_CHUNK at a time. Returns [T, heads*hd].
    """
    t, heads, hd = q.shape
    kvh = k.shape[1]
    g = heads // kvh
    if key_start > window_start(start_pos, window):
        raise ValueError(f"key_start {key_start} is past the window of the query at {start_pos}")
    out = np.empty((t, heads * hd), dtype=F32)
    kt = k.transpose(1, 2, 0)  # [kvh, hd, L]
    vt = v.transpose(1, 0, 2)  # [kvh, L, hd]
    for c0 in range(0, t, ATTN_QUERY_CHUNK):
        c1 = min(t, c0 + ATTN_QUERY_CHUNK)
        # keys lo..hi-1 (absolute): later keys are masked for every query of the chunk, earlier
        # ones fall out of every query's window
        lo, hi = max(key_start, window_start(start_pos + c0, window)), start_pos + c1
        n, a, length = c1 - c0, lo - key_start, hi - key_start
        # [kvh, n*g, hd] @ [kvh, hd, L] -> [kvh, n*g, L]; row r = i*g + j is query head kv*g + j.
        qg = q[c0:c1].reshape(n, kvh, g, hd).transpose(1, 0, 2, 3).reshape(kvh, n * g, hd)
        scores = np.matmul(qg, kt[:, :, a:length]) * F32(scale)
        qpos = start_pos + c0 + np.repeat(np.arange(n), g)
        kpos = np.arange(lo, hi)[None, :]
        masked = kpos > qpos[:, None]
        if window:
            masked |= kpos <= qpos[:, None] - window
        scores[:, masked] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        o = np.matmul(scores, vt[:, a:length])  # [kvh, n*g, hd]
        out[c0:c1] = o.reshape(kvh, n, g, hd).transpose(1, 0, 2, 3).reshape(n, heads * hd)
    return out


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_table: Sequence[int],
    start_pos: int,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scale: float | None = None,
    window: int | None = None,
) -> np.ndarray:
    """The graph's ``attention`` op over one layer's paged cache (one sequence).

    q [T, heads*hd], k/v [T, kv_heads*hd] are the new tokens at positions ``start_pos..``; they are
    written into ``k_cache``/``v_cache`` [num_blocks, block_size, kv_heads, hd] through
    ``block_table`` first, then each query attends causally over positions ``<= its own`` and,
    with a sliding ``window``, ``> its own - window``. Only the blocks holding keys a query can see
    are read, so a block wholly before the first query's window may already be released (its
    ``block_table`` entry is then never dereferenced). ``scale`` defaults to ``1/sqrt(head_dim)``.
    Returns [T, heads*hd] f32.
    """
    write_kv(k_cache, v_cache, k, v, block_table, start_pos)
    t = q.shape[0]
    s = 1.0 / math.sqrt(head_dim) if scale is None else scale
    bs = k_cache.shape[1]
    first_block = window_start(start_pos, window) // bs
    kk, vv = gather_kv(k_cache, v_cache, block_table, start_pos + t, first_block=first_block)
    return attention_dense(q.reshape(t, heads, head_dim), kk, vv, start_pos, s, window, first_block * bs)
