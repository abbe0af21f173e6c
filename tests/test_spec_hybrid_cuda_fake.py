"""CudaRunner.verify on a hybrid (tiny Qwen3.5) on the fake driver (no GPU): draft rows laid out by
draft position, each stateful launch run once per position group (over those rows: offset value
and state-input pointers), the per-row state inputs (live slot in and out, the item's start state
at position 0, a scratch or the item's own snapshot slot after each draft position), the state of
the last accepted position copied back into the live slot, passes split when the scratch slots run
out, and the engine admitting speculation on the hybrid CUDA runner."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.engine_waves import serve_waves, tokens_of
from fixtures.hybrid import write_qwen3_5_hf
from test_plan_runner_fake import GREEDY, FakeDriver, fake_builder

from engine.bench import NullTokenizer
from engine.types import StepItem


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
    copies: list[tuple[int, int, int]] = []
    runner._state_cuda.dtod = lambda dst, src, n, stream=None: copies.append((dst, src, n))
    return runner, drv, copies


def _draft(seq, draft, start, table, slot, **kw):
    return StepItem(seq, [7, *draft], start, table, True, GREEDY, history=[1] * start + [7], draft=draft,
                    state_slot=slot, **kw)


def _slot_copies(runner, src, dst):
    """The device copies of every stateful layer's slot ``src`` into ``dst``."""
    out = []
    for sp in runner.plan.states:
        base = runner._state_bufs[sp.name].ptr
        out.append((base + dst * sp.slot_bytes, base + src * sp.slot_bytes, sp.slot_bytes))
    return out


def test_rows_by_draft_position_and_the_state_put_back(fake):
    runner, drv, copies = fake
    runner.use_graphs = False
    s0 = runner.spec_scratch()[0]
    assert s0 == runner.num_state_slots + 1 and len(runner.spec_scratch()) == runner.spec_state_slots
    # the fake D2H leaves every id at 0: the draft of zeros is accepted whole (+ the bonus 0), the
    # draft starting with 3 is rejected at once (emits 0)
    a = _draft(0, [0, 0, 0], 5, [0], 2)
    b = _draft(1, [3], 9, [1], 4, state_restore=3)
    drv.launches.clear()
    assert runner.verify([a, b]) == [[0, 0, 0, 0], [0]]
    v = runner._views
    # rows: a0 b0 a1 b1 a2 a3, padded to bucket 8
    assert v["positions"][:8].tolist() == [5, 9, 6, 10, 7, 8, 0, 0]
    assert v["tokens"][:6].tolist() == [7, 7, 0, 3, 0, 0]
    assert v["state_in"][:8].tolist() == [2, 3, 2, 4, 2, 2, -1, -1]  # b starts from its restore slot
    assert v["state_out"][:8].tolist() == [2, 4, 2, 4, 2, 2, 6, 6]  # padding rows: the sink (6)
    assert v["state_snap"][:8].tolist() == [s0, s0 + 3, s0 + 1, -1, s0 + 2, -1, -1, -1]
    # every stateful launch once per position group (2, 2, 1, then the last row with 2 padding rows)
    layers = sum(1 for sp in runner.plan.states if sp.name.endswith("gated_delta_rule"))
    delta = [g[0] for n, g, _ in drv.launches if n.startswith("gated_delta_rule")]
    assert delta == [2, 2, 1, 3] * layers
    # (a decode pass's conv runs inside the delta rule's launches: engine.lowering.linear_attention)
    assert all("_cv" in n for n, _, _ in drv.launches if n.startswith("gated_delta_rule"))
    assert not any(n.startswith(("causal_conv1d", "gated_rmsnorm")) for n, _, _ in drv.launches)
    argmax = [g for n, g, _ in drv.launches if n.startswith("argmax")]
    assert argmax == [(8, 1, 1)]  # one sampler over every row
    # a accepted everything (its live slot holds the state after its last token); b goes back to
    # the state after its first token (scratch slot s0 + 3)
    assert copies == _slot_copies(runner, s0 + 3, 4)



def test_sixteen_rows_verify_in_two_passes_below_the_wide_decode(fake):
    """4 drafts of 3 tokens (16 rows) of the bf16 hybrid on the h200 profile (wide decode from 16
    rows, GEMM rows without a batch-1 step's bits): two passes of 8 rows (narrow_rows), each laid
    out by draft position, so ``read_logits`` after ``verify`` holds only the second pass's rows.
    The fake device's logits row r holds row r's position: fixtures.verify_rows reads each pass's
    rows back under their own (seq_id, position), where one read after the call (what the GPU test
    of the verify rows did, failing at 16 rows with rel err ~1.4 and 1.0) gets other sequences'
    rows and rows no pass wrote."""
    from fixtures.verify_rows import verify_row_logits

    runner, drv, _ = fake
    runner.use_graphs = False
    assert runner.plan.wide_rows == 16 and len(runner.spec_scratch()) >= 12
    written = np.zeros((16, runner.plan.values["logits"].width), dtype=np.float32)

    def read_value(name, rows):
        n = len(runner._last_rows)
        written[:n] = np.asarray(runner._views["positions"][:n], dtype=np.float32)[:, None]
        return written[:rows].copy()

    decode = runner._decode

    def note_rows(rows, *a, **kw):
        runner._last_rows = rows
        return decode(rows, *a, **kw)

    runner.read_value, runner._decode = read_value, note_rows
    starts = [9, 30, 51, 72]
    items = [_draft(i, [0, 0, 0], s, list(range(6 * i, 6 * i + 6)), i) for i, s in enumerate(starts)]
    drv.launches.clear()
    out, rows_of, passes = verify_row_logits(runner, items)
    assert out == [[0, 0, 0, 0]] * 4 and passes == [8, 8]
    assert [g for n, g, _ in drv.launches if n.startswith("argmax")] == [(8, 1, 1), (8, 1, 1)]
    assert sorted(rows_of) == [(i, s + j) for i, s in enumerate(starts) for j in range(4)]
    assert all(float(v[0]) == pos for (_, pos), v in rows_of.items())
    once = runner.read_logits(16)  # one read after the call, rows by draft position over all 16
    assert [float(once[j * 4 + i][0]) for i in range(4) for j in range(4)] != [s + j for s in starts for j in range(4)]


def test_stateful_launches_bind_their_row_group(fake):
    runner, _, _ = fake
    runner.use_graphs = False
    seen = []
    orig = runner._bind

    def spy(launch, shape):
        seen.append((launch, dict(shape)))
        return orig(launch, shape)

    runner._bind = spy
    runner.verify([_draft(0, [0, 0], 5, [0], 1), _draft(1, [0, 5], 3, [2], 0)])
    stateful = [(la, sh) for la, sh in seen if any(a.kind == "state" for a in la.args)]
    assert [(sh["row0"], sh["n"]) for _, sh in stateful[:3]] == [(0, 2), (2, 2), (4, 4)]  # bucket 8
    la, sh = stateful[1]
    x = next(a for a in la.args if a.kind == "value")
    sin = next(a for a in la.args if a.kind == "input" and a.ref == "state_in")
    assert runner._resolve(x, sh) == runner._value_ptr[x.ref] + 2 * runner._value_rowbytes[x.ref]
    assert runner._resolve(sin, sh) == runner._in_dev.ptr + runner._in_off["state_in"] + 2 * 4
    others = [sh for la, sh in seen if not any(a.kind == "state" for a in la.args)]
    assert others and all("row0" not in sh and sh["n"] == 8 for sh in others)


def test_own_snapshot_slot_serves_as_the_scratch(fake):
    """An item asking for a prefix-cache snapshot after its first token: that row stores into the
    item's snapshot slot, and a rejection restores from it."""
    runner, _, copies = fake
    runner.use_graphs = False
    s0 = runner.spec_scratch()[0]
    out = runner.verify([_draft(0, [4, 0], 15, [0, 1], 2, state_snapshots=((1, 5),))])
    assert out == [[0]]
    assert runner._views["state_snap"][:3].tolist() == [5, s0, -1]
    assert copies == _slot_copies(runner, 5, 2)


def test_graph_per_row_grouping_replayed(fake):
    runner, drv, copies = fake
    items = [_draft(0, [0, 0], 5, [0], 1), _draft(1, [0], 3, [2], 0)]
    assert runner.verify(items) == [[0, 0, 0], [0, 0]]
    captures, launches = drv.captures, drv.graph_launches
    assert runner.verify(items) == [[0, 0, 0], [0, 0]]
    assert drv.captures == captures and drv.graph_launches == launches + 1  # replayed, not recaptured
    runner.verify([_draft(0, [0, 0, 0], 5, [0], 1), _draft(1, [0], 3, [2], 0)])  # another grouping: its own graph
    assert drv.captures == captures + 1
    assert copies == []


def test_least_recently_used_groupings_are_dropped(fake, monkeypatch):
    import engine.runner_steps as rs

    runner, drv, _ = fake
    monkeypatch.setattr(rs, "GROUPINGS_KEPT", 2)
    tails = set(runner._graphs)  # the prompt tails' graphs (engine.runner_tail): never dropped
    grouped = lambda: sorted(k[4] for k in runner._graphs if len(k) == 5 and k not in tails)  # noqa: E731
    two = lambda k: [_draft(0, [0] * k, 5, [0], 1), _draft(1, [0], 3, [2], 0)]  # noqa: E731
    for k in (1, 2, 1, 3):
        runner.verify(two(k))
    assert grouped() == [(2, 2), (2, 2, 1, 3)]  # k = 2 (groups 2, 2, 4) went; k = 1 was used again
    captures = drv.captures
    runner.verify(two(1))
    assert drv.captures == captures  # still there
    for k in (1, 2, 3):  # one draft of k: groups (1, 1, ...), some of them a tail's graph, which stays
        runner.verify([_draft(0, [0] * k, 5, [0], 1)])
    assert tails <= set(runner._graphs)


def test_passes_split_when_scratch_slots_run_out(fake, monkeypatch):
    runner, drv, copies = fake
    runner.use_graphs = False
    monkeypatch.setattr(runner, "spec_state_slots", 3)
    items = [_draft(0, [0, 0], 5, [0], 1), _draft(1, [9, 0], 3, [2], 0), _draft(2, [0], 7, [3], 3)]
    drv.launches.clear()
    assert runner.verify(items) == [[0, 0, 0], [0], [0, 0]]
    assert [g for n, g, _ in drv.launches if n.startswith("argmax")] == [(4, 1, 1), (8, 1, 1)]  # 2 passes: 3 rows, 5 rows
    s0 = runner.spec_scratch()[0]
    assert copies == _slot_copies(runner, s0, 0)  # item 1, second pass: its first scratch slot
    with pytest.raises(Exception, match="needs more than the 3 state scratch slots"):
        runner.verify([_draft(0, [0, 0, 0, 0], 5, [0], 1)])


def test_engine_speculates_on_the_hybrid_cuda_runner(fake):
    """The engine admits an n-gram speculator on the hybrid CUDA runner (verify restores the state)
    and runs it: the fake device samples 0 every time, so prompt lookup drafts zeros and they are
    accepted; block and state-slot invariants hold every step."""
    from engine.spec.config import SpecConfig
    from engine.spec.proposer import NgramProposer
    from engine.spec.speculator import Speculator

    runner, _, _ = fake
    runner.ctx.make_current = lambda: None  # (the engine thread makes the context current)
    assert runner.verify_restores_state

    cfg = SpecConfig("ngram", k=3, ngram_min=1)
    outs, stats = serve_waves(runner, [[[5, 6, 7, 8][: i + 2] for i in range(2)]], max_tokens=12,
                              speculator=Speculator(NgramProposer(cfg.ngram_min, cfg.ngram_max), cfg),
                              tokenizer=NullTokenizer())  # fmt: skip
    outs = tokens_of(outs)
    assert outs == [[0] * 12, [0] * 12]
    assert stats.spec_accepted_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert np.all(np.asarray(runner._views["state_out"]) >= 0)


# ----- MTP on the cuda backend: the hidden-state tap and the host head --------------------------------


@pytest.fixture()
def fake_mtp(tmp_path, monkeypatch):
    import engine.runner_cuda as rc
    from engine.model import load_model

    drv = FakeDriver()
    monkeypatch.setattr(rc, "cuda", drv.module())
    rc.cuda.Context.make_current = lambda self: None  # (the engine thread makes the context current)
    path = write_qwen3_5_hf(tmp_path / "m", bf16=True, hidden_size=128, intermediate_size=256,
                            linear_key_head_dim=32, linear_value_head_dim=32, mtp_num_hidden_layers=1)
    model = load_model(path)
    runner = rc.CudaRunner(model, num_blocks=300, max_model_len=4096, builder=fake_builder(tmp_path), state_slots=6)
    reads = []

    def read_value(name, rows):  # the fake device's rows: a fixed pattern per row
        reads.append((name, rows))
        width = runner.plan.values[name].width
        return np.sin(np.arange(rows * width, dtype=np.float32).reshape(rows, width) * 0.37)

    runner.read_value = read_value
    return model, runner, reads


def test_tap_records_the_final_normed_rows_of_every_pass(fake_mtp):
    from engine import ops_ref
    from engine.spec.hidden_tap import HiddenTap

    model, runner, reads = fake_mtp
    runner.hidden_tap = tap = HiddenTap("h")
    w = np.asarray(model.dequantize("final_norm"), np.float32)
    eps = float(model.dims["rms_eps"])
    width = int(model.dims["hidden"])
    want = ops_ref.rmsnorm(np.sin(np.arange(9 * width, dtype=np.float32).reshape(9, width) * 0.37), w, eps)
    a = StepItem(0, [3, 4, 5, 6, 7], 0, [0], False, GREEDY, state_slot=0)
    b = StepItem(1, [8, 9, 10, 11], 0, [1], True, GREEDY, state_slot=1)
    runner.step([a, b])  # one varlen prefill pass of 9 rows
    assert reads == [("x", 9)]  # the final norm's input, every row of the pass
    assert tap.span(0) == (0, 5) and tap.span(1) == (0, 4)
    np.testing.assert_array_equal(tap.rows(0, 0, 5), want[:5])
    np.testing.assert_array_equal(tap.rows(1, 0, 4), want[5:])
    runner.step([StepItem(1, [12], 4, [1], True, GREEDY, state_slot=1)])  # a decode row
    assert reads[-1] == ("x", 1) and tap.span(1) == (0, 5)
    np.testing.assert_array_equal(tap.rows(1, 4, 5), want[:1])
    # a hybrid verify pass: rows by draft position, recorded at each row's own position
    runner.verify([_draft(1, [0, 0], 5, [1], 1)])
    assert reads[-1] == ("x", 3) and tap.span(1) == (0, 8)
    np.testing.assert_array_equal(tap.rows(1, 5, 8), want[:3])


def test_host_head_equals_the_reference_head(fake_mtp):
    """The MTP head over the host weights (the cuda backend's) computes exactly what it computes
    over a ReferenceRunner: the same tensors, the same numpy ops."""
    from engine.reference import ReferenceRunner
    from engine.spec.mtp_head import MtpHeadReference
    from engine.spec.mtp_host import HeadWeights

    model, runner, _ = fake_mtp
    ref = MtpHeadReference(ReferenceRunner(model, num_blocks=8, max_model_len=128, state_slots=2))
    host = MtpHeadReference(HeadWeights(model, runner.block_size, 128, num_blocks=8))
    hidden = np.random.default_rng(0).standard_normal((4, int(model.dims["hidden"]))).astype(np.float32)
    a, b = ref.forward([5, 6, 7, 8], hidden, 0, [0]), host.forward([5, 6, 7, 8], hidden, 0, [0])
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[2], b[2])
    c, d = ref.forward([a[0]], [a[2]], 4, [0]), host.forward([b[0]], [b[2]], 4, [0])
    assert c[0] == d[0]
    np.testing.assert_array_equal(c[1], d[1])


def test_the_cuda_head_plan_and_its_host_rows(fake_mtp):
    """The CUDA head's plan starts at the fc reading the input value eh (the host part: embedding,
    its norm, the hidden state's norm, concat) and holds one attention layer's KV and no state; a
    forward writes [rmsnorm(embedding) | rmsnorm(hidden)] rows into eh before each pass (a long
    chunk in passes of prefill_chunk_tokens), and returns its final norm's input, normalised."""
    from engine import ops_ref
    from engine.spec.mtp_cuda import MtpHeadCuda

    model, runner, reads = fake_mtp
    head = MtpHeadCuda(runner, num_blocks=16)
    r = head.runner
    hidden = int(model.dims["hidden"])
    assert r.plan.values["eh"].width == 2 * hidden
    first = next(st for st in r.plan.steps)
    assert (first.op.op, first.op.inputs, first.op.weights) == ("linear", ("eh",), ("mtp_fc",))
    assert not r.plan.states and sorted(r._kv_index) == [0] and r.num_blocks == 16
    assert {st.op.op for st in r.plan.steps} >= {"attention", "rope", "sigmoid_mul", "silu_mul"}
    assert not any(st.op.op == "embed" for st in r.plan.steps)
    writes = []
    r.write_value = lambda name, rows: writes.append((name, np.array(rows)))
    r.read_value = lambda name, rows: reads.append(("head", name, rows)) or np.ones((rows, hidden), np.float32)
    rng = np.random.default_rng(1)
    h = rng.standard_normal((3, hidden)).astype(np.float32)
    tok, logits, out = head.forward([5, 6, 7], h, 0, [0])
    assert tok == 0 and logits is None
    (name, rows), = writes
    emb = np.asarray(model.dequantize("embed"), np.float32)[[5, 6, 7]]
    want = np.concatenate([ops_ref.rmsnorm(emb, np.asarray(model.dequantize("mtp_norm_embed"), np.float32), 1e-6),
                           ops_ref.rmsnorm(h, np.asarray(model.dequantize("mtp_norm_hidden"), np.float32), 1e-6)], 1)
    assert name == "eh" and np.abs(rows - want).max() < 2e-2 * np.abs(want).max()  # (the table as bf16)
    assert reads[-1] == ("head", "x", 1)
    np.testing.assert_allclose(out, ops_ref.rmsnorm(np.ones((1, hidden), np.float32),
                                                    np.asarray(model.dequantize("mtp_final_norm"), np.float32), 1e-6)[0])
    r.profile = type(r.profile)(**{**r.profile.__dict__, "prefill_chunk_tokens": 2})
    writes.clear()
    head.forward([5, 6, 7, 8, 9], rng.standard_normal((5, hidden)).astype(np.float32), 3, [0])
    assert [w.shape[0] for _, w in writes] == [2, 2, 1]


def test_mtp_speculates_on_the_cuda_runner(fake_mtp):
    """`--speculative mtp` on the cuda backend: the CUDA head (a second runner) over a tap on the
    target; the engine runs with it (the fake device samples 0)."""
    from engine.spec.build import build_speculator
    from engine.spec.config import SpecConfig
    from engine.spec.mtp_cuda import MtpHeadCuda
    from engine.spec.proposer import MtpProposer

    model, runner, _ = fake_mtp
    spec = build_speculator(SpecConfig("mtp", k=2), model, runner)
    assert isinstance(spec.proposer, MtpProposer) and runner.hidden_tap is spec.proposer.tap
    assert isinstance(spec.proposer.head, MtpHeadCuda)
    [(out, _)], stats = serve_waves(runner, [[[5, 6, 7, 8, 9]]], max_tokens=10, speculator=spec, tokenizer=NullTokenizer())
    assert out == [0] * 10
    assert stats.spec_draft_tokens > 0
    assert len(runner.hidden_tap) == 0  # the finished sequence's rows dropped

