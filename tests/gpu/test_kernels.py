"""Every kernel family against numpy on a real GPU, through engine.cuda (tests/gpu/conftest.py
skips the lot without one).

Each kernel runs on fresh random inputs with its outputs poisoned with NaN and fails on a NaN left
or a relative error ||out - ref|| / ||ref|| above its tolerance. References: engine.quant
(dequantisation, the q8x int8 round trip), engine.ops_ref (rmsnorm, silu_mul, rope, attention)
and engine.sampling (penalties). The specs are the ones the plans take under this device's
profile (and under every profile of the same arch), with row and column tails, plus the option
variants tests/test_kernels_compile.py compiles.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from fixtures.catalog_specs import attention_params, attention_prefill_params, rope_params
from fixtures.engine_probes import rope
from gpu_harness import (
    DeviceArray,
    bf_round,
    needs_sm90,
    poisoned,
    rel_err,
    upload,
    uploaded_weights,
)

from engine import cuda, ops_ref, quant, storage
from engine import kernel_catalog as kc
from engine.profile import all_profiles
from engine.types import ConfigError

GEMV_SHAPE = (1003, 2560)  # an odd n (the last block's column tail), Qwen3-4B's hidden size
# (rows, bmax, residual, out dtype): batch 1, a partial and a full batch, more rows than bmax
GEMV_CASES = ((1, 1, False, "bf16"), (1, 1, True, "bf16"), (1, 1, False, "f32"),
              (3, 8, False, "bf16"), (8, 8, True, "bf16"), (8, 8, False, "f32"), (13, 8, True, "bf16"))


@pytest.fixture(scope="module")
def weights():
    return uploaded_weights(7)


def _same_arch_tunings(profile) -> dict:
    return {name: p.tuning for name, p in all_profiles().items() if p.arch == profile.arch}


# ---- GEMV ---------------------------------------------------------------------------------------


def run_gemv(kernels, weights, spec, rows: int, rng) -> tuple[float, float, int]:
    """Launch one gemv spec on random x (through its prologue, if any) and return (rel err, tol, NaNs)."""
    p = spec.params
    qt, n, k, od = p["quant"], p["n"], p["k"], p["out_dtype"]
    w, deq = weights(qt, n, k)
    pro = p.get("prologue") or ""
    args: dict = {}
    if pro == "norm":
        x = bf_round(rng.standard_normal((rows, p.get("x_stride") or k)) * 3.0)
        nw = rng.uniform(0.5, 1.5, k).astype(np.float32)
        xin = bf_round(ops_ref.rmsnorm(x[:, :k], nw, float(p["eps"])))
        args["norm_w"] = upload(nw, "f32")
    elif pro == "silu":
        x = bf_round(rng.standard_normal((rows, p["x_stride"])) * 2.0)
        xin = bf_round(ops_ref.silu_mul(x[:, :k], x[:, p["u_off"] : p["u_off"] + k]))
    else:
        x = xin = bf_round(rng.standard_normal((rows, k)))
    r = bf_round(rng.standard_normal((rows, n)))
    out = upload(r, "bf16") if p["residual"] else poisoned((rows, n), od)  # the residual aliases out
    args.update(out=out, w=w, x=upload(x, "bf16"), residual=out if p["residual"] else 0, rows=rows)
    if int(p.get("kparts", 1)) > 1:  # k split over grid.z: partial sums, per-tile counters (zeroed)
        args["kpart_sum"] = DeviceArray((int(p["kparts"]) * rows * n,), "f32")
        tiles = -(-n // p["rows_per_block"]) * -(-rows // p["bmax"])  # as the plan sizes it
        args["kpart_count"] = upload(np.zeros(tiles, np.int32), "i32")
    for a, off, nbytes in kc.l2_pf_ranges(p.get("l2_pf") or "") if p.get("l2_pf") else ():
        assert off + nbytes <= w.nbytes, (spec.entry, off, nbytes)
        args[f"pf{a}"] = w  # a prefetch only warms L2: any readable range of the right size
    for name, _ in kc.kernel_args(spec):
        if name.startswith("pf") and name not in args:
            args[name] = w
    kernels.launch(kc.choice("gemv", **p), rows, **args)
    got = out.get()
    resid = r if p["residual"] else 0
    if p.get("q8x"):  # the exact twin: int8 x rows in groups of 32 (engine.quant.q8x_round_trip)
        ref = quant.q8x_round_trip(xin).astype(np.float64) @ deq.T + resid
        tol = 1e-2 if od == "bf16" else (1e-3 if pro else 1e-4)
    else:
        ref = xin @ deq.T + resid
        tol = 1e-2
    return rel_err(got, ref), tol, int(np.isnan(got).sum())


def gemv_failures(kernels, weights, cases, rng) -> list[tuple]:
    """run_gemv over (spec, rows) ``cases``: (entry, rows, rel err, tol, NaNs) of each one with a NaN
    left or an error above its tolerance."""
    bad = []
    for s, rows in cases:
        err, tol, nans = run_gemv(kernels, weights, s, rows, rng)
        if nans or not err <= tol:
            bad.append((s.entry, rows, err, tol, nans))
    return bad


def _gemv_specs_of(tuning: dict, sm_count: int) -> list[tuple]:
    """(spec, rows) of the decode GEMVs a plan takes under ``tuning``: every file type (uploaded in
    the layout the tuning picks), every batch case, with no / the rmsnorm / the silu_mul prologue."""
    n, k = GEMV_SHAPE
    out = []
    for ft in [t for t in kc.QUANTS if t not in storage.REPACKED_FROM]:
        qt = kc.upload_type(ft, k, tuning)
        for rows, bmax, residual, od in GEMV_CASES:
            try:
                p = kc.linear_params(qt, n, k, tuning, residual=residual, out_dtype=od, bmax=bmax, sm_count=sm_count)
                out.append((kc.spec("gemv", **p), rows))
                if rows == bmax or rows == 1:
                    out.append((kc.spec("gemv", **{**p, "prologue": "norm", "x_stride": k, "eps": 1e-6}), rows))
                    if od == "bf16":
                        silu = dict(prologue="silu", x_stride=2 * k, u_off=k)
                        out.append((kc.spec("gemv", **{**p, **silu}), rows))
            except ConfigError:  # a type or option this kernel does not take (e.g. no decoder)
                continue
    return list(dict.fromkeys(out))


@pytest.mark.parametrize("tuning_of", sorted(all_profiles()))
def test_gemv_under_each_profile_tuning(kernels, weights, profile, device, tuning_of):
    """Every storage type x batch case x prologue under the tuning of each profile of this arch."""
    tunings = _same_arch_tunings(profile)
    if tuning_of not in tunings:
        pytest.skip(f"{tuning_of} compiles for another arch than {profile.arch}")
    cases = _gemv_specs_of(tunings[tuning_of], device.sm_count)
    kernels.prebuild(s for s, _ in cases)
    bad = gemv_failures(kernels, weights, cases, np.random.default_rng())
    assert len(cases) > 50 and not bad, bad


def _variant_gemvs(arch_sm90: bool) -> list:
    import test_kernels_compile as tkc

    specs = tkc._gemv_variant_specs() + (tkc._wsm_specs() if arch_sm90 else [])
    # the glu epilogue (gate and up rows of a tile paired) runs through the plans in test_runner_cuda
    return [s for s in specs if not s.params.get("glu")]


def test_gemv_option_variants(kernels, weights, device):
    """The gemv options test_kernels_compile.py compiles (staged / prefetch / coop / q8x /
    k splits / lanes / capped grids / prologues / L2 prefetch; wsm on sm_90), at batch 1 and 8."""
    specs = _variant_gemvs(device.compute_capability[0] == 9)
    kernels.prebuild(specs)
    cases = [(s, rows) for s in specs for rows in sorted({1, s.params["bmax"], s.params["bmax"] + 3})]
    bad = gemv_failures(kernels, weights, cases, np.random.default_rng())
    assert len(specs) > 20 and not bad, bad


def test_gemv_specs_of_the_hidden_256_moe_plan(kernels, weights, profile, tmp_path):
    """The decode GEMVs (template gemv) of the tiny q4_k_m Qwen3-MoE of tests/gpu/test_moe_runner.py
    (hidden 256: one k-quant super-block per row, fewer segments than a coop lane group) under this
    device's profile, at batch 1 (decode1) and at 3 rows (decode): the shapes the kernel tests above
    (k 2560) and the dense q4_k_m models (hidden 512) do not reach."""
    from fixtures.checkpoints import write_qwen3_moe_gguf
    from fixtures.moe_case import DIMS, SEED

    from engine.model import load_model
    from engine.plan import build_plan

    m = load_model(write_qwen3_moe_gguf(tmp_path / "m.gguf", quant="q4_k_m", seed=SEED, **DIMS))
    plan = build_plan(m.graph, m.dims, m.quant, profile, m.tensor_dtypes, m.rope_style)
    cases = {}
    for st in plan.steps:
        for mode, rows in (("decode1", 1), ("decode", 3)):
            for la in st.launches.get(mode, ()):
                if la.spec.template == "gemv" and la.min_rows <= rows and (not la.max_rows or rows <= la.max_rows):
                    cases[la.spec, rows] = None
    assert any(s.params["quant"] == "q4_k" and s.params["k"] == 256 and r == 1 for s, r in cases), cases
    kernels.prebuild(s for s, _ in cases)
    bad = gemv_failures(kernels, weights, cases, np.random.default_rng())
    assert not bad, bad


# ---- elementwise, embed, rope -------------------------------------------------------------------


def test_rmsnorm(kernels, profile):
    rng = np.random.default_rng()
    for n, residual in ((576, False), (4096, True), (2560, True)):
        rows, eps = 7, 1e-5
        c = kc.choice("rmsnorm", n=n, eps=eps, threads=kc.NORM_THREADS, residual=residual)
        x = bf_round(rng.standard_normal((rows, n)))
        r = bf_round(rng.standard_normal((rows, n)))
        w = rng.standard_normal(n).astype(np.float32)
        xt, out = upload(x, "bf16"), poisoned((rows, n))
        kernels.launch(c, rows, out=out, x=xt, r=upload(r, "bf16") if residual else 0, w=upload(w, "f32"), rows=rows)
        s = bf_round(x + r) if residual else x
        assert rel_err(out.get(), ops_ref.rmsnorm(s, w, eps)) <= 1e-2, c.spec.entry
        if residual:  # the sum is written back into x (the residual stream)
            assert rel_err(xt.get(), x + r) <= 1e-2, c.spec.entry


def test_embed_every_storage_type(kernels, weights, profile):
    rng = np.random.default_rng()
    hidden, vocab, rows = 2560, 300, 9
    checked = []
    for qt in kc.QUANTS:
        try:
            c = kc.choice("embed", quant=qt, hidden=hidden, threads=kc.ELEMENTWISE_THREADS)
        except ConfigError:
            continue
        table, deq = weights(qt, vocab, hidden)
        ids = rng.integers(0, vocab, rows)
        out = poisoned((rows, hidden))
        kernels.launch(c, rows, out=out, table=table, ids=upload(ids, "i32"), rows=rows)
        assert rel_err(out.get(), bf_round(ops_ref.embed(ids, deq))) <= 1e-2, c.spec.entry
        checked.append(qt)
    assert {"bf16", "q8_0", "q4_k", "q6_k"} <= set(checked), checked


@pytest.mark.parametrize("style,qk_norm,shape", [("neox", True, (16, 8, 128)), ("interleaved", False, (9, 3, 64))])
def test_rope_qk_norm_and_cache_write(kernels, profile, style, qk_norm, shape):
    H, KV, D = shape
    T, eps, theta = 11, 1e-6, 1e6
    width = (H + 2 * KV) * D
    dims = dict(heads=H, kv_heads=KV, head_dim=D, rope_theta=theta, rms_eps=eps)
    c = kc.choice("rope", **rope_params(dims, profile.tuning, style, q_stride=width, kv_stride=width, qk_norm=qk_norm))
    rng = np.random.default_rng()
    buf = bf_round(rng.standard_normal((T, width)))
    pos = rng.integers(0, 30000, T)
    slots = rng.permutation(64)[:T]
    slots[0] = -1  # a padding row: no cache write
    qn, kn = rng.standard_normal(D).astype(np.float32), rng.standard_normal(D).astype(np.float32)
    bt = upload(buf, "bf16")
    kc_t, vc_t = poisoned((64, KV, D)), poisoned((64, KV, D))
    kernels.launch(
        c, T, q=bt, k=bt.at(H * D), v=bt.at((H + KV) * D), positions=upload(pos, "i32"), q_norm=upload(qn, "f32"),
        k_norm=upload(kn, "f32"), freq=0, k_cache=kc_t, v_cache=vc_t, slots=upload(slots, "i32"), rows=T,
    )
    q, k, v = buf[:, : H * D], buf[:, H * D : (H + KV) * D], buf[:, (H + KV) * D :]
    if qk_norm:
        q, k = bf_round(ops_ref.head_rmsnorm(q, qn, eps, D)), bf_round(ops_ref.head_rmsnorm(k, kn, eps, D))
    qr, kr = rope(q, k, pos, head_dim=D, rope_dim=D, theta=theta, style=style)
    got = bt.get()
    assert rel_err(got[:, : H * D], qr) <= 1e-2
    assert rel_err(got[:, H * D : (H + KV) * D], kr) <= 1e-2
    assert rel_err(kc_t.get()[slots[1:]].reshape(T - 1, -1), kr[1:]) <= 1e-2
    assert rel_err(vc_t.get()[slots[1:]].reshape(T - 1, -1), v[1:]) <= 1e-2


def test_silu_mul(kernels, profile):
    rows, inter = 6, 1536
    c = kc.choice("silu_mul", inter=inter, in_stride=2 * inter, threads=kc.ELEMENTWISE_THREADS)
    gu = bf_round(np.random.default_rng().standard_normal((rows, 2 * inter)) * 3)
    t, out = upload(gu, "bf16"), poisoned((rows, inter))
    kernels.launch(c, rows, out=out, g=t, u=t.at(inter), rows=rows)
    assert rel_err(out.get(), ops_ref.silu_mul(gu[:, :inter], gu[:, inter:])) <= 1e-2


# ---- attention ----------------------------------------------------------------------------------


class PagedCache:
    """A random paged bf16 KV cache [blocks, block_size, kv_heads, head_dim]; each sequence's blocks
    a random disjoint subset, unused table entries pointing at a valid block it must not read.

    With ``first_visible`` (a sliding window's first key per sequence), the device table's entries
    for the blocks wholly before it point at a block of NaN instead (as a released block may hold
    anything), so a kernel that reads one fails; ``tables`` (the reference's) keep the real blocks."""

    def __init__(self, rng, ctxs: list[int], kvh: int, hd: int, bs: int, first_visible: list[int] | None = None):
        need = [-(-c // bs) for c in ctxs]
        nblocks = sum(need) + 3
        perm = rng.permutation(nblocks)
        self.tables = np.zeros((len(ctxs), max(need)), dtype=np.int32)
        at = 0
        for s, n in enumerate(need):
            self.tables[s, :n], self.tables[s, n:] = perm[at : at + n], perm[-1]
            at += n
        released = first_visible is not None  # one more block: the NaN one, last
        self.k = bf_round(rng.standard_normal((nblocks + released, bs, kvh, hd)))
        self.v = bf_round(rng.standard_normal((nblocks + released, bs, kvh, hd)))
        k, v, tables = self.k, self.v, self.tables
        if released:
            k, v, tables = self.k.copy(), self.v.copy(), self.tables.copy()
            k[nblocks], v[nblocks] = np.nan, np.nan
            for s, lo in enumerate(first_visible):
                tables[s, : lo // bs] = nblocks
        self.kd, self.vd, self.td = upload(k, "bf16"), upload(v, "bf16"), upload(tables, "i32")

    def ref(self, s: int, q: np.ndarray, pos0: int, scale: float, window: int = 0) -> np.ndarray:
        """Sequence s's queries q [T, heads, hd] at positions pos0.. over its cache (ops_ref), the
        last ``window`` keys only where a sliding window is set."""
        kk, vv = ops_ref.gather_kv(self.k, self.v, self.tables[s], pos0 + q.shape[0])
        return ops_ref.attention_dense(q, kk, vv, pos0, scale, window or None)


def run_decode_attention(kernels, spec, ctxs: list[int], rng, released: bool = False) -> tuple[float, int]:
    """Launch one decode attention spec (and its combine, when split) on sequences of ``ctxs`` keys
    over a random paged cache, each decoding its last position, and return (rel err against
    ops_ref, NaNs in the output). ``released``: with the spec's window, the blocks wholly before
    each query's window are NaN blocks (PagedCache's first_visible)."""
    p = spec.params
    H, KV, D, bs = p["heads"], p["kv_heads"], p["head_dim"], p["block_size"]
    first = [ops_ref.window_start(c - 1, p.get("window")) for c in ctxs] if released else None
    cache = PagedCache(rng, ctxs, KV, D, bs, first)
    S = len(ctxs)
    pos = np.array([c - 1 for c in ctxs], dtype=np.int32)
    qkv = bf_round(rng.standard_normal((S, p["q_stride"])))
    out = poisoned((S, p["out_stride"]))
    max_splits = -(-int(pos.max() + 1) // p["split"])
    part_o, part_ml = poisoned((S, H, max_splits, D), "f32"), poisoned((S, H, max_splits, 2), "f32")
    args = dict(
        out=out, part_o=0 if p["direct"] else part_o, part_ml=0 if p["direct"] else part_ml, q=upload(qkv, "bf16"),
        k_cache=cache.kd, v_cache=cache.vd, block_tables=cache.td, positions=upload(pos, "i32"),
        max_blocks=cache.tables.shape[1], max_splits=1 if p["direct"] else max_splits,
    )
    for name, _ in kc.kernel_args(spec):
        if name.startswith("pf"):
            args[name] = cache.kd  # an L2 prefetch of a later weight: any readable range
    kernels.launch(kc.choice("attention", **p), S, grid_kw={"max_splits": max_splits}, **args)
    if not p["direct"]:
        win = {"window": p["window"]} if p.get("window") else {}  # the combine starts at the window's first split
        cc = kc.choice("attention_combine", heads=H, head_dim=D, split=p["split"], out_stride=p["out_stride"], **win)
        kernels.launch(cc, S, out=out, part_o=part_o, part_ml=part_ml, positions=upload(pos, "i32"), max_splits=max_splits)
    got = out.get()[:, : H * D]
    q = qkv[:, : H * D].reshape(S, H, D)
    ref = np.concatenate([cache.ref(s, q[s : s + 1], int(pos[s]), p["scale"], p.get("window", 0)) for s in range(S)])
    return rel_err(got, ref), int(np.isnan(got).sum())


def test_decode_attention_profile_and_variants(kernels, profile):
    """Direct and split (+ combine) decode attention under the profile's tuning at Qwen3-4B and
    SmolLM2 shapes, and the variants test_kernels_compile.py compiles (GQA 1 / 3 / 4 / 8, vec16,
    warps, triggers, L2 prefetch), at contexts from 1 token to several splits."""
    import test_kernels_compile as tkc

    bs = profile.kv_block_size
    specs = []
    for H, KV, D in ((32, 8, 128), (9, 3, 64)):
        dims = dict(heads=H, kv_heads=KV, head_dim=D)
        for direct in (True, False):
            p = attention_params(dims, profile.tuning, bs, direct=direct,
                                    q_stride=(H + 2 * KV) * D, out_stride=H * D)
            specs.append(kc.spec("attention", **p))
    fused_rope = {"k_in", "slots"}
    specs += [s for s in tkc._attention_variant_specs()
              if s.template == "attention" and not fused_rope & {n for n, _ in kc.kernel_args(s)}]
    kernels.prebuild(specs)
    rng = np.random.default_rng()
    bad = []
    for s in specs:
        err, _ = run_decode_attention(kernels, s, [1, 17, 700, 1500 if s.params["direct"] else 3000], rng)
        if not err <= 1e-2:
            bad.append((s.entry, err))
    assert len(specs) > 10 and not bad, bad


PREFILL_CASES = [  # heads, kv_heads, head_dim, [(start position, rows)], out padding
    (32, 8, 128, [(0, 37), (100, 130), (5, 1), (55, 64)], 0),
    (32, 8, 128, [(1000, 200)], 0),
    (9, 3, 64, [(0, 70), (33, 17), (200, 129)], 0),
    (16, 16, 64, [(0, 65), (7, 3)], 64),
    (32, 4, 128, [(16, 80), (0, 1), (300, 47)], 0),
]


@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_prefill_attention(kernels, profile, case):
    """Varlen prefill (several sequences, prefix and chunk starts) with the profile's tile and the
    variant tiles; padding columns of the output stay untouched."""
    H, KV, D, seqs, pad = PREFILL_CASES[case]
    bs = profile.kv_block_size
    rng = np.random.default_rng(1000 + case)
    cache = PagedCache(rng, [p0 + n for p0, n in seqs], KV, D, bs)
    rows, q_stride, out_stride = sum(n for _, n in seqs), (H + 2 * KV) * D, H * D + pad
    qkv = bf_round(rng.standard_normal((rows, q_stride)))
    starts = np.cumsum([0] + [n for _, n in seqs]).astype(np.int32)
    pos = np.concatenate([np.arange(p0, p0 + n) for p0, n in seqs]).astype(np.int32)
    dims = dict(heads=H, kv_heads=KV, head_dim=D)
    base = attention_prefill_params(dims, profile.tuning, bs, q_stride=q_stride, out_stride=out_stride)
    tiles = {(base["block_q"], base["block_kv"], base["warps"]), (64, 64, 4), (128, 32, 8), (64, 32, 4)}
    q = qkv[:, : H * D].reshape(rows, H, D)
    ref = np.concatenate([cache.ref(s, q[starts[s] : starts[s + 1]], p0, D**-0.5) for s, (p0, _) in enumerate(seqs)])
    for bq, bkv, warps in sorted(tiles):
        c = kc.choice("attention_prefill", **{**base, "block_q": bq, "block_kv": bkv, "warps": warps})
        out = poisoned((rows, out_stride))
        kernels.launch(
            c, rows, grid_kw={"max_q": max(n for _, n in seqs), "nseq": len(seqs)}, out=out, q=upload(qkv, "bf16"),
            k_cache=cache.kd, v_cache=cache.vd, block_tables=cache.td, positions=upload(pos, "i32"),
            seq_starts=upload(starts, "i32"), max_blocks=cache.tables.shape[1],
        )
        got = out.get()
        assert rel_err(got[:, : H * D], ref) <= 1e-2, c.spec.entry
        assert np.isnan(got[:, H * D :]).all(), f"{c.spec.entry} wrote past heads * head_dim"


# ---- sampling -----------------------------------------------------------------------------------


def philox_uniform(seed: int, step: int) -> float:
    """The sampler's uniform draw: Philox4x32-10 of (step, seed), the top 24 bits of word 0."""
    M = 0xFFFFFFFF
    c0, c1, c2, c3 = step & M, (step >> 32) & M, 0, 0
    k0, k1 = seed & M, (seed >> 32) & M
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & M, p1 & M, ((p0 >> 32) ^ c3 ^ k1) & M, p0 & M
        k0, k1 = (k0 + 0x9E3779B9) & M, (k1 + 0xBB67AE85) & M
    return (c0 >> 8) / 16777216.0


def sample_ref(logits, T, top_k, top_p, min_p, seed, step) -> int:
    if T <= 0:
        return int(np.argmax(logits))
    p = np.exp((logits - logits.max()) / T)
    thr = max(min_p, 0.0)
    if 0 < top_k < len(p):
        thr = max(thr, np.sort(p)[::-1][top_k - 1])
    if top_p < 1.0:
        kept = np.sort(p[p >= thr])[::-1]
        idx = int(np.searchsorted(np.cumsum(kept), top_p * kept.sum()))
        thr = max(thr, kept[min(idx, len(kept) - 1)])
    w = np.where(p >= thr, p, 0.0)
    return int(np.searchsorted(np.cumsum(w), philox_uniform(seed, step) * w.sum(), side="right"))


def test_argmax_sample_and_penalties(kernels, profile):
    from engine.sampling import apply_penalties, penalty_entries
    from engine.types import SamplingParams

    V, S = 151936, 64
    rng = np.random.default_rng()
    logits = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    lt = upload(logits, "f32")
    t = kc.SAMPLING_THREADS
    out = poisoned((S,), "i32")
    kernels.launch(kc.choice("argmax", vocab=V, ld=V, threads=t), S, out=out, logits=lt, rows=S)
    assert (out.get() == logits.argmax(-1)).all()

    temp = rng.choice([0.0, 0.7, 1.0], S).astype(np.float32)
    top_k = rng.choice([0, 1, 40], S).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5], S).astype(np.float32)
    min_p = rng.choice([0.0, 0.05], S).astype(np.float32)
    seeds = rng.integers(0, 2**63, S, dtype=np.uint64)
    steps = rng.integers(0, 1000, S).astype(np.int32)
    cs = kc.choice("sample", vocab=V, ld=V, threads=t)
    args = dict(out=out, logits=lt, temperature=upload(temp, "f32"), top_k=upload(top_k, "i32"),
                top_p=upload(top_p, "f32"), min_p=upload(min_p, "f32"), seed=upload(seeds.view(np.int64), "i64"),
                step=upload(steps, "i32"), rows=S)
    kernels.launch(cs, S, **args)
    got = out.get().copy()
    ref = [sample_ref(logits[i].astype(np.float64), temp[i], top_k[i], top_p[i], min_p[i], int(seeds[i]), int(steps[i]))
           for i in range(S)]
    assert ((got >= 0) & (got < V)).all() and np.mean(got == np.array(ref)) >= 0.9  # f32 ties at a cutoff may differ
    kernels.launch(cs, S, **args)
    assert (out.get() == got).all(), "the same seed and step must draw the same token"

    params = [SamplingParams(temperature=1.0,
                             repetition_penalty=float(rng.uniform(1.0, 2.0)) if r % 2 == 0 else 1.0,
                             presence_penalty=float(rng.uniform(-1, 1)) if r % 3 else 0.0,
                             frequency_penalty=float(rng.uniform(-1, 1)) if r % 4 else 0.0) for r in range(S)]
    hists = [list(rng.integers(0, V, 300)) for _ in range(S)]
    ents = []
    for r in range(S):
        toks, info = penalty_entries(params[r], hists[r], 200, V)
        ents.append(np.stack([np.full_like(toks, r), toks, info], axis=1))
    ent = np.concatenate(ents).astype(np.int32)
    buf = np.zeros(4 + ent.size, dtype=np.int32)
    buf[0], buf[4:] = len(ent), ent.reshape(-1)
    lt2 = upload(logits, "f32")
    cp = kc.choice("penalties", ld=V, threads=kc.ELEMENTWISE_THREADS)
    kernels.launch(
        cp, S, logits=lt2, entries=upload(buf, "i32"),
        presence=upload(np.array([p.presence_penalty for p in params], np.float32), "f32"),
        frequency=upload(np.array([p.frequency_penalty for p in params], np.float32), "f32"),
        repetition=upload(np.array([p.repetition_penalty for p in params], np.float32), "f32"), capacity=len(ent),
    )
    ref = np.stack([apply_penalties(logits[r], params[r], hists[r], 200) for r in range(S)])
    assert rel_err(lt2.get(), ref) <= 1e-6


# ---- prefill GEMMs ------------------------------------------------------------------------------


def run_gemm(kernels, weights, spec, m: int, rng) -> float:
    p = spec.params
    n, k, od, qt = p["n"], p["k"], p.get("out_dtype", "bf16"), p.get("quant", "bf16")
    a = bf_round(rng.standard_normal((m, k)))
    if qt == "bf16":
        wh = bf_round(rng.standard_normal((n, k)) * 0.05)
        w = upload(wh, "bf16")
    else:
        w, wh = weights(qt, n, k)
    r = rng.standard_normal((m, n))
    r = bf_round(r) if od == "bf16" else r.astype(np.float32).astype(np.float64)
    out = upload(r, od) if p["residual"] else poisoned((m, n), od)
    kernels.launch(kc.choice("gemm", **p), m, out=out, a=upload(a, "bf16"), w=w, residual=out if p["residual"] else 0, rows=m)
    return rel_err(out.get(), a @ wh.T + (r if p["residual"] else 0))


def test_gemm_profile_and_variants(kernels, weights, profile):
    """The mma.sync GEMM: the profile's prefill and wide-decode tilings (residual, f32 out, M and N
    tails) and the code variants test_kernels_compile.py compiles (every fused dequant type,
    split-K, swizzle, fragment double-buffering, W prefetch, rasterisation)."""
    import test_kernels_compile as tkc

    specs = [kc.spec("gemm", **kc.gemm_params(576, 1536, profile.tuning, residual=True)),
             kc.spec("gemm", **kc.gemm_params(1000, 512, profile.tuning, out_dtype="f32"))]
    if "gemm_decode" in profile.tuning:
        specs.append(kc.spec("gemm", **kc.gemm_params(2560, 4096, profile.tuning, residual=True, section="gemm_decode")))
    specs += tkc._gemm_variant_specs()
    kernels.prebuild(specs)
    rng = np.random.default_rng()
    bad = [(s.entry, m, e) for s in specs for m in (1, 130, 300) if not (e := run_gemm(kernels, weights, s, m, rng)) <= 1e-2]
    assert not bad, bad


WGMMA_CONFIGS = [  # (tile_n, consumers, m_frags, stages, raster, maxnreg)
    (256, 2, 1, 4, True, True), (256, 2, 1, 3, True, True), (256, 2, 1, 4, False, True),
    (256, 2, 1, 4, True, False), (128, 2, 1, 6, True, False), (128, 2, 2, 4, True, True),
    (128, 1, 1, 8, True, False), (64, 2, 1, 8, True, False),
]


def run_wgmma(kernels, cfg, m, n, k, rng, *, residual=False, out_dtype="bf16", extra_rows=0) -> tuple[float, bool]:
    """One gemm_wgmma launch: A's tensor map spans m + extra_rows rows (the extra ones NaN, as the
    runner's maps span the whole arena), out has 64 poisoned rows past m that must stay NaN."""
    p = dict(n=n, k=k, residual=residual, out_dtype=out_dtype, **dict(zip(kc.GEMM_WGMMA_TILE, cfg, strict=True)))
    c = kc.choice("gemm_wgmma", **p)
    a = bf_round(rng.standard_normal((m, k)))
    w = bf_round(rng.standard_normal((n, k)) * 0.05)
    ad = upload(np.concatenate([a, np.full((extra_rows, k), np.nan)]), "bf16")
    wd = upload(w, "bf16")
    ref = a @ w.T
    out_all = poisoned((m + 64, n), out_dtype)
    if residual:
        r = rng.standard_normal((m, n))
        r = bf_round(r) if out_dtype == "bf16" else r.astype(np.float32).astype(np.float64)
        out_all.put(np.concatenate([r, np.full((64, n), np.nan)]))
        ref = ref + r
    ta = upload(np.frombuffer(cuda.tensor_map_bf16(ad.ptr, m + extra_rows, k, 2 * k, kc.gemm_wgmma_tile_m(p)), np.uint8), "u8")
    tw = upload(np.frombuffer(cuda.tensor_map_bf16(wd.ptr, n, k, 2 * k, p["tile_n"]), np.uint8), "u8")
    assert ta.ptr % 64 == 0 and tw.ptr % 64 == 0  # cuMemAlloc aligns to 256 bytes
    kernels.launch(c, m, out=out_all, tmap_a=ta, tmap_w=tw, residual=out_all if residual else 0, rows=m)
    got = out_all.get()
    return rel_err(got[:m], ref), bool(np.isnan(got[m:]).all())


def test_gemm_wgmma(kernels, device, profile):
    """The Hopper prefill GEMM (TMA + wgmma): the profile's tiles at M tails from 1 to 2100 rows and
    N tails, residual aliasing out, f32 out, an A map over NaN rows past M, every tile config."""
    needs_sm90(device)
    if profile.arch != "sm_90a":
        pytest.skip(f"gemm_wgmma needs the sm_90a arch, the profile compiles for {profile.arch}")
    wide = kc.gemm_wgmma_params(9728, 2560, profile.tuning)  # (None where the profile leaves it off)
    pc = tuple(wide[x] for x in kc.GEMM_WGMMA_TILE) if wide else WGMMA_CONFIGS[0]
    cases = [dict(m=513, n=2560, k=9728, cfg=pc, residual=True),
             dict(m=300, n=576, k=1536, cfg=pc, residual=True, out_dtype="f32"),
             dict(m=100, n=1000, k=512, cfg=pc, extra_rows=200)]
    cases += [dict(m=m, n=1040, k=1024, cfg=pc, residual=m % 2 == 1) for m in (1, 7, 64, 100, 129, 513, 1100, 2100)]
    for cfg in WGMMA_CONFIGS:
        cases += [dict(m=77, n=1000, k=1024, cfg=cfg, residual=True), dict(m=1100, n=2560, k=576, cfg=cfg)]
    bad = []
    for i, case in enumerate(cases):
        case = dict(case)
        m, n, k, cfg = case.pop("m"), case.pop("n"), case.pop("k"), case.pop("cfg")
        err, untouched = run_wgmma(kernels, cfg, m, n, k, np.random.default_rng(2000 + i), **case)
        tol = 5e-3 if case.get("out_dtype") == "f32" else 1e-2
        if not (err <= tol and untouched):
            bad.append((cfg, m, n, k, case, err, untouched))
    assert not bad, bad


def test_harness_bf16_round_trip():
    """The harness's bf16 conversion rounds to nearest even and keeps NaN (the poison)."""
    from gpu_harness import from_bf16, to_bf16

    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.nan, 3.0e38], np.float32)
    y = from_bf16(to_bf16(x))
    assert y[0] == 1.0 and y[1] == 1.0 and y[2] == 1.015625 and y[3] == -2.5 and np.isnan(y[4])
    assert math.isfinite(y[5])
