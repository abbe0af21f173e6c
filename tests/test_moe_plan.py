"""The CUDA plan of a Qwen3-MoE model (no GPU): `when` predicates pick each layer's ops, the
MoE lowering units' launches per mode, stacked expert weights as their file blocks, the weight
bytes the runner checks against free memory."""

from __future__ import annotations

import dataclasses

import pytest

from engine.graph import load_family
from engine.ir import NULL, Arg, kernel_specs
from engine.model import dims_for_size
from engine.plan import build_plan
from engine.profile import get_profile, with_tuning
from engine.weight_memory import plan_weight_bytes, weight_bytes

# a small qwen3-30b-a3b: 3 layers, the middle one dense (mlp_only_layers), k-quant friendly widths
SMALL = dict(hidden=256, layers=3, heads=4, kv_heads=2, head_dim=64, rope_dim=64, q_dim=256, kv_dim=128,
             intermediate=512, moe_intermediate=256, experts=16, experts_used=4, vocab=512, mlp_only_layers=[1])


def _plan(quant: str = "q4_k_m", profile: str = "h200", dtypes=None, tune: str = "", **over):
    g = load_family("qwen3_moe")
    d = {**dims_for_size("qwen3_moe", "qwen3-30b-a3b"), **SMALL, **over}
    prof = with_tuning(get_profile(profile), tune) if tune else get_profile(profile)
    return g, d, build_plan(g, d, g.quant(quant), prof, tensor_dtypes=dtypes)


def _ops_by_layer(plan) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for s in plan.steps:
        if s.layer is not None:
            out.setdefault(s.layer, []).append(s.op.op)
    return out


def test_when_predicates_pick_the_ops_of_each_layer():
    g, d, plan = _plan("bf16")
    by_layer = _ops_by_layer(plan)
    for layer in range(3):
        assert by_layer[layer] == [op.op for op in g.layer_ops(d, layer)]
    assert by_layer[0].count("moe_router") == 1 and "silu_mul" not in by_layer[0]
    assert by_layer[1].count("silu_mul") == 1 and "moe_experts" not in by_layer[1]
    assert by_layer[0] == by_layer[2]
    # the weights follow: the dense MLP only in layer 1, the router and experts in 0 and 2
    keys = {w.key for w in plan.weights}
    assert "L1.w_gate|w_up" in keys and "L1.router" not in keys and "L0.w_gate|w_up" not in keys
    assert {"L0.router", "L0.exp_gate", "L2.exp_down"} <= keys
    _, _, every = _plan("bf16", decoder_sparse_step=2, mlp_only_layers=[])  # layer 1 only is sparse
    assert [("moe_router" in ops) for ops in _ops_by_layer(every).values()] == [False, True, False]


def test_moe_launches_per_mode():
    _, d, plan = _plan("q8_0")
    router = next(s for s in plan.steps if s.op.op == "moe_router")
    experts = next(s for s in plan.steps if s.op.op == "moe_experts")
    gemv, topk = router.launches["prefill"]
    assert gemv.spec.template == "gemv" and gemv.spec.params["out_dtype"] == "f32"
    assert topk.spec.template == "moe_topk"
    assert topk.spec.params == {"experts": 16, "top_k": 4, "normalize": True, "warps": 4}
    outs = (Arg("value", "expert_ids"), Arg("value", "expert_weights"), Arg("value", "expert_ids.logits"))
    assert topk.args[:3] == outs
    norm = plan.steps[plan.steps.index(router) - 1]
    assert norm.op.op == "rmsnorm" and norm.layer == router.layer and norm.launches["prefill"]
    for mode in ("decode1", "decode"):  # the rmsnorm, the router GEMV and the routing in one launch
        (fused,) = router.launches[mode]
        assert norm.launches[mode] == ()
        assert fused.spec.template == "moe_router" and fused.args[:3] == outs
        assert fused.args[3:] == (Arg("value", "x"), Arg("weight", "L0.router"), Arg("scratch", "moe_route_count"),
                                  Arg("shape", "n", "i32"), Arg("weight", "L0.ffn_norm"), Arg("value", "h"))
        p = fused.spec.params
        assert (p["experts"], p["k"], p["top_k"], p["normalize"], p["wdtype"], p["x_stride"]) == (16, 256, 4, True, "f32", 256)
        assert (p["norm"], p["eps"], p["h_stride"]) == (True, repr(d["rms_eps"]), 256)
        assert p["trigger"] is (mode == "decode1") and fused.grid == (8, "(n + 7) // 8") and fused.block == (256,)
    count = next(s for s in plan.scratch if s.name == "moe_route_count")
    assert count.fill == "zero" and count.fixed == 4 * plan.max_tokens // 8
    assert [la.spec.params["mode"] for la in experts.launches["decode1"]] == ["glu", "down"]
    glu, down = experts.launches["decode1"]
    assert glu.grid == (256 // 4, "n * 4") and down.grid == (256 // 4, "n")
    assert down.args[0] == Arg("value", "x") and down.args[5] == Arg("value", "x")  # residual in place
    names = [la.spec.template + ":" + la.spec.params.get("mode", "") for la in experts.launches["decode"]]
    assert names == ["moe_gemv:glu", "moe_gemv:down", "moe_gemv:glu_grouped", "moe_gemv:down_grouped",
                     "moe_sort:", "moe_gemm:glu", "moe_gemm:down", "moe_combine:"]
    # the smallest batched buckets per slot (as batch 1), then the grouped GEMVs over the chosen experts
    # (batch 1 alone lets the next kernel launch early: decode_graph.early_trigger)
    assert glu.spec.params["trigger"] and down.spec.params["trigger"]
    untrigger = lambda la: dataclasses.replace(  # noqa: E731
        la, spec=dataclasses.replace(la.spec, params={**la.spec.params, "trigger": False}, entry=la.spec.entry.replace("_tr1", "")))
    assert experts.launches["decode"][:2] == tuple(dataclasses.replace(untrigger(la), max_rows=4) for la in (glu, down))
    grouped = experts.launches["decode"][2]
    assert grouped.grid == (256 // 16, "n * 4 if n * 4 < 16 else 16") and grouped.min_rows == 5  # 4 warps x 4 rows
    assert grouped.spec.params["rows_per_warp"] == 4
    assert [grouped.grid_for({"n": n})[1] for n in (2, 3, 8)] == [8, 12, 16]
    assert grouped.spec.params["max_slots"] >= plan.max_tokens
    # prefill: sorted by expert on the device, then the tensor-core grouped GEMM
    names = [la.spec.template + ":" + la.spec.params.get("mode", "") for la in experts.launches["prefill"]]
    assert names == ["moe_sort:", "moe_gemm:glu", "moe_gemm:down", "moe_combine:"]
    sort, glu, gdown, _ = experts.launches["prefill"]
    assert glu.grid == (256 // 64, "n * 4 // 64 + 16") and gdown.grid == (256 // 128, "n * 4 // 64 + 16")
    assert glu.args[4:6] == sort.args[:2] == gdown.args[3:5] == (Arg("scratch", "moe_perm"), Arg("scratch", "moe_tiles"))
    assert glu.smem == gdown.smem == 3 * (64 + 128) * 64 * 2 and glu.spec.params["quant"] == "q8_0"
    assert all(la.spec.pdl for la in experts.launches["decode"] + experts.launches["prefill"] + router.launches["decode"])
    ids, wts = plan.values["expert_ids"], plan.values["expert_weights"]
    assert (ids.dtype, ids.width, wts.dtype, wts.width) == ("i32", 4, "f32", 4)
    assert plan.values["expert_ids.logits"].dtype == "f32"
    assert {"moe_act", "moe_partial", "moe_perm", "moe_tiles"} <= {s.name for s in plan.scratch}
    assert NULL not in experts.launches["prefill"][3].args[:4]


def test_expert_stacks_keep_their_file_blocks():
    # a q4_k_m file with q6_k expert down projections in layer 0 (as the _M mixes write them); the
    # h200 profile repacks dense q6_k matrices (q6_kr) but the expert kernels read the file's blocks
    dtypes = {"exp_down@0": "q6_k", "w_down@1": "q6_k"}
    _, d, plan = _plan("q4_k_m", dtypes=dtypes)
    w = {w.key: w for w in plan.weights}
    assert (w["L0.exp_down"].dtype, w["L2.exp_down"].dtype, w["L0.exp_gate"].dtype) == ("q6_k", "q4_k", "q4_k")
    assert (w["L0.exp_gate"].rows, w["L0.exp_gate"].cols) == (16 * 256, 256)
    assert w["L1.w_down"].dtype == "q6_kr"
    down0 = next(s for s in plan.steps if s.op.op == "moe_experts" and s.layer == 0).launches["decode1"][1]
    assert down0.spec.params["quant"] == "q6_k"
    assert w["L0.router"].dtype == "f32"
    # the plan's weight bytes are what weight_memory counts (the runner's fit check)
    from engine import kernel_catalog as kc

    prof = get_profile("h200")
    wb = weight_bytes(load_family("qwen3_moe"), d, load_family("qwen3_moe").quant("q4_k_m"), dtypes,
                      device_type=lambda t, cols: kc.upload_type(t, cols, prof.tuning))
    assert wb.total == plan.weight_bytes()
    assert plan_weight_bytes(plan, load_family("qwen3_moe")) == wb


def test_every_moe_spec_renders():
    from engine.render import render

    _, _, plan = _plan("q4_k_m", profile="h100")
    specs = [s for s in kernel_specs(plan) if s.template.startswith("moe_")]
    assert {s.template for s in specs} == {"moe_topk", "moe_router", "moe_gemv", "moe_gemv_q8", "moe_combine", "moe_sort",
                                           "moe_gemm", "moe_q8round"}
    for s in specs:
        assert f"{s.entry}(" in render(s)


def test_shared_expert_lowering(tmp_path, monkeypatch):
    import shutil

    from test_moe_load import SHARED_FAMILY

    from engine import paths
    from engine.runner_bench import expert_weight_keys

    root = tmp_path / "models"
    shutil.copytree(paths.models_dir(), root)
    (root / "moe_shared.yaml").write_text(SHARED_FAMILY)
    g = load_family("moe_shared", root)
    d = {**dims_for_size("qwen3_moe", "qwen3-30b-a3b"), **SMALL, "shared_intermediate": 128}
    for q, prof in (("bf16", "h100"), ("q8_0", "h200")):
        plan = build_plan(g, d, g.quant(q), get_profile(prof))
        step = next(s for s in plan.steps if s.op.op == "moe_experts")
        for mode in ("decode1", "decode", "prefill"):
            names = [la.spec.template for la in step.launches[mode]]
            assert names[-1] == "moe_shared" and "silu_mul" in names, (mode, names)
            shared = step.launches[mode][names.index("moe_combine") + 1 if "moe_combine" in names else 2 :]
            for rows in (8, 32):  # (a pass of that many rows: from gemv_mmq.min_rows the mma GEMVs)
                linears = [la.spec.template for la in shared if la.runs_at(rows)]
                linears = [n for n in linears if n not in ("silu_mul", "moe_shared", "embed")]
                if mode == "prefill":
                    assert set(linears) <= {"gemm", "gemm_wgmma"} and len(linears) >= 3, names
                else:
                    assert linears == ["gemv"] * 3, names
        last = step.launches["decode"][-1]
        assert last.args[:4] == (Arg("value", "x"), Arg("value", "x.shared_out"), Arg("value", "h"), Arg("weight", "L0.sh_gate_inp"))
        assert plan.weight("L0.sh_gate_inp").dtype == "f32" and plan.values["x.shared_act"].width == 128
        assert all(s.layer != 1 for s in plan.steps if s.op.op == "moe_experts")
        # the bench's active-expert bytes: the three stacked expert matrices, not the shared
        # expert (dense, read whole every step)
        keys = expert_weight_keys(plan)
        assert "L0.exp_gate" in keys and "L0.exp_down" in keys, keys
        assert not any(".sh_" in k for k in keys), keys


def test_bench_counts_the_bytes_and_flops_a_moe_step_uses():
    from fixtures.engine_probes import decode_read_bytes

    from engine.runner_bench import expert_weight_keys, layer_matrix_params, streamed_weight_bytes
    from engine.weight_memory import active_expert_fraction, plan_weight_bytes

    g, d, plan = _plan("q4_k_m", profile="h100")
    assert expert_weight_keys(plan) == {f"L{i}.exp_{p}" for i in (0, 2) for p in ("gate", "up", "down")}
    wb = plan_weight_bytes(plan, g)
    embed_row = plan.weight("embed").cols * 2  # an untied table: a row gathered per token
    assert streamed_weight_bytes(plan, 1) == pytest.approx(decode_read_bytes(wb, d) + embed_row, abs=8)
    assert decode_read_bytes(wb, d) == wb.dense + wb.vectors + wb.experts * 4 // 16
    # 32 rows over 16 experts, top-4: nearly every expert is read
    assert active_expert_fraction(d, 32) == pytest.approx(1 - 0.75**32)
    assert streamed_weight_bytes(plan, 32) > 0.99 * (wb.total - wb.embedding)
    dense = sum(w.rows * w.cols for w in plan.weights if w.layer is not None and w.rows > 1 and "exp_" not in w.key)
    experts = sum(w.rows * w.cols for w in plan.weights if "exp_" in w.key)
    assert layer_matrix_params(plan) == dense + experts // 4


def test_grouped_buckets_round_x_where_the_per_slot_kernels_are_q8():
    """The grouped GEMVs of the batched buckets take q8x_round exactly where the per-slot kernels
    are moe_gemv_q8's (h100: gemv_coop.q8x), so a token's x is the one it gets alone (batched
    greedy output equal to solo); a profile without q8x keeps f32 x in both."""
    for profile, on in (("h100", True), ("generic-sm80", False)):
        _, _, plan = _plan("q4_k_m", profile=profile)
        for st in (s for s in plan.steps if s.op.op == "moe_experts"):
            launches = st.launches["decode"]
            assert {la.spec.template for la in launches[:2]} == {"moe_gemv_q8" if on else "moe_gemv"}, profile
            grouped = [la for la in launches if la.spec.params.get("mode", "").endswith("_grouped")]
            assert len(grouped) == 2 and all(bool(la.spec.params.get("q8x_round")) is on for la in grouped), profile
            # q8x_round: moe_q8round rounds h, then act, once a step, in the grouped GEMVs' buckets
            names = [la.spec.template if la.spec.template != "moe_gemv" else la.spec.params["mode"] for la in launches]
            rnd = [la for la in launches if la.spec.template == "moe_q8round"]
            if not on:
                assert not rnd
                continue
            i = names.index("glu_grouped")
            assert names[i - 1] == "moe_q8round" and names[i + 1] == "moe_q8round" and names[i + 2] == "down_grouped"
            glu, down = launches[i], launches[i + 2]
            assert rnd[0].args[1] == glu.args[3].__class__("value", "h") and glu.args[3] == rnd[0].args[0]
            assert rnd[1].args[1] == glu.args[0] and down.args[2] == rnd[1].args[0]
            assert rnd[1].grid[1] == "n * 4" and rnd[1].spec.params["row_mult"] == 4
            assert all((la.min_rows, la.max_rows) == (glu.min_rows, glu.max_rows) for la in rnd)
            # their f32 rows sized for the rows they run at (below the GEMM's), not the prefill chunk
            sizes = {sp.name: sp.fixed for sp in plan.scratch}
            assert sizes["moe_xq"] == glu.max_rows * 256 * 4 and sizes["moe_actq"] == glu.max_rows * 4 * 256 * 4


def test_q4_k_m_per_slot_experts_take_the_q8x_kernels():
    """q4_k gate / up and q4_k or q6_k down stacks: batch 1 (and the per-slot batched buckets) run
    moe_gemv_q8 with moe_gemv's arguments, a grid of warps x rows_per_warp rows per block; a
    profile without q8x keeps moe_gemv."""
    for profile, template in (("h100", "moe_gemv_q8"), ("generic-sm80", "moe_gemv")):
        _, _, plan = _plan("q4_k_m", profile=profile)
        downs = set()
        for st in (s for s in plan.steps if s.op.op == "moe_experts"):
            glu, down = st.launches["decode1"]
            assert (glu.spec.template, down.spec.template) == (template, template)
            assert (glu.spec.params["mode"], down.spec.params["mode"]) == ("glu", "down")
            assert glu.grid[1] == "n * 4" and down.grid[1] == "n" and down.args[5] == Arg("value", "x")
            (router,) = next(s for s in plan.steps if s.op.op == "moe_router" and s.layer == st.layer).launches["decode1"]
            if template == "moe_gemv_q8":
                p = glu.spec.params
                assert glu.grid[0] == -(-256 // (p["warps"] * p["rows_per_warp"])) and glu.block == (32 * p["warps"],)
                assert p["quant"] == "q4_k" and down.spec.params["residual"] and p["trigger"]
                # the glu routes the token itself from the router's logits: the router stores only those
                assert p["route"] and (p["experts"], p["normalize"]) == (16, True) and not router.spec.params["route"]
                assert glu.args[4] == router.args[0] and glu.args[6:] == router.args[1:3] and len(glu.args) == 8
                assert down.args[3:5] == router.args[:2]
                (batched,) = next(s for s in plan.steps if s.op.op == "moe_router" and s.layer == st.layer).launches["decode"]
                assert batched.spec.params["route"] and not st.launches["decode"][0].spec.params["route"]
            else:
                assert router.spec.params["route"] and len(glu.args) == 6
            downs.add(down.spec.params["quant"])
        assert downs == {"q4_k", "q6_k"} or len(downs) == 1


def test_batch1_down_reads_the_routing_glus_ids():
    """Only the routing glu routes: the batch-1 moe_gemv_q8 down after it (q4_k and q6_k stacks)
    reads the ids and weights the glu wrote (7 args, no logits), as the batched per-slot down;
    expert_q8_kernel takes no routing down."""
    from engine.moe_kernels import expert_q8_kernel
    from engine.types import ConfigError

    g = load_family("qwen3_moe")
    d = {**dims_for_size("qwen3_moe", "qwen3-30b-a3b"), **SMALL}
    plan = build_plan(g, d, g.quant("q4_k_m"), get_profile("h100"), tensor_dtypes={"exp_down@0": "q6_k"})
    quants = set()
    for st in (s for s in plan.steps if s.op.op == "moe_experts"):
        glu, down = st.launches["decode1"]
        (router,) = next(s for s in plan.steps if s.op.op == "moe_router" and s.layer == st.layer).launches["decode1"]
        assert glu.spec.params["route"] and glu.args[4] == router.args[0]
        assert not down.spec.params["route"] and down.args[3:5] == router.args[:2] and len(down.args) == 7
        assert not st.launches["decode"][1].spec.params["route"]
        quants.add(down.spec.params["quant"])
    assert quants == {"q4_k", "q6_k"}
    with pytest.raises(ConfigError, match="only the glu routes"):
        expert_q8_kernel("down", "q4_k", 256, 256, 4, route=(16, True))


@pytest.mark.parametrize("quant", ["bf16", "q4_k_m"])
def test_decode_buckets_switch_to_the_grouped_gemm(quant):
    from engine.ir import WIDE

    # the default thresholds (h200 moves both: test_moe_min_rows_...): bf16's wide decode buckets
    # exist, q4_k_m's none; the GEMM from 4 tokens per expert
    _, _, plan = _plan(quant, tune="gemm_decode.moe_min_rows=0; gemm_decode.quant_min_rows=0")
    assert bool(plan.wide_rows) is (quant == "bf16")
    experts = next(s for s in plan.steps if s.op.op == "moe_experts")
    cut = 4 * 16 // 4  # GEMM_TOKENS_PER_EXPERT tokens per expert on average: 16 experts, top 4
    for mode in ("decode", WIDE) if plan.wide_rows else ("decode",):
        launches = experts.launches[mode]
        per_slot = "moe_gemv_q8" if quant == "q4_k_m" else "moe_gemv"  # (q4_k / q6_k stacks: int8 x, dp4a)
        solo = [] if mode == WIDE else [(per_slot, "glu", 0, 4), (per_slot, "down", 0, 4)]
        first = 0 if mode == WIDE else 5  # batched decode: per slot up to 4 rows, grouped from 5
        got = [(la.spec.template, la.spec.params.get("mode"), la.min_rows, la.max_rows) for la in launches]
        rnd = [("moe_q8round", None, first, cut - 1)] if quant == "q4_k_m" else []  # (q8x_round: x, act rounded once)
        assert got == solo + [
            *rnd,
            ("moe_gemv", "glu_grouped", first, cut - 1),
            *rnd,
            ("moe_gemv", "down_grouped", first, cut - 1),
            ("moe_sort", None, cut, 0),
            ("moe_gemm", "glu", cut, 0),
            ("moe_gemm", "down", cut, 0),
            ("moe_combine", None, first, 0),
        ]
        launches = [la for la in launches[len(solo):] if la.spec.template != "moe_q8round"]
        sort, glu = launches[2:4]
        assert sort.spec.params["tile_m"] == glu.spec.params["tile_m"] == 16 and glu.grid[1] == "n * 4 // 16 + 16"
        assert [la.runs_at(cut - 1) for la in launches] == [True, True, False, False, False, True]
        assert [la.runs_at(cut) for la in launches] == [False, False, True, True, True, True]
        if not solo:
            continue
        # every decode pass runs one way through: per slot (sums its own slots) or grouped + combine
        for rows in (1, 2, 4, 5, 8, cut - 1, cut, 2 * cut):
            ran = [(la.spec.template, la.spec.params.get("mode")) for la in experts.launches[mode] if la.runs_at(rows)]
            if rows <= 4:
                assert ran == [(per_slot, "glu"), (per_slot, "down")], rows
            else:
                grouped = 3 + 2 * bool(rnd)
                assert ran[-1] == ("moe_combine", None) and len(ran) == (grouped if rows < cut else 4), (rows, ran)


def test_moe_min_rows_moves_the_grouped_gemm_down_to_that_bucket():
    g = load_family("qwen3_moe")
    d = {**dims_for_size("qwen3_moe", "qwen3-30b-a3b"), **SMALL}
    plan = build_plan(g, d, g.quant("q4_k_m"), with_tuning(get_profile("h100"), "gemm_decode.moe_min_rows=8"))
    experts = next(s for s in plan.steps if s.op.op == "moe_experts")
    for rows, want in ((4, "moe_gemv_q8"), (8, "moe_gemm"), (16, "moe_gemm")):
        ran = {la.spec.template for la in experts.launches["decode"] if la.runs_at(rows)}
        assert want in ran and ("moe_gemm" in ran) is (rows >= 8), (rows, ran)
        assert "moe_gemv" not in ran or rows < 8, (rows, ran)  # (the grouped GEMVs only below it)


@pytest.mark.parametrize("profile", ["h100", "generic-sm80"])
def test_moe_launch_args_match_the_kernel_parameters(profile):
    """Every MoE launch of a q4_k_m plan passes as many arguments as its rendered kernel takes,
    pointers where it takes pointers (the routing glu's two extra ones included)."""
    from fixtures.cuda_emu import _params_of

    from engine.render import render

    _, _, plan = _plan("q4_k_m", profile=profile)
    seen = set()
    for st in plan.steps:
        for la in (la for las in st.launches.values() for la in las):
            if la.spec.template.startswith("moe_") and la.spec.entry not in seen:
                seen.add(la.spec.entry)
                params = _params_of(render(la.spec), la.spec.entry)
                assert [("*" in p) for p in params] == [a.ctype == "ptr" for a in la.args], la.spec.entry
    assert len(seen) >= 12


def _b1_layer_launches(plan, layer: int, short: bool) -> list[str]:
    """The (template, mode) of each launch a batch-1 decode pass runs for one layer's steps."""
    from engine.ir import pass_key

    out = []
    for st in plan.steps:
        if st.layer != layer:
            continue
        key = pass_key(st, "decode1", 1, short, b1_rows=plan.b1_rows)
        out += [(la.spec.template, la.spec.params.get("mode")) for la in st.launches.get(key, ()) if la.runs_at(1)]
    return out


def test_qwen3_30b_a3b_batch1_layer_launches(monkeypatch):
    """The batch-1 decode launches of each Qwen3-30B-A3B q4_k_m layer on the h100 profile, as the
    file tools/make_checkpoint.py writes (q6_k v and expert down in even layers; issue #35's launch
    count): 6 below the short-context bound (the rope in the direct attention), 8 past it; the MoE
    MLP is three (the router with the rmsnorm folded in, the routing glu, the down that sums the
    slots and adds the residual), each with its early pdl_trigger(). Without the post-pass
    fold_router_norm the rmsnorm launch comes back; without route_in_glu the router routes itself
    again (same count)."""
    import sys
    from pathlib import Path

    from engine.lowering import registry

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import plan_golden

    def plan_without(*names):
        kept = [(o, fn) for o, fn in registry.POST_PASSES if fn.__name__ not in names]
        monkeypatch.setattr("engine.plan.POST_PASSES", kept)
        return plan_golden.plan_of("qwen3_moe/qwen3-30b-a3b/q4_k_m/h100")

    plan = plan_without()
    mlp = [("moe_router", None), ("moe_gemv_q8", "glu"), ("moe_gemv_q8", "down")]
    layers = 1 + max(st.layer for st in plan.steps if st.layer is not None)
    assert layers == 48
    for i in range(layers):
        qkv = ("gemv_pair", None)  # (q|k and v, the attention rmsnorm in its prologue)
        assert _b1_layer_launches(plan, i, True) == [qkv, ("attention", None), ("gemv", None), *mlp], i
        assert _b1_layer_launches(plan, i, False) == [qkv, ("rope", None), ("attention", None),
                                                      ("attention_combine", None), ("gemv", None), *mlp], i
        moe = [st for st in plan.steps if st.layer == i and st.op.op in ("moe_router", "moe_experts")]
        (router,), (glu, down) = (st.launches["decode1"] for st in moe)
        assert router.spec.params["trigger"] and glu.spec.params["trigger"] and down.spec.params["trigger"]
        assert not router.spec.params["route"] and glu.spec.params["route"] and down.spec.params["residual"]

    unfolded = plan_without("fold_router_norm")
    assert _b1_layer_launches(unfolded, 0, True) == [("gemv_pair", None), ("attention", None), ("gemv", None),
                                                     ("rmsnorm", None), *mlp]
    unrouted = plan_without("route_in_glu")
    assert _b1_layer_launches(unrouted, 0, True) == _b1_layer_launches(plan, 0, True)
    (router,), (glu, _) = (st.launches["decode1"] for st in unrouted.steps
                           if st.layer == 0 and st.op.op in ("moe_router", "moe_experts"))
    assert router.spec.params["route"] and not glu.spec.params.get("route")
