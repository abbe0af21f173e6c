"""CPU transliterations of kernels/_quant.cuh.j2's decode_unit for the q5 family and q4_k (word loads, shifts
and masks exactly as the CUDA code does them) checked against engine.quant.dequantize, so a bit
layout mistake shows up without a GPU. Keep them in step with the template."""

from __future__ import annotations

import numpy as np
import pytest

from engine import quant


def _u16(b: np.ndarray, off: int) -> int:
    return int(b[off]) | int(b[off + 1]) << 8


def _u32(b: np.ndarray, off: int) -> int:
    return _u16(b, off) | _u16(b, off + 2) << 16


def _h2f(h: int) -> float:
    return float(np.array([h], dtype=np.uint16).view(np.float16)[0])


def _q5_0(row: np.ndarray, u: int):
    b = 22 * u  # as the kernel: uint16 words from the block start
    d = _h2f(_u16(row, b))
    qh = _u16(row, b + 2) | _u16(row, b + 4) << 16
    q = [0.0] * 32
    for i in range(8):
        v = _u16(row, b + 6 + 2 * i)
        q[2 * i] = ((v & 0xF) | ((qh >> (2 * i)) & 1) << 4) - 16.0
        q[2 * i + 1] = (((v >> 8) & 0xF) | ((qh >> (2 * i + 1)) & 1) << 4) - 16.0
        q[2 * i + 16] = (((v >> 4) & 0xF) | ((qh >> (2 * i + 16)) & 1) << 4) - 16.0
        q[2 * i + 17] = (((v >> 12) & 0xF) | ((qh >> (2 * i + 17)) & 1) << 4) - 16.0
    return q, d, 0.0


def _q5_1(row: np.ndarray, u: int):
    b = 24 * u
    dm = _u32(row, b)
    d, m = _h2f(dm & 0xFFFF), _h2f(dm >> 16)
    qh = _u32(row, b + 4)
    q = [0.0] * 32
    for i in range(4):
        v = _u32(row, b + 8 + 4 * i)
        for j in range(4):
            e = 4 * i + j
            q[e] = float(((v >> (8 * j)) & 0xF) | ((qh >> e) & 1) << 4)
            q[e + 16] = float(((v >> (8 * j + 4)) & 0xF) | ((qh >> (e + 16)) & 1) << 4)
    return q, d, m


def _scale_min_k4(y: int, z: int, w: int, s: int) -> tuple[int, int]:
    """get_scale_min_k4 as the template's shift version: bytes 0-3, 4-7, 8-11 in words y, z, w."""
    t = 8 * (s & 3)
    lo, mid, hi = (y >> t) & 0xFF, (z >> t) & 0xFF, (w >> t) & 0xFF
    if s < 4:
        return lo & 63, mid & 63
    return (hi & 0xF) | ((lo >> 6) << 4), (hi >> 4) | ((mid >> 6) << 4)


def _q4_k(row: np.ndarray, u: int):
    sb, s = u >> 3, u & 7
    b = 144 * sb
    dm = _u32(row, b)
    scale, mn = _scale_min_k4(_u32(row, b + 4), _u32(row, b + 8), _u32(row, b + 12), s)
    d = _h2f(dm & 0xFFFF) * scale
    m = -_h2f(dm >> 16) * mn
    w = [_u32(row, b + 16 + 32 * (s >> 1) + 4 * i) for i in range(8)]
    sh = (s & 1) * 4
    q = [0.0] * 32
    for i in range(8):
        for j in range(4):
            q[4 * i + j] = float((w[i] >> (8 * j + sh)) & 0xF)
    return q, d, m


def _q5_k(row: np.ndarray, u: int):
    sb, s = u >> 3, u & 7
    b = 176 * sb
    dm = _u32(row, b)
    scale, mn = _scale_min_k4(_u32(row, b + 4), _u32(row, b + 8), _u32(row, b + 12), s)
    d = _h2f(dm & 0xFFFF) * scale
    m = -_h2f(dm >> 16) * mn
    hw = [_u32(row, b + 16 + 4 * i) for i in range(8)]
    w = [_u32(row, b + 48 + 32 * (s >> 1) + 4 * i) for i in range(8)]
    sh = (s & 1) * 4
    q = [0.0] * 32
    for i in range(8):
        for j in range(4):
            q[4 * i + j] = float(((w[i] >> (8 * j + sh)) & 0xF) | ((hw[i] >> (8 * j + s)) & 1) << 4)
    return q, d, m


@pytest.mark.parametrize("qt,fn", [("q5_0", _q5_0), ("q5_1", _q5_1), ("q4_k", _q4_k), ("q5_k", _q5_k)])
def test_decode_unit_transliteration_matches_engine_quant(qt, fn):
    rng = np.random.default_rng(7)
    elems, nbytes = quant.BLOCK_SIZES[qt]
    k = 512
    raw = rng.integers(0, 256, size=(k // elems, nbytes), dtype=np.uint8)
    f16_fields = {"q5_0": [0], "q5_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2]}[qt]
    for off in f16_fields:  # finite scales (random bytes could be inf/NaN)
        raw[:, off : off + 2] = rng.uniform(0.1, 1.0, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    row = raw.reshape(-1)
    ref = quant.dequantize(row, qt, (k,))
    got = np.empty(k, dtype=np.float64)
    for u in range(k // 32):
        q, d, m = fn(row, u)
        got[32 * u : 32 * u + 32] = np.asarray(q) * d + m
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
