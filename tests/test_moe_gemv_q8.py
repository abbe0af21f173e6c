"""kernels/moe_gemv_q8.cu.j2 (the per-slot expert GEMVs on int8 x and dp4a) rendered and run on the
CPU (tests/fixtures/cuda_emu.py) against numpy: random GGUF blocks for the stacked [E, N, K]
experts (q4_k, q5_k, q6_k), bf16 x rows, two tokens, outputs poisoned with NaN first (a row the kernel
never writes fails), row counts that leave a block's last warps past N. The kernel's math is the
q8x GEMV's: against ``x`` rounded as it stages it (engine.quant.q8x_round_trip) the results agree
to f32 order and the bf16 output rounding (5e-3: half a bf16 ulp is up to 2^-8), and against engine.ops_ref_moe.moe_experts (x
unrounded) to the q8x rounding (2e-2 of the output's scale). The other storage types keep
moe_gemv's f32 per-slot kernels (tests/gpu/test_moe_kernels.py checks both on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures import cuda_emu
from fixtures.quant_blocks import random_blocks

from engine import quant
from engine.moe_kernels import expert_q8_kernel, q8_supported
from engine.ops_ref_moe import moe_experts
from engine.render import render
from engine.storage import BLOCK_SIZES
from engine.types import ConfigError

E, TOP_K, ROWS = 5, 3, 2
NAN_BF16 = np.uint16(0x7FC0)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _stack_e(q: str, e: int, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes [e * n, row bytes], dequantised f32 [e, n, k]) of a random stack of e experts."""
    raw = random_blocks(q, e * n * (k // 256), seed).reshape(e * n, -1)
    return raw, quant.dequantize(raw.reshape(-1), q, (e * n, k)).reshape(e, n, k)


def _stack(q: str, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    return _stack_e(q, E, n, k, seed)


def _run(kern, rows, args, tmp_path):
    lib, types = cuda_emu.compile_any(render(kern.spec), kern.spec.entry, tmp_path)
    cuda_emu.launch_any(lib, types, kern.grid(rows), kern.block[0], 0, args)


def _ids(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(ROWS)]).astype(np.int32)


@pytest.mark.parametrize("q", ["q4_k", "q5_k", "q6_k"])
def test_glu_matches_the_reference(q, tmp_path):
    n, k = 36, 512  # 36 rows: the last block of 16 has warps past N
    (rg, g), (ru, u) = _stack(q, n, k, 1), _stack(q, n, k, 2)
    x = _bf16_bits(np.random.default_rng(3).standard_normal((ROWS, k)).astype(np.float32))
    ids = _ids(4)
    act = np.full((ROWS, TOP_K, n), NAN_BF16, np.uint16)
    kern = expert_q8_kernel("glu", q, n, k, TOP_K)
    _run(kern, ROWS, [act, rg, ru, x, ids, ROWS], tmp_path)
    got = _f32(act)
    assert np.isfinite(got).all()
    for xr, tol in ((quant.q8x_round_trip(_f32(x)), 5e-3), (_f32(x), 2e-2)):
        a, b = np.einsum("tk,tjnk->tjn", xr, g[ids]), np.einsum("tk,tjnk->tjn", xr, u[ids])
        want = a / (1 + np.exp(-np.clip(a, -80, 80))) * b
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < tol, (q, tol, err)


@pytest.mark.parametrize("q", ["q4_k", "q5_k", "q6_k"])
def test_down_matches_the_reference_with_the_residual(q, tmp_path):
    n, k = 40, 768  # k 768: 3 super-blocks a row, pairs not a multiple of 32 per lane
    raw, w = _stack(q, n, k, 5)
    rng = np.random.default_rng(6)
    act = _bf16_bits(rng.standard_normal((ROWS, TOP_K, k)).astype(np.float32))
    ids = _ids(7)
    wts = rng.uniform(0.1, 1.0, (ROWS, TOP_K)).astype(np.float32)
    res = _bf16_bits(rng.standard_normal((ROWS, n)).astype(np.float32))
    out = np.full((ROWS, n), NAN_BF16, np.uint16)
    kern = expert_q8_kernel("down", q, n, k, TOP_K, residual=True)
    _run(kern, ROWS, [out, raw, act, ids, wts, res, ROWS], tmp_path)
    got = _f32(out)
    assert np.isfinite(got).all()
    for ar, tol in ((quant.q8x_round_trip(_f32(act)), 5e-3), (_f32(act), 2e-2)):
        want = np.einsum("tj,tjnk,tjk->tn", wts, w[ids], ar) + _f32(res)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < tol, (q, tol, err)


def test_sparse_mlp_matches_ops_ref_moe(tmp_path):
    """glu then down (q4_k gate / up, q6_k down: a q4_k_m layer) against moe_experts."""
    hidden, inter = 256, 512
    (rg, g), (ru, u) = _stack("q4_k", inter, hidden, 11), _stack("q4_k", inter, hidden, 12)
    rd, d = _stack("q6_k", hidden, inter, 13)
    rng = np.random.default_rng(14)
    h = _bf16_bits(rng.standard_normal((ROWS, hidden)).astype(np.float32))
    ids = _ids(15)
    wts = rng.uniform(0.1, 1.0, (ROWS, TOP_K)).astype(np.float32)
    act = np.full((ROWS, TOP_K, inter), NAN_BF16, np.uint16)
    out = np.full((ROWS, hidden), NAN_BF16, np.uint16)
    _run(expert_q8_kernel("glu", "q4_k", inter, hidden, TOP_K), ROWS, [act, rg, ru, h, ids, ROWS], tmp_path)
    _run(expert_q8_kernel("down", "q6_k", hidden, inter, TOP_K), ROWS, [out, rd, act, ids, wts, None, ROWS], tmp_path)
    want = moe_experts(_f32(h), ids, wts, g, u, d)
    got = _f32(out)
    assert np.abs(got - want).max() / np.abs(want).max() < 3e-2


def test_a_token_does_not_depend_on_the_others(tmp_path):
    """Token 1 run alone (rows 1) gives the bits it gets beside token 0 (batched == solo), in glu
    and in down."""
    n, k = 24, 512
    raw, _ = _stack("q4_k", n, k, 21)
    rng = np.random.default_rng(22)
    x = _bf16_bits(rng.standard_normal((ROWS, k)).astype(np.float32))
    ids = _ids(24)
    glu = expert_q8_kernel("glu", "q4_k", n, k, TOP_K)
    act2 = np.full((ROWS, TOP_K, n), NAN_BF16, np.uint16)
    _run(glu, ROWS, [act2, raw, raw, x, ids, ROWS], tmp_path)
    act1 = np.full((1, TOP_K, n), NAN_BF16, np.uint16)
    _run(glu, 1, [act1, raw, raw, np.ascontiguousarray(x[1:]), np.ascontiguousarray(ids[1:]), 1], tmp_path)
    assert np.array_equal(act2[1], act1[0])
    act = _bf16_bits(rng.standard_normal((ROWS, TOP_K, k)).astype(np.float32))
    ids, wts = _ids(23), rng.uniform(0.1, 1.0, (ROWS, TOP_K)).astype(np.float32)
    kern = expert_q8_kernel("down", "q4_k", n, k, TOP_K)
    both = np.full((ROWS, n), NAN_BF16, np.uint16)
    _run(kern, ROWS, [both, raw, act, ids, wts, None, ROWS], tmp_path)
    solo = np.full((1, n), NAN_BF16, np.uint16)
    _run(kern, 1, [solo, raw, np.ascontiguousarray(act[1:]), np.ascontiguousarray(ids[1:]),
                   np.ascontiguousarray(wts[1:]), None, 1], tmp_path)  # fmt: skip
    assert np.array_equal(both[1], solo[0])


def test_builder_checks():
    assert q8_supported("glu", "q4_k", 2048, 8) and q8_supported("down", "q6_k", 768, 8)
    assert not q8_supported("glu", "q8_0", 2048, 8) and not q8_supported("down", "q4_k", 8192, 8)
    with pytest.raises(ConfigError, match="not supported"):
        expert_q8_kernel("glu", "q8_0", 768, 2048, 8)
    with pytest.raises(ConfigError, match="warps"):
        expert_q8_kernel("down", "q4_k", 2048, 768, 8, warps=3)
    k = expert_q8_kernel("glu", "q4_k", 768, 2048, 8)
    assert k.grid(1) == (768 // 16, 8, 1) and k.spec.params["prefetch"] == 1  # 32 segments: one per lane


@pytest.mark.parametrize(("experts", "top"), [(128, 8), (37, 4)])
def test_topk_routing_matches_moe_route(experts, top, tmp_path):
    """_moe_route.cuh.j2's route_token (two warp reductions a pick), through moe_topk, against
    engine.ops_ref_moe.moe_route on fresh random logits: ids exact, weights to f32 rounding; a row
    with tied logits (the lower ids first) and one whose other probabilities underflow to 0 (then
    picked in ascending id order, never an expert already taken)."""
    from engine.moe_kernels import topk_kernel
    from engine.ops_ref_moe import moe_route

    rng = np.random.default_rng()
    rows = 6
    logits = rng.standard_normal((rows, experts)).astype(np.float32) * 2
    logits[1, [4, 11, 20, 33]] = logits[1].max() + 1.0
    logits[2] = -200.0
    logits[2, 7] = 0.0
    for normalize in (True, False):
        ids, wts = np.full((rows, top), -1, np.int32), np.full((rows, top), np.nan, np.float32)
        tk = topk_kernel(experts, top, normalize)
        lib, types = cuda_emu.compile_any(render(tk.spec), tk.spec.entry, tmp_path)
        cuda_emu.launch_any(lib, types, tk.grid(rows), tk.block[0], 0, [ids, wts, logits, rows])
        want_ids, want_w = moe_route(logits, np.eye(experts, dtype=np.float32), top, normalize)
        assert np.array_equal(ids, want_ids), (ids, want_ids)
        assert list(ids[2]) == [7, *range(top - 1)] and list(ids[1, :4]) == [4, 11, 20, 33][: min(4, top)]
        np.testing.assert_allclose(wts, want_w, rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("normalize", [True, False])
def test_glu_routing_in_the_kernel_matches_moe_topk(normalize, tmp_path):
    """glu with ``route``: each block routes its token from the router logits (a three-way tie at
    the top: the lower ids first; a NaN logit never picked) and stores the ids and weights
    moe_topk gives (bitwise; run here too) and the act the plain glu gives with those ids."""
    from engine.moe_kernels import topk_kernel

    n, k, experts, top = 20, 256, 37, 4  # 37 experts: a partial last lane group in route_probs
    (rg, _), (ru, _) = _stack_e("q4_k", experts, n, k, 31), _stack_e("q4_k", experts, n, k, 32)
    rng = np.random.default_rng(33)
    logits = rng.standard_normal((ROWS, experts)).astype(np.float32)
    logits[1, [3, 9, 30]] = logits[1].max() + 1.0  # a three-way tie at the top: ids 3, 9, 30 in order
    logits[0, 5] = np.nan
    x = _bf16_bits(rng.standard_normal((ROWS, k)).astype(np.float32))
    ids_k, w_k = np.full((ROWS, top), -5, np.int32), np.full((ROWS, top), np.nan, np.float32)
    tk = topk_kernel(experts, top, normalize)
    lib, types = cuda_emu.compile_any(render(tk.spec), tk.spec.entry, tmp_path)
    cuda_emu.launch_any(lib, types, tk.grid(ROWS), tk.block[0], 0, [ids_k, w_k, logits, ROWS])
    assert list(ids_k[1, :3]) == [3, 9, 30] and 5 not in ids_k[0]
    ids, wts = np.full((ROWS, top), -5, np.int32), np.full((ROWS, top), np.nan, np.float32)
    act = np.full((ROWS, top, n), NAN_BF16, np.uint16)
    kern = expert_q8_kernel("glu", "q4_k", n, k, top, route=(experts, normalize))
    _run(kern, ROWS, [act, rg, ru, x, ids, ROWS, wts, logits], tmp_path)
    assert np.array_equal(ids, ids_k) and np.array_equal(wts.view(np.uint32), w_k.view(np.uint32))
    plain = np.full((ROWS, top, n), NAN_BF16, np.uint16)
    _run(expert_q8_kernel("glu", "q4_k", n, k, top), ROWS, [plain, rg, ru, x, ids_k, ROWS], tmp_path)
    assert np.array_equal(act, plain)


@pytest.mark.parametrize(
    ("q", "shape"),
    [("q6_k", {"prefetch": 1}), ("q6_k", {"warps": 4, "rows_per_warp": 1}), ("q4_k", {"warps": 2, "rows_per_warp": 4, "prefetch": 2})],
)
def test_down_block_shapes_give_the_same_bits(q, shape, tmp_path):
    """down in the block shapes moe_gemv_q8 takes (q6_k with prefetch 1: six chunks of segment
    loads a lane, one chunk's loads ahead of its math): out equal, bit for bit, to the default
    shape's (each lane sums its pairs in the same order whatever the shape)."""
    n, k, experts, top = 20, 768, 11, 8  # q6_k: 8 x 24 (slot, segment) pairs, 6 a lane
    raw, _ = _stack_e(q, experts, n, k, 61)
    rng = np.random.default_rng(62)
    ids = np.stack([rng.choice(experts, top, replace=False) for _ in range(ROWS)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (ROWS, top)).astype(np.float32)
    act = _bf16_bits(rng.standard_normal((ROWS, top, k)).astype(np.float32))
    res = _bf16_bits(rng.standard_normal((ROWS, n)).astype(np.float32))
    outs = []
    for kw in ({}, shape):
        out = res.copy()  # (the residual aliases out, as in the plan)
        _run(expert_q8_kernel("down", q, n, k, top, residual=True, trigger=True, **kw), ROWS, [out, raw, act, ids, wts, out, ROWS], tmp_path)
        outs.append(out)
    assert np.isfinite(_f32(outs[0])).all() and np.array_equal(outs[0], outs[1])


def _any_stack(q: str, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw [E * n, row bytes], f32 [E, n, k]): random bf16 rows or random GGUF blocks of ``q``."""
    if q == "bf16":
        bits = _bf16_bits(np.random.default_rng(seed).standard_normal((E * n, k)).astype(np.float32) * 0.05)
        return bits.view(np.uint8), _f32(bits).reshape(E, n, k)
    elems = BLOCK_SIZES[q][0]
    raw = random_blocks(q, E * n * k // elems, seed).reshape(E * n, -1)
    return raw, quant.dequantize(raw.reshape(-1), q, (E * n, k)).reshape(E, n, k)


@pytest.mark.parametrize("q", ["bf16", "q8_0", "q5_k", "q4_k", "q6_k"])
def test_moe_gemv_per_slot_kernels_match_numpy(q, tmp_path):
    """The f32 per-slot kernels (moe_gemv glu / down) that the other storage types keep at batch 1
    (and every type on a profile without q8x), on the CPU too: every type the family's combos list,
    outputs poisoned (glu) or the residual aliasing out (down)."""
    from engine.moe_kernels import expert_gemv_kernel

    n = k = 256
    (rg, g), (ru, u), (rd, d) = (_any_stack(q, n, k, 41 + i) for i in range(3))
    rng = np.random.default_rng(44)
    x = _bf16_bits(rng.standard_normal((ROWS, k)).astype(np.float32))
    ids, wts = _ids(45), rng.uniform(0.1, 1.0, (ROWS, TOP_K)).astype(np.float32)
    act = np.full((ROWS, TOP_K, n), NAN_BF16, np.uint16)
    _run(expert_gemv_kernel("glu", q, n, k, TOP_K), ROWS, [act, rg, ru, x, ids, ROWS], tmp_path)
    a, b = np.einsum("tk,tjnk->tjn", _f32(x), g[ids]), np.einsum("tk,tjnk->tjn", _f32(x), u[ids])
    want = a / (1 + np.exp(-np.clip(a, -80, 80))) * b
    assert np.isfinite(_f32(act)).all() and np.abs(_f32(act) - want).max() / np.abs(want).max() < 5e-3, q
    res = _bf16_bits(rng.standard_normal((ROWS, n)).astype(np.float32))
    out = res.copy()  # the residual aliases out
    _run(expert_gemv_kernel("down", q, n, k, TOP_K, residual=True), ROWS, [out, rd, act, ids, wts, out, ROWS], tmp_path)
    want = np.einsum("tj,tjnk,tjk->tn", wts, d[ids], _f32(act)) + _f32(res)
    assert np.abs(_f32(out) - want).max() / np.abs(want).max() < 5e-3, q


def test_router_without_routing_then_the_routing_glu_equals_the_routing_router(tmp_path):
    """The batch-1 pair the plan runs (route_in_glu): moe_router with route off (its folded
    rmsnorm's h and the logits; ids, weights and counter untouched), then the routing glu: the
    same ids, weights (bits), logits, h and act as the routing router then the plain glu."""
    from engine.moe_kernels import router_kernel

    experts, hidden, n = 24, 256, 16
    (rg, _), (ru, _) = _stack_e("q4_k", experts, n, hidden, 51), _stack_e("q4_k", experts, n, hidden, 52)
    rng = np.random.default_rng(53)
    w = (rng.standard_normal((experts, hidden)) * 0.05).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    x = _bf16_bits(rng.standard_normal((1, hidden)).astype(np.float32) * 3)
    got = {}
    for route in (True, False):
        rk = router_kernel(experts, hidden, TOP_K, True, "f32", hidden, eps=1e-6, h_stride=hidden, route=route)
        ids, wts = np.full((1, TOP_K), -7, np.int32), np.full((1, TOP_K), np.nan, np.float32)
        logits, h = np.full((1, experts), np.nan, np.float32), np.full((1, hidden), NAN_BF16, np.uint16)
        count = np.zeros(1, np.uint32)
        _run(rk, 1, [ids, wts, logits, x, w, count, 1, nw, h], tmp_path)
        act = np.full((1, TOP_K, n), NAN_BF16, np.uint16)
        if route:
            assert count[0] == 0
            _run(expert_q8_kernel("glu", "q4_k", n, hidden, TOP_K), 1, [act, rg, ru, h, ids, 1], tmp_path)
        else:
            assert (ids == -7).all() and np.isnan(wts).all() and count[0] == 0
            glu = expert_q8_kernel("glu", "q4_k", n, hidden, TOP_K, route=(experts, True))
            _run(glu, 1, [act, rg, ru, h, ids, 1, wts, logits], tmp_path)
        got[route] = (ids, wts.view(np.uint32), logits.view(np.uint32), h, act)
    for a, b in zip(got[True], got[False], strict=True):
        assert np.array_equal(a, b)
    assert np.isfinite(_f32(got[False][4])).all()


@pytest.mark.parametrize("q", ["q4_k", "q6_k"])
def test_grouped_kernels_round_x_as_the_per_slot_q8x_kernels(q, tmp_path):
    """q8x_round (the grouped buckets where the per-slot kernels are moe_gemv_q8's): moe_q8round
    rounds the x / act rows once (engine.quant.q8x_round_trip's values, a zero group included;
    rows past rows * row_mult untouched), then down_grouped's f32 partials are the dot products
    with those values (to f32 order: 1e-5), and glu_grouped's act matches the per-slot q8x glu's
    (to the bf16 rounding), so a token in a grouped bucket gets what it gets alone."""
    from engine.moe_kernels import expert_gemv_kernel, q8round_kernel

    n, k = 16, 256
    raw, w = _stack(q, n, k, 61)
    rng = np.random.default_rng(62)
    af = rng.standard_normal((ROWS, TOP_K, k)).astype(np.float32)
    af[1, 2, 32:64] = 0.0  # a zero group: q 0, dx 0
    a = _bf16_bits(af)
    ids = _ids(63)
    grouped = dict(experts=E, max_slots=8, rows_per_warp=2)
    aq = np.full((ROWS * TOP_K + 1, k), np.nan, np.float32)  # (one row past the step's: never written)
    _run(q8round_kernel(k, k, row_mult=TOP_K, threads=32), ROWS, [aq, a, ROWS], tmp_path)
    want_q = quant.q8x_round_trip(_f32(a).reshape(-1, k))
    assert np.isnan(aq[-1]).all() and np.allclose(aq[:-1], want_q, rtol=1e-6, atol=0) and (aq[5, 32:64] == 0).all()
    aq = np.ascontiguousarray(aq[:-1])
    part = np.full((ROWS, TOP_K, n), np.nan, np.float32)
    kern = expert_gemv_kernel("down_grouped", q, n, k, TOP_K, **grouped, q8x_round=True)
    _run(kern, ROWS, [part, raw, aq, ids, ROWS], tmp_path)
    want = np.einsum("tjnk,tjk->tjn", w[ids].astype(np.float64), quant.q8x_round_trip(_f32(a)).astype(np.float64))
    assert np.abs(part - want).max() / np.abs(want).max() < 1e-5
    plain = np.full((ROWS, TOP_K, n), np.nan, np.float32)  # (without the rounding: the q8x error, ~1e-3)
    _run(expert_gemv_kernel("down_grouped", q, n, k, TOP_K, **grouped), ROWS, [plain, raw, a, ids, ROWS], tmp_path)
    assert np.abs(plain - want).max() / np.abs(want).max() > 1e-4
    (rg, _), (ru, _) = _stack(q, n, k, 64), _stack(q, n, k, 65)
    x = _bf16_bits(rng.standard_normal((ROWS, k)).astype(np.float32))
    xs = np.zeros((ROWS, k + 64), np.uint16)  # (x rows of a wider stride, as h may be)
    xs[:, :k] = x
    xq = np.full((ROWS, k), np.nan, np.float32)
    _run(q8round_kernel(k, k + 64), ROWS, [xq, xs, ROWS], tmp_path)
    act_g, act_s = (np.full((ROWS, TOP_K, n), NAN_BF16, np.uint16) for _ in range(2))
    _run(expert_gemv_kernel("glu_grouped", q, n, k, TOP_K, **grouped, q8x_round=True), ROWS,
         [act_g, rg, ru, xq, ids, ROWS], tmp_path)  # fmt: skip
    _run(expert_q8_kernel("glu", q, n, k, TOP_K), ROWS, [act_s, rg, ru, x, ids, ROWS], tmp_path)
    g, s = _f32(act_g), _f32(act_s)
    assert np.isfinite(g).all() and np.abs(g - s).max() <= 2 ** -7 * np.abs(s).max()
