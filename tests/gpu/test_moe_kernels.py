"""The MoE kernels (moe_topk, moe_gemv glu/down and the grouped modes, moe_combine) against the
numpy reference on a real GPU.

Fresh random inputs each run: router logits for the top-k softmax (ids exact, weights 1e-5), random
GGUF blocks / bf16 rows for the stacked expert weights of every checked storage type (bf16, q8_0,
q4_k, q5_k, q6_k; relative error 1e-2 for the bf16 outputs), the residual aliasing the output, and
a whole sparse MLP (logits -> moe_topk -> glu -> down) against engine.ops_ref_moe.moe_experts.
Kernels are built by engine.compile and launched through engine.cuda (the engine's only driver
module); skipped without a CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine import cuda, quant, storage
from engine.moe_kernels import (
    combine_kernel,
    expert_gemv_kernel,
    expert_q8_kernel,
    router_kernel,
    shared_kernel,
    topk_kernel,
)
from engine.ops_ref_moe import moe_experts, moe_route

_NP = {"bf16": np.uint16, "f32": np.float32, "i32": np.int32, "u8": np.uint8}


class Arr:
    """A device array: a DeviceBuffer with its shape and element type (bf16 | f32 | i32 | u8)."""

    def __init__(self, buf, shape, dtype: str):
        self.buf, self.shape, self.dtype, self.ptr = buf, tuple(shape), dtype, buf.ptr


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


class Kit:
    """Device arrays and kernel launches over engine.cuda (what the tests below need)."""

    def __init__(self, cache_dir):
        from engine.compile import KernelBuilder
        from engine.kcache import KernelCache
        from engine.profile import select

        self.ctx = cuda.Context(0)
        self.builder = KernelBuilder(select(self.ctx.info).arch, KernelCache(cache_dir))
        self.fns: dict = {}
        self.mods: list = []

    def _put(self, host: np.ndarray, dtype: str) -> Arr:
        host = np.ascontiguousarray(host)
        buf = cuda.alloc(host.nbytes)
        cuda.htod(buf.ptr, host)
        return Arr(buf, host.shape, dtype)

    def bf(self, x) -> Arr:
        return self._put(_bf16_bits(np.asarray(x)), "bf16")

    def f32(self, x) -> Arr:
        return self._put(np.asarray(x, dtype=np.float32), "f32")

    def i32(self, x) -> Arr:
        return self._put(np.asarray(x, dtype=np.int32), "i32")

    def raw(self, x: np.ndarray) -> Arr:
        return self._put(np.asarray(x, dtype=np.uint8), "u8")

    def nan_like(self, shape, dtype: str = "bf16") -> Arr:
        fill = np.full(shape, 0x7FC0, np.uint16) if dtype == "bf16" else np.full(shape, np.nan, np.float32)
        return self._put(fill, dtype)

    def host(self, a: Arr) -> np.ndarray:
        self.ctx.synchronize()
        out = cuda.dtoh(np.empty(a.shape, _NP[a.dtype]), a.ptr)
        if a.dtype == "bf16":
            return (out.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return out if a.dtype == "i32" else out.astype(np.float64)

    def launch(self, k, args, rows: int, grid=None) -> None:
        if k.spec not in self.fns:
            built = self.builder.build_all([k.spec], progress=None).kernels[0]
            mod = cuda.Module(built.cubin, k.spec.entry)
            self.mods.append(mod)
            self.fns[k.spec] = mod.function(k.spec.entry)
        vals = [a.ptr if isinstance(a, Arr) else a for a in args]
        packed = cuda.KernelArgs([c for _, c in k.args], vals)
        cuda.PreparedLaunch(self.fns[k.spec], grid or k.grid(rows), k.block, k.smem)(packed)
        self.ctx.synchronize()


def bf_round(x: np.ndarray) -> np.ndarray:
    return (_bf16_bits(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


QUANTS = ("bf16", "q8_0", "q4_k", "q5_k", "q6_k")
SCALE_FIELDS = {"q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


@pytest.fixture(scope="module")
def gk(tmp_path_factory):
    return Kit(tmp_path_factory.mktemp("kcache"))


def stacked_weight(qt: str, e: int, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes [E * n, row bytes] uint8, dequantised f64 [E, n, k]): random blocks with small
    finite f16 scales, or random bf16 rows."""
    if qt == "bf16":
        bits = (rng.standard_normal((e * n, k)).astype(np.float32) * 0.05).view(np.uint32) >> 16
        raw = bits.astype(np.uint16).view(np.uint8)
        return raw, (bits.astype(np.uint32) << 16).view(np.float32).reshape(e, n, k).astype(np.float64)
    elems, nbytes = storage.BLOCK_SIZES[qt]
    nb = e * n * k // elems
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    for off in SCALE_FIELDS[qt]:
        scale = 0.002 if qt.endswith("_k") else 0.01
        raw[:, off : off + 2] = (rng.uniform(0.2, 1.0, nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)
    deq = quant.dequantize(raw.reshape(-1), qt, (e, n, k)).astype(np.float64)
    return raw.reshape(e * n, -1), deq


def _ids(rng, rows: int, experts: int, top_k: int) -> np.ndarray:
    return np.stack([rng.choice(experts, top_k, replace=False) for _ in range(rows)]).astype(np.int32)


@pytest.mark.parametrize("experts,top_k,normalize", [(128, 8, True), (60, 4, False), (8, 2, True), (512, 10, True)])
def test_topk_matches_moe_route(gk, experts, top_k, normalize):
    rng = np.random.default_rng()
    rows = 37
    logits = (rng.standard_normal((rows, experts)) * 2).astype(np.float32)
    logits[0] = 0.0  # every probability equal: the lowest ids win
    c = topk_kernel(experts, top_k, normalize)
    ids = gk.i32(np.full((rows, top_k), -7))
    wts = gk.nan_like((rows, top_k), "f32")
    gk.launch(c, [ids, wts, gk.f32(logits), rows], rows)
    # routing straight from logits: h = logits, router = identity
    want_ids, want_w = moe_route(logits, np.eye(experts, dtype=np.float32), top_k, normalize)
    np.testing.assert_array_equal(gk.host(ids), want_ids)
    np.testing.assert_allclose(gk.host(wts), want_w, rtol=1e-5, atol=1e-7)
    assert gk.host(ids)[0].tolist() == list(range(top_k))


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
@pytest.mark.parametrize("experts,top_k,normalize,hidden", [(128, 8, True, 2048), (60, 4, False, 264)])
def test_router_gemv_and_topk_in_one_launch(gk, wdtype, experts, top_k, normalize, hidden, norm):
    """moe_router: logits = x . W (f32 sums of bf16 x rows of a wider stride), then the top-k of
    each token as moe_topk computes it from those logits; 13 tokens (two token groups, the second
    partial), poisoned outputs, the counters zero again after each launch (a second launch on new
    x), and every token's logits bitwise what a batch-1 launch gives it. With the rmsnorm folded
    in (norm): h = rmsnorm(x) * nw stored (bf16, its own stride) and the logits are W . h."""
    rng = np.random.default_rng()
    rows, stride, h_stride, eps = 13, hidden + 8, hidden + 16, 1e-6
    c = router_kernel(experts, hidden, top_k, normalize, wdtype, stride, eps=eps if norm else None, h_stride=h_stride)
    w = rng.standard_normal((experts, hidden)).astype(np.float32) * 0.05
    w_dev = gk.f32(w) if wdtype == "f32" else gk.bf(w)
    w = w if wdtype == "f32" else bf_round(w).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    count = gk.i32(np.zeros(2))

    def launch_on(xs, n):
        ids, wts = gk.i32(np.full((n, top_k), -7)), gk.nan_like((n, top_k), "f32")
        logits, h = gk.nan_like((n, experts), "f32"), gk.nan_like((n, h_stride))
        gk.launch(c, [ids, wts, logits, gk.bf(xs), w_dev, count, n] + ([gk.f32(nw), h] if norm else []), n)
        return ids, wts, logits, h

    for launch in range(2):
        x = bf_round(rng.standard_normal((rows, stride)) * 3)
        ids, wts, logits, h = launch_on(x, rows)
        assert c.grid(rows) == (-(-experts // 2), 2, 1)
        got = gk.host(logits)
        xin = x[:, :hidden]
        if norm:
            got_h = gk.host(h)[:, :hidden]
            want_h = xin / np.sqrt((xin**2).mean(axis=1, keepdims=True) + eps) * nw
            assert rel_err(got_h, want_h) < 1e-2 and np.abs(got_h - want_h).max() < 2e-2 * np.abs(want_h).max()
            assert np.isnan(gk.host(h)[:, hidden:]).all()  # only the row's k columns are written
            xin = got_h  # the router reads the bf16 h it stored
        want = xin @ w.astype(np.float64).T
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        # the routing of the kernel's own logits (moe_topk's: ids exact, weights to f32 rounding)
        want_ids, want_w = moe_route(got.astype(np.float32), np.eye(experts, dtype=np.float32), top_k, normalize)
        np.testing.assert_array_equal(gk.host(ids), want_ids)
        np.testing.assert_allclose(gk.host(wts), want_w, rtol=1e-5, atol=1e-7)
        assert gk.host(count).tolist() == [0, 0], launch
    for t in (0, 8, 12):  # batched equals solo
        ids1, _, log1, h1 = launch_on(x[t : t + 1], 1)
        np.testing.assert_array_equal(gk.host(log1)[0], got[t])
        np.testing.assert_array_equal(gk.host(ids1)[0], gk.host(ids)[t])
        if norm:
            np.testing.assert_array_equal(gk.host(h1)[0, :hidden], gk.host(h)[t, :hidden])


@pytest.mark.parametrize("qt", QUANTS)
@pytest.mark.parametrize("hidden", [512, 256])  # 256: one k-quant super-block per row
def test_glu_and_down_match_numpy(gk, qt, hidden):
    rng = np.random.default_rng()
    e, inter, top_k, rows = 8, 256, 2, 3
    wg_raw, wg = stacked_weight(qt, e, inter, hidden, rng)
    wu_raw, wu = stacked_weight(qt, e, inter, hidden, rng)
    wd_raw, wd = stacked_weight(qt, e, hidden, inter, rng)
    ids = _ids(rng, rows, e, top_k)
    x = bf_round(rng.standard_normal((rows, hidden)))
    glu = expert_gemv_kernel("glu", qt, inter, hidden, top_k)
    act = gk.nan_like((rows, top_k, inter))
    dev = {n: gk.raw(r) for n, r in (("g", wg_raw), ("u", wu_raw), ("d", wd_raw))}
    ids_t = gk.i32(ids)
    gk.launch(glu, [act, dev["g"], dev["u"], gk.bf(x), ids_t, rows], rows)
    g = np.einsum("tk,tjnk->tjn", x, wg[ids])
    ref_act = g / (1 + np.exp(-g)) * np.einsum("tk,tjnk->tjn", x, wu[ids])
    got_act = gk.host(act)
    assert not np.isnan(got_act).any()
    assert rel_err(got_act, ref_act) < 1e-2, rel_err(got_act, ref_act)

    a = bf_round(rng.standard_normal((rows, top_k, inter)))
    w = rng.uniform(0.1, 1.0, (rows, top_k)).astype(np.float32)
    r = bf_round(rng.standard_normal((rows, hidden)))
    ref = np.einsum("tj,tjn->tn", w, np.einsum("tjk,tjnk->tjn", a, wd[ids]))
    for residual in (False, True):
        down = expert_gemv_kernel("down", qt, hidden, inter, top_k, residual=residual)
        out = gk.bf(r) if residual else gk.nan_like((rows, hidden))  # the residual aliases out
        gk.launch(down, [out, dev["d"], gk.bf(a), ids_t, gk.f32(w), out if residual else 0, rows], rows)
        got = gk.host(out)
        want = ref + (r if residual else 0)
        assert not np.isnan(got).any()
        assert rel_err(got, want) < 1e-2, (residual, rel_err(got, want))


@pytest.mark.parametrize("qt", QUANTS)
@pytest.mark.parametrize("experts,rows,top_k", [(8, 20, 4), (16, 3, 2)])  # ~10 slots per expert (> SB); unchosen experts
def test_grouped_glu_down_combine_match_numpy(gk, qt, experts, rows, top_k):
    rng = np.random.default_rng()
    hidden, inter = 512, 256
    wg_raw, wg = stacked_weight(qt, experts, inter, hidden, rng)
    wu_raw, wu = stacked_weight(qt, experts, inter, hidden, rng)
    wd_raw, wd = stacked_weight(qt, experts, hidden, inter, rng)
    dev = [gk.raw(r) for r in (wg_raw, wu_raw, wd_raw)]
    ids = _ids(rng, rows, experts, top_k)
    ids_t = gk.i32(ids)
    x = bf_round(rng.standard_normal((rows, hidden)))
    # 3 rows per warp: 12 per block, 256 rows not a multiple (the last block's last rows guarded)
    glu = expert_gemv_kernel("glu_grouped", qt, inter, hidden, top_k, experts=experts, max_slots=128, rows_per_warp=3)
    act = gk.nan_like((rows, top_k, inter))
    gk.launch(glu, [act, dev[0], dev[1], gk.bf(x), ids_t, rows], rows)
    g = np.einsum("tk,tjnk->tjn", x, wg[ids])
    ref_act = g / (1 + np.exp(-g)) * np.einsum("tk,tjnk->tjn", x, wu[ids])
    got_act = gk.host(act)
    assert not np.isnan(got_act).any() and rel_err(got_act, ref_act) < 1e-2, rel_err(got_act, ref_act)

    a = bf_round(rng.standard_normal((rows, top_k, inter)))
    w = rng.uniform(0.1, 1.0, (rows, top_k)).astype(np.float32)
    r = bf_round(rng.standard_normal((rows, hidden)))
    partial = gk.nan_like((rows, top_k, hidden), "f32")
    down = expert_gemv_kernel("down_grouped", qt, hidden, inter, top_k, experts=experts, max_slots=128, rows_per_warp=3)
    gk.launch(down, [partial, dev[2], gk.bf(a), ids_t, rows], rows)
    ref_partial = np.einsum("tjk,tjnk->tjn", a, wd[ids])
    got_partial = gk.host(partial)
    assert not np.isnan(got_partial).any() and rel_err(got_partial, ref_partial) < 1e-4
    out = gk.bf(r)  # the residual aliases out
    gk.launch(combine_kernel(hidden, top_k), [out, partial, gk.f32(w), out, rows], rows)
    want = np.einsum("tj,tjn->tn", w, ref_partial) + r
    assert rel_err(gk.host(out), want) < 1e-2


@pytest.mark.parametrize("qt", ["q4_k", "q6_k"])
def test_q8round_then_grouped_q8x_round_match_numpy(gk, qt):
    """The batched buckets' q8x_round path: moe_q8round rounds h (a wider row stride) and act
    (top_k rows a token) once, as engine.quant.q8x_round_trip (1e-6; a zero group stays 0), and
    glu_grouped / down_grouped on those f32 rows give the dot products with the rounded values
    (act 1e-2 after its bf16 store, partials 1e-4). Qwen3-30B-A3B widths, 6 tokens of 128 experts."""
    from engine.moe_kernels import q8round_kernel

    rng = np.random.default_rng()
    experts, rows, top_k, hidden, inter = 128, 6, 8, 2048, 768
    wg_raw, wg = stacked_weight(qt, experts, inter, hidden, rng)
    wu_raw, wu = stacked_weight(qt, experts, inter, hidden, rng)
    wd_raw, wd = stacked_weight(qt, experts, hidden, inter, rng)
    ids = _ids(rng, rows, experts, top_k)
    ids_t = gk.i32(ids)
    stride = hidden + 64
    x = bf_round(rng.standard_normal((rows, stride)))
    x[2, 64:96] = 0.0
    xq = gk.nan_like((rows, hidden), "f32")
    gk.launch(q8round_kernel(hidden, stride), [xq, gk.bf(x), rows], rows)
    want_x = quant.q8x_round_trip(x[:, :hidden].astype(np.float32)).astype(np.float64)
    got_x = gk.host(xq)
    assert np.allclose(got_x, want_x, rtol=1e-6, atol=0) and (got_x[2, 64:96] == 0).all()
    grouped = dict(experts=experts, max_slots=64, rows_per_warp=4, q8x_round=True)
    act = gk.nan_like((rows, top_k, inter))
    gk.launch(expert_gemv_kernel("glu_grouped", qt, inter, hidden, top_k, **grouped),
              [act, gk.raw(wg_raw), gk.raw(wu_raw), xq, ids_t, rows], rows)  # fmt: skip
    g = np.einsum("tk,tjnk->tjn", want_x, wg[ids])
    ref_act = g / (1 + np.exp(-g)) * np.einsum("tk,tjnk->tjn", want_x, wu[ids])
    got_act = gk.host(act)
    assert not np.isnan(got_act).any() and rel_err(got_act, ref_act) < 1e-2, rel_err(got_act, ref_act)
    aq = gk.nan_like((rows * top_k, inter), "f32")
    gk.launch(q8round_kernel(inter, inter, row_mult=top_k), [aq, act, rows], rows)
    want_a = quant.q8x_round_trip(got_act.reshape(-1, inter).astype(np.float32)).astype(np.float64)
    assert np.allclose(gk.host(aq), want_a, rtol=1e-6, atol=0)
    partial = gk.nan_like((rows, top_k, hidden), "f32")
    gk.launch(expert_gemv_kernel("down_grouped", qt, hidden, inter, top_k, **grouped),
              [partial, gk.raw(wd_raw), aq, ids_t, rows], rows)  # fmt: skip
    ref_partial = np.einsum("tjk,tjnk->tjn", want_a.reshape(rows, top_k, inter), wd[ids])
    got_partial = gk.host(partial)
    assert not np.isnan(got_partial).any() and rel_err(got_partial, ref_partial) < 1e-4


@pytest.mark.parametrize("qt", ["q4_k", "q8_0", "bf16"])
@pytest.mark.parametrize("grid_y", [None, 3, 1])  # None: min(E, rows * top_k); 3, 1: blocks loop over ranks
@pytest.mark.parametrize("rpw", [1, 4])
def test_grouped_kernels_take_the_chosen_experts_by_rank(gk, qt, grid_y, rpw):
    """The grouped GEMVs' block row y takes the y-th chosen expert (then y + gridDim.y ...): a batch
    of 2 over 128 experts, top-8, launches 16 block rows, not 128; a grid smaller than the distinct
    experts still covers them all; a token whose slots repeat an expert of another token shares it."""
    rng = np.random.default_rng()
    experts, rows, top_k, hidden, inter = 128, 2, 8, 256, 256
    wg_raw, wg = stacked_weight(qt, experts, inter, hidden, rng)
    wu_raw, wu = stacked_weight(qt, experts, inter, hidden, rng)
    wd_raw, wd = stacked_weight(qt, experts, hidden, inter, rng)
    first = rng.choice(experts, top_k, replace=False)
    rest = rng.choice(np.setdiff1d(np.arange(experts), first), top_k - 3, replace=False)
    ids = np.stack([first, rng.permutation(np.concatenate([first[2:5], rest]))]).astype(np.int32)  # 3 shared
    glu = expert_gemv_kernel("glu_grouped", qt, inter, hidden, top_k, experts=experts, max_slots=16, rows_per_warp=rpw)
    down = expert_gemv_kernel("down_grouped", qt, hidden, inter, top_k, experts=experts, max_slots=16, rows_per_warp=rpw)
    assert glu.grid(rows)[1] == down.grid(rows)[1] == rows * top_k
    grid = lambda k: None if grid_y is None else (k.grid(rows)[0], grid_y, 1)  # noqa: E731
    x = bf_round(rng.standard_normal((rows, hidden)))
    ids_t, act = gk.i32(ids), gk.nan_like((rows, top_k, inter))
    gk.launch(glu, [act, gk.raw(wg_raw), gk.raw(wu_raw), gk.bf(x), ids_t, rows], rows, grid(glu))
    g = np.einsum("tk,tjnk->tjn", x, wg[ids])
    ref_act = g / (1 + np.exp(-g)) * np.einsum("tk,tjnk->tjn", x, wu[ids])
    got_act = gk.host(act)
    assert not np.isnan(got_act).any() and rel_err(got_act, ref_act) < 1e-2, rel_err(got_act, ref_act)
    a = bf_round(rng.standard_normal((rows, top_k, inter)))
    partial = gk.nan_like((rows, top_k, hidden), "f32")
    gk.launch(down, [partial, gk.raw(wd_raw), gk.bf(a), ids_t, rows], rows, grid(down))
    got = gk.host(partial)
    ref = np.einsum("tjk,tjnk->tjn", a, wd[ids])
    assert not np.isnan(got).any() and rel_err(got, ref) < 1e-4, rel_err(got, ref)


@pytest.mark.parametrize("rows", [1, 3])
def test_per_slot_q4_k_m_experts_at_hidden_256(gk, rows):
    """The per-slot kernels as the tiny q4_k_m Qwen3-MoE of tests/gpu/test_moe_runner.py takes them
    (hidden = moe_intermediate = 256, 8 experts, top-2): q4_k gate/up and q6_k down (one super-block
    per row), the batch-1 trigger, residual aliasing out, at 1 row (decode1) and 3 (a per-slot
    batched bucket)."""
    rng = np.random.default_rng()
    e, inter, hidden, top_k = 8, 256, 256, 2
    wg_raw, wg = stacked_weight("q4_k", e, inter, hidden, rng)
    wu_raw, wu = stacked_weight("q4_k", e, inter, hidden, rng)
    wd_raw, wd = stacked_weight("q6_k", e, hidden, inter, rng)
    ids = _ids(rng, rows, e, top_k)
    x = bf_round(rng.standard_normal((rows, hidden)))
    r = bf_round(rng.standard_normal((rows, hidden)))
    w = rng.uniform(0.1, 1.0, (rows, top_k)).astype(np.float32)
    act = gk.nan_like((rows, top_k, inter))
    ids_t = gk.i32(ids)
    glu = expert_gemv_kernel("glu", "q4_k", inter, hidden, top_k, trigger=True)
    gk.launch(glu, [act, gk.raw(wg_raw), gk.raw(wu_raw), gk.bf(x), ids_t, rows], rows)
    g = np.einsum("tk,tjnk->tjn", x, wg[ids])
    ref_act = g / (1 + np.exp(-g)) * np.einsum("tk,tjnk->tjn", x, wu[ids])
    got_act = gk.host(act)
    assert not np.isnan(got_act).any() and rel_err(got_act, ref_act) < 1e-2, rel_err(got_act, ref_act)
    down = expert_gemv_kernel("down", "q6_k", hidden, inter, top_k, residual=True, trigger=True)
    out = gk.bf(r)
    gk.launch(down, [out, gk.raw(wd_raw), act, ids_t, gk.f32(w), out, rows], rows)
    a = gk.host(act)
    want = np.einsum("tj,tjn->tn", w, np.einsum("tjk,tjnk->tjn", a, wd[ids])) + r
    got = gk.host(out)
    assert not np.isnan(got).any() and rel_err(got, want) < 1e-2, rel_err(got, want)


@pytest.mark.parametrize("qt", ["q4_k", "q6_k", "q8_0", "bf16"])
def test_per_slot_kernels_batched_equal_solo(gk, qt):
    """The per-slot glu and down over 4 tokens (the smallest batched decode buckets) give each
    token exactly what a batch-1 launch of the same kernels gives it (bitwise)."""
    rng = np.random.default_rng()
    experts, rows, top_k, hidden, inter = 32, 4, 8, 512, 256
    raws = [stacked_weight(qt, experts, n, k, rng)[0] for n, k in ((inter, hidden), (inter, hidden), (hidden, inter))]
    dev = [gk.raw(r) for r in raws]
    ids = _ids(rng, rows, experts, top_k)
    x = bf_round(rng.standard_normal((rows, hidden)))
    res = bf_round(rng.standard_normal((rows, hidden)))
    w = rng.uniform(0.1, 1.0, (rows, top_k)).astype(np.float32)
    glu = expert_gemv_kernel("glu", qt, inter, hidden, top_k)
    down = expert_gemv_kernel("down", qt, hidden, inter, top_k, residual=True)

    def run(t0: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        act, out, ids_t = gk.nan_like((n, top_k, inter)), gk.bf(res[t0 : t0 + n]), gk.i32(ids[t0 : t0 + n])
        gk.launch(glu, [act, dev[0], dev[1], gk.bf(x[t0 : t0 + n]), ids_t, n], n)
        gk.launch(down, [out, dev[2], act, ids_t, gk.f32(w[t0 : t0 + n]), out, n], n)
        return gk.host(act), gk.host(out)

    act_b, out_b = run(0, rows)
    assert not np.isnan(out_b).any()
    for t in range(rows):
        act_s, out_s = run(t, 1)
        np.testing.assert_array_equal(act_b[t], act_s[0])
        np.testing.assert_array_equal(out_b[t], out_s[0])


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "tiny"])
@pytest.mark.parametrize("glu_q,down_q", [("q4_k", "q6_k"), ("q4_k", "q4_k"), ("q6_k", "q6_k"), ("q5_k", "q5_k")])
def test_q8_per_slot_kernels_match_numpy(gk, shape, glu_q, down_q):
    """moe_gemv_q8 glu then down (int8 x rows, dp4a) at the Qwen3-30B-A3B expert shape (hidden
    2048, moe_intermediate 768, top 8; 16 experts here) and the tiny model's (256, 256, top 2):
    (q4_k_m's q4_k / q6_k, q5_k_m's q5_k) against numpy on x as the kernel rounds it
    (q8x_round_trip: 1e-2) and on x itself (3e-2),
    act and out poisoned first, the residual aliasing out, the batch-1 trigger; then 3 tokens
    give each token the bits a 1-token launch gives it."""
    rng = np.random.default_rng()
    e, hidden, inter, top_k = (16, 2048, 768, 8) if shape != "tiny" else (8, 256, 256, 2)
    wg_raw, wg = stacked_weight(glu_q, e, inter, hidden, rng)
    wu_raw, wu = stacked_weight(glu_q, e, inter, hidden, rng)
    wd_raw, wd = stacked_weight(down_q, e, hidden, inter, rng)
    dev = [gk.raw(r) for r in (wg_raw, wu_raw, wd_raw)]
    rows = 3
    ids = _ids(rng, rows, e, top_k)
    x = bf_round(rng.standard_normal((rows, hidden)))
    r = bf_round(rng.standard_normal((rows, hidden)))
    w = rng.uniform(0.1, 1.0, (rows, top_k)).astype(np.float32)
    glu = expert_q8_kernel("glu", glu_q, inter, hidden, top_k, trigger=True)
    down = expert_q8_kernel("down", down_q, hidden, inter, top_k, residual=True, trigger=True)

    def run(t0: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        act, out, ids_t = gk.nan_like((n, top_k, inter)), gk.bf(r[t0 : t0 + n]), gk.i32(ids[t0 : t0 + n])
        gk.launch(glu, [act, dev[0], dev[1], gk.bf(x[t0 : t0 + n]), ids_t, n], n)
        gk.launch(down, [out, dev[2], act, ids_t, gk.f32(w[t0 : t0 + n]), out, n], n)
        return gk.host(act), gk.host(out)

    act, out = run(0, 1)
    assert not np.isnan(act).any() and not np.isnan(out).any()
    for xr, tol in ((quant.q8x_round_trip(x[:1]).astype(np.float64), 1e-2), (x[:1], 3e-2)):
        g = np.einsum("tk,tjnk->tjn", xr, wg[ids[:1]])
        ref_act = g / (1 + np.exp(-np.clip(g, -80, 80))) * np.einsum("tk,tjnk->tjn", xr, wu[ids[:1]])
        assert rel_err(act, ref_act) < tol, (tol, rel_err(act, ref_act))
    for ar, tol in ((quant.q8x_round_trip(act.astype(np.float32)).astype(np.float64), 1e-2), (act, 3e-2)):
        want = np.einsum("tj,tjn->tn", w[:1], np.einsum("tjk,tjnk->tjn", ar, wd[ids[:1]])) + r[:1]
        assert rel_err(out, want) < tol, (tol, rel_err(out, want))
    act_b, out_b = run(0, rows)
    np.testing.assert_array_equal(act_b[0], act[0])
    np.testing.assert_array_equal(out_b[0], out[0])
    for t in range(1, rows):
        act_s, out_s = run(t, 1)
        np.testing.assert_array_equal(act_b[t], act_s[0])
        np.testing.assert_array_equal(out_b[t], out_s[0])


@pytest.mark.parametrize("glu_q", ["q4_k", "q6_k"])
def test_q8_glu_routes_as_the_router_does(gk, glu_q):
    """Batch 1 as the plan runs it (engine.lowering.moe.route_in_glu): moe_router with route off
    (logits and h only; ids, weights and the counter untouched), then moe_gemv_q8 glu routing the
    token from those logits: the ids and weights bitwise what the routing moe_router gives from
    the same x, the act bitwise the plain glu's on those ids. Qwen3-30B-A3B router shape (128
    experts, top 8, hidden 2048), 16 expert rows wide."""
    rng = np.random.default_rng()
    experts, top_k, hidden, inter = 128, 8, 2048, 64
    wg_raw, _ = stacked_weight(glu_q, experts, inter, hidden, rng)
    wu_raw, _ = stacked_weight(glu_q, experts, inter, hidden, rng)
    wg, wu = gk.raw(wg_raw), gk.raw(wu_raw)
    w = gk.f32(rng.standard_normal((experts, hidden)).astype(np.float32) * 0.05)
    nw = gk.f32(rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    x = gk.bf(bf_round(rng.standard_normal((1, hidden)) * 3))
    count = gk.i32(np.zeros(1))
    norm = {"eps": 1e-6, "h_stride": hidden, "trigger": True}
    outs = {}
    for route in (True, False):
        ids, wts = gk.i32(np.full((1, top_k), -7)), gk.nan_like((1, top_k), "f32")
        logits, h = gk.nan_like((1, experts), "f32"), gk.nan_like((1, hidden))
        gk.launch(router_kernel(experts, hidden, top_k, True, "f32", hidden, route=route, **norm),
                  [ids, wts, logits, x, w, count, 1, nw, h], 1)
        act = gk.nan_like((1, top_k, inter))
        if route:
            assert gk.host(count).tolist() == [0]
            gk.launch(expert_q8_kernel("glu", glu_q, inter, hidden, top_k, trigger=True), [act, wg, wu, h, ids, 1], 1)
        else:
            assert gk.host(ids).tolist() == [[-7] * top_k] and np.isnan(gk.host(wts)).all()
            glu = expert_q8_kernel("glu", glu_q, inter, hidden, top_k, trigger=True, route=(experts, True))
            gk.launch(glu, [act, wg, wu, h, ids, 1, wts, logits], 1)
        outs[route] = [gk.host(a) for a in (ids, wts, logits, act)]
    for a, b in zip(outs[True], outs[False], strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.isnan(outs[False][3]).any()


def test_sparse_mlp_end_to_end(gk):
    """logits -> moe_topk -> glu -> down(+ residual) against ops_ref_moe on the same routing."""
    rng = np.random.default_rng()
    e, hidden, inter, top_k, rows, qt = 16, 256, 256, 4, 5, "q8_0"
    wg_raw, wg = stacked_weight(qt, e, inter, hidden, rng)
    wu_raw, wu = stacked_weight(qt, e, inter, hidden, rng)
    wd_raw, wd = stacked_weight(qt, e, hidden, inter, rng)
    h = bf_round(rng.standard_normal((rows, hidden)))
    res = bf_round(rng.standard_normal((rows, hidden)))
    logits = (rng.standard_normal((rows, e)) * 2).astype(np.float32)
    ids = gk.i32(np.zeros((rows, top_k)))
    wts = gk.f32(np.zeros((rows, top_k)))
    act = gk.nan_like((rows, top_k, inter))
    out = gk.bf(res)
    gk.launch(topk_kernel(e, top_k, True), [ids, wts, gk.f32(logits), rows], rows)
    dev = [gk.raw(x) for x in (wg_raw, wu_raw, wd_raw)]
    gk.launch(expert_gemv_kernel("glu", qt, inter, hidden, top_k), [act, dev[0], dev[1], gk.bf(h), ids, rows], rows)
    down = expert_gemv_kernel("down", qt, hidden, inter, top_k, residual=True)
    gk.launch(down, [out, dev[2], act, ids, wts, out, rows], rows)
    want_ids, want_w = moe_route(logits, np.eye(e, dtype=np.float32), top_k, True)
    np.testing.assert_array_equal(gk.host(ids), want_ids)
    ref = moe_experts(h.astype(np.float32), want_ids, want_w, wg.astype(np.float32), wu.astype(np.float32),
                      wd.astype(np.float32), residual=res.astype(np.float32))
    got = gk.host(out)
    assert rel_err(got, ref) < 2e-2, rel_err(got, ref)


def test_shared_expert_gate_and_add(gk):
    """moe_shared: out += sigmoid(x . gate) * y, in place, per token."""
    rng = np.random.default_rng()
    rows, hidden = 6, 2048
    x = bf_round(rng.standard_normal((rows, hidden)) * 0.5)
    y = bf_round(rng.standard_normal((rows, hidden)))
    base = bf_round(rng.standard_normal((rows, hidden)))
    gate = (rng.standard_normal(hidden) * 0.05).astype(np.float32)
    out = gk.bf(base)
    gk.launch(shared_kernel(hidden), [out, gk.bf(y), gk.bf(x), gk.f32(gate), rows], rows)
    want = base + y / (1 + np.exp(-(x @ gate.astype(np.float64))))[:, None]
    assert rel_err(gk.host(out), want) < 1e-2


@pytest.mark.parametrize("down_q", ["q4_k", "q6_k"])
def test_q8_down_with_the_shared_gate_folded_in_stores_moe_shareds_bits(gk, down_q):
    """Batch 1 as engine.lowering.moe.shared_into_down plans it (Qwen3.6-35B-A3B: hidden 2048,
    moe_intermediate 512, top 8; 16 experts here): moe_gemv_q8 down in its ``shared`` form against
    the plain down (+ residual in place) then moe_shared: the same out bits, for 1 and 3 rows."""
    rng = np.random.default_rng()
    e, hidden, inter, top_k = 16, 2048, 512, 8
    wd_raw, _ = stacked_weight(down_q, e, hidden, inter, rng)
    wd = gk.raw(wd_raw)
    plain = expert_q8_kernel("down", down_q, hidden, inter, top_k, residual=True, trigger=True)
    fused = expert_q8_kernel("down", down_q, hidden, inter, top_k, residual=True, trigger=True, shared=256)
    shared = shared_kernel(hidden)
    assert fused.block == plain.block == shared.block and fused.spec.entry != plain.spec.entry
    for rows in (1, 3):
        ids = gk.i32(_ids(rng, rows, e, top_k))
        act = gk.bf(bf_round(rng.standard_normal((rows, top_k, inter))))
        w = gk.f32(rng.uniform(0.1, 1.0, (rows, top_k)))
        res = bf_round(rng.standard_normal((rows, hidden)))
        y, h = gk.bf(bf_round(rng.standard_normal((rows, hidden)))), gk.bf(bf_round(rng.standard_normal((rows, hidden)) * 0.5))
        gate = gk.f32(rng.standard_normal(hidden) * 0.05)
        want = gk.bf(res)
        gk.launch(plain, [want, wd, act, ids, w, want, rows], rows)
        gk.launch(shared, [want, y, h, gate, rows], rows)
        got = gk.bf(res)
        gk.launch(fused, [got, wd, act, ids, w, got, y, h, gate, rows], rows)
        assert not np.isnan(gk.host(want)).any()
        np.testing.assert_array_equal(gk.host(got), gk.host(want))


def test_combine_with_the_shared_gate_folded_in_stores_moe_shareds_bits(gk):
    """moe_combine's ``shared`` form (the batched decode buckets: engine.lowering.moe.shared_into_down)
    against the plain combine (+ residual in place) then moe_shared, Qwen3.6-35B-A3B's hidden 2048,
    top 8, 5 rows: the same out bits."""
    rng = np.random.default_rng()
    hidden, top_k, rows = 2048, 8, 5
    partial = gk.f32(rng.standard_normal((rows, top_k, hidden)))
    w = gk.f32(rng.uniform(0.1, 1.0, (rows, top_k)))
    res = bf_round(rng.standard_normal((rows, hidden)))
    y, h = gk.bf(bf_round(rng.standard_normal((rows, hidden)))), gk.bf(bf_round(rng.standard_normal((rows, hidden)) * 0.5))
    gate = gk.f32(rng.standard_normal(hidden) * 0.05)
    want = gk.bf(res)
    gk.launch(combine_kernel(hidden, top_k), [want, partial, w, want, rows], rows)
    gk.launch(shared_kernel(hidden), [want, y, h, gate, rows], rows)
    got = gk.bf(res)
    gk.launch(combine_kernel(hidden, top_k, shared=256), [got, partial, w, got, y, h, gate, rows], rows)
    assert not np.isnan(gk.host(want)).any()
    np.testing.assert_array_equal(gk.host(got), gk.host(want))
