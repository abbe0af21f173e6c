"""q8_0r rows of any k % 32 == 0 for a tall q8_0 matrix (Gemma 3 270M's 262,144 x 640 tied head):
the upload rule (gemv_coop.q8_0r_min_rows), the Gemma 3 270M plan (the embedding lookup and the
lm_head read one q8_0r allocation; the head is a coop GEMV), and the kernels' q8_0r addressing on
the CPU (tests/fixtures/cuda_emu.py runs the rendered embedding kernel) against engine.quant. The
GPU twins: tests/gpu/test_gemma_kernels.py (test_gemma_gemvs, test_tall_q8_0r_head_readers)."""

from __future__ import annotations

import numpy as np
import pytest

from engine import kernel_catalog as kc
from engine import ops_ref, quant, storage
from engine.graph import load_family
from engine.model import resolve_dims
from engine.plan import build_plan
from engine.profile import get_profile, with_tuning
from engine.render import render

GEMMA_270M = {
    "hidden_size": 640, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "intermediate_size": 2048, "vocab_size": 262144, "sliding_window": 512,
    "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000.0, "rope_theta": 1e6,
}  # fmt: skip


def gemma_plan(profile):
    g = load_family("gemma3")
    return build_plan(g, resolve_dims(g, "hf", GEMMA_270M, "config.json"), g.quant("q4_k_m_640"), profile)


def test_upload_type_takes_tall_short_row_q8_0_matrices_as_q8_0r():
    t = get_profile("h100").tuning
    tall = int(t["gemv_coop"]["q8_0r_min_rows"])
    assert 49152 < tall <= 262144  # Gemma 3 270M's head, not SmolLM2's (49,152 x 576) yet
    assert kc.upload_type("q8_0", 640, t, 262144) == "q8_0r"
    assert kc.upload_type("q8_0", 640, t, 256) == "q8_0"  # Gemma's attn_v: the classic GEMV
    assert kc.upload_type("q8_0", 640, t) == "q8_0"  # rows unknown
    assert kc.upload_type("q8_0", 2048, t, 256) == "q8_0r"  # k % 256 == 0: any rows, as before
    assert kc.upload_type("q8_0", 640, {"gemv_coop": {"types": ["q8_0"]}}, 262144) == "q8_0"  # knob unset
    assert kc.upload_type("q8_0", 640, {"gemv_coop": {"types": [], "q8_0r_min_rows": 1}}, 262144) == "q8_0"


def test_gemma_270m_head_and_embedding_share_one_q8_0r_allocation():
    """The tied weight is planned once (the embedding), as q8_0r with 688-byte rows; the embedding
    lookup reads it as q8_0r and the lm_head is a coop GEMV on it at batch 1 and 8 (from 32 rows the mma bucket GEMV: gemv_mmq; the final norm
    stays its own launch: it reads Gemma's f32 residual stream, models/gemma3.yaml numerics). With the knob off the same plan keeps q8_0 and the classic GEMV."""
    plan = gemma_plan(get_profile("h100"))
    (emb,) = [w for w in plan.weights if w.key == "embed"]
    assert (emb.dtype, emb.rows, emb.cols) == ("q8_0r", 262144, 640)
    assert emb.nbytes == 262144 * 688 == 262144 * storage.row_bytes("q8_0r", 640)
    assert not any(w.key == "lm_head" for w in plan.weights)
    specs = {(st.op.op, mode): la.spec for st in plan.steps if st.head or st.op.op == "embed"
             for mode, las in st.launches.items() for la in las if la.spec.template in ("embed", "gemv") and la.runs_at(8)}  # fmt: skip
    assert {s.params["quant"] for s in specs.values()} == {"q8_0r"}
    assert specs["embed", "decode1"].params["hidden"] == 640
    one, eight = specs["linear", "decode1"].params, specs["linear", "decode"].params
    assert one["coop"] and one["q8x"] and one["bmax"] == 1 and one["out_dtype"] == "f32" and one["prologue"] == "none"
    assert eight["coop"] and eight["bmax"] == 8 and (one["n"], one["k"]) == (eight["n"], eight["k"]) == (262144, 640)
    off = gemma_plan(with_tuning(get_profile("h100"), "gemv_coop.q8_0r_min_rows=0"))
    assert next(w for w in off.weights if w.key == "embed").dtype == "q8_0"
    head = [la.spec for st in off.steps if st.head for la in st.launches["decode1"] if la.spec.template == "gemv"]
    assert head and not head[0].params["coop"] and head[0].params["quant"] == "q8_0"


@pytest.mark.parametrize("k", [640, 96, 2560])
def test_q8_0r_specs_take_any_k_multiple_of_32(k):
    """The kernel catalog takes q8_0r rows of any k % 32 == 0 (embed, gemv coop and classic,
    gemm); the rendered decoders address the qs plane at the padded offset (Q8R_QS: 48 for 640)."""
    t = get_profile("h100").tuning
    e = kc.spec("embed", quant="q8_0r", hidden=k, threads=256)
    g = kc.spec("gemv", **kc.linear_params("q8_0r", 4096, k, t, out_dtype="f32", bmax=1, sm_count=132))
    assert g.params["coop"]
    kc.spec("gemm", **kc.gemm_params(4096, k, t, quant="q8_0r"))
    for s in (e, g):
        src = render(s)
        assert "#define Q8R_QS(k) (((size_t)(k) / 32 * 2 + 15) / 16 * 16)" in src
        assert "2 * (K / 32)" not in src and f"2 * ({k} / 32)" not in src


def _tall_q8_0r(rng, n: int, k: int):
    """A random q8_0 [n, k] matrix as q8_0r bytes, the d plane's padding poisoned with 0x7E (f16
    NaN bytes: a reader taking a scale or weight from it goes NaN or far off), and its f64 values."""
    raw = np.frombuffer(quant.quantize_reference(rng.standard_normal((n, k)).astype(np.float32), "q8_0"), np.uint8)
    w = quant.repack(raw, "q8_0r", n, k).reshape(n, -1).copy()
    deq = quant.dequantize(w, "q8_0r", (n, k)).astype(np.float64)
    w[:, k // 32 * 2 : storage.q8_0r_qs_offset(k)] = 0x7E
    return w, deq


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return ((x.astype(np.float32).view(np.uint32) + 0x8000) >> 16).astype(np.uint16)


# the head's coop GEMV block shapes run on the CPU: the profile's own, and tools/gemv_tall_bench.py
# coop_variants of distinct code paths (whole warps with a partial second step, lane groups of 4,
# 4 rows per lane group, no grid cap, f32 x)
EMU_SHAPES = ["default", "coop t512 rpw1 l32 u4 cap4", "coop t512 rpw2 l4 u5 cap4", "coop t256 rpw4 l8 u1 cap4",
              "coop t256 rpw1 l8 u5", "coop t256 rpw2 l32 u2 f32x"]  # fmt: skip


@pytest.mark.parametrize("bmax,rows", [(1, 1), (8, 3), (8, 8)])
def test_emulated_head_gemv_reads_the_padded_q8_0r_rows(bmax, rows):
    """The lm_head GEMV specs the H100 profile takes for Gemma 3 270M's head (n = 262,144, k = 640:
    coop q8x, 512 threads, the grid capped), and block shapes the bench sweeps, rendered for a
    300-row slice of it (a partial last tile; the grid capped at 2 blocks, so blocks loop over tiles)
    and run by tests/fixtures/cuda_emu.py (threads in both orders) on q8_0r bytes with a poisoned padding: the logits (f32,
    poisoned NaN) equal x @ W.T with x as the q8x path quantises it (quant.q8x_round_trip; the f32
    path: x itself) to 1e-5; at batch 1 also with the final rmsnorm folded in, as the plan's decode1
    head runs (x the rmsnorm kernel's bf16 output: 1e-3, its sum of squares in another order)."""
    import sys
    from pathlib import Path

    from fixtures import cuda_emu

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from gemv_tall_bench import coop_variants

    n, k = 300, 640
    t = get_profile("h100").tuning
    base = kc.linear_params("q8_0r", 262144, k, t, out_dtype="f32", bmax=bmax, sm_count=132)
    shapes = dict([("default", base), *coop_variants(base, 132)])
    if bmax == 1:  # the plan's decode1 head: the final rmsnorm folded in (q8x_fuse)
        shapes["default+norm"] = dict(base, prologue="norm", x_stride=k, eps=1e-6)
    rng = np.random.default_rng(bmax + rows)
    w, deq = _tall_q8_0r(rng, n, k)
    x = _bf16_bits(rng.standard_normal((rows, k)) * 3.0)
    xf = (x.astype(np.uint32) << 16).view(np.float32)
    nw = rng.uniform(0.5, 1.5, k).astype(np.float32)
    bad = []
    for name in EMU_SHAPES + (["default+norm"] if bmax == 1 else []):
        p = dict(shapes[name], n=n)
        if p.get("grid_cap"):
            p["grid_cap"] = 2
        c = kc.choice("gemv", **p)
        lib, types = cuda_emu.compile_any(render(c.spec), c.spec.entry)
        xin, tol = xf, 1e-5
        if p.get("prologue") == "norm":  # bf16(x * inv_rms * w): the rmsnorm kernel's output
            xin, tol = (_bf16_bits(ops_ref.rmsnorm(xf, nw, 1e-6)).astype(np.uint32) << 16).view(np.float32), 1e-3
        ref = (quant.q8x_round_trip(xin).astype(np.float64) if p.get("q8x") else xin.astype(np.float64)) @ deq.T
        outs = []
        for reverse in (False, True):  # the threads in both orders between barriers: no race shows
            out = np.full((rows, n), np.nan, np.float32)
            vals = {"out": out, "w": w, "x": x, "residual": None, "rows": rows, "norm_w": nw}
            cuda_emu.launch_any(lib, types, c.grid(rows), c.block[0], c.smem, [vals[a] for a, _ in c.args], reverse)
            err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            if np.isnan(out).any() or not err <= tol:
                bad.append((name, reverse, err, int(np.isnan(out).sum())))
            outs.append(out)
        if not np.array_equal(*outs):
            bad.append((name, "thread order changes the bits"))
    assert not bad, bad


def test_emulated_embedding_lookup_reads_the_padded_q8_0r_rows():
    """The embedding kernel (scaled, as Gemma's) on the same q8_0r bytes, run by cuda_emu: every
    looked-up row is bf16(q * d * scale) of the file's blocks (the first and last rows included)."""
    from fixtures import cuda_emu

    rng = np.random.default_rng(11)
    n, k, scale = 100, 640, 640**0.5
    w, deq = _tall_q8_0r(rng, n, k)
    c = kc.choice("embed", quant="q8_0r", hidden=k, threads=kc.ELEMENTWISE_THREADS, scale=scale)
    lib, types = cuda_emu.compile_any(render(c.spec), c.spec.entry)
    ids = np.array([0, n - 1, 37, 37, 5], np.int32)
    out = np.full((ids.size, k), 0x7FC0, np.uint16)  # bf16 NaN
    cuda_emu.launch_any(lib, types, c.grid(ids.size), c.block[0], c.smem, [out, w, ids, ids.size])
    want = deq[ids].astype(np.float32) * np.float32(float(repr(scale)))
    np.testing.assert_array_equal(out, _bf16_bits(want))


def test_tall_weights_take_their_own_q8x_shape():
    """gemv_coop.q8x_tall_tuning applies to weights of at least q8x_tall_min_n rows only, over the
    file type's q8x_type_tuning (the h100 profile: Gemma's head in lane groups of 8, 5 segments a
    lane at batch 1, a whole row per step)."""
    prof = get_profile("h100")
    c = prof.tune("gemv_coop")
    assert c["q8x_tall_min_n"] <= 262144 and c["q8x_tall_tuning"]["q8_0"]["q8x_lanes_per_row"] == 8
    head1 = kc.linear_params("q8_0r", 262144, 640, prof.tuning, out_dtype="f32", bmax=1, sm_count=132)
    head8 = kc.linear_params("q8_0r", 262144, 640, prof.tuning, out_dtype="f32", bmax=8, sm_count=132)
    short = kc.linear_params("q8_0r", 4096, 2560, prof.tuning, bmax=1, sm_count=132)
    assert (head1["lanes"], head1["unroll"], head1["threads"], head1["rows_per_block"]) == (8, 5, 256, 32)
    assert (head8["lanes"], head8["unroll"], head8["threads"], head8["rows_per_block"]) == (8, 2, 256, 32)
    assert "lanes" not in short and short["unroll"] == 4  # the q8_0 type's own
    wide = kc.linear_params("q8_0r", 262144, 2048, prof.tuning, bmax=1, sm_count=132)
    assert "lanes" not in wide  # k above q8x_tall_max_k: not a short row
    tuned = with_tuning(prof, "gemv_coop.q8x_tall_tuning={q8_0: {q8x_lanes_per_row: 4}}")
    p8 = kc.linear_params("q8_0r", 262144, 640, tuned.tuning, out_dtype="f32", bmax=8, sm_count=132)
    p1 = kc.linear_params("q8_0r", 262144, 640, tuned.tuning, out_dtype="f32", bmax=1, sm_count=132)
    assert (p8["lanes"], p8["unroll"], p1["unroll"]) == (4, 2, 4)  # batch 1: the type's q8x_b1_unroll
    off = with_tuning(prof, "gemv_coop.q8x_tall_min_n=0")
    assert "lanes" not in kc.linear_params("q8_0r", 262144, 640, off.tuning, out_dtype="f32", bmax=1, sm_count=132)


def test_the_head_kernels_compile_with_nvrtc(tmp_path):
    """NVRTC compiles (sm_90a) what the Gemma 3 270M plan launches on the q8_0r head: the coop GEMV
    at batch 1 (the final norm folded in) and 8, the embedding lookup, and a tall q8_0r prefill GEMM
    (skipped where NVRTC or the CUDA headers are missing)."""
    try:
        from engine import nvrtc

        nvrtc.version()
        nvrtc.include_dirs()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no NVRTC: {e}")
    from engine.compile import KernelBuilder
    from engine.kcache import KernelCache

    plan = gemma_plan(get_profile("h100"))
    specs = {la.spec for st in plan.steps if st.head or st.op.op == "embed" for las in st.launches.values()
             for la in las if la.spec.params.get("quant") == "q8_0r"}  # fmt: skip
    specs.add(kc.spec("gemm", **kc.gemm_params(262144, 640, get_profile("h100").tuning, quant="q8_0r")))
    assert {s.template for s in specs} == {"gemv", "embed", "gemm"} and len(specs) >= 4
    builder = KernelBuilder("sm_90a", cache=KernelCache(tmp_path))
    for s in specs:
        assert builder.get(s).cubin, s.entry


def test_emulated_head_rows_do_not_depend_on_the_bucket():
    """The head's batch-1 and batch-8 coop specs (the tall q8x shape: the same lane groups at every
    bucket, so each row's segments are summed in the same order) give a row the same bits alone
    and beside 2 or 7 others (cuda_emu, no prologue)."""
    from fixtures import cuda_emu

    t = get_profile("h100").tuning
    rng = np.random.default_rng(5)
    n, k = 300, 640
    w, _ = _tall_q8_0r(rng, n, k)
    x = _bf16_bits(rng.standard_normal((8, k)))
    first = None
    for bmax, rows in ((1, 1), (8, 1), (8, 3), (8, 8)):
        p = dict(kc.linear_params("q8_0r", 262144, k, t, out_dtype="f32", bmax=bmax, sm_count=132), n=n, grid_cap=2)
        c = kc.choice("gemv", **p)
        lib, types = cuda_emu.compile_any(render(c.spec), c.spec.entry)
        out = np.full((rows, n), np.nan, np.float32)
        vals = {"out": out, "w": w, "x": np.ascontiguousarray(x[:rows]), "residual": None, "rows": rows}
        cuda_emu.launch_any(lib, types, c.grid(rows), c.block[0], c.smem, [vals[a] for a, _ in c.args])
        first = out[0] if first is None else first
        assert not np.isnan(out).any() and np.array_equal(out[0], first), (bmax, rows)
