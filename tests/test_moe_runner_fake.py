"""CudaRunner on a tiny Qwen3-MoE checkpoint over the fake driver (no GPU): every MoE launch binds
(arguments resolve, grids are whole), decode replays one graph, the expert stacks upload as the
file's bytes, and a model that does not fit fails before any allocation with bytes needed vs free."""

from __future__ import annotations

import pytest
from fixtures.checkpoints import write_qwen3_moe_gguf, write_qwen3_moe_safetensors
from test_plan_runner_fake import FakeDriver, fake_builder

from engine.model import load_model
from engine.types import MemraError, SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)
DIMS = dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            intermediate_size=512, moe_intermediate_size=256, mlp_only_layers=(1,), num_experts=8,
            num_experts_per_tok=2)


@pytest.fixture(params=["bf16", "q8_0", "shared"])
def moe_model(request, tmp_path, monkeypatch):
    if request.param == "shared":  # + a gated shared expert (tests/gpu/test_moe_runner.py's model)
        import sys
        from pathlib import Path

        from engine import paths

        sys.path.insert(0, str(Path(__file__).parent / "gpu"))
        from test_moe_runner import DIMS as GPU_DIMS
        from test_moe_runner import _with_shared_expert

        monkeypatch.setattr(paths, "models_dir", paths.models_dir)  # restored after the test
        return load_model(_with_shared_expert(write_qwen3_moe_safetensors(tmp_path / "m", seed=3, **GPU_DIMS), tmp_path))
    if request.param == "bf16":
        return load_model(write_qwen3_moe_safetensors(tmp_path / "m", seed=3, **DIMS))
    return load_model(write_qwen3_moe_gguf(tmp_path / "m.gguf", quant="q8_0", seed=3, **DIMS))


def _runner(monkeypatch, tmp_path, model, drv):
    import engine.runner_cuda as rc

    # the grouped GEMVs in the 8-row bucket (the h100 / h200 profiles run the grouped GEMM there)
    monkeypatch.setenv("MEMRA_TUNE", "gemm_decode.moe_min_rows=0")
    monkeypatch.setattr(rc, "cuda", drv.module())
    runner = rc.CudaRunner(model, num_blocks=32, max_model_len=256, builder=fake_builder(tmp_path))
    drv.reset()
    return runner


def test_moe_prefill_and_decode_bind_every_launch(moe_model, monkeypatch, tmp_path):
    drv = FakeDriver()
    runner = _runner(monkeypatch, tmp_path, moe_model, drv)
    runner.use_graphs = False  # (11 tokens: else the captured tail graph of 11 replays)
    runner.step([StepItem(0, list(range(1, 12)), 0, [0], True, GREEDY)])
    runner.use_graphs = True
    names = [n for n, _, _ in drv.launches]
    assert sum(n.startswith("moe_topk") for n in names) == 2  # layers 0 and 2; layer 1 is dense (prefill: GEMV + top-k)
    assert sum(n.startswith("moe_combine") for n in names) == 2
    shared = 2 if moe_model.graph.family == "moe_shared" else 0
    assert sum(n.startswith("moe_shared") for n in names) == shared
    assert sum(n.startswith("silu_mul") for n in names) <= 1 + shared  # the dense layer's (+ the shared experts')
    drv.launches.clear()
    runner.step([StepItem(0, [5], 11, [0], True, GREEDY)])
    runner.step([StepItem(0, [6], 12, [0], True, GREEDY)])
    assert drv.captures == 1 and drv.graph_launches == 2
    b1 = [n for n, _, _ in drv.launches]
    assert any(n.startswith("moe_gemv_glu_") and "grouped" not in n for n in b1)
    assert sum(n.startswith("moe_router") for n in b1) == 4 and not any(n.startswith("moe_topk") for n in b1)
    drv.launches.clear()
    runner.step([StepItem(i, [5], 11 + i, [i], True, GREEDY) for i in range(3)])  # bucket 4: per slot
    assert not any("grouped" in n or n.startswith("moe_combine") for n, _, _ in drv.launches)
    grids = [g for n, g, _ in drv.launches if n.startswith("moe_gemv_glu_")]
    assert grids and all(g[1] == 4 * 2 for g in grids)  # a block row per (token, slot)
    drv.launches.clear()
    runner.step([StepItem(i, [5], 10 + i % 4, [i], True, GREEDY) for i in range(6)])  # bucket 8: grouped
    grids = [g for n, g, _ in drv.launches if "glu_grouped" in n]
    assert grids and all(g[1] == 8 for g in grids)  # a block row per expert: min(E, 8 rows x top 2)
    runner.close()


def test_a_model_that_does_not_fit_fails_before_allocating(moe_model, monkeypatch, tmp_path):
    drv = FakeDriver()
    module = drv.module()
    free = 64 << 10  # far less than the weights
    module.Context.mem_info = lambda self: (free, 80 << 30)
    allocs = []
    base = module.alloc
    module.alloc = lambda n: allocs.append(n) or base(n)
    import engine.runner_cuda as rc

    monkeypatch.setattr(rc, "cuda", module)
    with pytest.raises(MemraError) as e:
        rc.CudaRunner(moe_model, num_blocks=32, max_model_len=256, builder=fake_builder(tmp_path))
    msg = str(e.value)
    assert e.value.code == "out_of_memory" and "\n" not in msg
    assert "experts" in msg and "GiB is free" in msg and str(moe_model.path) in msg
    assert allocs == []


def test_q4_k_m_batch1_routing_glu_binds(monkeypatch, tmp_path):
    """A q4_k_m model's batch-1 decode step (moe_gemv_q8: the routing glu of the post-pass
    route_in_glu, then the plain down reading its ids and weights): every launch binds, each
    sparse layer's glu routes and its down does not; a bucket-8 step binds the grouped GEMVs and
    their moe_q8round launches (h, then act, rounded once)."""
    model = load_model(write_qwen3_moe_gguf(tmp_path / "m.gguf", quant="q4_k_m", seed=3, **DIMS))
    drv = FakeDriver()
    runner = _runner(monkeypatch, tmp_path, model, drv)
    runner.step([StepItem(0, list(range(1, 8)), 0, [0], True, GREEDY)])
    drv.launches.clear()
    runner.use_graphs = False
    runner.step([StepItem(0, [5], 7, [0], True, GREEDY)])
    names = [n for n, _, _ in drv.launches]
    assert sum(n.startswith("moe_gemv_q8_glu_") and "route" in n for n in names) == 2, names
    assert sum(n.startswith("moe_gemv_q8_down_") and "route" not in n for n in names) == 2, names
    drv.launches.clear()
    runner.step([StepItem(i, [5], 7 + i % 3, [i], True, GREEDY) for i in range(6)])  # bucket 8: grouped, q8x_round
    names = [n for n, _, _ in drv.launches]
    assert sum(n.startswith("moe_q8round") for n in names) == 4 and sum("grouped" in n for n in names) == 4, names
    runner.close()


def test_decode_profile_labels_match_the_bound_pass_at_every_bucket(moe_model, monkeypatch, tmp_path):
    """tools/gpu_decode_profile.pass_labels (gpu_trace_decode's launch names) skips the launches a
    pass of its rows does not run (Launch.runs_at: the per-slot MoE kernels up to 4 rows, the
    grouped ones above), as CudaRunner binds the pass."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from gpu_decode_profile import pass_labels, pass_weight_bytes

    runner = _runner(monkeypatch, tmp_path, moe_model, FakeDriver())
    for rows in (4, 8):
        bound = runner._bind_pass("decode", rows, rows, False, "greedy", True)
        labels = pass_labels(runner, "decode", True, "greedy", rows=rows)
        assert [lb.split(":", 1)[1] for lb in labels] == [b.fn.name for b in bound]
        assert len(pass_weight_bytes(runner, "decode", True, "greedy", rows=rows)) == len(labels)
    runner.close()
