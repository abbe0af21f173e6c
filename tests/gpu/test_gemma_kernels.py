"""The kernels and branches Gemma 3 added, against numpy on a real GPU (tests/gpu/conftest.py skips the
lot without one), each on fresh random inputs with its outputs poisoned with NaN:

* sliding-window attention (the ``window`` param): split decode + combine and the direct decode
  kernel (vec16 and scalar), and the flash prefill, at Gemma 3 270M's shape (4 heads, 1 KV head,
  head_dim 256) and a GQA-8 head_dim 128 one; the KV blocks wholly before every query's window hold
  NaN (as released blocks may hold anything), so a kernel that reads one fails;
* the GeGLU gate (silu_mul with act gelu_tanh), the residual add (in place), the scaled embedding;
  their f32 residual-stream forms (models/gemma3.yaml numerics.f32_values: x): the add and the
  rmsnorm (with and without its residual) on an f32 x, the embedding storing f32, all to f32 rounding;
* the decode GEMVs at Gemma 3 270M's rows (640 values: Q5_0 q|k and gate|up, Q8_0 v, Q4_K o,
  Q6_K down) and its tall Q8_0 head (262,144 rows of 640), uploaded as the profile does (the head
  as q8_0r where gemv_coop.q8_0r_min_rows takes it); the q8_0r head's readers (coop GEMV block
  shapes, the embedding lookup, the prefill GEMM) with the d plane's padding poisoned.

References: engine.ops_ref (attention_dense with a window, gelu_tanh_mul, embed) and the GGUF
dequantisation (engine.quant through gpu_harness.random_weight). The norm offset (1 + w) is added to
the norm weights at upload (WeightPlan.offset), so no kernel has it; tests/gpu/test_gemma3.py covers
it end to end on a transformers-layout (offset 1) checkpoint.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.catalog_specs import attention_params, attention_prefill_params
from gpu_harness import bf_round, poisoned, random_weight, rel_err, upload, uploaded_weights
from test_kernels import PagedCache, gemv_failures, run_decode_attention, run_gemm

from engine import kernel_catalog as kc
from engine import ops_ref, storage

# (heads, kv_heads, head_dim): Gemma 3 270M, and a GQA-8 head_dim-128 model (Mistral-style window)
SHAPES = ((4, 1, 256), (32, 4, 128))


def decode_specs(profile, window: int) -> list:
    out = []
    bs = profile.kv_block_size
    for H, KV, D in SHAPES:
        dims = dict(heads=H, kv_heads=KV, head_dim=D)
        for direct in (True, False):
            p = attention_params(dims, profile.tuning, bs, direct=direct,
                                    q_stride=(H + 2 * KV) * D, out_stride=H * D)  # fmt: skip
            p.update(window=window, table_first=False, scale=0.0625)
            out.append(kc.spec("attention", **p))
            if p["vec16"]:  # the scalar key loop too
                out.append(kc.spec("attention", **{**p, "vec16": False}))
    return out


@pytest.mark.parametrize("window", [40, 512])
def test_window_decode_attention(kernels, profile, window):
    """Split (+ combine) and direct decode attention with a window, at contexts inside, at and far
    past it (several splits wholly before the window)."""
    specs = decode_specs(profile, window)
    kernels.prebuild(specs)
    rng = np.random.default_rng(window)
    bad = []
    for s in specs:
        ctxs = [1, 17, window, window + 1, window + 37, 700, 1500 if s.params["direct"] else 3000]
        err, nans = run_decode_attention(kernels, s, ctxs, rng, released=True)
        if nans or not err <= 1e-2:
            bad.append((s.entry, err, nans))
    assert len(specs) >= 4 and not bad, bad


# (start position, rows) per sequence of one varlen pass
PREFILL_SEQS = [[(0, 37), (100, 130), (5, 1)], [(450, 200), (0, 300)], [(1000, 64), (37, 90)]]


@pytest.mark.parametrize("window", [40, 512])
@pytest.mark.parametrize("shape", SHAPES)
def test_window_prefill_attention(kernels, profile, window, shape):
    """The flash prefill with a window: chunks that start before, at and past it, several sequences
    in one pass, with the profile's tile and the tiles the lowering may pick for head_dim 256."""
    H, KV, D = shape
    bs = profile.kv_block_size
    rng = np.random.default_rng(window + D)
    dims = dict(heads=H, kv_heads=KV, head_dim=D)
    for seqs in PREFILL_SEQS:
        first = [ops_ref.window_start(p0, window) for p0, _ in seqs]
        cache = PagedCache(rng, [p0 + n for p0, n in seqs], KV, D, bs, first)
        rows, q_stride, out_stride = sum(n for _, n in seqs), (H + 2 * KV) * D, H * D
        qkv = bf_round(rng.standard_normal((rows, q_stride)))
        starts = np.cumsum([0] + [n for _, n in seqs]).astype(np.int32)
        pos = np.concatenate([np.arange(p0, p0 + n) for p0, n in seqs]).astype(np.int32)
        base = attention_prefill_params(dims, profile.tuning, bs, q_stride=q_stride, out_stride=out_stride)
        q = qkv[:, : H * D].reshape(rows, H, D)
        ref = np.concatenate(
            [cache.ref(s, q[starts[s] : starts[s + 1]], p0, 0.0625, window) for s, (p0, _) in enumerate(seqs)]
        )
        for bq, bkv, warps in sorted({(64, 32, 4), (32, 32, 2), (64, 16, 4)}):
            c = kc.choice("attention_prefill", **{**base, "block_q": bq, "block_kv": bkv, "warps": warps,
                                                  "window": window, "scale": 0.0625})  # fmt: skip
            out = poisoned((rows, out_stride))
            kernels.launch(
                c, rows, grid_kw={"max_q": max(n for _, n in seqs), "nseq": len(seqs)}, out=out,
                q=upload(qkv, "bf16"), k_cache=cache.kd, v_cache=cache.vd, block_tables=cache.td,
                positions=upload(pos, "i32"), seq_starts=upload(starts, "i32"), max_blocks=cache.tables.shape[1],
            )  # fmt: skip
            got = out.get()
            assert not np.isnan(got).any(), (c.spec.entry, seqs)
            assert rel_err(got, ref) <= 1e-2, (c.spec.entry, seqs, rel_err(got, ref))


def test_gelu_tanh_mul(kernels, profile):
    rows, inter = 5, 2048
    c = kc.choice("silu_mul", inter=inter, in_stride=2 * inter, threads=kc.ELEMENTWISE_THREADS,
                  act="gelu_tanh")  # fmt: skip
    gu = bf_round(np.random.default_rng().standard_normal((rows, 2 * inter)) * 3)
    t, out = upload(gu, "bf16"), poisoned((rows, inter))
    kernels.launch(c, rows, out=out, g=t, u=t.at(inter), rows=rows)
    got = out.get()
    assert not np.isnan(got).any()
    assert rel_err(got, ops_ref.gelu_tanh_mul(gu[:, :inter], gu[:, inter:])) <= 1e-2
    assert rel_err(got, ops_ref.silu_mul(gu[:, :inter], gu[:, inter:])) > 0.05  # not SiLU


def test_residual_add_in_place(kernels, profile):
    rows, n = 7, 640
    c = kc.choice("add", n=n, a_stride=n, b_stride=2 * n, threads=kc.ELEMENTWISE_THREADS)
    rng = np.random.default_rng()
    a, b = bf_round(rng.standard_normal((rows, n)) * 20), bf_round(rng.standard_normal((rows, 2 * n)))
    at = upload(a, "bf16")
    kernels.launch(c, rows, out=at, a=at, b=upload(b, "bf16"), rows=rows)
    assert rel_err(at.get(), a + b[:, :n]) <= 1e-2
    f32_sum = a.astype(np.float32) + b[:, :n].astype(np.float32)
    assert np.array_equal(at.get(), bf_round(f32_sum))  # the f32 sum, rounded to bf16 once


def test_scaled_embedding(kernels, profile):
    rng = np.random.default_rng()
    hidden, vocab, rows, scale = 640, 300, 9, 640**0.5
    for qt in ("q8_0", "bf16", "q5_0"):
        c = kc.choice("embed", quant=qt, hidden=hidden, threads=kc.ELEMENTWISE_THREADS, scale=scale)
        raw, deq = random_weight(qt, vocab, hidden, rng)
        ids = rng.integers(0, vocab, rows)
        out = poisoned((rows, hidden))
        kernels.launch(c, rows, out=out, table=upload(raw, "u8"), ids=upload(ids, "i32"), rows=rows)
        want = bf_round(ops_ref.embed(ids, deq) * np.float32(scale))
        assert rel_err(out.get(), want) <= 1e-2, c.spec.entry


def test_f32_residual_stream_kernels(kernels, profile):
    """The f32 x forms: add (a_dtype f32: x + bf16 o, stored unrounded), rmsnorm (x_dtype f32; with
    its residual the f32 sum is written back and normalised as it is), embed (out_dtype f32)."""
    rng = np.random.default_rng()
    rows, n, t = 7, 640, kc.ELEMENTWISE_THREADS
    x = (rng.standard_normal((rows, n)) * 300).astype(np.float32)  # Gemma's residual norms are large
    o = bf_round(rng.standard_normal((rows, n)) * 20)
    c = kc.choice("add", n=n, a_stride=n, b_stride=n, threads=t, a_dtype="f32")
    xt = upload(x, "f32")
    kernels.launch(c, rows, out=xt, a=xt, b=upload(o, "bf16"), rows=rows)
    want = x + o.astype(np.float32)
    assert np.abs(xt.get() - want).max() <= 1e-6 * np.abs(want).max()
    w = (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)
    eps = 1e-6
    for residual in (False, True):
        c = kc.choice("rmsnorm", n=n, eps=repr(eps), threads=kc.NORM_THREADS, residual=residual, x_dtype="f32")
        xt, out = upload(x, "f32"), poisoned((rows, n))
        kernels.launch(c, rows, out=out, x=xt, r=upload(o, "bf16") if residual else 0, w=upload(w, "f32"), rows=rows)
        s = x + o.astype(np.float32) if residual else x
        if residual:
            assert np.abs(xt.get() - s).max() <= 1e-6 * np.abs(s).max()  # the sum, unrounded
            assert not np.array_equal(xt.get(), bf_round(s))
        want = ops_ref.rmsnorm(s, w, eps)
        assert rel_err(out.get(), want) <= 4e-3, (residual, rel_err(out.get(), want))
    hidden, vocab, scale = 640, 300, 640**0.5
    c = kc.choice("embed", quant="q8_0", hidden=hidden, threads=t, scale=scale, out_dtype="f32")
    raw, deq = random_weight("q8_0", vocab, hidden, rng)
    ids = rng.integers(0, vocab, rows)
    out = poisoned((rows, hidden), "f32")
    kernels.launch(c, rows, out=out, table=upload(raw, "u8"), ids=upload(ids, "i32"), rows=rows)
    want = ops_ref.embed(ids, deq) * np.float32(scale)
    assert np.abs(out.get() - want).max() <= 1e-5 * np.abs(want).max()


# Gemma 3 270M's decode GEMVs: (file type, n, k)
GEMMA_GEMVS = [("q5_0", 1280, 640), ("q5_0", 4096, 640), ("q8_0", 256, 640), ("q4_k", 640, 1024),
               ("q6_k", 640, 2048), ("q8_0", 262144, 640)]  # fmt: skip


@pytest.mark.parametrize("case", GEMMA_GEMVS, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}")
def test_gemma_gemvs(kernels, profile, device, case):
    """The GEMVs at Gemma 3 270M's shapes (rows of 640 values, not a multiple of 256) in the layout
    the profile picks, at batch 1 and 8, the logits (f32) and the residual variants; and each with the
    coop GEMV's q8x off (models/gemma3.yaml numerics.exact_x: the o / down projections' plan)."""
    import dataclasses

    ft, n, k = case
    qt = kc.upload_type(ft, k, profile.tuning, n)
    exact = dict(profile.tuning, gemv_coop=dataclasses.replace(profile.tuning["gemv_coop"], q8x=False))
    cases = []
    for tuning in (profile.tuning, exact):
        for rows, bmax, residual, od in ((1, 1, False, "bf16"), (1, 1, False, "f32"), (8, 8, True, "bf16"),
                                         (8, 8, False, "f32")):  # fmt: skip
            p = kc.linear_params(qt, n, k, tuning, residual=residual, out_dtype=od, bmax=bmax,
                                 sm_count=device.sm_count)  # fmt: skip
            cases.append((kc.spec("gemv", **p), rows))
    cases = list(dict.fromkeys(cases))
    kernels.prebuild(s for s, _ in cases)
    bad = gemv_failures(kernels, uploaded_weights(n), cases, np.random.default_rng(n))
    assert not bad, bad


def poisoned_pad_q8_0r(seed: int):
    """``get(qt, n, k)`` as gpu_harness.uploaded_weights, for q8_0r only, with the bytes between
    a row's k/32 f16 scales and its qs plane (the 16-byte padding) set to 0x7E (f16 NaN): a reader
    that takes a scale or a weight from them returns NaN."""
    cache: dict = {}
    rng = np.random.default_rng(seed)

    def get(qt: str, n: int, k: int):
        assert qt == "q8_0r", qt
        if (n, k) not in cache:
            raw, deq = random_weight(qt, n, k, rng)
            pad = slice(k // 32 * 2, storage.q8_0r_qs_offset(k))
            assert pad.stop > pad.start and not raw[:, pad].any()
            raw = raw.copy()
            raw[:, pad] = 0x7E
            cache[n, k] = (upload(raw, "u8"), deq)
        return cache[n, k]

    return get


def test_tall_q8_0r_head_readers(kernels, profile, device):
    """Gemma 3 270M's tied head as q8_0r (rows of 640: 40 bytes of scales padded to 48, then 640
    int8; the padding poisoned): the profile's coop GEMV at batch 1 (bmax 1; also with the final
    rmsnorm folded in) and 2, 5, 8 (bmax 8), on the full 262,144 rows, the logits f32; the block shapes tools/gemv_tall_bench.py sweeps
    (lanes per row, rows per warp, grid caps, the f32-x path) on 20,001 rows (a partial last tile);
    the embedding lookup (embed, scaled) and the prefill GEMM on the same bytes. Against numpy."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from gemv_tall_bench import coop_variants

    n, k = 262144, 640
    assert kc.upload_type("q8_0", k, profile.tuning, n) in ("q8_0", "q8_0r")
    get = poisoned_pad_q8_0r(7)
    cases = []
    for rows, bmax in ((1, 1), (2, 8), (5, 8), (8, 8)):
        p = kc.linear_params("q8_0r", n, k, profile.tuning, out_dtype="f32", bmax=bmax, sm_count=device.sm_count)
        cases.append((kc.spec("gemv", **p), rows))
        if bmax == 1:  # the plan's decode1 head: the final rmsnorm folded in (q8x_fuse)
            cases.append((kc.spec("gemv", **{**p, "prologue": "norm", "x_stride": k, "eps": 1e-6}), rows))
    short = 20001
    for bmax, rows in ((1, 1), (8, 8), (8, 3)):
        base = kc.linear_params("q8_0r", short, k, profile.tuning, out_dtype="f32", bmax=bmax, sm_count=device.sm_count)
        cases += [(kc.spec("gemv", **p), rows) for _, p in coop_variants(base, device.sm_count)]
    kernels.prebuild(s for s, _ in cases)
    bad = gemv_failures(kernels, get, cases, np.random.default_rng(1))
    assert len(cases) > 40 and not bad, bad

    raw_w, deq = get("q8_0r", short, k)
    vocab, rows, scale = short, 9, 640**0.5
    c = kc.choice("embed", quant="q8_0r", hidden=k, threads=kc.ELEMENTWISE_THREADS, scale=scale)
    ids = np.random.default_rng(2).integers(0, vocab, rows)
    ids[0], ids[-1] = 0, vocab - 1
    out = poisoned((rows, k))
    kernels.launch(c, rows, out=out, table=raw_w, ids=upload(ids, "i32"), rows=rows)
    assert rel_err(out.get(), bf_round(ops_ref.embed(ids, deq) * np.float32(scale))) <= 1e-2

    g = kc.spec("gemm", **kc.gemm_params(short, k, profile.tuning, out_dtype="f32", quant="q8_0r"))
    kernels.prebuild([g])
    rng = np.random.default_rng(3)
    bad = [(m, e) for m in (1, 77) if not (e := run_gemm(kernels, get, g, m, rng)) <= 1e-2]
    assert not bad, bad
