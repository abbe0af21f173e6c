"""The MoE hybrid's batch-1 decode plan without a GPU (issue #36: launches per layer): Qwen3.6-35B-A3B
q4_k_m on the h100 profile runs 8 decode1 launches per Gated-DeltaNet layer and 12 per gated
attention layer (the shared expert as plain ops, its gate|up one GEMV, silu_mul folded into the down
GEMV, moe_shared folded into the routed down: engine.lowering.moe.shared_into_down; the gated norm
and the causal conv folded into the delta rule: engine.lowering.linear_attention.fold_delta_neighbours);
the batched decode's per-slot down and moe_combine take moe_shared in too; prefill keeps moe_shared,
causal_conv1d and gated_rmsnorm; the shared_gate op's reference is moe_experts' shared term."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.checkpoints import mix_tensor_type

from engine.graph import load_family
from engine.model import dims_for_size
from engine.ops_ref_moe import moe_experts, shared_gate, swiglu_ffn
from engine.plan import build_plan
from engine.profile import get_profile


def _plan(profile="h100", quant="q4_k_m"):
    g = load_family("qwen3_5_moe")
    d = dims_for_size("qwen3_5_moe", "qwen3.6-35b-a3b")
    d["layers"], d["layer_types"] = 4, d["layer_types"][:4]
    types = {f"exp_down@{i}": mix_tensor_type(quant, "exp_down", i) for i in range(4)} if quant == "q4_k_m" else {}
    return build_plan(g, d, g.quant(quant), get_profile(profile), types, rope_style="neox")


def _launches(plan, layer, mode):
    return [la.spec.template for st in plan.steps if st.layer == layer for la in st.launches[mode]]


def test_batch1_launches_per_layer_kind():
    plan = _plan()
    linear, full = _launches(plan, 0, "decode1"), _launches(plan, 3, "decode1")
    moe = ["moe_router", "moe_gemv_q8", "gemv", "gemv", "moe_gemv_q8"]
    assert linear == ["gemv", "gated_delta_rule", "gemv", *moe], linear
    assert full == ["gemv", "split_heads", "rope", "attention", "attention_combine", "sigmoid_mul", "gemv", *moe], full
    gate = next(st for st in plan.steps if st.op.op == "shared_gate" and st.layer == 0)
    (down,) = gate.launches["decode1"]
    assert down.spec.params["mode"] == "down" and down.spec.params["shared"] and down.spec.params["residual"]
    assert [a.ref for a in down.args[6:9]] == ["sy", "h", "L0.sh_gate_inp"]
    glu_up = next(st for st in plan.steps if st.op.op == "linear" and st.layer == 0 and st.op.outputs == ("sg", "su"))
    assert plan.weight(glu_up.launches["decode1"][0].args[1].ref).parts == ("sh_gate", "sh_up")
    # the batched decode: the per-slot down (up to 4 rows) and moe_combine (from 5) in their shared
    # form in the shared_gate step; prefill keeps moe_shared, gated_rmsnorm and causal_conv1d
    batched = [(la.spec.template, la.spec.params["shared"], la.min_rows, la.max_rows) for la in gate.launches["decode"]]
    assert batched == [("moe_gemv_q8", True, 0, 4), ("moe_combine", True, 5, 0)], batched
    assert "moe_shared" not in _launches(plan, 0, "decode") and "moe_shared" in _launches(plan, 0, "prefill")
    for name in ("gated_rmsnorm", "causal_conv1d"):
        assert name in _launches(plan, 0, "prefill") and name not in _launches(plan, 0, "decode")


def test_shared_gate_stays_apart_without_the_int8_down():
    """bf16 experts (moe_gemv's down, no shared form): moe_shared keeps its launch at batch 1."""
    plan = _plan(quant="bf16")
    assert _launches(plan, 0, "decode1")[-1] == "moe_shared"


def test_shared_gate_reference_is_moe_experts_shared_term():
    rng = np.random.default_rng(0)
    t, hdim, e, inter, k = 3, 16, 4, 8, 2
    h = rng.standard_normal((t, hdim)).astype(np.float32)
    g, u = (rng.standard_normal((e, inter, hdim)).astype(np.float32) for _ in range(2))
    d = rng.standard_normal((e, hdim, inter)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3], [1, 2]])
    wts = rng.uniform(0.1, 1, (t, k)).astype(np.float32)
    sh = (rng.standard_normal((5, hdim)), rng.standard_normal((5, hdim)), rng.standard_normal((hdim, 5)), rng.standard_normal(hdim))
    sh = tuple(np.asarray(x, np.float32) for x in sh)
    res = rng.standard_normal((t, hdim)).astype(np.float32)
    want = moe_experts(h, ids, wts, g, u, d, sh, residual=res)
    routed = moe_experts(h, ids, wts, g, u, d, residual=res)
    got = shared_gate(h, swiglu_ffn(h, sh[0], sh[1], sh[2]), sh[3].reshape(1, -1), routed)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bench_reads_the_shared_expert_whole_and_the_routed_ones_by_share():
    """engine.runner_bench counts the stacked experts at top_k / E (the routed down too, though its
    batch-1 launch runs in the shared_gate step) and the shared expert's matrices whole."""
    from engine.runner_bench import expert_weight_keys, streamed_weight_bytes

    plan = _plan()
    assert expert_weight_keys(plan) == {f"L{i}.exp_{p}" for i in range(4) for p in ("gate", "up", "down")}
    share = plan.dims["experts_used"] / plan.dims["experts"]
    stacked = sum(w.nbytes for w in plan.weights if "exp_" in w.key)
    rest = sum(w.nbytes for w in plan.weights if "exp_" not in w.key and w.key != "embed")
    embed_row = plan.weight("embed").cols * 2
    assert streamed_weight_bytes(plan, 1) == pytest.approx(rest + stacked * share + embed_row, abs=64)
    assert any(w.key == "L0.sh_gate|sh_up" for w in plan.weights)


def test_the_folded_moe_hybrid_binds_and_steps_on_the_fake_driver(tmp_path, monkeypatch):
    """The tiny q4_k_m Qwen3.5-MoE GGUF of the GPU tests on CudaRunner over the fake driver: the
    fused sh_gate|sh_up weight uploads, every folded launch binds (the delta rule's conv / norm
    args and counters, the shared down's y / h / gate), and a prefill then batch-1 and batch-2
    decode steps of 1, 2 and 6 rows launch no causal_conv1d, gated_rmsnorm or moe_shared (the
    per-slot down's and, at 6 rows, moe_combine's shared forms instead)."""
    from fixtures import hybrid_case as case
    from fixtures.hybrid import write_random_hybrid_gguf
    from test_plan_runner_fake import GREEDY, FakeDriver, fake_builder

    import engine.runner_cuda as rc
    from engine.model import load_model
    from engine.types import StepItem

    drv = FakeDriver()
    monkeypatch.setattr(rc, "cuda", drv.module())
    path = write_random_hybrid_gguf(tmp_path / "m.gguf", quant="q4_k_m", moe=case.GGUF_MOE, seed=case.SEED, **case.GGUF_DIMS)
    runner = rc.CudaRunner(load_model(path), num_blocks=64, max_model_len=512, builder=fake_builder(tmp_path), state_slots=4)
    runner.use_graphs = False
    assert runner.plan.weight("L0.sh_gate|sh_up").parts == ("sh_gate", "sh_up")
    runner.step([StepItem(0, list(range(3, 12)), 0, [0], True, GREEDY, state_slot=0)])
    layers = runner.plan.dims["layers"]
    for rows in (1, 2, 6):
        drv.launches.clear()
        items = [StepItem(i, [5], 9, [i], True, GREEDY, state_slot=i % 4) for i in range(rows)]
        runner.step(items)
        names = [n.split("__")[0] for n, _, _ in drv.launches]
        assert "gated_delta_rule" in names and not {"causal_conv1d", "gated_rmsnorm", "moe_shared"} & set(names)
        folded = [n.split("__")[0] for n, _, _ in drv.launches if "_sh1" in n]
        kind = "moe_combine" if rows > 4 else "moe_gemv_q8_down"
        assert len(folded) == layers and all(n.startswith(kind) for n in folded), folded
