"""tools/gpu_spec_round.py on the fake driver of test_plan_runner_fake (no GPU): its passes are the
graphs the runner replays, and a speculative round on the CUDA runner is one graph replay (inputs in,
ids out inside the graph) and one synchronisation, with no eager launch and no copy of its own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import test_plan_runner_fake as base  # noqa: E402
from fixtures.tools import load_tool  # noqa: E402

from engine.bench import NullTokenizer  # noqa: E402

fake = base.fake


def _timed(mod):
    """The fake driver module with CUDA events that report 1 ms between two records."""

    class Event(mod.Event):
        def elapsed_ms(self, start):
            return 1.0

        def destroy(self):
            pass

    mod.Event = Event
    return mod


def test_pass_graphs_are_the_verify_graphs(fake):
    runner, drv = fake
    tool = load_tool("gpu_spec_round")
    import engine.runner_cuda as rc

    res = tool.passes(_timed(rc.cuda), runner, 4, [20], breakdown=False)
    rows = res["depths"][20]
    assert rows["verify"]["rows"] == 5 and rows["verify before"]["rows"] == 8
    assert [rows[f"rows {n}"]["us"] for n in (1, 8)] == [20.0, 20.0]  # 1 ms / 50 replays
    assert res["verify_vshort"] and not res["verify_short_ok"]  # (the h200 profile folds the short rope)
    assert (5, "greedy", True, True, "verify") in runner._graphs  # the graph a k=4 verify replays at 20
    assert rows["verify"]["launches"] < rows["verify unfolded"]["launches"] == rows["verify before"]["launches"]


def test_a_speculative_round_is_one_graph_replay_and_one_sync(fake):
    runner, drv = fake
    runner.ctx.make_current = lambda: None
    tool = load_tool("gpu_spec_round")
    import engine.runner_cuda as rc

    res = tool.engine_round(_timed(rc.cuda), runner, NullTokenizer(), list(range(3, 23)), 4, 41)
    on, off = res["replay"], res["off"]
    # the fake device samples token 0 everywhere: the recorded continuation is all zeros, accepted
    assert on["exact"] and off["tokens"] == on["tokens"] == 40
    assert on["rounds"] == 8 and on["tokens_per_round"] == 5.0
    assert on["spec_accepted_tokens"] == on["spec_draft_tokens"] == 32
    assert on["per_round"] == {"graph launch": 1.0, "synchronize": 1.0}  # no eager launch, no copy
    assert off["per_round"] == {"graph launch": 1.0, "synchronize": 1.0}
    assert set(on["split_us"]) == {"schedule", "attach", "runner host", "device wait", "apply", "loop other", "in pass"}
    assert on["split_us"]["in pass"] > 0  # (the detokenisation and events inside the next pass)
    assert "plain steps" in tool.report({"device": "fake", "model": "m", "k": 4, "passes": {
        "short_context": 256, "verify_short_ok": False, "verify_vshort": True, "depths": {}}, "round": res})


@pytest.mark.parametrize("b1_rows", [True, False], ids=["b1_rows", "bucket"])
def test_verify_passes_fold_the_rope_and_run_the_layers_as_batch_1(tmp_path, monkeypatch, b1_rows):
    """On a q4_1 SmolLM2-shaped plan (batch-1 GEMVs fold rmsnorm / silu_mul), the verify pass of 5
    rows runs batch 1's layer launches (decode_graph.b1_rows: the bmax-1 GEMVs with the norms
    folded in, a grid row per row) and the bucket's head (the final rmsnorm, then the bmax-8
    GEMV): batch 1's launches and one; with b1_rows off, plain decode's rmsnorm / silu_mul launches
    and bucket GEMVs throughout. Below split_kv_tokens (VSHORT: the rope folded into the direct
    attention, vfresh) no rope and no combine launch; past it the same launches as the plain
    decode pass."""
    from fixtures.checkpoints import Dims, write_random_gguf

    import engine.runner_cuda as rc
    from engine.model import load_model
    from engine.profile import get_profile, with_tuning

    drv = base.FakeDriver()
    monkeypatch.setattr(rc, "cuda", _timed(drv.module()))
    dims = Dims(576, 2, 9, 3, 64, 1536, 512, tie_word_embeddings=True)
    path = write_random_gguf(tmp_path / "q.gguf", "llama", dims, "q4_1", seed=5)
    prof = get_profile("h200") if b1_rows else with_tuning(get_profile("h200"), "decode_graph.b1_rows=0")
    runner = rc.CudaRunner(load_model(path), prof, num_blocks=64, max_model_len=512, builder=base.fake_builder(tmp_path))
    assert (runner.plan.b1_rows >= 5) == b1_rows
    tool = load_tool("gpu_spec_round")
    res = tool.passes(rc.cuda, runner, 4, [20, 300], breakdown=False)["depths"]
    # below split, per layer the combine and the rope; past it nothing
    assert res[20]["verify unfolded"]["launches"] - res[20]["verify"]["launches"] == 2 * 2
    assert res[300]["verify unfolded"]["launches"] == res[300]["verify"]["launches"]
    # against batch 1 (the norms folded into its GEMVs): the final norm (the head's), and without
    # b1_rows 2 rmsnorm + silu_mul per layer
    extra = 1 if b1_rows else 2 * 3 + 1
    for depth in (20, 300):
        assert res[depth]["verify"]["launches"] - res[depth]["plain b1"]["launches"] == extra

    def names(key):
        return [b.fn.name for b in runner._graphs[key][1]]

    verify, plain = names((5, "greedy", True, True, "verify")), names((5, "greedy", False, True))
    assert not any(n.startswith(("attention_combine", "rope")) for n in verify)
    assert sum("_vfresh16" in n for n in verify) == 2  # (the direct attention writing earlier rows' keys)
    for ns in (verify, plain):
        assert sum(n.startswith("rmsnorm") for n in ns) == (1 if b1_rows else 2 * 2 + 1)
        assert sum(n.startswith("silu_mul") for n in ns) == (0 if b1_rows else 2)

    def folded(ns):
        return [n for n in ns if n.startswith("gemv") and ("_prologuenorm" in n or "_prologuesilu" in n)]

    gemvs = [n for n in verify if n.startswith("gemv")]
    b1 = [n for n in names((1, "greedy", True, True)) if n.startswith("gemv")]
    assert gemvs == [n for n in plain if n.startswith("gemv")] and "_bmax8_" in gemvs[-1]
    if b1_rows:  # the layers' GEMVs are batch 1's, folds and all
        assert gemvs[:-1] == b1[:-1] and len(folded(gemvs)) == 2 * 3
    else:
        assert not folded(gemvs) and folded(b1)  # (batch 1 folds them)
