"""Quantised GGUF models through CudaRunner (skipped without a GPU): both decode GEMV layouts, the
cooperative one also with int8 x rows (gemv_coop.q8x: __dp4a dot products).

A tiny Qwen3 GGUF of random q8_0 or q4_k_m blocks (q4_k with q6_k for attn_v / ffn_down of every
other layer and the embedding), and a tiny SmolLM2-shaped llama GGUF of q4_0 or q4_1 blocks (k = 576:
padded row-planar rows), run on the classic gemv and on the warp-cooperative one (whose plan uploads
q8_0 as q8_0r, q6_k as q6_kr, q4_0 / q4_1 as q4_0r / q4_1r); prefill and decode logits must match
the numpy reference on the same file bytes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fixtures.checkpoints import Dims, write_random_gguf

from engine import cuda
from engine import kernel_catalog as kc
from engine.types import SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)
DIMS = Dims(
    hidden_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=768,
)
LLAMA_DIMS = dataclasses.replace(DIMS, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                 tie_word_embeddings=True)  # fmt: skip
COOP = {
    "types": ["bf16", "q4_k", "q8_0", "q6_k", "q4_0", "q4_1"],
    "unroll": 4,
}
PLANAR = {"q8_0r", "q6_kr", "q4_0r", "q4_1r"}


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# the layouts with int8 x rows (gemv_coop.q8x)
Q8X_LAYOUTS = ("coop_q8x", "q8x_lanes8", "q8x_lanes4", "q8x_wsm", "q8x_wsm_early")


@pytest.mark.parametrize(
    "layout",
    ["classic", "coop", "coop_q8x", "q8x_lanes8", "q8x_lanes4", "q8x_wsm", "q8x_wsm_early", "dequant_wgmma"],
)
@pytest.mark.parametrize(
    "family,q", [("qwen3", "q8_0"), ("qwen3", "q4_k_m"), ("llama", "q4_0"), ("llama", "q4_1")]
)
def test_quantised_gguf_logits_match_the_reference(tmp_path, family, q, layout):
    from engine.model import load_model
    from engine.profile import select
    from engine.reference import ReferenceRunner
    from engine.runner_cuda import CudaRunner

    dims = LLAMA_DIMS if family == "llama" else DIMS
    path = write_random_gguf(tmp_path / f"tiny_{q}.gguf", family, dims, q, seed=7)
    model = load_model(path)
    prof = select(cuda.detect_devices()[0])
    coop = {
        "classic": {**COOP, "types": []},
        "coop": COOP,
        "coop_q8x": {**COOP, "q8x": True},
        # 8 lanes per row (4 row groups per warp); then 4 lanes with the k split over warps,
        # the pipeline, next-tile loads and a capped grid (blocks loop over row tiles)
        "q8x_lanes8": {**COOP, "q8x": True, "q8x_lanes_per_row": 8, "q8x_fuse": True},
        # row tiles bulk-copied into shared memory (capped grid: blocks loop, copying the next tile)
        "q8x_wsm": {**COOP, "q8x": True, "q8x_lanes_per_row": 8, "q8x_fuse": True, "q8x_wsm_kb": 200,
                    "q8x_blocks_per_sm": 1, "pipeline": True},
        # the same with the norm weights read before pdl_wait and the k-split residual right after it
        "q8x_wsm_early": {**COOP, "q8x": True, "q8x_lanes_per_row": 8, "q8x_fuse": True, "q8x_wsm_kb": 200,
                          "q8x_blocks_per_sm": 1, "pipeline": True, "q8x_early_norm_w": True, "q8x_ksplit": 2,
                          "q8x_ksplit_max_n": 1 << 20},
        "q8x_lanes4": {
            **COOP,
            "q8x": True,
            "q8x_lanes_per_row": 4,
            "q8x_ksplit": 2,
            "q8x_ksplit_max_n": 1 << 20,
            "pipeline": True,
            "tile_prefetch": True,
            "q8x_blocks_per_sm": 1,
            "q8x_fuse": True,
        },
    }.get(layout)
    tuning = {**prof.tuning, "gemv_coop": coop or {**COOP, "types": []}}
    if layout == "dequant_wgmma":  # every prefill pass: matrices dequantised to bf16, then gemm_wgmma
        if prof.arch != "sm_90a":
            pytest.skip("gemm_wgmma needs sm_90a")
        tuning["gemm_wgmma"] = {**tuning["gemm_wgmma"], "enabled": True, "dequant_min_rows": 1}
    prof = dataclasses.replace(prof, tuning=tuning)
    runner = CudaRunner(model, prof, num_blocks=64, max_model_len=512)
    try:
        dtypes = {w.dtype for w in runner.plan.weights if w.rows > 1}
        gemvs = [
            la.spec for st in runner.plan.steps for la in st.launches["decode1"] if la.spec.template == "gemv"
        ]
        if layout == "dequant_wgmma":
            pre = [la for st in runner.plan.steps for la in st.launches["prefill"] if la.runs_at(13)]
            assert {la.spec.template for la in pre} >= {"embed", "gemm_wgmma"}
            assert "gemm" not in {la.spec.template for la in pre}
        elif layout != "classic":
            assert dtypes & PLANAR and all(s.params["coop"] for s in gemvs), dtypes
            q8x = {s.params["q8x"] for s in gemvs if s.params["quant"] != "bf16"}
            assert q8x == {layout in Q8X_LAYOUTS}, q8x
            lanes = {s.params["lanes"] for s in gemvs if s.params["q8x"]}
            want = {"q8x_lanes8": 8, "q8x_lanes4": 4, "q8x_wsm": 8, "q8x_wsm_early": 8}.get(layout, 32)
            assert lanes == {want} or layout not in Q8X_LAYOUTS, lanes
            assert any(s.params["wsm"] for s in gemvs) is layout.startswith("q8x_wsm")
            # norm weights before pdl_wait: only where asked; the residual right after it: every
            # batch-1 k-split GEMV (kernel_catalog.builders.coop_options)
            early_nw = {s.params["early_nw"] for s in gemvs}
            assert (True in early_nw) is (layout == "q8x_wsm_early"), early_nw
            early_res = {s.params["early_res"] for s in gemvs}
            assert (True in early_res) is (layout in ("q8x_wsm_early", "q8x_lanes4")), early_res
        else:
            assert not dtypes & PLANAR and not any(s.params["coop"] for s in gemvs)
        ref = ReferenceRunner(model, num_blocks=64, max_model_len=512)
        rng = np.random.default_rng(11)
        prompt = [int(t) for t in rng.integers(3, dims.vocab_size, 13)]
        table = list(range(4))
        tok = runner.step([StepItem(0, prompt, 0, table, True, GREEDY)])[0]
        errs = [_rel(runner.read_logits(1)[0], ref.forward_logits(prompt)[-1])]
        seq = prompt + [tok]
        for _ in range(3):
            tok = runner.step([StepItem(0, [seq[-1]], len(seq) - 1, table, True, GREEDY)])[0]
            errs.append(_rel(runner.read_logits(1)[0], ref.forward_logits(seq)[-1]))
            seq.append(tok)
        print(f"{q} {layout}: logits rel err {', '.join(f'{e:.2e}' for e in errs)} layouts {sorted(dtypes)}")
        # int8 x rows add ~5.5e-3 relative error per GEMV (against f32 x rows;
        # the q8x kernels match their numpy twin quant.q8x_round_trip to ~1e-7): a looser bound
        assert max(errs) < (4e-2 if layout in Q8X_LAYOUTS else 2e-2), errs
    finally:
        runner.close()


def _decode_logits(runner, prompt, steps=3):
    """Logits of a greedy prefill and `steps` decode steps (float32 arrays, in order)."""
    table = list(range(4))
    tok = runner.step([StepItem(0, prompt, 0, table, True, GREEDY)])[0]
    out = [np.array(runner.read_logits(1)[0])]
    seq = prompt + [tok]
    for _ in range(steps):
        tok = runner.step([StepItem(0, [seq[-1]], len(seq) - 1, table, True, GREEDY)])[0]
        out.append(np.array(runner.read_logits(1)[0]))
        seq.append(tok)
    return out


def _assert_same_bits(want, got, label=""):
    """Each step's logits in ``got`` are finite, not all zero, and the same bits as in ``want``."""
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert np.isfinite(b).all() and np.any(b != 0), (label, step)
        assert np.array_equal(a, b), (label, step, float(np.max(np.abs(a - b))))


@pytest.mark.parametrize("q8x", [False, True])
@pytest.mark.parametrize(
    "family,q", [("qwen3", "q8_0"), ("qwen3", "q4_k_m"), ("llama", "q4_0"), ("llama", "q4_1")]
)
def test_tile_prefetch_gives_the_same_bits(tmp_path, family, q, q8x):
    """gemv_coop.tile_prefetch: a lane's last step of a row tile loads the block's next tile's first
    segments; the arithmetic is unchanged, so the logits must be the same bits. A profile with
    sm_count = 1 caps the q8x grid at two blocks, so each loops over many tiles; without q8x every
    block has one tile (the prefetch is never taken) and the bits must match all the same."""
    from engine.model import load_model
    from engine.profile import select
    from engine.runner_cuda import CudaRunner

    prof = select(cuda.detect_devices()[0])
    dims = LLAMA_DIMS if family == "llama" else DIMS
    model = load_model(write_random_gguf(tmp_path / f"tiny_{q}.gguf", family, dims, q, seed=7))
    base = {**COOP, "pipeline": True, "q8x": q8x, "q8x_threads": 256, "q8x_blocks_per_sm": 2}
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(3, dims.vocab_size, 11)]
    logits = {}
    for name, coop in (("off", base), ("on", {**base, "tile_prefetch": True})):
        p = dataclasses.replace(prof, sm_count=1, tuning={**prof.tuning, "gemv_coop": coop})
        runner = CudaRunner(model, p, num_blocks=64, max_model_len=512)
        try:
            gemvs = [la for st in runner.plan.steps for la in st.launches["decode1"] if la.spec.template == "gemv"]
            coops = [la for la in gemvs if la.spec.params["coop"]]
            assert coops and all(la.spec.params["tile_pf"] == (name == "on") for la in coops)
            if q8x:  # the capped grid: blocks loop over row tiles
                assert any(la.grid[0] < -(-la.spec.params["n"] // la.spec.params["rows_per_block"]) for la in coops)
            logits[name] = _decode_logits(runner, prompt)
        finally:
            runner.close()
    _assert_same_bits(logits["off"], logits["on"])


@pytest.mark.parametrize("tile_pf", [False, True])
@pytest.mark.parametrize(
    "family,q", [("qwen3", "q8_0"), ("qwen3", "q4_k_m"), ("llama", "q4_0"), ("llama", "q4_1")]
)
def test_coop_glu_gives_the_same_bits(tmp_path, family, q, tile_pf):
    """gemv_coop.q8x_glu: the batch-1 q8x gate|up GEMV pairs its tile's gate and up rows and stores
    silu(gate) * up (rounding both to bf16 first, as its stored rows were), and the down projection
    reads that instead of applying the silu prologue to both halves: the logits must be the same
    bits. sm_count = 1 caps the grid at two blocks, so each loops over many tiles (with tile_pf: the
    next tile's paired rows loaded in the last step of the current one)."""
    from engine.model import load_model
    from engine.profile import select
    from engine.runner_cuda import CudaRunner

    prof = select(cuda.detect_devices()[0])
    dims = LLAMA_DIMS if family == "llama" else DIMS
    model = load_model(write_random_gguf(tmp_path / f"tiny_{q}.gguf", family, dims, q, seed=7))
    base = {**COOP, "pipeline": True, "tile_prefetch": tile_pf, "q8x": True, "q8x_threads": 256,
            "q8x_blocks_per_sm": 2, "q8x_fuse": True, "q8x_lanes_per_row": 8}
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(3, dims.vocab_size, 11)]
    logits = {}
    for name, coop in (("off", base), ("on", {**base, "q8x_glu": True})):
        tuning = {**prof.tuning, "gemv_coop": coop, "gemv": {**prof.tune("gemv"), "fuse_glu": True}}
        runner = CudaRunner(model, dataclasses.replace(prof, sm_count=1, tuning=tuning), num_blocks=64, max_model_len=512)
        try:
            gemvs = [la.spec for st in runner.plan.steps for la in st.launches["decode1"] if la.spec.template == "gemv"]
            glu = [s for s in gemvs if s.params["glu"]]
            assert len(glu) == (dims.num_hidden_layers if name == "on" else 0), [s.entry for s in glu]
            assert all(s.params["coop"] and s.params["q8x"] for s in glu)
            silu = [s for s in gemvs if s.params["prologue"] == "silu"]
            assert len(silu) == (0 if name == "on" else dims.num_hidden_layers), [s.entry for s in silu]
            logits[name] = _decode_logits(runner, prompt)
        finally:
            runner.close()
    _assert_same_bits(logits["off"], logits["on"])


def _two_prompt_logits(runner, prompts):
    """Logits of both prompts' prefill, then 3 decode steps of sequence 0 alone and 3 of both."""
    tables = [list(range(4)), list(range(4, 8))]
    seqs = [list(p) for p in prompts]
    out = []
    for i, p in enumerate(prompts):
        seqs[i].append(runner.step([StepItem(i, p, 0, tables[i], True, GREEDY)])[0])
        out.append(np.array(runner.read_logits(1)[0]))
    for rows in (1, 1, 1, 2, 2, 2):
        items = [StepItem(i, [seqs[i][-1]], len(seqs[i]) - 1, tables[i], True, GREEDY) for i in range(rows)]
        for i, tok in enumerate(runner.step(items)):
            seqs[i].append(tok)
        out.append(np.array(runner.read_logits(rows)))
    return out


def _q4_k_m_split_linears(tmp_path, variants, check):
    """Logits (_two_prompt_logits) of the tiny q4_k_m file (q6_k v in every other layer, so q|k
    and v are separate allocations) per (name, MEMRA_TUNE spec, use_graphs); ``check(name,
    runner)`` inspects each plan first."""
    from engine.model import load_model
    from engine.profile import select, with_tuning
    from engine.runner_cuda import CudaRunner

    prof = select(cuda.detect_devices()[0])
    model = load_model(write_random_gguf(tmp_path / "tiny_q4_k_m.gguf", "qwen3", DIMS, "q4_k_m", seed=7))
    rng = np.random.default_rng(9)
    prompts = [[int(t) for t in rng.integers(3, DIMS.vocab_size, n)] for n in (11, 6)]
    logits = {}
    for name, tune, graphs in variants:
        runner = CudaRunner(model, with_tuning(prof, tune), num_blocks=64, max_model_len=512, use_graphs=graphs)
        try:
            check(name, runner)
            logits[name] = _two_prompt_logits(runner, prompts)
        finally:
            runner.close()
    return logits


def _knob_keeps_the_bits(tmp_path, tune, knob, names, check):
    """_q4_k_m_split_linears with MEMRA_TUNE ``tune`` and switch ``knob`` off (variant names[0])
    and on (names[1]: replayed, eager, and with decode_graph.pair_min_blocks=2): every "on"
    variant's logits must be the same bits as the "off" one's."""
    off, on = names
    variants = (
        (off, f"{tune}; {knob}=false", True),
        (on, f"{tune}; {knob}=true", True),
        (f"{on} eager", f"{tune}; {knob}=true", False),
        (f"{on} min 2", f"{tune}; {knob}=true; decode_graph.pair_min_blocks=2", True),
    )
    logits = _q4_k_m_split_linears(tmp_path, variants, check)
    for name, _, _ in variants[1:]:
        _assert_same_bits(logits[off], logits[name], name)


def test_forked_v_gemv_gives_the_same_bits(tmp_path):
    """decode_graph.fork_linears: a q4_k_m layer's v GEMV (q6_k, stored apart from q|k) runs on a
    second stream alongside the q|k GEMV. It reads the same x and writes its own output, so the
    logits must be the same bits as with one stream, from replayed graphs and eagerly, for one
    sequence (decode1) and for two (decode)."""

    def check(name, runner):
        forked = [la for st in runner.plan.steps for la in st.launches["decode1"] if la.concurrent]
        assert bool(forked) is (name != "one stream") and all(la.spec.template == "gemv" for la in forked)

    off = "decode_graph.pair_linears=false; decode_graph.fork_linears="
    logits = _q4_k_m_split_linears(
        tmp_path,
        (("one stream", off + "false", True), ("forked", off + "true", True), ("forked eager", off + "true", False)),
        check,
    )
    for name in ("forked", "forked eager"):
        _assert_same_bits(logits["one stream"], logits[name], name)


def test_paired_q_k_and_v_gemvs_give_the_same_bits(tmp_path):
    """decode_graph.pair_linears: a q4_k_m layer's q|k and v GEMVs (q4_k with q6_k or q4_k, in two
    allocations) as one gemv_pair launch at batch 1, the v part re-planned in the q|k part's block
    shape. Every block computes what its own GEMV's block would, and at these shapes the v parts
    keep their lanes and k split (tests/test_plan.py checks it), so the logits must be the same bits
    as the separate launches', replayed and eager; batch 2 (decode) keeps its separate launches."""
    layers = DIMS.num_hidden_layers

    def check(name, runner):
        pairs = [la for st in runner.plan.steps for la in st.launches["decode1"] if la.spec.template == "gemv_pair"]
        assert len(pairs) == (layers if name.startswith("paired") else 0), name
        assert not any(la.concurrent for st in runner.plan.steps for la in st.launches["decode1"])
        for la in pairs:
            a, b = (p.params for p in kc.pair_parts(la.spec))
            assert a["threads"] == b["threads"] == la.block[0] and la.grid[0] == la.spec.params["blocks_a"] + la.spec.params["blocks_b"]
        assert not any(la.spec.template == "gemv_pair" for st in runner.plan.steps for la in st.launches["decode"])

    _knob_keeps_the_bits(tmp_path, "decode_graph.fork_linears=false", "decode_graph.pair_linears", ("apart", "paired"), check)


def test_trace_records_every_block_and_keeps_the_bits(tmp_path, monkeypatch):
    """MEMRA_TRACE=1 (the block timeline of tools/gpu_trace_decode.py): a replayed decode graph
    writes one record per block of every launch, with start <= pdl_wait return <= end on one
    clock, and the logits are the same bits as the untraced kernels'."""
    from engine.model import load_model
    from engine.profile import select
    from engine.runner_cuda import CudaRunner

    prof = select(cuda.detect_devices()[0])
    model = load_model(write_random_gguf(tmp_path / "tiny_q4_k_m.gguf", "qwen3", DIMS, "q4_k_m", seed=7))
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, DIMS.vocab_size, 9)]
    logits = {}
    for name in ("plain", "traced"):
        if name == "traced":
            monkeypatch.setenv("MEMRA_TRACE", "1")
        runner = CudaRunner(model, prof, num_blocks=64, max_model_len=512)
        try:
            logits[name] = _decode_logits(runner, prompt)
            if name == "traced":
                graph, bound = next(g for k, g in runner._graphs.items() if k[0] != "tail")  # the decode graph
                runner.trace_reset()
                graph.launch(runner.stream)
                recs = runner.trace_read()
                assert len(recs) == sum(int(np.prod(b.grid)) for b in bound)
                start, wait, end = recs[:, 2], recs[:, 3], recs[:, 5]
                assert np.all(start > 0) and np.all(start <= end)
                waited = wait > 0
                assert waited.mean() > 0.9 and np.all(start[waited] <= wait[waited])
                assert np.all(wait[waited] <= end[waited])
            else:
                with pytest.raises(Exception, match="MEMRA_TRACE"):
                    runner.trace_reset()
        finally:
            runner.close()
    _assert_same_bits(logits["plain"], logits["traced"])


def test_register_room_variants_give_the_same_bits(tmp_path):
    """q6_k at batch-1 unroll 1 and the pair at pair_min_blocks 3 only change registers and how
    many segments a lane has in flight, not the sums or their order: the same logits bits."""
    import yaml

    from engine.profile import select

    types = dict(select(cuda.detect_devices()[0]).tuning["gemv_coop"]["q8x_type_tuning"])

    def q6(**extra):
        return "gemv_coop.q8x_type_tuning=" + yaml.safe_dump(
            {**types, "q6_k": {**types.get("q6_k", {}), **extra}}, default_flow_style=True
        ).strip()

    def check(name, runner):
        pairs = [la for st in runner.plan.steps for la in st.launches["decode1"] if la.spec.template == "gemv_pair"]
        if name != "off":
            assert pairs and all(p.params["min_blocks"] == 3 for la in pairs for p in kc.pair_parts(la.spec)), name

    variants = (
        ("off", "", True),
        ("unroll 1, pair min 3", f"{q6(q8x_b1_unroll=1)}; decode_graph.pair_min_blocks=3", True),
    )
    logits = _q4_k_m_split_linears(tmp_path, variants, check)
    for name, _, _ in variants[1:]:
        _assert_same_bits(logits["off"], logits[name], name)


def test_attention_l2_prefetch_gives_the_same_bits(tmp_path):
    """attention_decode.l2_prefetch_o: at batch 1 and short contexts the direct attention
    prefetches its layer's o weight into L2 (bulk prefetches at its start), or the o GEMV
    prefetches the gate|up rows (decode_graph.o_prefetch_next_kb). A prefetch is a hint, so the
    logits must be the same bits as without it, replayed and eager."""
    from engine.ir import SHORT1

    layers = DIMS.num_hidden_layers

    def check(name, runner):
        pf = [la for st in runner.plan.steps for la in st.launches.get(SHORT1, ()) if la.spec.params.get("l2_pf")]
        assert len(pf) == (0 if name in ("off", "o gemv") else layers), name
        o = [la for st in runner.plan.steps for la in st.launches["decode1"] if la.spec.params.get("l2_pf")]
        assert len(o) == {"o gemv": layers}.get(name, 0), name

    # every layer of the tiny file inside the o window (the profile's is sized for Qwen3-4B's o),
    # and the profile's own window knobs off unless a variant sets them
    off = (
        "decode_graph.o_window_min_kb=0; decode_graph.o_window_max_kb=0; attention_decode.l2_prefetch_o=false; "
        "attention_decode.trigger_b1=false; decode_graph.o_prefetch_next_kb=0"
    )
    on = f"{off}; attention_decode.l2_prefetch_o=true"
    variants = (
        ("off", off, True),
        ("start", on, True),
        ("start eager", on, False),
        ("o gemv", f"{off}; decode_graph.o_prefetch_next_kb=256", True),
    )
    logits = _q4_k_m_split_linears(tmp_path, variants, check)
    for name, _, _ in variants[1:]:
        _assert_same_bits(logits["off"], logits[name], name)
