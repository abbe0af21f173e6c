"""engine.quant against gguf.quants (random blocks of every type and real SmolLM2 blocks)."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.quant_blocks import F16_FIELDS, random_blocks
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine import quant
from engine.types import MemraError

QUANTS = list(F16_FIELDS)


def test_block_sizes_match_gguf() -> None:
    from gguf.constants import GGML_QUANT_SIZES

    for name, size in quant.BLOCK_SIZES.items():
        file_type = quant.REPACKED_FROM.get(name, name)  # device layouts keep their file type's sizes
        assert GGML_QUANT_SIZES[T[file_type.upper()]] == size


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


@pytest.mark.parametrize("layout", ["q4_0r", "q4_1r"])
@pytest.mark.parametrize("cols", [576, 512])
def test_q4_planar_repack_round_trips_and_dequantizes_like_gguf(layout: str, cols: int) -> None:
    """q4_0r / q4_1r rows: the qs plane (16 bytes per block, 16-byte aligned for any k), then the
    d (d, m) plane, zero-padded to 16 bytes (k = 576, SmolLM2's hidden size: 368 bytes, not 360);
    repack / unpack round-trip the file bytes, and the device layout dequantises as gguf does the
    file's."""
    file_type = quant.REPACKED_FROM[layout]
    rows, (elems, nbytes) = 5, quant.BLOCK_SIZES[file_type]
    nb = cols // elems
    raw = random_blocks(file_type, rows * nb, seed=cols + len(layout))
    packed = quant.repack(raw, layout, rows, cols)
    pitch = quant.row_bytes(layout, cols)
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
def test_dequantize_matches_gguf_on_random_blocks(dtype: str) -> None:
    elems, _ = quant.BLOCK_SIZES[dtype]
    raw = random_blocks(dtype, 4 * 6, seed=hash(dtype) % 1000)
    ref = gguf_dequantize(raw.reshape(4, -1), T[dtype.upper()])
    got = quant.dequantize(raw, dtype, (4, 6 * elems))
    assert got.dtype == np.float32 and got.shape == (4, 6 * elems)
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    np.testing.assert_array_max_ulp(got, ref.astype(np.float32), maxulp=1)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_plain_types(dtype: str) -> None:
    x = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    raw = np.frombuffer(quant.quantize_reference(x, dtype), np.uint8)
    ref = gguf_dequantize(gguf_quantize(x, T[dtype.upper()]).reshape(3, -1).view(np.uint8), T[dtype.upper()])
    np.testing.assert_array_equal(quant.dequantize(raw, dtype, x.shape), ref)


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "bf16", "f16"])
def test_quantize_reference_is_byte_identical_to_gguf(dtype: str) -> None:
    x = np.random.default_rng(1).normal(size=(4, 128)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    ours = np.frombuffer(quant.quantize_reference(x, dtype), np.uint8)
    theirs = gguf_quantize(x, T[dtype.upper()]).reshape(-1).view(np.uint8)
    np.testing.assert_array_equal(ours, theirs)
    back = quant.dequantize(ours, dtype, x.shape)
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


@pytest.mark.parametrize(
    "name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight", "output_norm.weight"]
)
def test_real_smollm2_blocks(smollm2_source, name: str) -> None:
    src = smollm2_source
    info = src.info(name)
    rows = min(info.shape[0], 64) if len(info.shape) == 2 else None
    raw = src.raw(name)
    if rows is not None:
        raw = raw[: rows * info.nbytes // info.shape[0]]
        shape = (rows, info.shape[1])
    else:
        shape = info.shape
    ref = gguf_dequantize(
        np.asarray(raw).reshape(shape[0], -1) if rows else np.asarray(raw).view(np.float32),
        T[info.dtype.upper()],
    )
    got = quant.dequantize(raw, info.dtype, shape)
    np.testing.assert_array_max_ulp(got, np.asarray(ref, np.float32).reshape(shape), maxulp=1)


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
