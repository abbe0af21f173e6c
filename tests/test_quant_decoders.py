"""CPU transliterations of kernels/_quant.cuh.j2's decode_unit for the q5 family, q4_k and the row-planar
q4_0r / q4_1r (word loads, shifts and masks exactly as the CUDA code does them) checked against
engine.quant.dequantize, and of the coop GEMV's q8x q4_0r / q4_1r dot product checked against its numpy
twin, so a bit layout mistake shows up without a GPU. Keep them in step with the templates."""

from __future__ import annotations

import numpy as np
import pytest

from engine import quant, storage


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
    elems, nbytes = storage.BLOCK_SIZES[qt]
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


def _q4_planar(layout: str, k: int):
    """decode_unit of q4_0r / q4_1r as the template does it: the block's 16 qs bytes as 4 words from
    the qs plane, its d (q4_1r: the d | m << 16 word) from the plane after the k / 2 qs bytes."""

    def unit(row: np.ndarray, u: int):
        w = [_u32(row, 16 * u + 4 * i) for i in range(4)]
        if layout == "q4_1r":
            dm = _u32(row, k // 2 + 4 * u)
            d, m, bias = _h2f(dm & 0xFFFF), _h2f(dm >> 16), 0.0
        else:
            d, m, bias = _h2f(_u16(row, k // 2 + 2 * u)), 0.0, 8.0
        q = [0.0] * 32
        for i in range(4):
            for j in range(4):
                q[4 * i + j] = float((w[i] >> (8 * j)) & 0xF) - bias
                q[4 * i + j + 16] = float((w[i] >> (8 * j + 4)) & 0xF) - bias
        return q, d, m

    return unit


def _planar_row(layout: str, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """One random row of the file type, repacked to ``layout``: (device bytes, dequantised f32)."""
    file_type = storage.REPACKED_FROM[layout]
    _, nbytes = storage.BLOCK_SIZES[file_type]
    raw = rng.integers(0, 256, size=(k // 32, nbytes), dtype=np.uint8)
    for off in (0, 2) if file_type == "q4_1" else (0,):
        raw[:, off : off + 2] = rng.uniform(-1.0, 1.0, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return quant.repack(raw.reshape(-1), layout, 1, k), quant.dequantize(raw.reshape(-1), file_type, (k,))


@pytest.mark.parametrize("layout", ["q4_0r", "q4_1r"])
def test_q4_planar_decode_unit_transliteration_matches_engine_quant(layout):
    rng = np.random.default_rng(9)
    k = 576  # SmolLM2's hidden size: the padded 16-byte row pitch
    row, ref = _planar_row(layout, k, rng)
    unit = _q4_planar(layout, k)
    got = np.empty(k, dtype=np.float64)
    for u in range(k // 32):
        q, d, m = unit(row, u)
        got[32 * u : 32 * u + 32] = np.asarray(q) * d + m
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


def _dp4a(a: int, b: int, signed_a: bool) -> int:
    """__dp4a (signed_a) / dp4a.u32.s32: the sum of 4 byte products, b's bytes signed."""
    t = 0
    for i in range(4):
        x, y = (a >> (8 * i)) & 0xFF, (b >> (8 * i)) & 0xFF
        if signed_a and x > 127:
            x -= 256
        t += x * (y - 256 if y > 127 else y)
    return t


def _q8x_rows(x: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """The q8x staging of one x row: int8 per 32-group (q = rint(x * 127 / amax)) as little-endian
    words per 16 elements, and per 16 elements (dx, dx * sum q), all f32 as the kernel stores them."""
    g = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(g).max(axis=1)
    dx = (amax / np.float32(127.0)).astype(np.float32)
    idx = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(g * idx[:, None]).astype(np.int8).reshape(-1, 16)
    words = [q[h].view(np.uint8).view("<u4").astype(np.int64) for h in range(q.shape[0])]
    sums = q.astype(np.int64).sum(axis=1)
    dm = np.stack([np.repeat(dx, 2), np.repeat(dx, 2) * sums.astype(np.float32)], axis=1).astype(np.float32)
    return words, dm


@pytest.mark.parametrize("layout", ["q4_0r", "q4_1r"])
def test_q4_planar_q8x_dot_transliteration_matches_the_numpy_twin(layout):
    """The coop q8x segment of q4_0r / q4_1r (kernels/_gemv_coop.cuh.j2): low nibbles dp4a'd with the
    block's first 16 int8 x, the high nibbles masked (16 * q) with dp4a.u32.s32 against the next 16,
    acc += d * dx / 16 * (16 * il + ih) + m * (dx * sum q of both halves), m = -8 * d for q4_0r. It
    must equal x's q8x round trip (engine.quant.q8x_round_trip) dotted with the dequantised row."""
    rng = np.random.default_rng(13)
    k = 576
    row, deq = _planar_row(layout, k, rng)
    x = rng.standard_normal(k).astype(np.float32)
    x[64:96] = 0.0  # an all-zero group
    words, dm = _q8x_rows(x)
    acc = 0.0
    for s in range(k // 32):
        w = [_u32(row, 16 * s + 4 * i) for i in range(4)]
        if layout == "q4_1r":
            dmw = _u32(row, k // 2 + 4 * s)
            d, m = _h2f(dmw & 0xFFFF), _h2f(dmw >> 16)
        else:
            d = _h2f(_u16(row, k // 2 + 2 * s))
            m = -8.0 * d
        xl, xh = words[2 * s], words[2 * s + 1]
        il = sum(_dp4a(w[i] & 0x0F0F0F0F, int(xl[i]), True) for i in range(4))
        ih = sum(_dp4a(w[i] & 0xF0F0F0F0, int(xh[i]), False) for i in range(4))
        assert abs(16 * il + ih) < 1 << 22  # I2F's exact range
        sx = dm[2 * s, 1] + dm[2 * s + 1, 1]
        acc += d * dm[2 * s, 0] * 0.0625 * (16 * il + ih) + m * sx
    ref = float(quant.q8x_round_trip(x[None])[0].astype(np.float64) @ deq.astype(np.float64))
    # f32 rounding of dx and q * dx only: ~1e-7 of the sum of the terms' magnitudes
    assert abs(acc - ref) <= 1e-6 * float(np.abs(deq).astype(np.float64) @ np.abs(x).astype(np.float64))
