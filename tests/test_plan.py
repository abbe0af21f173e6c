"""engine.plan: weights fused, values laid out, launches lowered and deduplicated (no GPU)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.graph import load_family
from engine.ir import kernel_specs, storage_nbytes
from engine.model import dims_for_size
from engine.plan import build_plan
from engine.profile import get_profile, with_tuning
from engine.render import render
from engine.storage import row_bytes
from engine.types import ConfigError


def plan_for(family: str, size: str, quant: str = "bf16", profile: str = "h200", **kw):
    graph = load_family(family)
    return build_plan(
        graph,
        dims_for_size(family, size),
        graph.quant(quant),
        get_profile(profile),
        **kw,
    )


def test_qwen3_fuses_qkv_and_gate_up_and_orders_steps_layer_major():
    plan = plan_for("qwen3", "qwen3-0.6b")
    keys = [w.key for w in plan.weights]
    assert "L0.wq|wk|wv" in keys and "L27.w_gate|w_up" in keys
    qkv = plan.weight("L0.wq|wk|wv")
    assert (qkv.rows, qkv.cols, qkv.part_rows) == (2048 + 1024 + 1024, 1024, (2048, 1024, 1024))
    assert qkv.nbytes == 4096 * 1024 * 2
    # tied lm_head reuses the embedding allocation
    assert "lm_head" not in keys and "embed" in keys
    layers = [s.layer for s in plan.steps if s.layer is not None]
    assert layers == sorted(layers)  # layer 0's ops, then layer 1's ...
    q, k, v = plan.values["q"], plan.values["k"], plan.values["v"]
    assert q.buffer == k.buffer == v.buffer and (q.offset, k.offset, v.offset) == (0, 2048, 3072)
    assert q.ld == k.ld == 4096


def test_qwen3_head_norms_fuse_into_rope():
    plan = plan_for("qwen3", "qwen3-0.6b")
    step_ops = [(s.op.op, len(s.launches["prefill"])) for s in plan.steps if s.layer == 0]
    assert ("head_rmsnorm", 0) in step_ops
    rope = next(s for s in plan.steps if s.layer == 3 and s.op.op == "rope").launches["prefill"][0]
    assert rope.spec.params["qk_norm"] is True
    assert rope.spec.params["q_stride"] == 4096
    weights = [a.ref for a in rope.args if a.kind == "weight"]
    assert weights == ["L3.q_norm", "L3.k_norm"]
    kv = [(a.ref, a.layer) for a in rope.args if a.kind == "kv"]
    assert kv == [("k", 3), ("v", 3)]


def test_decode_rope_folds_into_attention_when_the_profile_says_so():
    """attention_decode.fuse_rope (on for h200): short-context decode launches no rope kernel (the
    rope step's "short" launches are empty) and the direct attention launch carries the rope params,
    the head-norm weights and the cache slots; the split decode kernels (in the direct kernel's
    warps) and prefill keep the rope kernel (a split block would redo the rope). With the knob off, "short" launches rope again."""
    from engine import kernel_catalog as kc
    from engine.profile import with_tuning

    graph = load_family("qwen3")
    dims = dims_for_size("qwen3", "qwen3-0.6b")
    prof = get_profile("h200")
    assert prof.tuning["attention_decode"]["fuse_rope"]
    plan = build_plan(graph, dims, graph.quant("bf16"), prof)
    rope = next(s for s in plan.steps if s.layer == 3 and s.op.op == "rope")
    attn = next(s for s in plan.steps if s.layer == 3 and s.op.op == "attention")
    assert rope.launches["short"] == () and rope.launches["prefill"]
    assert rope.launches["decode1"][0].spec.template == rope.launches["decode"][0].spec.template == "rope"
    la = attn.launches["short"][0]
    p = la.spec.params
    assert p["rope"] and p["direct"] and p["qk_norm"] and p["kv_stride"] == 4096 and p["style"] == "neox"
    assert p["warps"] == prof.tuning["attention_decode"]["direct_warps"] == 8
    assert [a.ref for a in la.args if a.kind == "weight"] == ["L3.q_norm", "L3.k_norm"]
    assert ("input", "slots") in [(a.kind, a.ref) for a in la.args]
    assert len(la.args) == len(kc.kernel_args(la.spec))
    for mode in ("decode1", "decode"):
        split = attn.launches[mode][0].spec.params
        # the direct kernel's warps: a row below split sums its keys in the same order in both
        assert not split["rope"] and not split["direct"] and split["warps"] == 8
    assert attn.launches["prefill"][0].spec.template == "attention_prefill"
    off = with_tuning(prof, "attention_decode.fuse_rope=false")
    plan = build_plan(graph, dims, graph.quant("bf16"), off)
    rope = next(s for s in plan.steps if s.layer == 3 and s.op.op == "rope")
    attn = next(s for s in plan.steps if s.layer == 3 and s.op.op == "attention")
    assert rope.launches["short"][0].spec.template == "rope"
    assert not attn.launches["short"][0].spec.params["rope"]


def test_llama_rope_has_no_qk_norm_and_interleaved_style_for_gguf():
    plan = plan_for("llama", "smollm2-135m", quant="q4_1", rope_style="interleaved")
    rope = next(s for s in plan.steps if s.op.op == "rope").launches["prefill"][0]
    assert rope.spec.params["qk_norm"] is False and rope.spec.params["style"] == "interleaved"
    qkv = plan.weight("L0.wq|wk|wv")
    # the h200 coop layout takes q4_1 row-planar: the file's 360-byte rows padded to 368
    assert qkv.dtype == "q4_1r" and qkv.nbytes == storage_nbytes("q4_1r", 576 + 192 + 192, 576) == 960 * 368


def test_unequal_storage_types_fuse_runs_of_equal_ones():
    """q|k of one type fuse and a v of another stays apart (a q4_k_m file's q6_k attn_v); the rope
    then reads v with its own row stride (v_stride). A type between two equal ones splits all."""
    graph = load_family("llama")
    dims = dims_for_size("llama", "llama3-8b")
    dtypes = {"wq": "q4_k", "wk": "q4_k", "wv": "q6_k", "w_gate": "q4_k", "w_up": "q4_k", "w_down": "q6_k"}
    plan = build_plan(graph, dims, graph.quant("q4_k_m"), get_profile("h200"), tensor_dtypes=dtypes)
    keys = {w.key for w in plan.weights}
    assert "L0.wq|wk" in keys and "L0.wq" not in keys and "L0.wv" in keys and "L0.w_gate|w_up" in keys
    linear = next(s for s in plan.steps if s.layer == 0 and s.op.op == "linear")
    assert len(_at(linear.launches["decode"])) == len(_at(linear.launches["decode"], 32)) == 2  # wq|wk, then wv
    q, k, v = (plan.values[n] for n in linear.op.outputs)
    assert q.buffer == k.buffer != v.buffer and q.ld == k.ld == q.width + k.width and v.ld == v.width
    rope = next(s for s in plan.steps if s.layer == 0 and s.op.op == "rope")
    p = rope.launches["prefill"][0].spec.params
    assert (p["q_stride"], p["kv_stride"], p["v_stride"]) == (q.ld, k.ld, v.ld)
    assert "v_stride" in rope.launches["prefill"][0].spec.entry
    mixed = build_plan(
        graph,
        dims,
        graph.quant("q4_k_m"),
        get_profile("h200"),
        tensor_dtypes={**dtypes, "wk": "q6_k", "wv": "q4_k"},
    )
    assert {"L0.wq", "L0.wk", "L0.wv"} <= {w.key for w in mixed.weights}


# the h200 profile's batch-1 attention-window knobs (twentieth session) off: the tests of those
# knobs, and of the launches they would change, compare plans against the plan without them
WINDOW_OFF = "attention_decode.l2_prefetch_o=false; attention_decode.trigger_b1=false; decode_graph.o_prefetch_next_kb=0"


def _q4_k_m_plan(tuning: str):
    """The h200 plan, with its attention-window knobs off (WINDOW_OFF) and then the
    MEMRA_TUNE-style ``tuning`` overrides, of a Qwen3-4B q4_k_m file: q4_k weights with q6_k v and
    down (so q|k and v are separate allocations)."""
    graph = load_family("qwen3")
    dtypes = {"wq": "q4_k", "wk": "q4_k", "wv": "q6_k", "w_gate": "q4_k", "w_up": "q4_k", "w_down": "q6_k"}
    prof = with_tuning(get_profile("h200"), f"{WINDOW_OFF}; {tuning}")
    return build_plan(graph, dims_for_size("qwen3", "qwen3-4b"), graph.quant("q4_k_m"), prof, tensor_dtypes=dtypes)


def test_fork_linears_marks_a_split_linears_later_launches_concurrent():
    """decode_graph.fork_linears: the v GEMV of a q4_k_m layer (stored apart from q|k) may run
    alongside the q|k GEMV in decode, never in prefill; nothing else is concurrent, and with the
    knob off nothing is."""
    for on in (True, False):
        plan = _q4_k_m_plan(f"decode_graph.pair_linears=false; decode_graph.fork_linears={str(on).lower()}")
        qkv = [s for s in plan.steps if s.op.op == "linear" and s.op.outputs[0] == "q"]
        assert len(qkv) == dims_for_size("qwen3", "qwen3-4b")["layers"]
        for step in plan.steps:
            for mode, launches in step.launches.items():
                flags = [la.concurrent for la in launches]
                if step in qkv and mode in ("decode1", "decode"):
                    for rows in (8, 32):  # (the coop and the mma bucket GEMVs alike)
                        assert [la.concurrent for la in _at(launches, rows)] == [False, on], (mode, rows)
                else:
                    assert not any(flags), (step.op.op, step.op.outputs, mode)


def test_pair_linears_runs_q_k_and_v_as_one_launch_at_batch_1():
    """decode_graph.pair_linears: each q4_k_m layer's q|k (q4_k) and v (q6_k) GEMVs at batch 1 are
    one gemv_pair launch: part a is the unpaired q|k spec itself, part b the v re-planned in its
    block shape; the args are both launches' in order, the grid their blocks, the shared memory
    the larger. Batch 8 and prefill keep their launches (decode forked), and off nothing pairs."""
    from fixtures.pdl import waits_first

    from engine import kernel_catalog as kc

    apart = _q4_k_m_plan("decode_graph.pair_linears=false")
    paired = _q4_k_m_plan("decode_graph.pair_linears=true; decode_graph.pair_min_blocks=0")
    qkv = [(s, t) for s, t in zip(apart.steps, paired.steps, strict=True) if s.op.op == "linear" and s.op.outputs[0] == "q"]
    assert len(qkv) == dims_for_size("qwen3", "qwen3-4b")["layers"]
    for s, t in qkv:
        (pair,) = t.launches["decode1"]
        qk, v = s.launches["decode1"]
        assert pair.spec.template == "gemv_pair" and not pair.concurrent and not pair.fit_grid
        a, b = kc.pair_parts(pair.spec)
        assert a.params == qk.spec.params
        assert b.params["quant"] == v.spec.params["quant"] == "q6_kr" and b.params["n"] == v.spec.params["n"]
        assert b.params["threads"] == a.params["threads"] == pair.block[0] == 320
        # the v part keeps its lanes and k split in the smaller block: 10-row tiles
        assert (b.params["lanes"], b.params["ksplit"], b.params["rows_per_block"]) == (16, 2, 10)
        assert pair.grid[0] == pair.spec.params["blocks_a"] + pair.spec.params["blocks_b"] == 128 + 103
        assert pair.args == qk.args + v.args and len(kc.kernel_args(pair.spec)) == len(pair.args)
        assert pair.smem == max(kc.gemv_smem(a.params), kc.gemv_smem(b.params)) == qk.smem
        assert [la.spec for la in t.launches["decode"]] == [la.spec for la in s.launches["decode"]]
        assert [la.concurrent for la in _at(t.launches["decode"])] == [la.concurrent for la in _at(t.launches["decode"], 32)] == [False, True]
        assert t.launches["prefill"] == s.launches["prefill"]
    assert not any(la.spec.template == "gemv_pair" for st in apart.steps for la in st.launches["decode1"])
    spec = qkv[0][1].launches["decode1"][0].spec
    src = render(spec)
    assert waits_first(src, spec.entry)
    a_src = src[src.index("namespace memra_pair_a {") : src.index("namespace memra_pair_b {")]
    assert "#undef UPT" in a_src and "#undef K\n" in a_src and "__global__" not in a_src


def test_a_q4_k_v_part_keeps_a_k_split_that_divides_the_pair_warps():
    """A q4_k_m file whose v is q4_k in some layers (llama.cpp's mix): that v pairs with q|k in
    320-thread blocks, where q4_k's k split of 4 does not divide 10 warps, so it takes 2 (20-row
    tiles, the 52 blocks it has alone), not 1 (40-row tiles, half the blocks)."""
    from engine import kernel_catalog as kc

    graph = load_family("qwen3")
    dims = dims_for_size("qwen3", "qwen3-4b")
    dtypes = {"wq": "q4_k", "wk": "q4_k", "wv": "q4_k", "w_gate": "q4_k", "w_up": "q4_k", "w_down": "q6_k"}
    dtypes.update({f"wv@{lay}": "q6_k" for lay in range(0, dims["layers"], 2)})
    prof = with_tuning(get_profile("h200"), "decode_graph.pair_linears=true")
    plan = build_plan(graph, dims, graph.quant("q4_k_m"), prof, tensor_dtypes=dtypes)
    shapes = set()
    for st in plan.steps:
        if st.op.op == "linear" and st.op.outputs[0] == "q":
            (pair,) = st.launches["decode1"]
            _, v = kc.pair_parts(pair.spec)
            p = v.params
            shapes.add((p["quant"], p["threads"], p["ksplit"], p["rows_per_block"], pair.spec.params["blocks_b"]))
    assert shapes == {("q6_kr", 320, 2, 10, 103), ("q4_k", 320, 2, 20, 52)}


def test_tiny_q4_k_m_pairs_keep_the_v_shape(tmp_path):
    """The tiny q4_k_m GGUF of tests/gpu/test_quant_models.py (q6_k v in layer 0, q4_k in layer 1):
    both layers pair at batch 1, and there the v part has its unpaired spec (640-thread blocks on
    both sides), which the GPU test's same-bits check relies on."""
    import sys
    from pathlib import Path

    from fixtures.checkpoints import write_random_gguf

    from engine import kernel_catalog as kc
    from engine.model import load_model

    sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    from test_quant_models import DIMS

    m = load_model(write_random_gguf(tmp_path / "tiny.gguf", "qwen3", DIMS, "q4_k_m", seed=7))

    def qkv(tune):
        prof = with_tuning(get_profile("h200"), tune)
        plan = build_plan(m.graph, m.dims, m.quant, prof, m.tensor_dtypes, m.rope_style)
        return [s.launches["decode1"] for s in plan.steps if s.op.op == "linear" and s.op.outputs[0] == "q"]

    apart, paired = qkv("decode_graph.pair_linears=false"), qkv("decode_graph.pair_min_blocks=0")
    assert len(paired) == DIMS.num_hidden_layers
    vq = []
    for two, (pair,) in zip(apart, paired, strict=True):
        assert [p.params for p in kc.pair_parts(pair.spec)] == [la.spec.params for la in two]
        vq.append(two[1].spec.params["quant"])
    assert vq == ["q6_kr", "q4_k"]


def test_pair_min_blocks_sets_the_pair_launch_bounds():
    """decode_graph.pair_min_blocks: both parts carry min_blocks, so the pair kernel is declared
    __launch_bounds__(threads, N) (ptxas then fits the q6_kr part in 64 registers without spills
    at 3); the parts are otherwise the unset pair's, and nothing else changes."""
    from engine import kernel_catalog as kc

    def pairs(tune):
        plan = _q4_k_m_plan("decode_graph.pair_linears=true" + tune)
        return [la for st in plan.steps for la in st.launches["decode1"] if la.spec.template == "gemv_pair"]

    assert all("__launch_bounds__(320, 2)" in render(la.spec) for la in pairs(""))  # the h200 profile's
    for free, three in zip(pairs("; decode_graph.pair_min_blocks=0"), pairs("; decode_graph.pair_min_blocks=3"), strict=True):
        for p, q in zip(kc.pair_parts(free.spec), kc.pair_parts(three.spec), strict=True):
            assert q.params == {**p.params, "min_blocks": 3}
        assert "__launch_bounds__(320, 3)" in render(three.spec) and "__launch_bounds__(320)" in render(free.spec)
        assert (three.grid, three.block, three.smem, three.args) == (free.grid, free.block, free.smem, free.args)


def test_pair_spec_rules_name_the_problem():
    from engine import kernel_catalog as kc

    def gemv(**kw):
        p = kc.linear_params("q4_k", 1024, 2560, get_profile("h200").tuning, bmax=1)
        return kc.spec("gemv", **{**p, **kw})

    a = gemv()
    assert a.params["coop"] and a.params["q8x"] and a.params["threads"] == 640
    with pytest.raises(ConfigError, match="threads differ"):
        kc.pair_spec(a, gemv(threads=320, ksplit=1, rows_per_block=40))
    with pytest.raises(ConfigError, match="grid_cap"):
        kc.pair_spec(a, gemv(grid_cap=8))
    with pytest.raises(ConfigError, match="coop gemv"):
        kc.pair_spec(a, kc.spec("rmsnorm", n=64, eps=1e-6, threads=256, residual=False))
    p = kc.pair_spec(a, a)
    assert kc.spec("gemv_pair", **p.params) == p  # the params alone rebuild the spec
    c = kc.choice("gemv_pair", **p.params)
    assert c.grid(1) == (2 * p.params["blocks_a"], 1, 1) and c.block == (a.params["threads"], 1, 1)


def test_launch_key_picks_short1_then_short_then_the_mode():
    from engine.ir import SHORT1, launch_key

    both, short_only = {"decode1": (), "short": (), SHORT1: ()}, {"decode1": (), "decode": (), "short": ()}
    assert launch_key(both, "decode1", True) == SHORT1
    assert launch_key(both, "decode1", False) == "decode1"
    assert launch_key(both, "decode", True) == "short"
    assert launch_key(short_only, "decode1", True) == "short"
    assert launch_key({"decode1": ()}, "decode1", True) == "decode1"


def test_launch_key_of_a_verify_pass():
    """A verify pass takes VSHORT (short context) only in the decode mode it was lowered for: a
    wide verify pass (16 rows and more where the plan has a wide mode) keeps its own launches,
    "short" or the mode's (GPU: 16 verify rows of a hybrid read the decode GEMVs' layouts through
    VSHORT and got logits off by 100 %); past short context a verify pass runs plain decode's."""
    from engine.ir import VSHORT, WIDE, launch_key

    ls = {"decode": (), "short": (), VSHORT: (), WIDE: ()}
    assert launch_key(ls, "decode", True, verify=True) == VSHORT
    assert launch_key(ls, "decode", False, verify=True) == "decode"
    assert launch_key(ls, WIDE, True, verify=True) == "short"
    assert launch_key(ls, WIDE, False, verify=True) == WIDE
    assert launch_key(ls, "decode", True) == "short"


def test_attention_table_first_on_every_decode_kernel():
    """attention_decode.table_first (on for h200): every decode attention kernel, the short-context
    direct one and the split one, stages its first table chunk at its start, before the row's
    position is known (its own loop, outside the chunk loop that needs the position); off, the
    source has no such loop."""

    def attn(plan):
        short = {la.spec for s in plan.steps for la in s.launches.get("short", ()) if la.spec.template == "attention"}
        split = {la.spec for s in plan.steps for la in s.launches.get("decode", ()) if la.spec.template == "attention"}
        assert len(short) == 1 and len(split) == 1
        return short.pop(), split.pop()

    graph = load_family("qwen3")
    dims = dims_for_size("qwen3", "qwen3-4b")
    for plan in (_q4_k_m_plan(""), build_plan(graph, dims, graph.quant("q8_0"), get_profile("h200"))):
        for spec in attn(plan):
            assert spec.params["table_first"] and "_table_first1" in spec.entry, spec.entry
            src = render(spec)
            assert "sm_tab[i] = table[t0 + i]" in src and "if (cbeg != start)  //" in src
            assert src.index("sm_tab[i] = table[t0 + i]") < src.index("for (int cbeg = start;")
    for spec in attn(_q4_k_m_plan("attention_decode.table_first=false")):
        assert not spec.params["table_first"] and "table[t0 + i]" not in render(spec)


def test_early_trigger_marks_the_batch_1_coop_gemvs_only():
    """decode_graph.early_trigger: every decode1 coop GEMV calls pdl_trigger() after its first loads
    (entry name trigger1); the batch-8 GEMVs, the prefill and the other kernels do not."""
    for on in (True, False):
        plan = _q4_k_m_plan(f"decode_graph.early_trigger={str(on).lower()}")
        for step in plan.steps:
            for mode, launches in step.launches.items():
                for la in launches:
                    if la.spec.template != "gemv":
                        assert not la.spec.params.get("trigger", False), la.spec.entry
                        continue
                    want = on and la.spec.params["coop"] and mode == "decode1"
                    assert la.spec.params.get("trigger", False) is want, (mode, la.spec.entry)
                    assert ("trigger1" in la.spec.entry) is want
                    if want:
                        assert "pdl_trigger();" in render(la.spec)


def test_residual_linear_writes_in_place_and_logits_are_f32():
    plan = plan_for("llama", "smollm2-135m")
    wo = [s for s in plan.steps if s.layer == 0 and s.op.op == "linear"][1].launches["decode"][0]
    assert wo.spec.params["residual"] is True
    assert [a.ref for a in wo.args if a.kind == "value"] == ["x", "a", "x"]
    head = [s for s in plan.steps if s.head]
    assert [s.op.op for s in head] == ["rmsnorm", "linear"]
    assert head[-1].launches["decode"][0].spec.params["out_dtype"] == "f32"
    assert plan.values["logits"].dtype == "f32"
    logits_buf = next(b for b in plan.buffers if b.name == "logits")
    assert logits_buf.rows == max(get_profile("h200").cuda_graph_batch_sizes)


def test_kernel_specs_are_deduplicated_and_grids_evaluate():
    plan = plan_for("llama", "smollm2-135m")
    specs = kernel_specs(plan)
    assert len(specs) == len(set(specs))
    # 30 layers share their kernels: a handful of distinct specs, not hundreds (the decode GEMVs
    # with fused norm / SiLU prologues and the wide-decode GEMMs add a few, the token_mask and
    # logprobs steps of the masked sampling kinds)
    assert len(specs) < 44
    gemv = next(s for s in plan.steps if s.op.op == "linear").launches["decode"][0]
    assert gemv.grid_for({"n": 9})[1] == 2  # ceil(9 / max_batch 8)


@pytest.mark.parametrize(
    "family,size,quant",
    [("qwen3", "qwen3-0.6b", "bf16"), ("llama", "smollm2-135m", "q4_1"), ("llama", "llama3-8b", "q8_0")],
)
def test_every_real_template_spec_renders(family, size, quant):
    plan = plan_for(family, size, quant)
    real = kernel_specs(plan)
    # prefill linears take the Hopper TMA + wgmma GEMM on the h200 profile (quantised ones for long
    # chunks, after a dequantisation)
    wgmma = {"gemm_wgmma"}
    assert {s.template for s in real} - wgmma == {
        "embed",
        "rmsnorm",
        "gemv",
        "gemm",
        "rope",
        "silu_mul",
        "attention",
        "attention_prefill",
        "attention_combine",
        "argmax",
        "sample",
        "penalties",
        "token_mask",
        "logprobs",
    }
    assert wgmma <= {s.template for s in real}
    for spec in real:
        src = render(spec)
        assert spec.entry in src


def test_arena_offsets_are_aligned():
    plan = plan_for("qwen3", "qwen3-0.6b")
    offs = plan.buffer_offsets()
    assert all(o % 256 == 0 for o in offs.values())
    assert plan.arena_bytes() >= sum(b.nbytes(plan.max_tokens) for b in plan.buffers)


def test_missing_dims_and_unknown_storage_fail_clearly():
    graph = load_family("llama")
    with pytest.raises(ConfigError, match="dims lack 'vocab'"):
        build_plan(
            graph,
            {"hidden": 8, "layers": 1, "heads": 1, "intermediate": 8},
            graph.quant("bf16"),
            get_profile("h200"),
        )
    with pytest.raises(ConfigError, match="whole number"):
        storage_nbytes("q4_0", 2, 48)


def test_attention_decode_splits_prefill_flash_and_scratch_is_sized_by_context():
    from engine.kernel_catalog import PREFILL_BLOCK_Q

    plan = plan_for("qwen3", "qwen3-0.6b")
    step = next(s for s in plan.steps if s.layer == 0 and s.op.op == "attention")
    dec, comb = step.launches["decode"]
    assert dec.spec.params["direct"] is False
    assert comb.spec.template == "attention_combine"
    split = get_profile("h200").tune("attention_decode")["split_kv_tokens"]
    assert dec.grid_for({"n": 4, "max_ctx": 4096}) == (4, 8, 4096 // split)
    # varlen flash attention: (q tiles, heads, sequences); with the key split (h200: span), passes
    # of up to split_rows rows one block per span too, and the combine's fold
    pre, part, fold = step.launches["prefill"]
    pt = get_profile("h200").tune("attention_prefill")
    span, srows = pt["span"], pt["split_rows"]
    assert pre.spec.template == part.spec.template == "attention_prefill" and fold.spec.template == "attention_combine"
    assert pre.spec.params["span"] == part.spec.params["span"] == fold.spec.params["split"] == span > 0
    assert not pre.spec.params["partial"] and part.spec.params["partial"] and fold.spec.params["fold"]
    assert [la.runs_at(srows) for la in (pre, part, fold)] == [False, True, True]
    assert [la.runs_at(srows + 1) for la in (pre, part, fold)] == [True, False, False]
    assert pre.grid_for({"n": 300, "max_q": 130, "nseq": 3}) == (3, 16, 3)
    # the split launch a block per kv head (split_gqa): its 2 warps the group's query heads, 16 rows
    assert part.spec.params["gqa"] and part.block == (64,)
    assert part.grid_for({"n": 20, "max_q": 17, "nseq": 2, "max_ctx": 4096}) == (2, 8, 2 * 4096 // span)
    assert ("input", "seq_starts") in [(a.kind, a.ref) for a in pre.args]
    assert pre.smem == (PREFILL_BLOCK_Q + 4 * pt["block_kv"]) * (128 + 8) * 2
    assert part.smem == (32 + 4 * pt["block_kv"]) * (128 + 8) * 2
    scratch = {sp.name: sp for sp in plan.scratch}
    rows = max(get_profile("h200").cuda_graph_batch_sizes)
    assert scratch["attn_o"].nbytes(4096) == (4096 // split) * rows * 16 * 128 * 4
    assert scratch["pattn_o"].nbytes(4096) == (4096 // span) * srows * 16 * 128 * 4


def _short_chunks_only(**kw):
    """The h200 plan of a q8_0 SmolLM2 without the long-chunk dequantise + wgmma path."""
    from engine.profile import with_tuning

    graph = load_family("llama")
    prof = with_tuning(get_profile("h200"), "gemm_wgmma.dequant_min_rows=0")
    return build_plan(graph, dims_for_size("llama", "smollm2-135m"), graph.quant("q8_0"), prof, **kw)


def test_quantised_prefill_uses_the_fused_gemm_on_the_gguf_rows():
    from engine import kernel_catalog as kc

    plan = _short_chunks_only()
    linear = next(s for s in plan.steps if s.layer == 0 and s.op.op == "linear")
    (gemm,) = linear.launches["prefill"]
    assert gemm.spec.template == "gemm" and gemm.spec.params["quant"] == "q8_0"
    assert gemm.args[2].kind == "weight"
    g = {**kc.GEMM_FIXED["gemm"], **get_profile("h200").tuning["gemm"]}  # the prefill tile, padded or swizzled rows
    pad = 0 if g["swizzle"] else 8
    assert gemm.smem == g["stages"] * (g["tile_m"] + g["tile_n"]) * (gemm.spec.params["tile_k"] + pad) * 2
    assert not {sp.name for sp in plan.scratch} & {"dequant", "iota"}
    assert [launch.spec.template for launch in linear.launches["decode"]] == ["gemv"]


def test_quantised_prefill_falls_back_to_dequantise_then_gemm_without_a_fused_decoder(monkeypatch):
    from engine import kernel_catalog as kc

    gemm_params = kc.gemm_params

    def bf16_only(n, k, tuning, **kw):
        if kw.get("quant", "bf16") != "bf16":
            raise ConfigError("no fused decoder")
        return gemm_params(n, k, tuning, **kw)

    monkeypatch.setattr(kc, "gemm_params", bf16_only)
    plan = _short_chunks_only()
    linear = next(s for s in plan.steps if s.layer == 0 and s.op.op == "linear")
    deq, gemm = linear.launches["prefill"]
    assert deq.spec.template == "embed" and deq.spec.params["quant"] == "q8_0"
    assert gemm.spec.template == "gemm" and gemm.args[2].kind == "scratch"
    assert gemm.spec.params["quant"] == "bf16"
    assert {sp.name for sp in plan.scratch} >= {"dequant", "iota"}


def test_linear_gemm_lowers_with_the_wide_decode_tuning():
    from engine import kernel_catalog as kc
    from engine.graph import Op
    from engine.ir import Value, WeightPlan
    from engine.lowering.context import Lowerer
    from engine.lowering.linear import linear_gemm
    from engine.profile import with_tuning

    prof = get_profile("h200")
    adapter = Lowerer(prof, dims_for_size("qwen3", "qwen3-4b"), "neox")
    op = Op("linear", ("attn",), ("h",), ("wo",), {"residual": "h"})
    ins = [Value("attn", "attn", 0, 4096, 4096, "bf16")]
    outs = [Value("h", "h", 0, 2560, 2560, "bf16")]
    ws = [WeightPlan("L0.wo", 0, ("wo",), "bf16", 2560, 4096)]
    (dec,) = linear_gemm(adapter, op, "decode", ins, outs, ws, section="gemm_decode")
    off = with_tuning(prof, "gemm_wgmma.enabled=false")
    (pre,) = linear_gemm(
        Lowerer(off, dims_for_size("qwen3", "qwen3-4b"), "neox"), op, "prefill", ins, outs, ws
    )
    t = prof.tune("gemm_decode")
    assert dec.spec.params["tile_m"] == t["tile_m"] and dec.spec.params["split_k"] == t["split_k"]
    assert dec.spec.params["residual"] is True and pre.spec.params["split_k"] == kc.GEMM_FIXED["gemm"]["split_k"]
    assert dec.grid_for({"n": 100}) == (2560 // t["tile_n"], -(-100 // t["tile_m"]))
    assert dec.smem == kc.gemm_smem(dec.spec.params) and dec.spec != pre.spec


def test_bf16_prefill_linear_lowers_to_the_wgmma_gemm_with_tensor_maps():
    """On the h200 profile a bf16 prefill linear is the TMA + wgmma GEMM: A and W reach it as tensor
    maps (value / weight, box rows = the tile's rows), the residual aliases out; where k is not a
    multiple of 64 (or the profile turns it off) the mma.sync gemm takes the linear."""
    from engine import kernel_catalog as kc
    from engine.graph import Op
    from engine.ir import Value, WeightPlan
    from engine.lowering.context import Lowerer
    from engine.lowering.linear import linear_gemm

    prof = get_profile("h200")
    g = prof.tune("gemm_wgmma")
    adapter = Lowerer(prof, dims_for_size("qwen3", "qwen3-4b"), "neox")
    op = Op("linear", ("attn",), ("h",), ("wo",), {"residual": "h"})
    ins = [Value("attn", "attn", 0, 4096, 4096, "bf16")]
    outs = [Value("h", "h", 0, 2560, 2560, "bf16")]
    ws = [WeightPlan("L0.wo", 0, ("wo",), "bf16", 2560, 4096)]
    (pre,) = linear_gemm(adapter, op, "prefill", ins, outs, ws)
    tile = kc.GEMM_WGMMA_NARROW if 2560 < g["wide_min_n"] else kc.GEMM_WGMMA_WIDE
    tile_m = 64 * tile["consumers"] * tile["m_frags"]
    tn = pre.spec.params["tile_n"]
    assert tn == tile["tile_n"]
    assert pre.spec.template == "gemm_wgmma" and pre.spec.params["residual"] is True
    assert [a.kind for a in pre.args] == ["value", "tmap", "tmap", "value", "shape"]
    assert pre.args[1].ref == ("value", "attn", tile_m) and pre.args[2].ref == (
        "weight",
        "L0.wo",
        tn,
    )
    assert pre.args[0].ref == pre.args[3].ref == "h"
    assert pre.grid_for({"n": 300}) == (-(-2560 // tn), -(-300 // tile_m))
    assert pre.block == (128 * (tile["consumers"] + 1),) and pre.smem == kc.gemm_wgmma_smem(pre.spec.params)
    odd = [WeightPlan("L0.wo", 0, ("wo",), "bf16", 2560, 4128)]
    (mma,) = linear_gemm(adapter, op, "prefill", [Value("attn", "attn", 0, 4128, 4128, "bf16")], outs, odd)
    assert mma.spec.template == "gemm"


def test_sampling_kinds_use_argmax_and_sample():
    plan = plan_for("llama", "smollm2-135m")
    assert [launch.spec.template for launch in plan.sampling["greedy"]] == ["argmax"]
    (sample,) = plan.sampling["sample"]
    assert [a.ref for a in sample.args if a.kind == "input"][:1] == ["out_ids"]


def test_llama3_rope_scaling_adds_frequency_divisors_to_rope():
    graph = load_family("llama")
    dims = dict(dims_for_size("llama", "llama3-8b"))
    dims["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    plan = build_plan(graph, dims, graph.quant("bf16"), get_profile("h200"))
    assert plan.weight("rope_freq").cols == 64
    rope = next(s for s in plan.steps if s.op.op == "rope").launches["prefill"][0]
    assert rope.spec.params["freq_factors"] is True
    assert rope.args[6].kind == "weight" and rope.args[6].ref == "rope_freq"
    attn = next(s for s in plan.steps if s.op.op == "attention").launches["short"][0]  # rope folded in
    assert attn.spec.params["freq_factors"] is True and attn.args[-2].ref == "rope_freq"
    plain = plan_for("llama", "llama3-8b")
    assert "rope_freq" not in {w.key for w in plain.weights}


def test_short_context_decode_uses_direct_attention_without_combine():
    plan = plan_for("llama", "smollm2-135m")
    step = next(s for s in plan.steps if s.op.op == "attention")
    (short,) = step.launches["short"]
    assert short.spec.params["direct"] is True
    assert plan.short_context == get_profile("h200").tune("attention_decode")["split_kv_tokens"]
    assert short.spec in kernel_specs(plan)


def test_wide_decode_buckets_run_bf16_linear_layers_as_gemms():
    from engine.ir import WIDE

    plan = plan_for("qwen3", "qwen3-4b")
    assert plan.wide_rows == 16  # kernel_catalog.GEMM_DECODE_MIN_ROWS
    for step in plan.steps:
        wide = [la.spec.template for la in step.launches[WIDE]]
        if step.op.op == "linear" and step.op.outputs != ("logits",):
            assert wide and set(wide) == {"gemm"}, step.op
        if step.op.op in ("rmsnorm", "silu_mul"):  # materialised: the GEMMs read them
            assert wide == [step.op.op], step.op
    # quantised matrices keep the GEMV in every bucket, unless gemm_decode.quant_min_rows says (h200: 64)
    assert plan_for("qwen3", "qwen3-4b", "q8_0", profile="generic-sm90").wide_rows == 0
    assert plan_for("qwen3", "qwen3-4b", "q8_0").wide_rows == 64


@pytest.mark.parametrize("quant", ["q8_0", "q4_k_m", "q6_k"])
def test_quant_min_rows_runs_quantised_decode_buckets_as_dequantising_gemms(quant):
    from engine.ir import WIDE
    prof = with_tuning(get_profile("h100"), "gemm_decode.quant_min_rows=8")
    graph = load_family("qwen3")
    plan = build_plan(graph, dims_for_size("qwen3", "qwen3-4b"), graph.quant(quant), prof)
    assert plan.wide_rows == 8
    stored = {w.key: w.dtype for w in plan.weights}
    for step in plan.steps:
        if step.op.op == "linear" and step.op.outputs != ("logits",):
            (gemm,) = step.launches[WIDE]
            assert gemm.spec.template == "gemm"
            (w,) = [a.ref for a in gemm.args if a.kind == "weight"]
            assert gemm.spec.params["quant"] == stored[w] != "bf16"
            assert gemm.spec.params["tile_m"] == prof.tune("gemm_decode")["tile_m"]
    # a bucket list that stops below it: no wide bucket
    short = dataclasses.replace(prof, cuda_graph_batch_sizes=(1, 2, 4))
    assert build_plan(graph, dims_for_size("qwen3", "qwen3-4b"), graph.quant(quant), short).wide_rows == 0


def test_prologue_fusion_only_when_every_reader_is_a_linear_x():
    from engine.graph import Op
    from engine.plan import _prologue_fusable

    norm = Op("rmsnorm", ("h",), ("hn",), ("n",))
    lin = Op("linear", ("hn",), ("q",), ("wq",))
    other = Op("rope", ("hn", "q"), ("q",))
    writes_h = Op("linear", ("q",), ("h",), ("wo",), {"residual": "h"})
    assert set(_prologue_fusable([(norm, 0, False), (lin, 0, False)])) == {(id(norm), 0)}
    assert not _prologue_fusable([(norm, 0, False), (lin, 0, False), (other, 0, False)])
    # h changes between the norm and a later reader: that reader would see the new h
    assert not _prologue_fusable([(norm, 0, False), (lin, 0, False), (writes_h, 0, False), (lin, 0, False)])
    # the reader is in the head, the norm is not (the prefill head runs only head steps)
    assert not _prologue_fusable([(norm, None, False), (lin, None, True)])
    # a redefinition ends the scan: later readers belong to the new value
    assert _prologue_fusable([(norm, 0, False), (lin, 0, False), (norm, 1, False), (other, 1, False)]) == {
        (id(norm), 0): "rmsnorm"
    }


def test_the_h200_profile_keeps_separate_norm_kernels_and_folds_silu_into_gate_up():
    # the rmsnorm launches stay (bf16 readers are no q8x GEMVs), gemv.fuse_glu is on
    plan = plan_for("qwen3", "qwen3-4b")
    for step in plan.steps:
        if step.op.op == "rmsnorm":
            assert len(step.launches["decode"]) == 1 and len(step.launches["decode1"]) == 1
        if step.op.op == "silu_mul":
            assert step.launches["decode"] == () and step.launches["decode1"] == ()
            assert len(step.launches["prefill"]) == 1


def _decode_gemvs(plan):
    """Every decode1 / decode GEMV launch of a plan but the mma bucket GEMVs of gemv_mmq.min_rows
    rows and more (tests/test_gemv_mmq.py)."""
    for step in plan.steps:
        for mode in ("decode1", "decode"):
            yield from (la for la in step.launches[mode] if la.spec.template == "gemv" and not la.spec.params["mma"])


def _at(launches, rows: int = 8) -> list:
    """The launches a pass of ``rows`` rows runs (Launch.runs_at: from gemv_mmq.min_rows rows the
    mma bucket GEMVs in place of the coop ones)."""
    return [la for la in launches if la.runs_at(rows)]


def test_gemv_prefetch_knob_reaches_the_staged_decode_launches():
    import dataclasses

    from engine import kernel_catalog as kc

    prof = get_profile("h200")
    tuning = {**prof.tuning, "gemv": {**prof.tune("gemv"), "prefetch": True}}
    tuning["gemv_coop"] = {**prof.tune("gemv_coop"), "types": []}  # the classic layout's knobs
    graph = load_family("qwen3")
    plan = build_plan(
        graph,
        dims_for_size("qwen3", "qwen3-4b"),
        graph.quant("q8_0"),
        dataclasses.replace(prof, tuning=tuning),
    )
    seen = 0
    for la in _decode_gemvs(plan):
        p = la.spec.params
        assert p["prefetch"] is p["stage"] and la.smem == 0
        seen += 1
    assert seen
    # the h200 plan's q8_0 GEMVs are coop q8x: dynamic shared memory for the int8 x rows
    for step in plan_for("qwen3", "qwen3-4b", "q8_0").steps:
        for la in step.launches["decode"]:
            if la.spec.template == "gemv":
                p = la.spec.params
                assert la.smem == (kc.gemv_smem(p) if p["q8x"] else 0)


def test_gemv_coop_q8x_where_the_int8_rows_fit():
    """gemv_coop.q8x reaches the q4_k / q8_0r / q6_kr decode GEMVs whose bmax * k * 3 / 2 bytes fit
    COOP_Q8X_MAX (with that dynamic shared memory), never bf16 or a classic type; off, none has it.
    A bucket GEMV whose 8 int8 x rows would not fit takes fewer a grid row (kernel_catalog.decode_bmax)."""
    import dataclasses

    from engine import kernel_catalog as kc

    prof = get_profile("h200")
    assert prof.tune("gemv_coop")["q8x"]
    graph = load_family("qwen3")
    for q in ("q4_k_m", "q8_0"):
        for on in (True, False):
            tuning = {**prof.tuning, "gemv_coop": {**prof.tune("gemv_coop"), "q8x": on}}
            plan = build_plan(
                graph,
                dims_for_size("qwen3", "qwen3-4b"),
                graph.quant(q),
                dataclasses.replace(prof, tuning=tuning),
            )
            got = {True: 0, False: 0}
            for la in _decode_gemvs(plan):
                p = la.spec.params
                want = on and p["quant"] in kc.Q8X_TYPES and p["bmax"] * p["k"] * 3 // 2 <= kc.COOP_Q8X_MAX
                assert p["q8x"] is want, (q, on, la.spec.entry)
                x = (p["bmax"] * p["k"] * 3 // 2 + 127) // 128 * 128  # + the row tile with wsm
                tile = p["rows_per_block"] * row_bytes(p["quant"], p["k"]) if p["wsm"] else 0
                assert la.smem == (x + tile if p["wsm"] else p["bmax"] * p["k"] * 3 // 2 if want else 0)
                got[want] += 1
            assert got[True] if on else not got[True], (q, on, got)
            assert got[False] or on  # off: every GEMV on the f32 path
            if on:  # the 9728-long down rows: 4 x rows a grid row in the buckets, int8 like batch 1
                downs = {la.spec.params["bmax"] for la in _decode_gemvs(plan) if la.spec.params["k"] == 9728}
                assert downs == {1, 4}, (q, downs)


def test_q8x_tile_loop_and_k_split_knobs_reach_the_plan():
    """MEMRA_TUNE-style overrides of gemv_coop.q8x_blocks_per_sm / q8x_ksplit pass the profile
    schema and land in the q8x decode GEMVs: the grid capped at blocks_per_sm * sm_count (blocks
    loop over the row tiles), k split only where n <= q8x_ksplit_max_n (rows per block divided by
    it); the q8_0 q8x specs with k >= 8192 stage x in two rounds (kc.Q8X_STAGE_ROUNDS), no other."""
    from engine import kernel_catalog as kc
    from engine.profile import with_tuning

    knobs = (
        "gemv_coop.q8x_blocks_per_sm=3; gemv_coop.q8x_ksplit=2; gemv_coop.q8x_ksplit_max_n=2560; "
        "gemv_coop.q8x_type_tuning={}"  # 256-thread blocks for q8_0 too
    )
    prof = with_tuning(get_profile("h200"), knobs)
    graph = load_family("qwen3")
    plan = build_plan(graph, dims_for_size("qwen3", "qwen3-4b"), graph.quant("q8_0"), prof)
    seen = {"split": 0, "whole": 0}
    for la in _decode_gemvs(plan):
        p = la.spec.params
        if not p["q8x"]:
            assert (p["grid_cap"], p["ksplit"], p["stage_rounds"]) == (0, 1, 1), la.spec.entry
            continue
        split = p["n"] <= 2560
        seen["split" if split else "whole"] += 1
        rounds = 2 if p["k"] >= kc.Q8X_STAGE_ROUNDS["q8_0"][1] else 1
        assert p["grid_cap"] == 3 * prof.sm_count and p["stage_rounds"] == rounds
        assert p["ksplit"] == (2 if split else 1) and p["rows_per_block"] == 8 // p["ksplit"] * 2
        tiles = -(-p["n"] // p["rows_per_block"])
        assert la.grid[0] == min(tiles, 3 * prof.sm_count) == kc.gemv_grid_x(p)
        assert ("ksplit2" in la.spec.entry) is split and ("stage_rounds2" in la.spec.entry) is (rounds == 2)
    assert seen["split"] and seen["whole"], seen


def test_q8x_ksplit_splits_every_q8x_types_short_gemvs():
    """gemv_coop.q8x_ksplit with q8x_ksplit_max_n: the short-n q8x GEMVs of every q8x file type
    split k (q8_0 and q4_k here), the taller ones do not."""
    from engine.profile import with_tuning

    graph = load_family("qwen3")
    dims = dims_for_size("qwen3", "qwen3-4b")
    prof = with_tuning(
        get_profile("h200"), "gemv_coop.q8x_ksplit=2; gemv_coop.q8x_ksplit_max_n=2560; gemv_coop.q8x_type_tuning={}"
    )
    for quant in ("q8_0", "q4_k_m"):
        gemvs = [la.spec.params for la in _decode_gemvs(build_plan(graph, dims, graph.quant(quant), prof))]
        q8x = [p for p in gemvs if p["q8x"]]
        assert {p["quant"] for p in q8x if p["n"] <= 2560} >= ({"q8_0r"} if quant == "q8_0" else {"q4_k"}), quant
        assert q8x and all((p["ksplit"] == 2) is (p["n"] <= 2560) for p in q8x), quant


def test_gemv_coop_repacks_q8_0_and_lowers_the_cooperative_gemv():
    import dataclasses

    from engine import kernel_catalog as kc

    prof = get_profile("h200")
    coop = {"types": ["q8_0", "q4_k"], "unroll": 4}
    graph = load_family("qwen3")
    plan = build_plan(
        graph,
        dims_for_size("qwen3", "qwen3-4b"),
        graph.quant("q8_0"),
        dataclasses.replace(prof, tuning={**prof.tuning, "gemv_coop": coop}),
    )
    # every q8_0 matrix of Qwen3-4B has k % 256 == 0: uploaded row-planar, same bytes
    mats = [w for w in plan.weights if w.rows > 1]
    assert mats and all(w.dtype == "q8_0r" for w in mats)
    assert all(w.nbytes == storage_nbytes("q8_0", w.rows, w.cols) for w in mats)
    seen = {"gemv": 0, "prefill": 0}
    for step in plan.steps:
        for la in step.launches["decode1"] + step.launches["decode"]:
            if la.spec.template == "gemv":
                p = la.spec.params
                assert p["coop"] and p["quant"] == "q8_0r" and p["threads"] == 128
                assert p["rows_per_block"] == 4 and la.grid[0] == -(-p["n"] // 4) and la.block == (128,)
                assert not p["stage"] and "coop1" in la.spec.entry
                seen["gemv"] += 1
        for la in step.launches["prefill"]:
            if la.spec.template in ("gemm", "embed"):
                assert la.spec.params["quant"] in ("q8_0r", "bf16")
                seen["prefill"] += 1
    assert seen["gemv"] and seen["prefill"]
    # a row length that is not a multiple of 256 keeps the file layout and the classic gemv (unless
    # the matrix is tall and gemv_coop.q8_0r_min_rows asks: tests/test_q8_0r_tall.py)
    assert kc.upload_type("q8_0", 576, {"gemv_coop": coop}) == "q8_0"
    assert kc.upload_type("q8_0", 576, {"gemv_coop": coop}, 262144) == "q8_0"
    assert kc.upload_type("q8_0", 2560, {"gemv_coop": {**coop, "types": []}}) == "q8_0"
    assert not kc.gemv_layout("q8_0", {**prof.tuning, "gemv_coop": coop}).get("coop")
    fused = kc.spec(
        "gemv",
        **kc.linear_params("q4_k", 64, 512, {**prof.tuning, "gemv_coop": coop}),
        prologue="silu",
        x_stride=1024,
        u_off=512,
    )
    assert fused.params["coop"] and fused.params["prologue"] == "silu"
    with pytest.raises(ConfigError, match="not a multiple of the q8_0r block"):
        kc.spec("embed", quant="q8_0r", hidden=592, threads=256)


def test_a_fusion_is_decided_for_every_layer_at_once():
    # q4_k_m as llama.cpp mixes it: attn_v is q6_k in every other layer. A layer whose q|k|v agree
    # must not fuse all three when another layer cannot: the outputs are bound once, and a fused
    # launch in layer 1 would write 3 matrices' columns into layer 0's q|k buffer (found on the
    # H200). q|k agree in every layer: they fuse everywhere, v stays apart everywhere.
    graph = load_family("qwen3")
    dims = dims_for_size("qwen3", "qwen3-0.6b")
    dtypes = {"wq": "q4_k", "wk": "q4_k", "wv": "q4_k", "w_gate": "q4_k", "w_up": "q4_k", "w_down": "q4_k"}
    dtypes.update({f"wv@{lay}": "q6_k" for lay in range(0, dims["layers"], 2)})
    plan = build_plan(graph, dims, graph.quant("q4_k_m"), get_profile("h200"), tensor_dtypes=dtypes)
    keys = {w.key for w in plan.weights}
    assert not any("wk|wv" in k for k in keys) and "L1.wq|wk" in keys and "L1.wv" in keys
    assert "L1.w_gate|w_up" in keys
    for st in plan.steps:
        for la in st.launches["prefill"] + st.launches["decode"]:
            if la.spec.template in ("gemm", "gemv"):
                out = plan.values[la.args[0].ref]
                assert la.spec.params["n"] <= out.ld - out.offset, (st.layer, la.spec.entry)


def test_fuse_glu_folds_silu_mul_into_the_gate_up_gemv_in_decode_only():
    """gemv.fuse_glu: the decode gate|up GEMV gets glu = intermediate size (it stores silu(gate) * up
    in the gate half), silu_mul gets no decode launch, and the down GEMV reads x from the gate half
    (x_stride = 2 * intermediate, no prologue); prefill keeps silu_mul; coop-layout weights do not."""
    from engine.profile import with_tuning

    graph = load_family("llama")
    dims = dims_for_size("llama", "smollm2-135m")
    prof = with_tuning(get_profile("h200"), "gemv.fuse_glu=true")
    plan = build_plan(graph, dims, graph.quant("bf16"), prof)
    steps = [s for s in plan.steps if s.layer == 2]
    gate_up = next(s for s in steps if s.op.op == "linear" and "w_gate" in s.op.weights[0])
    silu = next(s for s in steps if s.op.op == "silu_mul")
    down = next(s for s in steps if s.op.op == "linear" and "w_down" in s.op.weights[0])
    for mode in ("decode1", "decode"):
        (g,) = gate_up.launches[mode]
        assert g.spec.params["glu"] == 1536 and g.spec.params["n"] == 3072 and "glu1536" in g.spec.entry
        assert silu.launches[mode] == ()
        (dn,) = down.launches[mode]
        assert dn.spec.params["x_stride"] == 3072 and dn.spec.params["prologue"] == "none"
        assert dn.args[2].ref == g.args[0].ref  # x is the gate|up output
    assert silu.launches["prefill"] and gate_up.launches["prefill"][0].spec.template in ("gemm", "gemm_wgmma")
    off = build_plan(
        graph, dims, graph.quant("bf16"), with_tuning(get_profile("h200"), "gemv.fuse_glu=false")
    )
    assert not any(
        la.spec.params.get("glu")
        for s in off.steps
        for la in s.launches["decode1"]
        if la.spec.template == "gemv"
    )
    with pytest.raises(ConfigError, match="glu"):
        from engine import kernel_catalog as kc

        kc.spec("gemv", **kc.linear_params("bf16", 3000, 576, prof.tuning), glu=1536)


@pytest.mark.parametrize("quant", ["q4_k_m", "q8_0"])
def test_q8x_glu_pairs_gate_and_up_rows_in_the_batch1_coop_gemv(quant):
    """gemv_coop.q8x_glu (on in the h200 profile): the batch-1 q8x gate|up GEMV of Qwen3-4B (no k
    split, no wsm there) gets glu = intermediate size and its grid covers intermediate / (rows_per_block / 2)
    tiles (or the grid cap); the down GEMV reads the gate half with no prologue. Batch 8 keeps the silu prologue, and
    the kernel source pairs the rows (GLU + l - RPB / 2) and stores through glu_sm. A coop glu with a
    k split or wsm is refused."""
    from engine import kernel_catalog as kc

    graph = load_family("qwen3")
    dims = dims_for_size("qwen3", "qwen3-4b")
    on = build_plan(graph, dims, graph.quant(quant), get_profile("h200"))  # (the profile has it on)
    off = build_plan(graph, dims, graph.quant(quant), with_tuning(get_profile("h200"), "gemv_coop.q8x_glu=false"))
    inter = dims["intermediate"]
    for plan, glu in ((on, True), (off, False)):
        steps = [s for s in plan.steps if s.layer == 1]
        gate_up = next(s for s in steps if s.op.op == "linear" and "w_gate" in s.op.weights[0])
        down = next(s for s in steps if s.op.op == "linear" and "w_down" in s.op.weights[0])
        (g,) = gate_up.launches["decode1"]
        (dn,) = down.launches["decode1"]
        assert g.spec.params["glu"] == (inter if glu else 0) and g.spec.params["q8x"]
        assert dn.spec.params["prologue"] == ("none" if glu else "silu")
        assert dn.spec.params["x_stride"] == 2 * inter and dn.args[2].ref == g.args[0].ref
        (g8,) = _at(gate_up.launches["decode"])
        assert not g8.spec.params["glu"]
        if glu:
            tiles = -(-inter // (g.spec.params["rows_per_block"] // 2))
            assert g.grid[0] == min(tiles, g.spec.params["grid_cap"] or tiles)
            src = render(g.spec)
            assert "GLU + l - RPB / 2" in src and "glu_sm[jj][b]" in src
    assert [[la.spec for la in s.launches["decode"]] for s in on.steps] == [
        [la.spec for la in s.launches["decode"]] for s in off.steps
    ]
    g = next(la.spec for s in on.steps for la in s.launches["decode1"] if la.spec.params.get("glu"))
    for bad in ({"ksplit": 2, "rows_per_block": g.params["rows_per_block"] // 2}, {"wsm": True, "tile_pf": False}):
        with pytest.raises(ConfigError, match="glu"):
            kc.spec("gemv", **{**g.params, **bad})


def test_q8x_fuse_folds_rmsnorm_into_q8x_readers_only():
    """gemv_coop.q8x_fuse: in decode1, a rmsnorm / silu_mul whose readers are all q8x GEMVs gets no
    launch and its readers the prologue; with q8x off, and in the batched decode mode, the launches
    stay. q8x GEMVs take the q8x_threads / q8x_rows_per_warp block shape, the k-split ones the
    q4_k q8x_ksplit_threads."""
    import dataclasses

    prof = get_profile("h200")
    c = prof.tune("gemv_coop")
    assert c["q8x_fuse"] and c["q8x"]
    graph = load_family("qwen3")
    for on in (True, False):
        # (without the per-type shapes: the general knobs' tiles are what is checked below; without
        # the glu epilogue, which takes the silu prologue's place: its own test is above)
        tuning = {**prof.tuning, "gemv_coop": {**c, "q8x": on, "q8x_type_tuning": {}, "q8x_glu": False}}
        plan = build_plan(
            graph,
            dims_for_size("qwen3", "qwen3-4b"),
            graph.quant("q4_k_m"),
            dataclasses.replace(prof, tuning=tuning),
        )
        for mode in ("decode1", "decode"):
            kinds = [la.spec.template for st in plan.steps if st.layer == 0 for la in st.launches[mode]]
            gemvs = [
                la.spec.params
                for st in plan.steps
                if st.layer == 0
                for la in _at(st.launches[mode])
                if la.spec.template == "gemv"
            ]
            kst = c.get("q8x_ksplit_threads") or c["q8x_threads"]  # the k-split (o, down) blocks
            for p in gemvs:
                if p["q8x"] and p["ksplit"] > 1:
                    assert (p["threads"], p["rows_per_block"]) == (kst, kst // 32 // p["ksplit"] * c["q8x_rows_per_warp"])
                elif p["q8x"]:
                    assert (p["threads"], p["rows_per_block"]) == (
                        c["q8x_threads"],
                        c["q8x_threads"] // 32 * c["q8x_rows_per_warp"],
                    )
            if on and mode == "decode1":
                assert "rmsnorm" not in kinds and "silu_mul" not in kinds, (mode, kinds)
                assert sorted(p["prologue"] for p in gemvs) == ["none", "norm", "norm", "silu"]
                assert all(p["q8x"] for p in gemvs if p["prologue"] != "none")
            else:
                assert kinds.count("rmsnorm") == 2 and not any(p["prologue"] != "none" for p in gemvs)


@pytest.mark.parametrize("quant,layout", [("q4_1", "q4_1r"), ("q4_0", "q4_0r")])
def test_q4_smollm2_decodes_on_coop_q8x_gemvs_without_norm_launches_at_batch_1(quant, layout):
    """The h200 profile's gemv_coop.types take q4_0 / q4_1: SmolLM2's matrices are uploaded row-planar
    (k = 576: a 16-byte padded pitch), every decode GEMV on them is a coop q8x GEMV, and at batch 1
    q8x_fuse folds the rmsnorm / silu_mul launches into them: a short-context layer is qkv,
    attention (with the rope), o, gate|up, down (7 launches with the classic GEMV: 2 rmsnorm more).
    Batch 8 keeps the separate kernels (and, on the coop layout, silu_mul: no glu epilogue). The real
    file's embedding (the tied lm_head) is q8_0, and k = 576 is no q8_0r row: a classic GEMV, so the
    final norm keeps its launch (q8x_fuse looks through the tie to the embedding's type)."""
    from engine import kernel_catalog as kc

    prof = get_profile("h200")
    assert {"q4_0", "q4_1"} <= set(prof.tune("gemv_coop")["types"])
    plan = plan_for("llama", "smollm2-135m", quant, tensor_dtypes={"embed": "q8_0"})
    mats = {w.key: w for w in plan.weights if w.rows > 1}
    assert mats.pop("embed").dtype == "q8_0"
    assert mats and all(w.dtype == layout for w in mats.values())
    for w in mats.values():
        assert w.nbytes == w.rows * row_bytes(layout, w.cols) == storage_nbytes(layout, w.rows, w.cols)
    assert row_bytes(layout, 576) == (368 if layout == "q4_1r" else 336)

    def layer_launches(mode):
        return [
            la for st in plan.steps if st.layer == 3 for la in st.launches.get("short", st.launches[mode])
        ]

    one = layer_launches("decode1")
    assert [la.spec.template for la in one] == ["gemv", "attention", "gemv", "gemv", "gemv"]
    gemvs = [la.spec.params for la in one if la.spec.template == "gemv"]
    assert [p["prologue"] for p in gemvs] == ["norm", "none", "norm", "silu"]
    for la in (la for la in one if la.spec.template == "gemv"):
        p = la.spec.params
        assert (
            p["coop"] and p["q8x"] and p["quant"] == layout and la.smem == kc.gemv_smem(p) >= p["k"] * 3 // 2
        )
    wide = [la.spec for st in plan.steps if st.layer == 3 for la in st.launches["decode"]]
    assert [s.template for s in wide].count("rmsnorm") == 2 and [s.template for s in wide].count(
        "silu_mul"
    ) == 1
    assert all(s.params["q8x"] and s.params["prologue"] == "none" for s in wide if s.template == "gemv")
    head = [la.spec for st in plan.steps if st.head for la in st.launches["decode1"]]
    assert [s.template for s in head] == ["rmsnorm", "gemv"] and head[1].params["prologue"] == "none"
    assert head[1].params["quant"] == "q8_0" and not head[1].params["coop"]
    # with an embedding of the same type the lm_head is a q8x GEMV too, the final norm folded into it
    tied = plan_for("llama", "smollm2-135m", quant)
    head = [la.spec for st in tied.steps if st.head for la in st.launches["decode1"]]
    assert (
        [s.template for s in head] == ["gemv"]
        and head[0].params["q8x"]
        and head[0].params["prologue"] == "norm"
    )
    assert (
        tied.weight("embed").dtype == layout
        and tied.steps[0].launches["prefill"][0].spec.params["quant"] == layout
    )


def test_direct_attention_splits_query_heads_over_grid_z():
    """attention_decode.direct_qsplit: the short-context direct kernel gets grid z = the largest
    divisor of heads / kv_heads up to the knob (each block one share of the kv head's query heads);
    the split kernels and prefill keep one block per kv head."""
    from engine import kernel_catalog as kc
    from engine.profile import with_tuning

    assert [kc.direct_qsplit(g, {"attention_decode": {"direct_qsplit": 4}}) for g in (1, 2, 3, 4, 6, 8)] == [
        1,
        2,
        3,
        4,
        3,
        4,
    ]
    assert kc.direct_qsplit(4, {"attention_decode": {}}) == 1
    with pytest.raises(ConfigError, match="qsplit=3 .* needs direct and to divide 4"):
        kc.spec(
            "attention",
            heads=32,
            kv_heads=8,
            head_dim=128,
            block_size=16,
            split=256,
            scale=0.1,
            q_stride=6144,
            out_stride=4096,
            direct=True,
            warps=8,
            qsplit=3,
        )
    prof = get_profile("h200")
    assert prof.tune("attention_decode")["direct_qsplit"] == 4
    for size, want in (("qwen3-4b", 4), ("qwen3-0.6b", 2)):
        for p, qs in ((prof, want), (with_tuning(prof, "attention_decode.direct_qsplit=1"), 1)):
            graph = load_family("qwen3")
            plan = build_plan(graph, dims_for_size("qwen3", size), graph.quant("bf16"), p)
            short = [
                la
                for st in plan.steps
                for la in st.launches.get("short", ())
                if la.spec.template == "attention"
            ]
            split = [
                la for st in plan.steps for la in st.launches["decode"] if la.spec.template == "attention"
            ]
            assert short and all(la.grid[2] == qs and la.spec.params["qsplit"] == qs for la in short)
            assert ("qsplit" in short[0].spec.entry) is (qs > 1)
            assert split and all(la.spec.params["qsplit"] == 1 for la in split)


def test_long_quantised_prefill_chunks_dequantise_and_run_the_wgmma_gemm():
    """gemm_wgmma.dequant_min_rows: a quantised prefill linear has two paths, picked by the pass's
    rows: from that many rows the matrix is dequantised into the bf16 scratch (embed over ids
    0..rows-1) and multiplied by gemm_wgmma through a scratch tensor map of the matrix's shape;
    below it the fused mma.sync gemm decodes W tiles itself. 0 turns the long path off."""
    from engine.profile import with_tuning

    prof = get_profile("h200")
    t = prof.tune("gemm_wgmma")["dequant_min_rows"]
    assert t > 0
    plan = plan_for("qwen3", "qwen3-4b", "q8_0")
    down = next(s for s in plan.steps if s.layer == 1 and s.op.op == "linear" and "w_down" in s.op.weights[0])
    deq, wg, fused = down.launches["prefill"]
    assert (deq.spec.template, wg.spec.template, fused.spec.template) == ("embed", "gemm_wgmma", "gemm")
    assert deq.min_rows == wg.min_rows == t and fused.max_rows == t - 1 and not fused.min_rows
    assert [deq.runs_at(n) for n in (1, t - 1, t, 4096)] == [False, False, True, True]
    assert [fused.runs_at(n) for n in (1, t - 1, t)] == [True, True, False]
    assert (deq.args[0].kind, deq.args[0].ref, deq.grid) == ("scratch", "dequant", (2560,))
    assert wg.args[2].ref == ("scratch", "dequant", wg.spec.params["tile_n"], 2560, 9728)
    assert wg.spec.params["residual"] and fused.spec.params["quant"] == "q8_0r"
    assert next(sp for sp in plan.scratch if sp.name == "dequant").fixed >= 19456 * 2560 * 2
    for n in (1, 8, 32, 128):  # decode: one GEMV at every row count, no dequantisation
        assert [la.spec.template for la in _at(down.launches["decode"], n)] == ["gemv"], n
    graph = load_family("qwen3")
    off = with_tuning(prof, "gemm_wgmma.dequant_min_rows=0")
    plan = build_plan(graph, dims_for_size("qwen3", "qwen3-4b"), graph.quant("q8_0"), off)
    down = next(s for s in plan.steps if s.layer == 1 and s.op.op == "linear" and "w_down" in s.op.weights[0])
    assert [la.spec.template for la in down.launches["prefill"]] == ["gemm"]
    every = with_tuning(prof, "gemm_wgmma.dequant_min_rows=1")  # every pass: no fused gemm at all
    plan = build_plan(graph, dims_for_size("qwen3", "qwen3-4b"), graph.quant("q8_0"), every)
    down = next(s for s in plan.steps if s.layer == 1 and s.op.op == "linear" and "w_down" in s.op.weights[0])
    assert [(la.spec.template, la.min_rows, la.max_rows) for la in down.launches["prefill"]] == [
        ("embed", 0, 0),
        ("gemm_wgmma", 0, 0),
    ]


def test_q8x_type_tuning_gives_a_file_type_its_own_block_shape():
    """gemv_coop.q8x_type_tuning: q8_0 weights (q8_0r) take 512-thread q8x blocks while the q4_k
    and q6_k weights keep the general q8x_threads; zero fields keep the general knob; an unknown file
    type is a ConfigError naming it."""
    from engine import kernel_catalog as kc
    prof = with_tuning(get_profile("h200"), "gemv_coop.q8x_type_tuning={q8_0: {q8x_threads: 512}}")
    general = prof.tuning["gemv_coop"]["q8x_threads"]
    assert general and general != 512
    for layout, want in (("q8_0r", 512), ("q4_k", general), ("q6_kr", general)):
        p = kc.linear_params(layout, 19456, 2560, prof.tuning, bmax=1, sm_count=132)
        assert p["q8x"] and p["threads"] == want, layout
        assert p["rows_per_block"] == want // 32 * prof.tuning["gemv_coop"]["q8x_rows_per_warp"], layout
    graph = load_family("qwen3")
    plan = build_plan(graph, dims_for_size("qwen3", "qwen3-4b"), graph.quant("q8_0"), prof)
    assert {la.block for la in _decode_gemvs(plan) if la.spec.params["q8x"]} == {(512,)}
    with pytest.raises(ConfigError, match="q8x_type_tuning.*unknown file type"):
        with_tuning(get_profile("h200"), "gemv_coop.q8x_type_tuning={q8_0r: {q8x_threads: 512}}")


def test_q8x_b1_unroll_sets_a_file_types_batch1_segments_in_flight():
    """gemv_coop.q8x_b1_unroll (per file type): the batch-1 q4_k GEMVs take that unroll; b8 and the
    other types keep gemv_coop.unroll; 0 keeps it."""
    from engine import kernel_catalog as kc
    from engine.profile import with_tuning

    prof = get_profile("h200")
    general = prof.tuning["gemv_coop"]["unroll"]
    # the profile's type tuning without its own batch-1 unrolls, then q4_k's at every k
    types = {t: {**v, "q8x_b1_unroll": 0} for t, v in prof.tuning["gemv_coop"]["q8x_type_tuning"].items()}
    q4 = {**types["q4_k"], "q8x_b1_unroll": 2 * general, "q8x_b1_unroll_max_k": 0}
    tuned = {**prof.tuning, "gemv_coop": {**prof.tuning["gemv_coop"], "q8x_type_tuning": {**types, "q4_k": q4}}}
    for layout, n, k, bmax, want in (
        ("q4_k", 19456, 2560, 1, 2 * general),
        ("q4_k", 2560, 9728, 1, 2 * general),
        ("q4_k", 19456, 2560, 8, general),
        ("q6_kr", 2560, 9728, 1, general),
        ("q8_0r", 19456, 2560, 1, general),
    ):
        p = kc.linear_params(layout, n, k, tuned, bmax=bmax, sm_count=132)
        assert p["unroll"] == want, (layout, n, k, bmax)
    plain = {**tuned, "gemv_coop": {**tuned["gemv_coop"], "q8x_type_tuning": types}}
    assert kc.linear_params("q4_k", 19456, 2560, plain, bmax=1)["unroll"] == general
    # the h200 profile: unroll 4 on k <= 4096 for q4_k, q6_k and q8_0, the downs (k 9728) keep it
    for layout, k, want in (("q4_k", 2560, 4), ("q4_k", 9728, general), ("q6_kr", 2560, 4), ("q8_0r", 4096, 4)):
        assert kc.linear_params(layout, 2560, k, prof.tuning, bmax=1, sm_count=132)["unroll"] == want, (layout, k)
    # q8x_b1_unroll_max_k: the short-k GEMVs (q|k, gate|up, o) only, the down projections keep unroll
    short = {**q4, "q8x_b1_unroll_max_k": 4096}
    short_k = {**tuned, "gemv_coop": {**tuned["gemv_coop"], "q8x_type_tuning": {**types, "q4_k": short}}}
    for n, k, want in ((19456, 2560, 2 * general), (2560, 4096, 2 * general), (2560, 9728, general)):
        assert kc.linear_params("q4_k", n, k, short_k, bmax=1, sm_count=132)["unroll"] == want, (n, k)
    knob = "gemv_coop.q8x_type_tuning={q4_k: {q8x_b1_unroll: 4}}"
    plan = build_plan(
        load_family("qwen3"),
        dims_for_size("qwen3", "qwen3-4b"),
        load_family("qwen3").quant("q4_k_m"),
        with_tuning(prof, knob),
        tensor_dtypes={"w_down": "q6_k", "wv": "q6_k"},
    )
    b1 = {la.spec.params["quant"]: la.spec.params["unroll"] for st in plan.steps for la in st.launches["decode1"] if la.spec.template == "gemv"}
    assert b1["q4_k"] == 4 and b1["q6_kr"] == general


def test_q8x_ksplit_threads_and_b1_rows_per_warp_shape_the_q8_0_tiles():
    """q8x_ksplit_threads: the k-split GEMVs (n <= q8x_ksplit_max_n: o, down) take their own block
    size (640 threads = 10 groups of 2 rows: 20-row tiles, 128 blocks for n = 2560);
    q8x_b1_rows_per_warp: the bmax-1 GEMVs without the k split take that many rows per warp, the
    bmax-8 ones and the k-split ones keep q8x_rows_per_warp; both apply per file type."""
    from engine import kernel_catalog as kc
    prof = with_tuning(
        get_profile("h200"),
        "gemv_coop.q8x_type_tuning={q8_0: {q8x_threads: 512, q8x_b1_rows_per_warp: 1, q8x_ksplit_threads: 640}}",
    )
    c = prof.tuning["gemv_coop"]
    assert c["q8x_ksplit"] == 2 and c["q8x_ksplit_max_n"] == 2560 and c["q8x_rows_per_warp"] == 2
    for n, k, bmax, want in (
        (2560, 9728, 1, (640, 20, 2)),  # down: k split, 640 threads, 2 rows per warp
        (2560, 4096, 1, (640, 20, 2)),  # o
        (19456, 2560, 1, (512, 16, None)),  # gate|up at batch 1: 1 row per warp
        (19456, 2560, 8, (512, 32, None)),  # at bmax 8: the type's q8x_rows_per_warp
    ):
        p = kc.linear_params("q8_0r", n, k, prof.tuning, bmax=bmax, sm_count=132)
        assert (p["threads"], p["rows_per_block"], p.get("ksplit")) == want, (n, k, bmax, p)
    assert kc.spec("gemv", **kc.linear_params("q8_0r", 2560, 9728, prof.tuning, bmax=1)).entry
    general = c["q8x_threads"]  # q4_k: not in the map, and not a k-split type
    p = kc.linear_params("q4_k", 19456, 2560, prof.tuning, bmax=1, sm_count=132)
    assert (p["threads"], p["rows_per_block"]) == (general, general // 32 * c["q8x_rows_per_warp"])
    graph = load_family("qwen3")
    plan = build_plan(graph, dims_for_size("qwen3", "qwen3-4b"), graph.quant("q8_0"), prof)
    blocks = {la.block for la in _decode_gemvs(plan) if la.spec.params["q8x"]}
    assert blocks == {(512,), (640,)}, blocks
    # q8x_ksplit_min_n (per type): the h200 q4_1 weights split from n = 2048 only, so SmolLM2's
    # short weights keep their tiles while Qwen3-4B's o / down take 640-thread k-split blocks
    h200 = get_profile("h200").tuning
    assert h200["gemv_coop"]["q8x_type_tuning"]["q4_1"]["q8x_ksplit_min_n"] == 2048
    for n, k, want in ((2560, 9728, (640, 2)), (2048, 2048, (640, 2)), (576, 1536, (h200["gemv_coop"]["q8x_threads"], None))):
        p = kc.linear_params("q4_1r", n, k, h200, bmax=1, sm_count=132)
        assert (p["threads"], p.get("ksplit")) == want, (n, p)


def test_q8x_lanes_per_row_makes_lane_groups_with_their_own_rows():
    """gemv_coop.q8x_lanes_per_row (per file type): a warp becomes 32 / lanes lane
    groups, each owning rows_per_warp rows, so a block covers 32 / lanes times the rows; the
    kernel param ``lanes`` is in the entry name only when it is not 32; a bad value is refused."""
    from engine import kernel_catalog as kc
    from engine.profile import with_tuning

    h200 = get_profile("h200")
    base = kc.linear_params("q8_0r", 19456, 2560, h200.tuning, bmax=1, sm_count=132)
    assert "lanes" not in base and "lanes" not in kc.spec("gemv", **base).entry
    assert kc.linear_params("q4_k", 19456, 2560, h200.tuning, bmax=1, sm_count=132)["lanes"] == 8
    prof = with_tuning(
        h200,
        "gemv_coop.q8x_type_tuning={q4_k: {q8x_lanes_per_row: 8, q8x_rows_per_warp: 1, q8x_ksplit: 4,"
        " q8x_ksplit_threads: 640}}",
    )
    p = kc.linear_params("q4_k", 19456, 2560, prof.tuning, bmax=1, sm_count=132)
    assert (p["lanes"], p["threads"], p["rows_per_block"]) == (8, 256, 32), p
    assert "lanes8" in kc.spec("gemv", **p).entry
    # the k-split down projection (the type's own q8x_ksplit): 640 threads = 20 warps in 4 k
    # groups, 4 lane groups of 1 row each: 20-row tiles
    p = kc.linear_params("q4_k", 2560, 9728, prof.tuning, bmax=1, sm_count=132)
    assert (p["lanes"], p["threads"], p["rows_per_block"], p["ksplit"]) == (8, 640, 20, 4), p
    assert "lanes" not in kc.linear_params("q8_0r", 19456, 2560, prof.tuning, bmax=1)  # other types
    with pytest.raises(ConfigError, match="lanes=5"):
        kc.spec("gemv", **{**p, "lanes": 5})
    with pytest.raises(ConfigError, match="rows_per_block=10 must be a multiple"):
        kc.spec("gemv", **{**p, "rows_per_block": 10})


def test_q8x_wsm_copies_short_gemvs_row_tiles_into_shared_memory():
    """gemv_coop.q8x_wsm_kb: the row tile of a batch-1 q8x GEMV bulk-copied into shared memory
    (entry name wsm1) where it fits that many KB and the blocks that fit at once hold every tile: q|k,
    not gate|up (487 tiles, 396 blocks) nor the lm_head, not batch 8; tile_pf is then off; the dynamic shared memory grows by the tile;
    a tile past 227 KB is refused."""
    from engine import kernel_catalog as kc
    from engine.profile import with_tuning

    h200 = get_profile("h200")
    on, off = with_tuning(h200, "gemv_coop.q8x_wsm_kb=200"), with_tuning(h200, "gemv_coop.q8x_wsm_kb=0")
    for tun, want in ((off.tuning, False), (on.tuning, True)):
        p = kc.linear_params("q4_k", 5120, 2560, tun, bmax=1, sm_count=132)  # q|k: 40-row tiles
        s = kc.spec("gemv", **p)
        assert s.params["wsm"] is want and ("wsm1" in s.entry) is want
        assert ("cp.async.bulk.shared::cluster" in render(s)) is want
        x, rpb = 2560 * 3 // 2, p["rows_per_block"]
        assert kc.gemv_smem(s.params) == ((x + 127) // 128 * 128 + rpb * 1440 if want else x)
        if want:
            assert not s.params["tile_pf"]
    # gate|up: 487 tiles of 40 rows, 3 blocks of 61 KB per SM hold 396; half of it: 244 tiles
    assert not kc.linear_params("q4_k", 19456, 2560, on.tuning, bmax=1, sm_count=132).get("wsm")
    assert kc.linear_params("q4_k", 9728, 2560, on.tuning, bmax=1, sm_count=132).get("wsm")
    assert not kc.linear_params("q4_k", 5120, 2560, on.tuning, bmax=8, sm_count=132).get("wsm")
    assert not kc.linear_params("q6_kr", 151936, 2560, on.tuning, bmax=1, sm_count=132).get("wsm")  # lm_head
    small = with_tuning(h200, "gemv_coop.q8x_wsm_kb=16")  # a 46 KB tile does not fit in 16 KB
    assert not kc.linear_params("q4_k", 5120, 2560, small.tuning, bmax=1, sm_count=132).get("wsm")
    p = kc.linear_params("q4_k", 5120, 2560, on.tuning, bmax=1, sm_count=132)
    with pytest.raises(ConfigError, match="wsm: .* exceed"):
        kc.spec("gemv", **{**p, "rows_per_block": 256, "threads": 1024, "lanes": 4, "grid_cap": 0})
    with pytest.raises(ConfigError, match="wsm .* without tile_pf"):
        kc.spec("gemv", **{**p, "tile_pf": True})


def test_b1_short_n_threads_give_short_weights_wider_blocks_at_every_batch():
    """gemv.b1_short_n_threads / short_n_max: the classic GEMVs of weights with n <= short_n_max
    (Qwen3-0.6B o, down) take that block size in the plan at batch 1 and its warps per row in the
    buckets too (the warps per row split a row's k: batched equal to solo; a bf16 bucket block is
    one row group of them, rows_per_warp rows a warp); the longer ones (qkv, gate|up, lm_head) and
    the coop layout keep theirs."""
    from engine import kernel_catalog as kc
    prof = with_tuning(get_profile("h200"), "gemv.b1_short_n_threads=512; gemv.short_n_max=1024")
    graph = load_family("qwen3")
    plan = build_plan(graph, dims_for_size("qwen3", "qwen3-0.6b"), graph.quant("bf16"), prof)
    for mode in ("decode1", "decode"):
        got = {}
        for st in plan.steps:
            for key in (mode, "short") if mode == "decode1" else (mode,):
                for la in st.launches.get(key, ()):
                    if la.spec.template == "gemv":
                        p = la.spec.params
                        got[p["n"]] = la.block[0] // 32 // (p["rows_per_block"] // p["rows_per_warp"])
                        assert la.block[0] == (512 if p["n"] == 1024 else 256) or mode == "decode", (mode, p)
        assert got == {1024: 4, 4096: 2, 6144: 2, 151936: 2}, (mode, got)  # warps per row
    off = with_tuning(prof, "gemv.b1_short_n_threads=0")
    assert kc.linear_params("bf16", 1024, 3072, off.tuning, bmax=1)["threads"] == 256
    assert kc.linear_params("bf16", 1024, 3072, prof.tuning, bmax=1)["threads"] == 512
    assert kc.linear_params("q8_0r", 1024, 3072, prof.tuning, bmax=1)["threads"] != 512  # coop: its own


def test_q8x_early_norm_w_and_residual_only_where_the_kernel_uses_them():
    """gemv_coop.q8x_early_norm_w (on in the h200 profile): the batch-1 q8x GEMVs whose prologue is
    the rmsnorm (q|k|v, gate|up, lm_head) load their norm weights before pdl_wait (entry early_nw1);
    the silu / plain ones (down, o) and the batch-8 ones do not carry it; the kernel loads them
    early only where one staging round holds the row (norm_merged). The batch-1 k-split GEMVs with
    a residual read it right after pdl_wait (early_res1; always, no knob: it gained under 1 %)."""
    from engine import kernel_catalog as kc

    graph = load_family("qwen3")
    plan = build_plan(graph, dims_for_size("qwen3", "qwen3-4b"), graph.quant("q8_0"), get_profile("h200"))
    gemvs = [la.spec for st in plan.steps for la in st.launches["decode1"] if la.spec.template == "gemv"]
    norm = {s.params["early_nw"] for s in gemvs if s.params["prologue"] == "norm"}
    other = {s.params["early_nw"] for s in gemvs if s.params["prologue"] != "norm"}
    assert norm == {True} and other == {False}, (norm, other)
    wide = [la.spec for st in plan.steps for la in st.launches["decode"] if la.spec.template == "gemv"]
    assert wide and not any(s.params["early_nw"] for s in wide)
    qkv = next(s for s in gemvs if s.params["prologue"] == "norm")
    src = render(qkv)
    before_wait = src.split(qkv.entry + "(")[1].split("\n    pdl_wait();")[0]
    assert "nwe[j][0] = __ldg(" in before_wait and "raw[j].w0 = nwe[j][0];" in src
    off = render(kc.spec("gemv", **{**qkv.params, "early_nw": False}))
    assert "nwe" not in off
    # early_res: the batch-1 k-split GEMVs with a residual (o, down) read it after pdl_wait
    res = {(s.params["residual"] and s.params["ksplit"] > 1): set() for s in gemvs}
    for s in gemvs:
        res[s.params["residual"] and s.params["ksplit"] > 1].add(s.params["early_res"])
    assert res == {True: {True}, False: {False}}, res
    assert not any(s.params["early_res"] for s in wide)
    down = next(s for s in gemvs if s.params["early_res"])
    assert "v + res_first" in render(down) and "res_first" not in render(kc.spec("gemv", **{**down.params, "early_res": False}))
    with pytest.raises(ConfigError, match="early_nw"):
        kc.spec(
            "gemv",
            **{
                **qkv.params,
                "q8x": False,
                "coop": False,
                "lanes": 32,
                "ksplit": 1,
                "wsm": False,
                "grid_cap": 0,
                "trigger": False,
                "pipeline": False,
            },
        )


def test_attention_trigger_b1_is_a_short1_launch_of_the_direct_kernel():
    """attention_decode.trigger_b1: each attention step gets a SHORT1 launch, the short launch's
    direct kernel with ``trigger`` on, so only the batch-1 short pass triggers early; every other
    key of every step is the plan without the knob."""
    from engine.ir import SHORT1

    off, on = _q4_k_m_plan("attention_decode.trigger_b1=false"), _q4_k_m_plan("attention_decode.trigger_b1=true")
    assert not any(SHORT1 in st.launches for st in off.steps)
    attn = 0
    for s, t in zip(off.steps, on.steps, strict=True):
        assert {k: v for k, v in t.launches.items() if k != SHORT1} == s.launches
        if s.op.op != "attention":
            assert SHORT1 not in t.launches
            continue
        attn += 1
        (short,), (la,) = s.launches["short"], t.launches[SHORT1]
        assert not short.spec.params["trigger"] and la.spec.params["trigger"]
        assert la.spec.params == {**short.spec.params, "trigger": True}
        assert (la.grid, la.block, la.args, la.smem) == (short.grid, short.block, short.args, short.smem)
        assert "pdl_trigger();" in render(la.spec) and "pdl_trigger();" not in render(short.spec)
    assert attn == on.dims["layers"]


def test_attention_l2_prefetch_names_the_layers_next_weights_in_a_short1_launch():
    """attention_decode.l2_prefetch_o: each attention step's SHORT1 launch is the direct kernel with
    an l2_pf range over its own layer's o weight (whole), that weight a trailing pointer arg; other
    keys of every step are the plan's without the knob; it keeps trigger_b1's trigger."""
    from engine import kernel_catalog as kc
    from engine.ir import SHORT1, Arg

    base = _q4_k_m_plan("")
    tune = "attention_decode.l2_prefetch_o=true; attention_decode.trigger_b1=true"
    plan = _q4_k_m_plan(tune)
    trig = _q4_k_m_plan("attention_decode.trigger_b1=true")
    seen = 0
    for s, t, tr in zip(base.steps, plan.steps, trig.steps, strict=True):
        assert {k: v for k, v in t.launches.items() if k != SHORT1} == s.launches
        if s.op.op != "attention":
            assert SHORT1 not in t.launches
            continue
        seen += 1
        (la,), (short,) = t.launches[SHORT1], tr.launches[SHORT1]
        o = plan.weight(f"L{s.layer}.wo")
        assert kc.l2_pf_ranges(la.spec.params["l2_pf"]) == ((0, 0, o.nbytes),)
        assert la.spec.params == {**short.spec.params, "l2_pf": la.spec.params["l2_pf"]} and la.spec.params["trigger"]
        assert la.args == short.args + (Arg("weight", o.key),)
        assert (la.grid, la.block, la.smem) == (short.grid, short.block, short.smem)
        assert len(kc.kernel_args(la.spec)) == len(la.args)
    assert seen == plan.dims["layers"]


def test_o_prefetch_next_kb_puts_the_gate_up_rows_on_the_o_gemv():
    """decode_graph.o_prefetch_next_kb: each layer's batch-1 o GEMV (decode1) takes l2_pf ranges
    over the first KB of its layer's gate|up (half from the gate rows, half from the up rows) and
    that weight as its last arg; every other launch is the plan's without the knob."""
    from engine import kernel_catalog as kc
    from engine.ir import Arg

    base, plan = _q4_k_m_plan(""), _q4_k_m_plan("decode_graph.o_prefetch_next_kb=1024")
    changed = 0
    for s, t in zip(base.steps, plan.steps, strict=True):
        for key, launches in s.launches.items():
            if launches == t.launches[key]:
                continue
            changed += 1
            assert key == "decode1" and s.op.op == "linear" and s.op.outputs == ("x",)
            (la,), (new,) = launches, t.launches[key]
            gu = plan.weight(f"L{s.layer}.w_gate|w_up")
            assert la.args[1] == Arg("weight", f"L{s.layer}.wo")  # the o projection's GEMV
            half = plan.dims["intermediate"] * row_bytes(gu.dtype, gu.cols)
            assert kc.l2_pf_ranges(new.spec.params["l2_pf"]) == ((0, 0, 512 * 1024), (0, half, 512 * 1024))
            assert new.args == la.args + (Arg("weight", gu.key),) and len(kc.kernel_args(new.spec)) == len(new.args)
            assert new.spec.params == {**la.spec.params, "l2_pf": new.spec.params["l2_pf"]}
            assert "L2_PF_CALL();" in render(new.spec)
    assert changed == plan.dims["layers"]


def test_o_window_gates_the_attention_window_knobs_by_the_o_weight():
    """decode_graph.o_window_min_kb / o_window_max_kb: the h200 profile's attention-window knobs
    (trigger_b1, l2_prefetch_o, o_prefetch_next_kb) reach the layers whose o weight has 5-8 MB
    (Qwen3-4B q4_k_m: 5760 KB), not a q8_0 o (10880 KB) nor a Qwen3-0.6B bf16 o (4096 KB); with
    the window open (0 / 0) the q8_0 plan gets them too."""
    from engine.ir import SHORT1

    graph = load_family("qwen3")

    def window(size, quant, tune=""):
        prof = with_tuning(get_profile("h200"), tune) if tune else get_profile("h200")
        plan = build_plan(graph, dims_for_size("qwen3", size), graph.quant(quant), prof)
        attn = [la.spec.params for st in plan.steps for la in st.launches.get(SHORT1, ())]
        o_pf = [
            la.spec.params["l2_pf"]
            for st in plan.steps
            for la in st.launches.get("decode1", ())
            if la.spec.template == "gemv" and la.spec.params.get("l2_pf")
        ]
        return attn, o_pf

    layers = dims_for_size("qwen3", "qwen3-4b")["layers"]
    attn, o_pf = window("qwen3-4b", "q4_k_m")
    assert len(attn) == layers and all(p["trigger"] and p["l2_pf"].startswith("0:0:5898240") for p in attn)
    assert len(o_pf) == layers
    assert window("qwen3-4b", "q8_0") == ([], [])
    assert window("qwen3-0.6b", "bf16") == ([], [])
    attn, o_pf = window("qwen3-4b", "q8_0", "decode_graph.o_window_min_kb=0; decode_graph.o_window_max_kb=0")
    assert len(attn) == layers and all(p["l2_pf"].startswith("0:0:11141120") for p in attn)
    assert len(o_pf) == layers


def test_b1_rows_small_plans_run_batch_1_layer_launches_in_small_passes():
    """decode_graph.b1_rows / b1_rows_kb: Plan.b1_rows is the knob where every layer matrix holds at
    most b1_rows_kb KB (SmolLM2-135M q4_1: gate|up 1,105 KB), else 0 (Qwen3-4B; or the knob off); a
    pass of 2 .. b1_rows rows then takes each layer step's decode1 launches (engine.ir.pass_key)
    and keeps the bucket's head, the short attention and a verify pass's VSHORT."""
    from engine.ir import SHORT1, VSHORT, launch_key, pass_key
    from engine.profile import with_tuning

    prof = get_profile("h200")
    assert prof.tune("decode_graph")["b1_rows"] == 8 and prof.tune("decode_graph")["b1_rows_kb"] == 2048
    small = plan_for("llama", "smollm2-135m", "q4_1")
    assert small.b1_rows == 8
    assert plan_for("qwen3", "qwen3-4b", "q4_k_m").b1_rows == 0
    graph = load_family("llama")
    for spec in ("decode_graph.b1_rows=0", "decode_graph.b1_rows_kb=1024"):
        plan = build_plan(graph, dims_for_size("llama", "smollm2-135m"), graph.quant("q4_1"), with_tuning(prof, spec))
        assert plan.b1_rows == 0, spec
    for st in small.steps:
        for n in (2, 5, 8, 9):
            for short, verify in ((False, False), (True, False), (True, True)):
                key = pass_key(st, "decode", n, short, verify, small.b1_rows)
                plain = launch_key(st.launches, "decode", short, verify)
                if st.head or n > 8 or plain != "decode":
                    assert key == plain
                else:
                    assert key == "decode1"
                assert key not in (SHORT1,) and (key != VSHORT or verify)
        assert pass_key(st, "decode1", 1, True, False, small.b1_rows) == launch_key(st.launches, "decode1", True)
    # a 5-row pass: batch 1's launch count and one (the final norm the head's bucket GEMV reads)
    def count(mode, n, short):
        return sum(len(_at(st.launches[pass_key(st, mode, n, short, False, small.b1_rows)], n)) for st in small.steps)

    assert count("decode", 5, False) == count("decode1", 1, False) + 1
