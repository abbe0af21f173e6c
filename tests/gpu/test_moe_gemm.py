"""The grouped expert GEMM of prefill (kernels/moe_sort.cu.j2, moe_gemm.cu.j2, then moe_combine)
against numpy on a real GPU (skipped without one).

Fresh random inputs each run, for every storage type the MoE family lists (bf16, f16, f32, q8_0,
q4_k, q5_k, q6_k): random GGUF blocks / float rows for the stacked expert weights
(test_moe_kernels.stacked_weight),
with uniform routing and skewed routing (three hot experts every token picks, more than one row tile
each; four cold ones; the rest chosen by no token). Outputs start as NaN, so a row the kernels miss fails. Checks:
moe_sort's permutation groups the slots by expert and its tile table covers them in tiles of at
most tile_m rows; the glu GEMM's act rows (moe_sort's order) and the down GEMM's per-slot partials
within bf16 tolerance of numpy (the W tile is decoded to bf16 for the tensor cores); moe_combine
of them equal to the router-weighted sum plus the residual.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_moe_kernels import QUANTS, Kit, bf_round, rel_err, stacked_weight

from engine.moe_kernels import combine_kernel, expert_gemm_kernel, gemm_max_tiles, sort_kernel


@pytest.fixture(scope="module")
def gk(tmp_path_factory):
    return Kit(tmp_path_factory.mktemp("kcache"))


def _stacked(qt: str, e: int, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """stacked_weight, plus f16 / f32 rows (raw bytes [E * n, row bytes], f64 values [E, n, k])."""
    if qt not in ("f16", "f32"):
        return stacked_weight(qt, e, n, k, rng)
    w = (rng.standard_normal((e * n, k)) * 0.05).astype(np.float16 if qt == "f16" else np.float32)
    return w.view(np.uint8), w.astype(np.float64).reshape(e, n, k)


def _routing(rng, rows: int, experts: int, top_k: int, skewed: bool) -> np.ndarray:
    if not skewed:
        return np.stack([rng.choice(experts, top_k, replace=False) for _ in range(rows)]).astype(np.int32)
    p = np.zeros(experts)  # experts 6 .. E-2 never chosen
    p[[0, 2, 3, 4]] = 1e-2  # four cold ones
    p[[1, 5, experts - 1]] = 1.0  # three hot ones: every token picks them
    p /= p.sum()
    return np.stack([rng.choice(experts, top_k, replace=False, p=p) for _ in range(rows)]).astype(np.int32)


def _per_slot(a: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[rows, top_k, n]: a[t] (or a[t, j] when a is per slot) times expert ids[t, j]'s w[e].T, one
    matmul per expert (not a gathered [rows, top_k, n, k] copy of the weights)."""
    out = np.zeros(ids.shape + (w.shape[1],))
    for e in np.unique(ids):
        t, j = np.nonzero(ids == e)
        out[t, j] = (a[t] if a.ndim == 2 else a[t, j]) @ w[e].T
    return out


def _check_sort(ids: np.ndarray, perm: np.ndarray, tiles: np.ndarray, experts: int, tile_m: int) -> None:
    flat = ids.reshape(-1)
    assert sorted(perm.tolist()) == list(range(flat.size))  # a permutation of the slots
    assert np.all(np.diff(flat[perm]) >= 0)  # grouped by expert, experts in order
    count = int(tiles[0, 0])
    assert 0 < count <= gemm_max_tiles(ids.shape[0], ids.shape[1], experts, tile_m)
    covered = []
    for e, first, end, _ in tiles[1 : 1 + count]:
        assert 0 < end - first <= tile_m and np.all(flat[perm[first:end]] == e)
        covered += range(first, end)
    assert covered == list(range(flat.size))  # every sorted row in exactly one tile, in order
    want = sum(-(-int(c) // tile_m) for c in np.bincount(flat, minlength=experts))
    assert count == want


# the prefill row tiles (64 rows, 2 x 4 warps) and the decode buckets' (16 rows, 1 x 8 warps)
TILES = {"prefill": {}, "decode": {"tile_m": 16, "warps_m": 1}}


@pytest.mark.parametrize("qt", QUANTS + ("f16", "f32"))
@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize("shape", TILES)
def test_grouped_gemm_matches_numpy(gk, qt, skewed, shape):
    rng = np.random.default_rng()
    experts, top_k, rows, hidden, inter = 16, 4, 150, 512, 256
    wg_raw, wg = _stacked(qt, experts, inter, hidden, rng)
    wu_raw, wu = _stacked(qt, experts, inter, hidden, rng)
    wd_raw, wd = _stacked(qt, experts, hidden, inter, rng)
    dev = [gk.raw(r) for r in (wg_raw, wu_raw, wd_raw)]
    ids = _routing(rng, rows, experts, top_k, skewed)
    counts = np.bincount(ids.reshape(-1), minlength=experts)
    if skewed:
        assert (counts == 0).any() and counts.max() > 64  # empty experts; hot ones span tiles
    x = bf_round(rng.standard_normal((rows, hidden)))
    glu = expert_gemm_kernel("glu", qt, inter, hidden, top_k, experts, **TILES[shape])
    down = expert_gemm_kernel("down", qt, hidden, inter, top_k, experts, **TILES[shape])
    bm = glu.spec.params["tile_m"]
    slots = rows * top_k
    perm = gk.i32(np.full(slots, -1))
    tiles = gk.i32(np.full((1 + gemm_max_tiles(rows, top_k, experts, bm), 4), -1))
    ids_t = gk.i32(ids)
    gk.launch(sort_kernel(experts, top_k, bm), [perm, tiles, ids_t, rows], rows)
    p, tt = gk.host(perm).astype(np.int64), gk.host(tiles).astype(np.int64)
    _check_sort(ids, p, tt, experts, bm)

    act = gk.nan_like((slots, inter))
    gk.launch(glu, [act, dev[0], dev[1], gk.bf(x), perm, tiles, rows], rows)
    g = _per_slot(x, ids, wg)
    ref_act = (g / (1 + np.exp(-g)) * _per_slot(x, ids, wu)).reshape(slots, inter)[p]
    got_act = gk.host(act)
    assert not np.isnan(got_act).any()
    assert rel_err(got_act, ref_act) < 1e-2, rel_err(got_act, ref_act)

    a_sorted = bf_round(rng.standard_normal((slots, inter)))  # act rows in moe_sort's order
    a = np.empty_like(a_sorted)
    a[p] = a_sorted  # by slot
    partial = gk.nan_like((rows, top_k, hidden), "f32")
    gk.launch(down, [partial, dev[2], gk.bf(a_sorted), perm, tiles, rows], rows)
    ref_partial = _per_slot(a.reshape(rows, top_k, inter), ids, wd)
    got_partial = gk.host(partial)
    assert not np.isnan(got_partial).any()
    assert rel_err(got_partial, ref_partial) < 1e-2, rel_err(got_partial, ref_partial)

    w = rng.uniform(0.1, 1.0, (rows, top_k)).astype(np.float32)
    r = bf_round(rng.standard_normal((rows, hidden)))
    out = gk.bf(r)  # the residual aliases out
    gk.launch(combine_kernel(hidden, top_k), [out, partial, gk.f32(w), out, rows], rows)
    want = np.einsum("tj,tjn->tn", w, ref_partial) + r
    assert rel_err(gk.host(out), want) < 1e-2


@pytest.mark.parametrize("rows", [1, 7])
def test_grouped_gemm_few_rows_and_tiles_past_the_count(gk, rows):
    """A step with fewer pairs than one tile: most blocks of the grid find no tile and exit; the
    rows that are present match numpy (q4_k, the bench's type)."""
    rng = np.random.default_rng()
    experts, top_k, hidden, inter, qt = 8, 2, 256, 256, "q4_k"
    wg_raw, wg = stacked_weight(qt, experts, inter, hidden, rng)
    wu_raw, wu = stacked_weight(qt, experts, inter, hidden, rng)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(rows)]).astype(np.int32)
    glu = expert_gemm_kernel("glu", qt, inter, hidden, top_k, experts)
    bm = glu.spec.params["tile_m"]
    perm = gk.i32(np.full(rows * top_k, -1))
    tiles = gk.i32(np.full((1 + gemm_max_tiles(rows, top_k, experts, bm), 4), -1))
    gk.launch(sort_kernel(experts, top_k, bm), [perm, tiles, gk.i32(ids), rows], rows)
    x = bf_round(rng.standard_normal((rows, hidden)))
    act = gk.nan_like((rows * top_k, inter))
    gk.launch(glu, [act, gk.raw(wg_raw), gk.raw(wu_raw), gk.bf(x), perm, tiles, rows], rows)
    p = gk.host(perm).astype(np.int64)
    g = _per_slot(x, ids, wg)
    ref = (g / (1 + np.exp(-g)) * _per_slot(x, ids, wu)).reshape(-1, inter)[p]
    got = gk.host(act)
    assert not np.isnan(got).any() and rel_err(got, ref) < 1e-2, rel_err(got, ref)
