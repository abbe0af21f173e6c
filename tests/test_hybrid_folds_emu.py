"""The decode folds of issue #36 on the CPU, through the g++ CUDA emulator (tests/fixtures/cuda_emu.py;
the GPU proof is tests/gpu/test_hybrid_kernels.py and tests/gpu/test_moe_kernels.py): the delta rule's
``conv`` and ``norm`` forms store the bits of causal_conv1d (in place), gated_delta_rule and
gated_rmsnorm run apart (output, delta-rule state, conv state in the live slots, in place or not,
and a snapshot), with the blocks in either order (the last block of a head / k head differs), and
leave their counters at zero; moe_gemv_q8's ``shared`` down and moe_combine's ``shared`` form store
the bits of the plain kernel then moe_shared."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures import cuda_emu

from engine import linear_attn_kernels as lk
from engine import moe_kernels as mk
from engine.render import render

SLOTS = 6


def _bf16(x) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _run(k, grid, args, tmp_path, **kw):
    lib, types = cuda_emu.compile_any(render(k.spec), k.spec.entry, tmp_path)
    cuda_emu.launch_any(lib, types, grid, k.block[0], k.smem, args, **kw)


@pytest.mark.parametrize("tiled,conv_on,norm_on", [(False, True, True), (True, True, True), (False, True, False), (True, False, True)])
def test_delta_rule_conv_and_norm_forms_store_the_kernels_bits(tmp_path, tiled, conv_on, norm_on):
    rng = np.random.default_rng(3)
    kh, vh, kd, vd, ck, eps, rows = 2, 4, 32, 64, 4, 1e-6, 3
    qkv_w = 2 * kh * kd + vh * vd
    qs, bs, zs, os_ = qkv_w + 8, vh + 4, vh * vd + 32, vh * vd
    qkv = _bf16(rng.standard_normal((rows, qs)))
    b, a = _bf16(rng.standard_normal((rows, bs))), _bf16(rng.standard_normal((rows, bs)))
    A = -np.exp(rng.uniform(-2, 1.5, vh)).astype(np.float32)
    dt = (0.5 * rng.standard_normal(vh)).astype(np.float32)
    z = _bf16(rng.standard_normal((rows, zs)))
    w = (1 + 0.2 * rng.standard_normal(vd)).astype(np.float32)
    cw = (0.5 * rng.standard_normal((qkv_w, ck))).astype(np.float32)
    state0 = (rng.standard_normal((SLOTS, vh, kd, vd)) * 0.1).astype(np.float32)
    cstate0 = rng.standard_normal((SLOTS, qkv_w, ck - 1)).astype(np.float32)
    ins = np.array([-1, 1, 4], np.int32)  # zeros; in place; from another slot
    outs = np.array([0, 1, 2], np.int32)
    snap = np.array([-1, 3, 5], np.int32)
    starts = np.arange(rows + 1, dtype=np.int32)
    conv = lk.conv1d_kernel(qkv_w, ck, qs, qs, False)
    plain = lk.delta_rule_kernel(kh, vh, kd, vd, qs, bs, bs, os_, tiled, False)
    norm = lk.gated_rmsnorm_kernel(vh, vd, os_, zs, os_, eps)
    fused = lk.delta_rule_kernel(kh, vh, kd, vd, qs, bs, bs, os_, tiled, False, norm=(zs, os_, eps) if norm_on else None,
                                 conv=ck if conv_on else 0, trigger=True)
    grid = plain.grid(rows)
    # apart
    x, out, st, cst = qkv.copy(), np.full((rows, os_), 0x7FC0, np.uint16), state0.copy(), cstate0.copy()
    if conv_on:
        _run(conv, conv.grid(rows), [x, x, cw, cst, ins, outs, snap, starts, rows], tmp_path)
    _run(plain, grid, [out, x, b, a, A, dt, st, ins, outs, snap, starts, rows], tmp_path)
    if norm_on:
        _run(norm, norm.grid(rows), [out, out, z, w, rows], tmp_path)
    want = (out, st, cst)
    assert not (out == 0x7FC0).any() and np.array_equal(cst, cstate0) is not conv_on
    for blocks_reversed in (False, True):
        x, st, cst = qkv.copy(), state0.copy(), cstate0.copy()
        out = np.full((rows, os_), 0x7FC0, np.uint16)
        ccnt, cnt = np.zeros(rows * kh, np.int32), np.zeros(rows * vh, np.int32)
        args = [out, x, b, a, A, dt, st, ins, outs, snap, starts, *((cw, cst, ccnt) if conv_on else ()),
                *((out, z, w, cnt) if norm_on else ()), rows]
        _run(fused, grid, args, tmp_path, blocks_reversed=blocks_reversed)
        for got, exp in zip((out, st, cst), want, strict=True):
            assert np.array_equal(got, exp), blocks_reversed
        assert np.array_equal(x, qkv) and not ccnt.any() and not cnt.any()


@pytest.mark.parametrize("quant", ["q4_k", "q6_k"])
def test_shared_down_stores_the_plain_down_then_moe_shareds_bits(tmp_path, quant):
    from fixtures.quant_blocks import random_blocks

    rng = np.random.default_rng(5)
    e, hidden, inter, top_k, rows = 4, 256, 256, 2, 2
    raw = random_blocks(quant, e * hidden * inter // 256, seed=5).reshape(e * hidden, -1)
    ids = np.array([[0, 3], [2, 1]], np.int32)
    wts = rng.uniform(0.1, 1.0, (rows, top_k)).astype(np.float32)
    act = _bf16(rng.standard_normal((rows, top_k, inter)))
    res = _bf16(rng.standard_normal((rows, hidden)))
    y, h = _bf16(rng.standard_normal((rows, hidden))), _bf16(rng.standard_normal((rows, hidden)) * 0.5)
    gate = (rng.standard_normal(hidden) * 0.05).astype(np.float32)
    plain = mk.expert_q8_kernel("down", quant, hidden, inter, top_k, residual=True)
    shared = mk.shared_kernel(hidden)
    fused = mk.expert_q8_kernel("down", quant, hidden, inter, top_k, residual=True, shared=256)
    want = res.copy()
    _run(plain, plain.grid(rows), [want, raw, act, ids, wts, want, rows], tmp_path)
    _run(shared, shared.grid(rows), [want, y, h, gate, rows], tmp_path)
    got = res.copy()
    _run(fused, fused.grid(rows), [got, raw, act, ids, wts, got, y, h, gate, rows], tmp_path)
    assert np.array_equal(got, want) and not np.array_equal(want, res)


def test_shared_combine_stores_the_plain_combine_then_moe_shareds_bits(tmp_path):
    rng = np.random.default_rng(6)
    hidden, top_k, rows = 512, 3, 3
    partial = rng.standard_normal((rows, top_k, hidden)).astype(np.float32)
    wts = rng.uniform(0.1, 1.0, (rows, top_k)).astype(np.float32)
    res = _bf16(rng.standard_normal((rows, hidden)))
    y, h = _bf16(rng.standard_normal((rows, hidden))), _bf16(rng.standard_normal((rows, hidden)) * 0.5)
    gate = (rng.standard_normal(hidden) * 0.05).astype(np.float32)
    plain, shared = mk.combine_kernel(hidden, top_k), mk.shared_kernel(hidden)
    fused = mk.combine_kernel(hidden, top_k, shared=256)
    want = res.copy()
    _run(plain, plain.grid(rows), [want, partial, wts, want, rows], tmp_path)
    _run(shared, shared.grid(rows), [want, y, h, gate, rows], tmp_path)
    got = res.copy()
    _run(fused, fused.grid(rows), [got, partial, wts, got, y, h, gate, rows], tmp_path)
    assert np.array_equal(got, want) and not np.array_equal(want, res)
