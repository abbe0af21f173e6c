"""CudaRunner's recurrent-state handling for a hybrid (tiny Qwen3.5) on the fake driver (no GPU):
state arrays per stateful layer with a sink slot, KV only for the attention layers, and the
state_in / state_out / state_snap step inputs of prefill passes (restore, zeros, chunk
continuation, snapshots after chosen tokens) and of decode buckets (padding rows into the sink)."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.hybrid import write_qwen3_5_hf
from test_plan_runner_fake import GREEDY, FakeDriver, fake_builder

from engine import linear_attn_kernels as lk
from engine.types import MemraError, StepItem


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    import engine.runner_cuda as rc
    from engine.model import load_model

    drv = FakeDriver()
    monkeypatch.setattr(rc, "cuda", drv.module())
    path = write_qwen3_5_hf(tmp_path / "m", bf16=True, hidden_size=128, intermediate_size=256,
                            linear_key_head_dim=32, linear_value_head_dim=32)
    runner = rc.CudaRunner(load_model(path), num_blocks=300, max_model_len=4096, builder=fake_builder(tmp_path),
                           state_slots=6)
    return runner, drv


def test_state_arrays_and_kv_for_attention_layers_only(fake):
    runner, _ = fake
    d = runner.plan.dims
    assert runner.num_state_slots == 6
    names = sorted(sp.name for sp in runner.plan.states)
    assert names == ["L0.causal_conv1d", "L0.gated_delta_rule", "L2.causal_conv1d", "L2.gated_delta_rule"]
    conv = next(sp for sp in runner.plan.states if sp.name == "L0.causal_conv1d")
    assert conv.slot_bytes == 4 * d["lin_conv_dim"] * (d["lin_conv_kernel"] - 1)
    assert runner._state_bufs["L0.gated_delta_rule"].nbytes == (7 + runner.spec_state_slots) * 4 * d["lin_v_heads"] * d["lin_k_dim"] * d["lin_v_dim"]
    assert sorted(runner._kv_index) == [1, 3]  # layers 1 and 3 hold full attention
    assert runner.kv.nbytes == 2 * 2 * runner._kv_layer_bytes


def test_prefill_state_inputs(fake):
    runner, drv = fake
    v = runner._views
    bs = runner.block_size
    a = StepItem(0, list(range(3, 3 + 2 * bs)), 0, [0, 1], False, GREEDY, state_slot=2, state_snapshots=((bs, 4),))
    b = StepItem(1, list(range(3, 8)), bs, [2, 3], True, GREEDY, state_slot=3, state_restore=5,
                 state_snapshots=((5, 1),))
    runner.step([a, b])
    assert runner._varlen  # one pass with both sequences
    assert list(v["state_in"][:2]) == [-1, 5] and list(v["state_out"][:2]) == [2, 3]
    snap = list(v["state_snap"][: 2 * bs + 5])
    assert snap[bs - 1] == 4 and snap[2 * bs + 4] == 1 and snap.count(-1) == 2 * bs + 3
    launched = {n.split("__")[0] for n, _, _ in drv.launches}
    delta = "gated_delta_chunk" if lk.delta_prefill_form() == "chunked" else "gated_delta_rule"  # the prefill form
    assert {"causal_conv1d", delta, "gated_rmsnorm", "split_heads", "sigmoid_mul"} <= launched
    conv = [g for n, g, _ in drv.launches if n.startswith(delta)]
    assert conv and all(g[1] == runner.plan.dims["lin_v_heads"] for g in conv)


def test_long_prefill_continues_from_the_live_slot(fake):
    runner, _ = fake
    chunk = runner.profile.prefill_chunk_tokens
    n = chunk + 7
    table = list(range(-(-n // runner.block_size)))
    seen = []
    orig = runner._fill_state_prefill

    def spy(s, it, lo, hi, row):
        orig(s, it, lo, hi, row)
        seen.append((lo, hi, int(runner._views["state_in"][s]), int(runner._views["state_out"][s])))

    runner._fill_state_prefill = spy
    runner.step([StepItem(0, [5] * n, 0, table, True, GREEDY, state_slot=1)])
    assert seen == [(0, chunk, -1, 1), (chunk, n, 1, 1)]


def test_decode_state_inputs_and_padding_rows(fake):
    runner, _ = fake
    v = runner._views
    items = [
        StepItem(0, [5], 4, [0], True, GREEDY, state_slot=0),
        StepItem(1, [6], 16, [1, 2], True, GREEDY, state_slot=1, state_restore=4, state_snapshots=((1, 5),)),
        StepItem(2, [7], 9, [3], True, GREEDY, state_slot=2),
    ]
    runner.step(items)
    bucket = runner._bucket_of[3]
    assert bucket == 4
    assert list(v["state_in"][:4]) == [0, 4, 2, -1]
    assert list(v["state_out"][:4]) == [0, 1, 2, 6]  # the padding row writes the sink (slot 6)
    assert list(v["state_snap"][:4]) == [-1, 5, -1, -1]


def test_bad_slots_are_internal_errors(fake):
    runner, _ = fake
    with pytest.raises(MemraError, match="needs a state slot"):
        runner.step([StepItem(0, [5, 6], 0, [0], True, GREEDY)])
    with pytest.raises(MemraError, match="out of range"):
        runner.step([StepItem(0, [5, 6], 0, [0], True, GREEDY, state_slot=6)])
    assert np.all(np.asarray(runner._views["state_out"]) >= -1)


def test_a_graphs_warm_run_leaves_every_state_alone(fake):
    """The first step of a decode bucket runs its launches once outside the capture: with the state
    inputs parked (zeros in, the sink out, no snapshot), then the step's own inputs restored."""
    runner, drv = fake
    v = runner._views
    seen = []
    orig = runner._run

    def spy(bound):
        seen.append((list(v["state_in"][:2]), list(v["state_out"][:2]), list(v["state_snap"][:2])))
        orig(bound)

    runner._run = spy
    runner.step([StepItem(0, [5], 4, [0], True, GREEDY, state_slot=3, state_snapshots=((1, 4),))])
    assert [x[:1] for x in seen[0]] == [[-1], [6], [-1]]  # the warm run: parked
    assert (v["state_in"][0], v["state_out"][0], v["state_snap"][0]) == (3, 3, 4)  # restored for the replay
    assert drv.graph_launches == 1
