"""engine.storage and engine.quant: block sizes and row pitches, the device layouts (repack / unpack,
dequantised as gguf does their file type), the gguf-backed dequantise / quantise wrappers."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.quant_blocks import F16_FIELDS, random_blocks
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from engine import quant, storage
from engine.types import MemraError

QUANTS = list(F16_FIELDS)


def test_storage_facts() -> None:
    from gguf.constants import GGML_QUANT_SIZES

    assert set(storage.BLOCK_SIZES) == set(storage.FILE_TYPES) | set(storage.REPACKED_FROM)
    for name in storage.FILE_TYPES:
        assert storage.BLOCK_SIZES[name] == GGML_QUANT_SIZES[T[name.upper()]]
    for layout, file_type in storage.REPACKED_FROM.items():  # a device layout keeps its file type's blocks
        assert storage.BLOCK_SIZES[layout] == storage.BLOCK_SIZES[file_type]
        elems, nbytes = storage.BLOCK_SIZES[file_type]
        assert sum(e - a for a, e in storage.PLANES[layout]) == nbytes  # the planes cover the block
    assert storage.row_bytes("q4_1", 576) == 360 and storage.row_bytes("q4_1r", 576) == 368  # padded to 16
    assert storage.row_bytes("q8_0r", 512) == storage.row_bytes("q8_0", 512) == 544
    assert storage.nbytes_for("q6_k", (3, 512)) == 3 * 2 * 210 and storage.nbytes_for("bf16", ()) == 2
    with pytest.raises(MemraError, match="not a multiple of its block size 256"):
        storage.row_bytes("q4_k", 100)


def test_q8_0r_repack_round_trips_and_dequantizes_like_q8_0() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    raw = np.frombuffer(quant.quantize_reference(x, "q8_0"), np.uint8)
    packed = quant.repack(raw, "q8_0r", 6, 512)
    assert packed.size == raw.size and not np.array_equal(packed, raw)
    # row-planar: the row's 16 f16 scales first, then its 512 int8
    assert np.array_equal(packed.reshape(6, -1)[:, :2], raw.reshape(6, 16, 34)[:, 0, :2])
    assert np.array_equal(packed.reshape(6, -1)[:, 32:64], raw.reshape(6, 16, 34)[:, 0, 2:])
    assert np.array_equal(quant.unpack(packed, "q8_0r", 6, 512), raw)
    np.testing.assert_array_equal(quant.dequantize(packed, "q8_0r", (6, 512)), quant.dequantize(raw, "q8_0", (6, 512)))
    with pytest.raises(MemraError, match="q8_0 matrix"):
        quant.repack(raw[:-1], "q8_0r", 6, 512)


@pytest.mark.parametrize("cols", [640, 96, 32])
def test_q8_0r_short_rows_pad_the_d_plane_to_16_bytes(cols: int) -> None:
    """q8_0r rows of any k % 32 == 0 (Gemma 3 270M's 640): the k/32 f16 scales, zero-padded to 16
    bytes, then the k int8 qs, so both planes and every row are 16-byte aligned (640: 40 + 8 + 640
    = 688 bytes, not q8_0's 680); repack / unpack round-trip and the layout dequantises as q8_0."""
    rng = np.random.default_rng(cols)
    rows, nb = 5, cols // 32
    raw = np.frombuffer(quant.quantize_reference(rng.standard_normal((rows, cols)).astype(np.float32), "q8_0"), np.uint8)
    off = storage.q8_0r_qs_offset(cols)
    assert off % 16 == 0 and 2 * nb <= off < 2 * nb + 16
    assert storage.row_bytes("q8_0r", cols) == off + cols and storage.row_bytes("q8_0r", cols) % 16 == 0
    assert storage.row_bytes("q8_0r", 640) == 688
    packed = quant.repack(raw, "q8_0r", rows, cols)
    assert packed.size == rows * (off + cols)
    p, blocks = packed.reshape(rows, -1), raw.reshape(rows, nb, 34)
    assert np.array_equal(p[:, : 2 * nb], blocks[:, :, :2].reshape(rows, -1))  # the d plane
    assert not p[:, 2 * nb : off].any()  # its zero padding
    assert np.array_equal(p[:, off:], blocks[:, :, 2:].reshape(rows, -1))  # the qs plane
    assert np.array_equal(quant.unpack(packed, "q8_0r", rows, cols), raw)
    np.testing.assert_array_equal(
        quant.dequantize(packed, "q8_0r", (rows, cols)), quant.dequantize(raw, "q8_0", (rows, cols))
    )
    with pytest.raises(MemraError, match="needs"):
        quant.dequantize(packed[:-16], "q8_0r", (rows, cols))


@pytest.mark.parametrize("layout", ["q4_0r", "q4_1r"])
@pytest.mark.parametrize("cols", [576, 512])
def test_q4_planar_repack_round_trips_and_dequantizes_like_gguf(layout: str, cols: int) -> None:
    """q4_0r / q4_1r rows: the qs plane (16 bytes per block, 16-byte aligned for any k), then the
    d (d, m) plane, zero-padded to 16 bytes (k = 576, SmolLM2's hidden size: 368 bytes, not 360);
    repack / unpack round-trip the file bytes, and the device layout dequantises as gguf does the
    file's."""
    file_type = storage.REPACKED_FROM[layout]
    rows, (elems, nbytes) = 5, storage.BLOCK_SIZES[file_type]
    nb = cols // elems
    raw = random_blocks(file_type, rows * nb, seed=cols + len(layout))
    packed = quant.repack(raw, layout, rows, cols)
    pitch = storage.row_bytes(layout, cols)
    assert pitch % 16 == 0 and pitch - nb * nbytes < 16 and packed.size == rows * pitch
    blocks, prow = raw.reshape(rows, nb, nbytes), packed.reshape(rows, pitch)
    scale = nbytes - 16  # the f16 d (q4_1: d, m) in front of each block's 16 qs bytes
    assert np.array_equal(prow[:, : 16 * nb], blocks[:, :, scale:].reshape(rows, -1))
    assert np.array_equal(prow[:, 16 * nb : nbytes * nb], blocks[:, :, :scale].reshape(rows, -1))
    assert not prow[:, nbytes * nb :].any()
    assert np.array_equal(quant.unpack(packed, layout, rows, cols), raw.reshape(-1))
    ref = gguf_dequantize(raw.reshape(rows, -1), T[file_type.upper()])
    got = quant.dequantize(packed, layout, (rows, cols))
    np.testing.assert_array_max_ulp(got, ref.astype(np.float32), maxulp=1)
    with pytest.raises(MemraError, match=f"{file_type} matrix"):
        quant.repack(raw[:-1], layout, rows, cols)


@pytest.mark.parametrize("dtype", QUANTS)
def test_dequantize_shapes_random_blocks(dtype: str) -> None:
    elems, _ = storage.BLOCK_SIZES[dtype]
    raw = random_blocks(dtype, 4 * 6, seed=hash(dtype) % 1000)
    got = quant.dequantize(raw, dtype, (4, 6 * elems))
    assert got.dtype == np.float32 and got.shape == (4, 6 * elems)
    assert np.isfinite(got).all() and np.abs(got).max() > 0


def test_f32_dequantize_returns_its_own_array() -> None:
    x = np.arange(8, dtype=np.float32)
    raw = np.frombuffer(quant.quantize_reference(x, "f32"), np.uint8).copy()
    got = quant.dequantize(raw, "f32", (2, 4))
    got[0, 0] = 99.0
    assert raw.view(np.float32)[0] == 0.0


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "bf16", "f16"])
def test_quantize_reference_round_trips(dtype: str) -> None:
    x = np.random.default_rng(1).normal(size=(4, 128)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    ours = np.frombuffer(quant.quantize_reference(x, dtype), np.uint8)
    assert ours.size == storage.nbytes_for(dtype, x.shape)
    back = quant.dequantize(ours, dtype, x.shape)
    assert not back[0, :32].any()
    tol = {"q8_0": 0.02, "q5_0": 0.15, "q5_1": 0.15, "bf16": 0.01, "f16": 0.002}.get(dtype, 0.35)
    assert np.abs(back - x).max() < tol


def test_errors() -> None:
    with pytest.raises(MemraError, match="needs 34 bytes"):
        quant.dequantize(np.zeros(33, np.uint8), "q8_0", (32,))
    with pytest.raises(MemraError, match="multiple of its block size 32"):
        quant.dequantize(np.zeros(34, np.uint8), "q8_0", (1, 31))
    with pytest.raises(MemraError, match="unsupported tensor dtype 'iq2_xs'"):
        quant.dequantize(np.zeros(4, np.uint8), "iq2_xs", (1,))
    with pytest.raises(MemraError, match="does not support 'q4_k'"):
        quant.quantize_reference(np.zeros((1, 256), np.float32), "q4_k")


def test_q8x_round_trip_is_the_int8_group_quantisation_the_dp4a_gemv_uses():
    from engine.quant import q8x_round_trip

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 256)) * np.array([[1.0], [40.0], [1e-3]])).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero group stays zero (no division by a zero amax)
    y = q8x_round_trip(x)
    g, yg = x.reshape(3, -1, 32), y.reshape(3, -1, 32)
    amax = np.abs(g).max(axis=-1, keepdims=True)
    d = amax / np.float32(127.0)
    assert np.all(yg[1, 1] == 0.0)
    q = np.where(d > 0, yg / np.where(d > 0, d, 1.0), 0.0)
    assert np.allclose(q, np.rint(q), atol=1e-3) and np.abs(q).max() <= 127.0 + 1e-3  # int8 levels
    assert np.all(np.abs(yg - g) <= d / 2 * (1 + 1e-5) + 1e-12)  # round to nearest
    assert np.allclose(np.abs(yg).max(axis=-1), amax[..., 0], rtol=1e-6)  # amax maps to +-127
    assert not np.array_equal(y, x)
    with pytest.raises(MemraError, match="multiple of 32"):
        q8x_round_trip(np.ones((1, 48), np.float32))
