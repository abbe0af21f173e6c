"""CudaRunner.verify's host logic on the fake driver of test_plan_runner_fake (no GPU): every verify
position becomes a decode row of the same sequence (its own position, the sequence's block table),
all draft rows of a step replay one decode bucket graph, and the argmax ids become accepted tokens."""

from __future__ import annotations

import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import test_plan_runner_fake as base  # noqa: E402

from engine.ir import VSHORT  # noqa: E402
from engine.spec.cuda_verify import has_verify_short, narrow_rows, short_is_safe  # noqa: E402
from engine.types import StepItem  # noqa: E402

fake = base.fake
GREEDY = base.GREEDY


def _draft_item(seq, draft, start, table):
    return StepItem(seq, [7, *draft], start, table, True, GREEDY, history=[1] * start + [7], draft=draft)


def test_verify_runs_draft_positions_as_decode_rows_of_one_bucket(fake):
    runner, drv = fake
    # the fake D2H leaves every id at 0: a draft of zeros is accepted whole (+ the bonus 0), a
    # draft starting with 3 is rejected at once (emits 0)
    items = [
        _draft_item(0, [0, 0, 0], 5, [0]),
        StepItem(1, [9], 4, [1], True, GREEDY),  # a plain decode row in the same step
        _draft_item(2, [3, 0], 9, [2]),
    ]
    graphs = []  # (rows, kind, short, ...) of each decode graph replayed
    graph = runner._graph
    runner._graph = lambda *a, **k: graphs.append((a, k)) or graph(*a, **k)
    out = runner.verify(items)
    assert out == [[0, 0, 0, 0], [0], [0]]
    v = runner._views
    assert v["positions"][:7].tolist() == [5, 6, 7, 8, 9, 10, 11]  # 7 rows: a graph of 7, no padding
    assert v["tokens"][:7].tolist() == [7, 0, 0, 0, 7, 3, 0]
    assert v["slots"][:7].tolist() == [5, 6, 7, 8, 2 * 16 + 9, 2 * 16 + 10, 2 * 16 + 11]
    tables = runner._tables[: 8 * runner._table_ld].reshape(8, -1)
    assert tables[:7, 0].tolist() == [0, 0, 0, 0, 2, 2, 2]
    # the 7-row verify graph (captured when the runner was built: engine.runner_tail's prompt tails
    # replay the same graphs), after the plain row's bucket-1 graph
    assert [(a[0], k.get("verify")) for a, k in graphs] == [(1, False), (7, True)]
    captures, launches = drv.captures, drv.graph_launches
    assert runner.verify([items[0], items[2]]) == [[0, 0, 0, 0], [0]]
    assert drv.captures == captures and drv.graph_launches == launches + 1  # replayed, not recaptured


def test_verify_pass_in_the_bucket_graph_when_exact_rows_are_off(fake):
    """``verify_exact_rows = False``: a 5-row verify pass (k = 4) runs the bucket-8 graph, its 3
    padding rows at the sink block (the A/B of tools/gpu_spec_round.py)."""
    runner, drv = fake
    runner.verify_exact_rows = False
    graphs = []
    graph = runner._graph
    runner._graph = lambda *a, **k: graphs.append(a[0]) or graph(*a, **k)
    assert runner.verify([_draft_item(0, [0, 0, 0, 0], 5, [0])]) == [[0, 0, 0, 0, 0]]
    assert runner._views["positions"][:8].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert runner._views["slots"][5:8].tolist() == [runner._sink_block * 16] * 3
    assert graphs == [8]


def test_eager_verify_without_graphs(fake):
    runner, drv = fake
    runner.use_graphs = False
    assert runner.verify([_draft_item(0, [0, 5], 3, [0])]) == [[0, 0]]
    assert drv.captures == 0 and drv.graph_launches == 0


def test_fused_rope_short_attention_is_not_used_for_verify_rows():
    def plan(short_rope):
        rope = types.SimpleNamespace(op=types.SimpleNamespace(op="rope"), launches={"decode": (1,), **short_rope})
        return types.SimpleNamespace(steps=[rope])

    assert short_is_safe(plan({}))
    assert short_is_safe(plan({"short": (1,)}))
    assert not short_is_safe(plan({"short": ()}))  # rope folded into the short attention kernel


def test_short_verify_rows_run_the_direct_attention_writing_earlier_rows_keys(fake):
    """The h200 profile folds the short rope into the direct attention (its plain form unsafe for one
    sequence's rows): a verify pass below split_kv_tokens takes the plan's VSHORT launches (the
    rope-fused direct attention with vfresh, each block writing its sequence's earlier rows' keys
    itself: no rope launch, no combine); past it, the long launches (the rope kernel, the split
    attention, the combine)."""
    runner, drv = fake
    plan = runner.plan
    assert not short_is_safe(plan) and has_verify_short(plan)
    for st in plan.steps:
        if st.op.op == "attention":
            (short,), (vshort,) = st.launches["short"], st.launches[VSHORT]
            assert short.spec.params["rope"] and not short.spec.params["vfresh"]
            assert vshort.spec.params["rope"] and vshort.spec.params["direct"] and vshort.spec.params["vfresh"]
            assert vshort.args == short.args  # (the same inputs: the raw k / v rows, slots, norms)
        if st.op.op == "rope":
            assert st.launches[VSHORT] == ()
    assert runner.verify([_draft_item(0, [0, 0, 0, 0], 5, [0])]) == [[0, 0, 0, 0, 0]]
    names = [b.fn.name for b in runner._graphs[(5, "greedy", True, True, "verify")][1]]
    assert not any(n.startswith(("rope", "attention_combine")) for n in names)
    assert sum("_vfresh" in n for n in names) == plan.dims["layers"]
    assert runner.verify([_draft_item(0, [0, 0, 0, 0], 300, list(range(20)))]) == [[0, 0, 0, 0, 0]]
    names = [b.fn.name for b in runner._graphs[(5, "greedy", False, True, "verify")][1]]
    assert sum(n.startswith("attention_combine") for n in names) == plan.dims["layers"]
    assert sum(n.startswith("rope") for n in names) == plan.dims["layers"]


def test_the_verify_attention_holds_every_draft_row():
    """A draft of MAX_SPEC_TOKENS tokens is that many rows before its last in one verify pass: the
    VSHORT attention's blocks write (and read) that many earlier rows' keys (kernel_catalog
    .VERIFY_FRESH_MAX: the param vfresh)."""
    from engine import kernel_catalog as kc
    from engine.spec.config import MAX_SPEC_TOKENS

    assert kc.VERIFY_FRESH_MAX == MAX_SPEC_TOKENS


def test_verify_passes_stay_below_the_wide_decode():
    """A plan with a wide decode (bf16 GEMMs from 16 rows) verifies at most 8 rows a pass: the
    GEMM rows would not get a batch-1 step's bits; without one, up to the largest bucket."""
    sizes = (1, 2, 4, 8, 16, 24, 32)
    assert narrow_rows(types.SimpleNamespace(wide_rows=16, graph_batch_sizes=sizes), 32) == 8
    assert narrow_rows(types.SimpleNamespace(wide_rows=0, graph_batch_sizes=sizes), 32) == 32


def test_masked_and_logprobs_rows_beside_draft_rows(fake):
    """A constrained row and a logprobs row in a verify step go through the plain decode path, both
    on the device (the token_mask and logprobs kernels; the fake device leaves ids and logprobs at
    0), nothing read back for the host sampler; the draft row is accepted from the argmax ids."""
    import numpy as np

    from engine.types import SamplingParams

    runner, drv = fake
    vocab = runner.plan.values["logits"].width
    read = []
    runner.read_logits = lambda rows: read.append(rows) or np.zeros((rows, vocab), np.float32)
    bits = np.zeros(((vocab + 31) // 32) * 32, dtype=np.uint8)
    bits[5] = 1
    mask = np.packbits(bits, bitorder="little").view(np.int32)
    items = [
        _draft_item(0, [0, 0], 5, [0]),
        StepItem(1, [9], 4, [1], True, GREEDY, history=[1] * 4 + [9], allowed=mask),
        StepItem(2, [9], 4, [2], True, SamplingParams(temperature=0.0, logprobs=2), history=[1] * 4 + [9]),
    ]
    assert runner.verify(items) == [[0, 0, 0], [0], [0]]
    names = {n.split("__")[0] for n, _, _ in drv.launches}
    assert {"token_mask", "logprobs"} <= names
    assert items[2].logprobs_out == (0.0, [(0, 0.0), (0, 0.0)])
    assert items[0].logprobs_out is None and items[1].logprobs_out is None
    assert read == []  # no logits read back


def test_build_speculator_captures_the_verify_graphs_ahead(fake):
    """build_speculator on the CUDA runner captures every verify graph a round may replay (2 .. 8
    rows, short and long, from padding rows at the sink block), so no round captures one. (Here
    the runner's build already captured the short ones: a prompt's trailing partial block below
    short_context replays the same graphs, engine.runner_tail; past it a tail's pass runs the TAIL
    attention, graphs of its own, so build_speculator captures the long ones.)"""
    from engine.spec.build import build_speculator
    from engine.spec.config import SpecConfig

    runner, drv = fake
    want = {(n, "greedy", s) for n in range(2, 9) for s in (True, False)}
    built = {k[:3] for k in runner._graphs if k[-1] == "verify"}
    assert built & want == {w for w in want if w[2]}  # (the "tail" ones end otherwise)
    for key in [k for k in runner._graphs if k[-1] == "verify" and k[:3] in want][::2]:
        runner._graphs.pop(key)  # half of them left to capture
    missing = want - {k[:3] for k in runner._graphs if k[-1] == "verify"}
    assert len(missing) == 4 + 7
    build_speculator(SpecConfig("ngram", k=4), None, runner)
    assert drv.captures == len(missing)
    assert want <= {key[:3] for key in runner._graphs if key[-1] == "verify"}
    assert runner.verify([_draft_item(0, [0, 0, 0, 0], 5, [0]), _draft_item(2, [0, 0], 9, [2])]) == [[0] * 5, [0] * 3]
    assert runner.verify([_draft_item(0, [0, 0, 0, 0], 300, list(range(20)))]) == [[0] * 5]
    assert drv.captures == len(missing)


def test_verify_rows_tables_equal_a_fresh_fill_after_longer_tables(fake):
    """The rows of one draft share its block table (one copy for the run of them): after a pass
    whose rows had longer tables, every row's table is its item's, the rest at the sink."""
    runner, _ = fake
    ld, sink = runner._table_ld, runner._sink_block
    runner.verify([_draft_item(0, [0, 0, 0], 40, [1, 2, 3]), _draft_item(1, [0, 0], 33, [4, 5, 6])])
    items = [_draft_item(2, [0, 0], 9, [7]), _draft_item(3, [0, 0, 0], 20, [8, 9])]
    runner.verify(items)
    want = [[7]] * 3 + [[8, 9]] * 4
    tables = runner._tables[: 7 * ld].reshape(7, ld)
    for r, bt in enumerate(want):
        assert tables[r, : len(bt)].tolist() == bt and (tables[r, len(bt) :] == sink).all()
