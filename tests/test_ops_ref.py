"""engine.ops_ref against straightforward independent formulations on tiny shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from fixtures.engine_probes import permute_for_interleaved, rope

from engine import ops_ref
from engine.types import ConfigError

RNG = np.random.default_rng(1234)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def test_embed_gathers_rows():
    table = rand(10, 4)
    out = ops_ref.embed([3, 0, 3, 9], table)
    assert out.dtype == np.float32 and out.shape == (4, 4)
    np.testing.assert_array_equal(out, table[[3, 0, 3, 9]])


def test_rmsnorm_matches_loop():
    x, w = rand(3, 8), rand(8)
    out = ops_ref.rmsnorm(x, w, 1e-5)
    for t in range(3):
        rms = math.sqrt(sum(float(v) ** 2 for v in x[t]) / 8 + 1e-5)
        np.testing.assert_allclose(out[t], [x[t, i] / rms * w[i] for i in range(8)], rtol=1e-5)


def test_head_rmsnorm_normalises_each_head_slice():
    x, w = rand(2, 12), rand(4)
    out = ops_ref.head_rmsnorm(x, w, 1e-6, head_dim=4)
    for h in range(3):
        sl = slice(4 * h, 4 * h + 4)
        np.testing.assert_allclose(out[:, sl], ops_ref.rmsnorm(x[:, sl], w, 1e-6), rtol=1e-6)
    with pytest.raises(ValueError):
        ops_ref.head_rmsnorm(rand(2, 10), w, 1e-6, head_dim=4)


def test_linear_and_residual():
    x, w, r = rand(3, 5), rand(7, 5), rand(3, 7)
    want = np.array([[sum(x[t, i] * w[o, i] for i in range(5)) for o in range(7)] for t in range(3)])
    np.testing.assert_allclose(ops_ref.linear(x, w), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ops_ref.linear(x, w, r), want + r, rtol=1e-5, atol=1e-5)


def test_silu_mul_and_extremes():
    g, u = rand(4, 6), rand(4, 6)
    want = g / (1 + np.exp(-g.astype(np.float64))) * u
    np.testing.assert_allclose(ops_ref.silu_mul(g, u), want, rtol=1e-5, atol=1e-6)
    big = np.array([[-1000.0, 1000.0]], np.float32)
    with np.errstate(all="raise"):
        out = ops_ref.silu_mul(big, np.ones_like(big))
    np.testing.assert_allclose(out, [[0.0, 1000.0]])


def _rope_loop(x, positions, head_dim, rope_dim, theta, style):
    out = x.astype(np.float64).copy()
    half = rope_dim // 2
    for t, p in enumerate(positions):
        for h in range(x.shape[1] // head_dim):
            base = h * head_dim
            for i in range(half):
                ang = p * theta ** (-2 * i / rope_dim)
                a, b = (base + i, base + i + half) if style == "neox" else (base + 2 * i, base + 2 * i + 1)
                xa, xb = x[t, a], x[t, b]
                out[t, a] = xa * math.cos(ang) - xb * math.sin(ang)
                out[t, b] = xb * math.cos(ang) + xa * math.sin(ang)
    return out


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("rope_dim", [8, 4])  # 4: partial rotary, dims past rope_dim pass through
def test_rope_matches_loop(style, rope_dim):
    q, k = rand(3, 16), rand(3, 8)
    pos = [0, 5, 17]
    rq, rk = rope(q, k, pos, head_dim=8, rope_dim=rope_dim, theta=10000.0, style=style)
    np.testing.assert_allclose(rq, _rope_loop(q, pos, 8, rope_dim, 10000.0, style), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rk, _rope_loop(k, pos, 8, rope_dim, 10000.0, style), rtol=1e-5, atol=1e-5)


def test_rope_neox_equals_interleaved_under_llama_permutation():
    heads, hd = 2, 8
    x, w = rand(4, 6), rand(heads * hd, 6)
    wp = permute_for_interleaved(w, heads)
    pos = [0, 1, 9, 30]
    inv = ops_ref.rope_inv_freq(hd, 500000.0)
    cos, sin = ops_ref.rope_tables(pos, inv)
    neox = ops_ref.rope_apply(x @ w.T, cos, sin, head_dim=hd, style="neox")
    inter = ops_ref.rope_apply(x @ wp.T, cos, sin, head_dim=hd, style="interleaved")
    # rows of the permuted projection are the HF rows in permuted order
    perm = permute_for_interleaved(np.arange(heads * hd, dtype=np.float32)[:, None], heads)
    np.testing.assert_allclose(inter, neox[:, perm[:, 0].astype(int)], rtol=1e-5, atol=1e-5)


def test_rope_scaling_llama3_matches_hf_formula():
    cfg = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    dim, theta = 128, 500000.0
    inv = ops_ref.rope_inv_freq(dim, theta, cfg)
    base = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    # independent per-frequency restatement of Meta's apply_scaling
    want = []
    for f in base:
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            want.append(f)
        elif wavelen > 8192 / 1.0:
            want.append(f / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want.append((1 - smooth) * f / 8.0 + smooth * f)
    np.testing.assert_allclose(inv, want, rtol=1e-12)
    assert inv[0] == base[0] and inv[-1] == pytest.approx(base[-1] / 8.0)


def test_rope_scaling_linear_freq_factors_and_errors():
    base = ops_ref.rope_inv_freq(8, 10000.0)
    np.testing.assert_allclose(ops_ref.rope_inv_freq(8, 10000.0, {"type": "linear", "factor": 2.0}), base / 2)
    ff = np.array([1.0, 2.0, 4.0, 8.0], np.float32)
    np.testing.assert_allclose(ops_ref.rope_inv_freq(8, 10000.0, None, ff), base / ff)
    with pytest.raises(ConfigError, match="yarn"):
        ops_ref.rope_inv_freq(8, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="rope_freqs"):
        ops_ref.rope_inv_freq(8, 10000.0, None, np.ones(3, np.float32))
    with pytest.raises(ConfigError, match="low_freq_factor"):
        ops_ref.rope_inv_freq(8, 10000.0, {"rope_type": "llama3", "factor": 8.0})


def _attention_loop(q, k, v, start_pos, heads, kv_heads, hd):
    """Explicit per-query, per-head softmax over keys 0..own position."""
    t = q.shape[0]
    out = np.zeros((t, heads * hd))
    g = heads // kv_heads
    for i in range(t):
        p = start_pos + i
        for h in range(heads):
            kvh = h // g
            qv = q[i, h * hd : (h + 1) * hd].astype(np.float64)
            s = [float(qv @ k[j, kvh * hd : (kvh + 1) * hd]) / math.sqrt(hd) for j in range(p + 1)]
            m = max(s)
            e = [math.exp(x - m) for x in s]
            z = sum(e)
            out[i, h * hd : (h + 1) * hd] = sum(
                e[j] / z * v[j, kvh * hd : (kvh + 1) * hd] for j in range(p + 1)
            )
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3), (4, 1)])
def test_paged_attention_matches_loop(heads, kv_heads):
    hd, bs, total = 4, 4, 11
    k_all, v_all = rand(total, kv_heads * hd), rand(total, kv_heads * hd)
    q = rand(5, heads * hd)
    start = total - 5
    kc = np.zeros((8, bs, kv_heads, hd), np.float32)
    vc = np.zeros_like(kc)
    table = [6, 1, 3]  # scattered blocks
    ops_ref.write_kv(kc, vc, k_all[:start], v_all[:start], table, 0)
    out = ops_ref.attention(
        q, k_all[start:], v_all[start:], kc, vc, table, start, heads=heads, kv_heads=kv_heads, head_dim=hd
    )
    want = _attention_loop(q, k_all, v_all, start, heads, kv_heads, hd)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    # the cache now holds every position at its (block, offset)
    for p in range(total):
        np.testing.assert_array_equal(kc[table[p // bs], p % bs].reshape(-1), k_all[p])


def test_write_kv_rejects_short_block_table():
    kc = np.zeros((4, 2, 1, 2), np.float32)
    with pytest.raises(ValueError, match="block_table"):
        ops_ref.write_kv(kc, kc.copy(), rand(5, 2), rand(5, 2), [0, 1], 0)


def test_attention_query_chunking_is_exact_across_chunk_edges(monkeypatch):
    heads, kv_heads, hd, t, start = 4, 2, 4, 9, 3
    q = rand(t, heads, hd)
    k, v = rand(start + t, kv_heads, hd), rand(start + t, kv_heads, hd)
    want = _attention_loop(
        q.reshape(t, -1), k.reshape(start + t, -1), v.reshape(start + t, -1), start, heads, kv_heads, hd
    )
    for chunk in (1, 2, 4, 256):
        monkeypatch.setattr(ops_ref, "ATTN_QUERY_CHUNK", chunk)
        got = ops_ref.attention_dense(q, k, v, start, 1 / math.sqrt(hd))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"chunk {chunk}")
