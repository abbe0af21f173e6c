"""Batched equal to solo, bit for bit, on the CPU (issue #38 item 3): the decode kernels of real plans
(tiny q4_k_m Qwen3 and q4_1 SmolLM2-shaped Llama GGUFs on the h100 profile) rendered and run under
g++ (tests/fixtures/cuda_emu.py: the block's threads as fibers, shuffles and __syncwarp as warp
collectives) on random inputs, each layer-0 step's batch-1 launches against its bucket ones:

* every linear: the batch-1 GEMV (decode1: the rmsnorm or silu_mul folded into its x staging,
  q8x_b1_unroll, a gemv_pair's parts) on one row against the step before it (the rmsnorm /
  silu_mul kernel) and the bmax-8 GEMV (decode) on three rows: the same output bits per row; and
  the batch-1 GEMV on the three rows at once (a grid row each, as a pass of Plan.b1_rows rows runs
  it) gives each row its one-row bits;
* the attention: the direct kernel with the rope folded in (short) against the rope kernel, the
  split attention and attention_combine (decode) at contexts 1 .. 256: the same output bits and the
  same KV writes (also for a tiny Gemma 3: heads of 256, q/k head norms, window layers).

Both also over the Gemma 3 270M Q4_K_M file's launches (a plan with its storage types and a
262,144-row head; the tests draw their own weights): the classic q5_0 / q8_0 GEMVs, the exact-x
q4_k and q6_kr ones, the tall q8_0r head, the head_dim-256 window attention.

The GEMVs store f32 row sums without the residual here (a bf16 store hides most last-bit
differences): on main the q6_k down projection (its k split over two warp groups in unroll-sized
runs, batch-1 unroll 4 against 2) differs in 31 of 40 outputs. The attention outputs are bf16, so
a different key order rarely shows in them (main's 4-warp split kernel passes this test; the plan
check, tests/test_batch_invariance.py, catches the warp counts). The bulk-copy (wsm) and trigger
knobs are off (inline PTX; the same arithmetic by the template's own claim), and the emulator runs
__expf as exp2f(x log2 e): this checks the order of operations, not the device's intrinsics
(tests/gpu/test_batch_invariance_gpu.py does that on the GPU).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fixtures import cuda_emu
from fixtures.checkpoints import Dims, to_bf16_bits, write_gemma3_safetensors, write_random_gguf
from fixtures.quant_blocks import random_blocks

from engine import kernel_catalog as kc
from engine import quant, storage
from engine.kernel_catalog.contracts import PAIR_PARTS
from engine.render import render

ROWS = 3  # x rows of a bucket GEMV (rows 0..2 of its bmax-8 block)
BS = 16
QWEN = Dims(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            intermediate_size=1536, vocab_size=768)  # fmt: skip
LLAMA = dataclasses.replace(QWEN, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                            tie_word_embeddings=True)  # fmt: skip
MODELS = {"qwen3-q4_k_m": ("qwen3", QWEN, "q4_k_m"), "llama-q4_1": ("llama", LLAMA, "q4_1")}
GEMMA_MIX = {"wq": "q5_0", "wk": "q5_0", "w_gate": "q5_0", "w_up": "q5_0", "wo": "q4_k", "wv": "q8_0",
             "w_down": "q6_k", "embed": "q8_0", "lm_head": "q8_0"}  # fmt: skip
# inline PTX (bulk copies, PDL) the emulator cannot run; f32 outputs without the residual: the row
# sums unrounded (a bf16 store would hide most last-bit differences of the k split)
OFF = dict(wsm=False, trigger=False, l2_pf="", out_dtype="f32", residual=False, early_res=False)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    from engine.model import load_model
    from engine.plan import build_plan
    from engine.profile import get_profile

    out = {}
    for name, (family, dims, q) in MODELS.items():
        m = load_model(write_random_gguf(tmp_path_factory.mktemp(name) / "m.gguf", family, dims, q, seed=3))
        out[name] = build_plan(m.graph, m.dims, m.quant, get_profile("h100"), m.tensor_dtypes, m.rope_style)
    # Gemma 3's attention: 4 / 1 heads of 256 (vec16 with a whole warp per key), a 512-key window
    gemma = dict(hidden_size=640, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                 intermediate_size=512, vocab_size=512)  # fmt: skip
    m = load_model(write_gemma3_safetensors(tmp_path_factory.mktemp("gemma"), window=512, **gemma))
    out["gemma3-bf16"] = build_plan(m.graph, m.dims, m.quant, get_profile("h100"), m.tensor_dtypes, m.rope_style)
    # the Gemma 3 270M Q4_K_M file's launches (plan only: the tests draw their own weights): q5_0
    # q/k/gate/up, q4_k attn_output, q8_0 attn_v, q6_k ffn_down, the tied 262,144-row q8_0 head
    m = load_model(write_gemma3_safetensors(tmp_path_factory.mktemp("gemma270"), window=512,
                                            **{**gemma, "intermediate_size": 2048}))  # fmt: skip
    dims = {**m.dims, "vocab": 262144}
    out["gemma3-q4_k_m_640"] = build_plan(m.graph, dims, m.graph.quant("q4_k_m_640"), get_profile("h100"), GEMMA_MIX,
                                          m.rope_style)  # fmt: skip
    return out


def _bf16(x) -> np.ndarray:
    return to_bf16_bits(np.ascontiguousarray(x, np.float32)).reshape(np.shape(x))


def _run(spec, grid, threads, smem, args, tmp_path):
    lib, types = cuda_emu.compile_any(render(spec), spec.entry, tmp_path)
    cuda_emu.launch_any(lib, types, grid, threads, smem, args)


def _gemvs(launches) -> list[dict]:
    """The gemv params of a linear's launches (a gemv_pair's two parts as gemvs)."""
    out = []
    for la in launches:
        p = la.spec.params
        if la.spec.template == "gemv_pair":
            out += [{k[len(x) :]: v for k, v in p.items() if k.startswith(x)} for x in PAIR_PARTS]
        else:
            out.append(dict(p))
    return out


def run_gemv(tmp_path, w, x, rows, norm_w=None, **p):
    spec = kc.spec("gemv", **{**p, **OFF})
    pp = spec.params
    out = np.full((rows, pp["n"]), np.nan, np.float32)
    args = [out, w, x, None, rows] + ([norm_w] if pp["prologue"] == "norm" else [])
    grid = (kc.gemv_grid_x(pp), -(-rows // pp["bmax"]), 1)
    _run(spec, grid, pp["threads"], kc.gemv_smem(pp), args, tmp_path)
    return out


def _layer0(plan, op):
    return [(i, st) for i, st in enumerate(plan.steps) if st.layer == 0 and st.op.op == op]


# README's run: the q4_k_m model's GEMVs; .ci/run's long step the q4_1 and Gemma 3 mixes too
@pytest.mark.parametrize(
    "model", ["qwen3-q4_k_m", *(pytest.param(m, marks=pytest.mark.long) for m in ("llama-q4_1", "gemma3-q4_k_m_640"))]
)
def test_batch1_gemvs_equal_the_bucket_path_row_by_row(plans, model, tmp_path):
    plan = plans[model]
    rng = np.random.default_rng(0)
    checked = 0
    for i, st in _layer0(plan, "linear"):
        prev = plan.steps[i - 1]
        bucket = [la for la in st.launches["decode"] if la.runs_at(ROWS)]  # (a pass of ROWS rows' launches)
        for p1, pn in zip(_gemvs(st.launches["decode1"]), _gemvs(bucket), strict=True):
            assert (p1["quant"], p1["n"], p1["k"]) == (pn["quant"], pn["n"], pn["k"])
            n, k = min(p1["n"], 2 * max(p1["rows_per_block"], pn["rows_per_block"])), p1["k"]
            p1, pn = {**p1, "n": n}, {**pn, "n": n}
            file_type = storage.REPACKED_FROM.get(p1["quant"], p1["quant"])
            elems = quant.block(file_type)[0]
            raw = random_blocks(file_type, n * k // elems, seed=checked)
            w = np.ascontiguousarray(quant.repack(raw, p1["quant"], n, k) if p1["quant"] != file_type else raw).reshape(-1)
            pro = p1["prologue"]
            if pro == "norm":  # decode: the rmsnorm kernel before the bucket GEMV
                x = _bf16(rng.standard_normal((ROWS, k)) * rng.uniform(0.2, 4.0, (ROWS, 1)))
                nw = (1.0 + 0.2 * rng.standard_normal(k)).astype(np.float32)
                (rs,) = prev.launches["decode"]
                xn = np.full((ROWS, k), 0x7FC0, np.uint16)
                _run(rs.spec, (ROWS, 1, 1), rs.block[0], 0, [xn, x, None, nw, ROWS], tmp_path)
            elif pro == "silu":  # decode: the silu_mul kernel before it
                x = _bf16(rng.standard_normal((ROWS, p1["x_stride"])) * 2.0)
                nw = None
                (sm,) = prev.launches["decode"]
                xn = np.full((ROWS, k), 0x7FC0, np.uint16)
                t = sm.block[0]
                _run(sm.spec, (-(-k // 8 // t), ROWS, 1), t, 0, [xn, x, x.ctypes.data + 2 * p1["u_off"], ROWS], tmp_path)
            else:
                x = xn = _bf16(rng.standard_normal((ROWS, k)))
                nw = None
            want = run_gemv(tmp_path, w, xn, ROWS, **pn)
            # the batch-1 GEMV over all rows at once (a grid row each: a pass of Plan.b1_rows rows)
            rows_b1 = run_gemv(tmp_path, w, x, ROWS, nw, **p1)
            for r in range(ROWS):
                got = run_gemv(tmp_path, w, np.ascontiguousarray(x[r : r + 1]), 1, nw, **p1)
                assert np.array_equal(got[0], want[r]), (model, i, p1["quant"], pro, r, int((got[0] != want[r]).sum()))
                assert np.array_equal(rows_b1[r], got[0]), (model, i, p1["quant"], pro, r, "b1 rows")
            checked += 1
    assert checked >= 4


# gemma3-bf16's attention (head_dim 256, a window, k and v in one stride) adds no path that
# gemma3-q4_k_m_640 (head_dim 256, a window, v_stride) and llama (k and v in one stride) leave out:
# .ci/run's long step runs it
ATTENTION_MODELS = [*sorted(MODELS), pytest.param("gemma3-bf16", marks=pytest.mark.long), "gemma3-q4_k_m_640"]


@pytest.mark.parametrize("model", ATTENTION_MODELS)
def test_short_attention_equals_rope_split_attention_and_combine(plans, model, tmp_path):
    plan = plans[model]
    ((ia, att),) = _layer0(plan, "attention")
    ((_, rope_st),) = _layer0(plan, "rope")
    (direct,) = att.launches["short"]
    split, comb = att.launches["decode"]
    (rope,) = rope_st.launches["decode"]
    dp = direct.spec.params
    assert dp["direct"] and dp["rope"] and not split.spec.params["direct"]
    heads, kvh, hd = dp["heads"], dp["kv_heads"], dp["head_dim"]
    kv_stride, v_stride = dp["kv_stride"], dp["v_stride"] or dp["kv_stride"]
    rng = np.random.default_rng(6)
    q_norm = (1.0 + 0.3 * rng.standard_normal(hd)).astype(np.float32) if dp["qk_norm"] else None
    k_norm = (1.0 + 0.3 * rng.standard_normal(hd)).astype(np.float32) if dp["qk_norm"] else None
    nblocks = dp["split"] // BS + 1
    cache0 = _bf16(rng.standard_normal((2, nblocks, BS, kvh, hd)))
    table = np.arange(nblocks, dtype=np.int32)[::-1].copy()  # (blocks out of order)
    for ctx in (1, 9, 100, dp["split"]):
        q = _bf16(rng.standard_normal((1, dp["q_stride"])) * 2.0)
        k = _bf16(rng.standard_normal((1, kv_stride)) * 2.0)
        v = _bf16(rng.standard_normal((1, v_stride)))
        pos = np.array([ctx - 1], np.int32)
        slots = np.array([table[(ctx - 1) // BS] * BS + (ctx - 1) % BS], np.int32)
        # short (batch 1 below split): the direct kernel rotates q / k and writes the row's own KV
        kd, vd = cache0[0].copy(), cache0[1].copy()
        out_d = np.full((1, dp["out_stride"]), 0x7FC0, np.uint16)
        _run(direct.spec, (1, kvh, dp["qsplit"]), direct.block[0], 0,
             [out_d, None, None, q.copy(), kd, vd, table, pos, nblocks, 1, k, v, q_norm, k_norm, None, slots],
             tmp_path)  # fmt: skip
        # a verify or bucket row: the rope kernel, the split attention, the combine
        ks, vs, q2, k2 = cache0[0].copy(), cache0[1].copy(), q.copy(), k.copy()
        _run(rope.spec, (1, kc.rope_head_blocks(rope.spec.params), 1), rope.block[0], 0,
             [q2, k2, v, pos, q_norm, k_norm, None, ks, vs, slots, 1], tmp_path)  # fmt: skip
        assert np.array_equal(kd, ks) and np.array_equal(vd, vs), (model, ctx, "KV writes differ")
        ms = 2
        part_o = np.full((1, heads, ms, hd), np.nan, np.float32)
        part_ml = np.full((1, heads, ms, 2), np.nan, np.float32)
        _run(split.spec, (1, kvh, ms), split.block[0], 0,
             [None, part_o, part_ml, q2, ks, vs, table, pos, nblocks, ms], tmp_path)  # fmt: skip
        out_s = np.full((1, dp["out_stride"]), 0x7FC0, np.uint16)
        _run(comb.spec, (1, heads, 1), comb.block[0], 0, [out_s, part_o, part_ml, pos, ms], tmp_path)
        assert not np.isnan((out_d.astype(np.uint32) << 16).view(np.float32)).any()
        assert np.array_equal(out_d, out_s), (model, ctx, int((out_d != out_s).sum()))


@pytest.mark.parametrize("model", ATTENTION_MODELS)
def test_verify_short_attention_equals_split_attention_and_combine(plans, model, tmp_path):
    """A verify pass below split (VSHORT: no rope launch; the rope-fused direct attention with vfresh)
    over three rows of one sequence (positions p .. p + 2) and a fourth of another sequence, on a
    cache whose slots for those rows hold garbage, its blocks run first to last and last to first
    (each block writes the keys it reads: a block that relied on another row's block would read the
    garbage in one of the orders); against the rope kernel then the split attention and the combine
    (the long launches): the same outputs and the same KV writes, bit for bit."""
    from engine.ir import VSHORT

    plan = plans[model]
    ((_, att),) = _layer0(plan, "attention")
    ((_, rope_st),) = _layer0(plan, "rope")
    assert rope_st.launches[VSHORT] == ()
    (direct,) = att.launches[VSHORT]
    (rope,) = rope_st.launches["decode"]
    split, comb = att.launches["decode"]
    dp = direct.spec.params
    assert dp["direct"] and dp["rope"] and dp["vfresh"] == kc.VERIFY_FRESH_MAX
    heads, kvh, hd, rows = dp["heads"], dp["kv_heads"], dp["head_dim"], 4
    rp = rope.spec.params
    kv_stride, v_stride = rp["kv_stride"], rp.get("v_stride") or rp["kv_stride"]
    rng = np.random.default_rng(8)
    q_norm = (1.0 + 0.3 * rng.standard_normal(hd)).astype(np.float32) if rp["qk_norm"] else None
    k_norm = (1.0 + 0.3 * rng.standard_normal(hd)).astype(np.float32) if rp["qk_norm"] else None
    nblocks = 2 * (dp["split"] // BS + 1)
    half = nblocks // 2
    table = np.arange(half, dtype=np.int32)[::-1].copy()  # (blocks out of order)
    other = np.arange(half, nblocks, dtype=np.int32)  # row 3: another sequence, its own blocks
    tables = np.ascontiguousarray(np.stack([table, table, table, other]))
    for p0 in (0, 40, dp["split"] - rows):  # (every position below split: the short launches)
        cache = _bf16(rng.standard_normal((2, nblocks, BS, kvh, hd)))
        q = _bf16(rng.standard_normal((rows, dp["q_stride"])) * 2.0)
        k = _bf16(rng.standard_normal((rows, kv_stride)) * 2.0)
        v = _bf16(rng.standard_normal((rows, v_stride)))
        pos = np.array([p0, p0 + 1, p0 + 2, p0 + 3], dtype=np.int32)  # (row 3 at the next position: not row 2's)
        slots = (tables[np.arange(rows), pos // BS] * BS + pos % BS).astype(np.int32)
        kc_s, vc_s, q_s = cache[0].copy(), cache[1].copy(), q.copy()
        _run(rope.spec, (rows, kc.rope_head_blocks(rp), 1), rope.block[0], 0,
             [q_s, k.copy(), v.copy(), pos, q_norm, k_norm, None, kc_s, vc_s, slots, rows], tmp_path)  # fmt: skip
        ms = 2
        part_o = np.full((rows, heads, ms, hd), np.nan, np.float32)
        part_ml = np.full((rows, heads, ms, 2), np.nan, np.float32)
        _run(split.spec, (rows, kvh, ms), split.block[0], 0,
             [None, part_o, part_ml, q_s, kc_s, vc_s, tables, pos, half, ms], tmp_path)  # fmt: skip
        out_s = np.full((rows, dp["out_stride"]), 0x7FC0, np.uint16)
        _run(comb.spec, (rows, heads, 1), comb.block[0], 0, [out_s, part_o, part_ml, pos, ms], tmp_path)
        lib, types = cuda_emu.compile_any(render(direct.spec), direct.spec.entry, tmp_path)
        for backwards in (False, True):
            kc_d, vc_d = cache[0].copy(), cache[1].copy()
            out_d = np.full((rows, dp["out_stride"]), 0x7FC0, np.uint16)
            cuda_emu.launch_any(lib, types, (rows, kvh, dp["qsplit"]), direct.block[0], 0,
                                [out_d, None, None, q.copy(), kc_d, vc_d, tables, pos, half, 1, k, v, q_norm,
                                 k_norm, None, slots], blocks_reversed=backwards)  # fmt: skip
            assert not np.isnan((out_d.astype(np.uint32) << 16).view(np.float32)).any()
            assert np.array_equal(out_d, out_s), (model, p0, backwards, [int((out_d[r] != out_s[r]).sum()) for r in range(rows)], np.array_equal(kc_d, kc_s))
            assert np.array_equal(kc_d, kc_s) and np.array_equal(vc_d, vc_s), (model, p0, backwards)


@pytest.mark.parametrize(
    "file_type,k,threads,rpb,rounds,bucket",
    [("q4_1", 4096, 256, 16, 1, 8), ("q8_0", 2560, 512, 16, 1, 8), ("q4_k", 1024, 640, 20, 1, 8),
     ("q8_0", 8192, 512, 16, 2, 4)],
    ids=["rows_inv_rms", "merged-512", "merged-640", "merged-2-rounds"],
)  # fmt: skip
def test_fused_norm_in_any_block_equals_the_rmsnorm_kernel(file_type, k, threads, rpb, rounds, bucket, tmp_path):
    """The norm prologue in blocks of other sizes than the rmsnorm kernel's 256, from the staging
    loads (k / 8 groups in one or two rounds) or from its own pass over x (more groups than threads);
    the 8192-long rows in a 4-row bucket GEMV (kernel_catalog.decode_bmax)."""
    rng = np.random.default_rng(9)
    layout = kc.upload_type(file_type, k, {"gemv_coop": {"types": [file_type]}})
    n = 2 * rpb
    raw = random_blocks(file_type, n * k // quant.block(file_type)[0], seed=1)
    w = np.ascontiguousarray(quant.repack(raw, layout, n, k) if layout != file_type else raw).reshape(-1)
    x = _bf16(rng.standard_normal((ROWS, k)) * rng.uniform(0.2, 4.0, (ROWS, 1)))
    nw = (1.0 + 0.2 * rng.standard_normal(k)).astype(np.float32)
    xn = np.full((ROWS, k), 0x7FC0, np.uint16)
    rs = kc.spec("rmsnorm", n=k, eps="1e-06", threads=kc.NORM_THREADS, residual=False)
    _run(rs, (ROWS, 1, 1), kc.NORM_THREADS, 0, [xn, x, None, nw, ROWS], tmp_path)
    xf = (x.astype(np.uint32) << 16).view(np.float32)
    ref = xf / np.sqrt((xf.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * nw
    assert np.abs((xn.astype(np.uint32) << 16).view(np.float32) - ref).max() <= 2**-7 * np.abs(ref).max()
    base = dict(quant=layout, n=n, k=k, threads=threads, rows_per_block=rpb, residual=False, out_dtype="bf16",
                coop=True, q8x=True, pipeline=True)  # fmt: skip
    want = run_gemv(tmp_path, w, xn, ROWS, **base, bmax=bucket)
    for r in range(ROWS):
        got = run_gemv(tmp_path, w, np.ascontiguousarray(x[r : r + 1]), 1, nw, **base, bmax=1, prologue="norm",
                       x_stride=k, eps="1e-06", early_nw=True, stage_rounds=rounds)  # fmt: skip
        assert np.array_equal(got[0], want[r]), (file_type, r, int((got[0] != want[r]).sum()))


@pytest.mark.parametrize("k", [576, 9216])
def test_classic_gemv_norm_prologue_equals_the_rmsnorm_kernel(k, tmp_path):
    """The classic (bf16) GEMV's norm prologue on three rows of a bucket (rows_inv_rms: at k = 576
    one live round of the 1024 "threads", the other partial sums stored as 0; at 9216 every round,
    two groups a "thread") against the rmsnorm kernel then the GEMV without it: the same bits."""
    rng = np.random.default_rng(1)
    n = 8
    x = _bf16(rng.standard_normal((ROWS, k)) * rng.uniform(0.2, 4.0, (ROWS, 1)))
    nw = (1.0 + 0.2 * rng.standard_normal(k)).astype(np.float32)
    w = _bf16(rng.standard_normal((n, k)) * 0.05).reshape(-1)
    xn = np.full((ROWS, k), 0x7FC0, np.uint16)
    rs = kc.spec("rmsnorm", n=k, eps="1e-06", threads=kc.NORM_THREADS, residual=False)
    _run(rs, (ROWS, 1, 1), kc.NORM_THREADS, 0, [xn, x, None, nw, ROWS], tmp_path)
    p = kc.linear_params("bf16", n, k, {"gemv": {}, "gemv_coop": {}}, bmax=8)
    assert not p.get("coop")
    want = run_gemv(tmp_path, w, xn, ROWS, **p)
    got = run_gemv(tmp_path, w, x, ROWS, nw, **{**p, "prologue": "norm", "x_stride": k, "eps": "1e-06"})
    assert np.array_equal(got, want), int((got != want).sum())
