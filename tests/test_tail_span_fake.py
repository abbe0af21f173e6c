"""A prompt tail's pass past short_context on CudaRunner's fake driver (no GPU; engine.runner_tail,
engine.ir.TAIL): a dense plan with the prefill key split runs the tail rows' attention as the key
split's partial launch (attention_prefill, ``partial`` + ``row_tables``: block tables one per row,
as a decode pass fills them) + attention_combine's fold, the rest of the pass as the decode
launches; ``seq_starts`` hold the pass's sequences (each tail's rows, the padding rows one each,
empty sequences to the grid's end): one row a tail under the dense rule (a prompt's last token),
several for a whole trailing partial block (a plan with a sliding-window pool; ``run_tails``
called with the tails' lengths here). Short-context tails, ordinary decode rows past
short_context and speculative verify passes keep their launches; a hybrid plan has no TAIL
launches. The numbers (warm == cold, batched == solo, rows vs the reference) are checked on the
emulator (tests/test_tail_span_emu.py) and the GPU (tests/gpu/test_warm_tail_rows_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
from test_plan_runner_fake import GREEDY
from test_warm_tail_fake import _build, _spy_decode

from engine.ir import TAIL, TAIL_SEQS
from engine.runner_tail import graph_key, has_tail_attention, run_tails
from engine.types import StepItem


def _names(drv) -> list[str]:
    return [n for n, _, _ in drv.launches]


def _kinds(drv) -> set[str]:
    """The attention kernels a pass launched: split decode, its direct form, the span partials."""
    out = set()
    for n, _, _ in drv.launches:
        if n.startswith("attention_prefill"):
            assert "partial1" in n and "row_tables1" in n, n
            out.add("span")
        elif n.startswith("attention_combine"):
            out.add("fold" if "fold1" in n else "combine")
        elif n.startswith("attention__"):
            out.add("direct" if "direct1" in n else "split")
    return out


def _item(seq, toks, depth, table, **kw):
    return StepItem(seq, toks, depth, table, True, GREEDY, history=[1] * (depth + len(toks)),
                    prompt_len=depth + len(toks), **kw)  # fmt: skip


def test_only_a_dense_plan_with_the_key_split_has_tail_launches(tmp_path, monkeypatch):
    runner, _, _ = _build(tmp_path / "d", monkeypatch, False)
    plan = runner.plan
    assert has_tail_attention(plan) and runner._tail_attention
    attn = [st for st in plan.steps if st.op.op == "attention"]
    assert attn and all(TAIL in st.launches for st in attn)
    assert not any(TAIL in st.launches for st in plan.steps if st.op.op != "attention")
    for st in attn:
        part, comb = st.launches[TAIL]
        assert part.spec.template == "attention_prefill" and comb.spec.template == "attention_combine"
        p = part.spec.params
        assert p["partial"] and p["row_tables"] and p["span"] == plan_span(runner) and comb.spec.params["fold"]
        assert part.max_rows == comb.max_rows == runner.profile.tune("attention_prefill")["split_rows"]
        # the same kernel as the prefill pass's partial launch, less row_tables
        pre = next(la for la in st.launches["prefill"] if la.spec.params.get("partial"))
        assert {**pre.spec.params, "row_tables": True} == p and pre.grid[1:] == part.grid[1:]
    hybrid, _, _ = _build(tmp_path / "h", monkeypatch, True)
    assert not has_tail_attention(hybrid.plan) and not hybrid._tail_attention


def plan_span(runner) -> int:
    return int(runner.profile.tune("attention_prefill")["span"])


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_a_tail_past_short_context_runs_the_span_attention(tmp_path, monkeypatch, graphs):
    runner, drv, _ = _build(tmp_path, monkeypatch, False)
    bs, short = runner.block_size, runner.plan.short_context
    runner.use_graphs = graphs
    passes = _spy_decode(runner)
    deep = 200 * bs  # past short_context (256)
    assert deep > short
    drv.reset()
    item = _item(0, [7, 8, 9, 10, 11], deep, list(range(deep // bs + 1)))
    if graphs:  # the dense rule: the item's last token, a one-row pass
        assert runner.step([item]) == [0]
        assert len(passes) == 1 and len(passes[0]) == 1
        assert runner._views["seq_starts"][:2].tolist() == [0, 1]
        assert drv.graph_launches == 1 and drv.captures == 0  # its graph, captured ahead
        assert graph_key(runner, 1, "greedy", False) in runner._graphs
        return
    assert run_tails(runner, [(item, 5)]) == [0]  # (five rows of one sequence: a whole-block tail)
    assert len(passes) == 1 and len(passes[0]) == 5
    ss = runner._views["seq_starts"][:6].tolist()
    assert ss == [0, 5, 5, 5, 5, 5]  # one sequence of five rows, the grid's others empty
    assert _kinds(drv) == {"span", "fold"}
    splits = -(-runner.max_model_len // plan_span(runner))
    layers = runner.plan.dims["layers"]
    grids = [g for n, g, _ in drv.launches if n.startswith("attention_prefill")]
    seqs = min(5, TAIL_SEQS)  # (the grid's sequences)
    assert len(grids) == layers and all(g == (1, runner.plan.dims["kv_heads"], seqs * splits) for g in grids)
    # the same tail at a short depth: the direct decode kernel, no span launch
    drv.reset()
    run_tails(runner, [(_item(0, [7, 8, 9, 10, 11], 4 * bs, list(range(5))), 5)])
    assert _kinds(drv) == {"direct"}


def test_packed_tails_fill_one_sequence_each(tmp_path, monkeypatch):
    """Three tails past short_context in one step: one pass, seq_starts at each tail's first row."""
    runner, drv, _ = _build(tmp_path, monkeypatch, False)
    bs = runner.block_size
    runner.use_graphs = False
    passes = _spy_decode(runner)
    a = _item(1, [5, 6, 7], 30 * bs, list(range(0, 31)))
    b = _item(2, [8], 40 * bs, list(range(40, 81)))
    c = _item(3, [1, 2, 3, 4], 50 * bs, list(range(90, 141)))
    drv.reset()
    import engine.runner_tail as rt

    monkeypatch.setattr(rt, "whole_block_tails", lambda r: True)  # (a window pool's rule: packs by _limit)
    assert run_tails(runner, [(a, 3), (b, 1), (c, 4)]) == [0, 0, 0]
    assert [[r.seq_id for r in p] for p in passes] == [[1, 1, 1, 2, 3, 3, 3, 3]]
    assert runner._views["seq_starts"][:9].tolist() == [0, 3, 4, 8, 8, 8, 8, 8, 8]
    assert _kinds(drv) == {"span", "fold"}
    splits = -(-runner.max_model_len // plan_span(runner))
    assert {g for n, g, _ in drv.launches if n.startswith("attention_prefill")} == {
        (1, runner.plan.dims["kv_heads"], TAIL_SEQS * splits)
    }
    # each row's block table is its item's (a sequence reads its first row's: row_tables)
    ld = runner._table_ld
    tables = runner._tables[: 8 * ld].reshape(8, ld)
    assert tables[0, :31].tolist() == list(range(31)) and tables[3, :41].tolist() == list(range(40, 81))
    assert tables[4, :51].tolist() == list(range(90, 141))


def test_decode_rows_and_verify_passes_past_short_context_keep_the_decode_attention(tmp_path, monkeypatch):
    runner, drv, _ = _build(tmp_path, monkeypatch, False)
    bs = runner.block_size
    runner.use_graphs = False
    deep = 200 * bs
    table = list(range(deep // bs + 2))
    drv.reset()
    rows = [StepItem(s, [7], deep + s, table, True, GREEDY, prompt_len=deep) for s in range(3)]
    runner.step(rows)  # generated tokens: plain decode rows
    assert _kinds(drv) == {"split", "combine"}
    drv.reset()
    runner._decode(rows, short_ok=False, exact=True, verify=True)  # a verify pass's rows
    assert _kinds(drv) == {"split", "combine"}


def test_more_tails_than_a_tail_pass_holds_run_in_more_passes(tmp_path, monkeypatch):
    """Six one-token tails past short_context: passes of at most TAIL_SEQS tails (the grid's
    sequences); below short_context the same six share one pass."""
    runner, drv, _ = _build(tmp_path, monkeypatch, False)
    bs = runner.block_size
    runner.use_graphs = False
    passes = _spy_decode(runner)
    deep = [_item(s, [5], (30 + s) * bs, list(range(40 * s, 40 * s + 32 + s))) for s in range(6)]
    runner.step(deep)
    assert [len(p) for p in passes] == [TAIL_SEQS, 6 - TAIL_SEQS]
    passes.clear()
    runner.step([_item(s, [5], 2 * bs, list(range(4 * s, 4 * s + 3))) for s in range(6)])
    assert [len(p) for p in passes] == [6]
    rows = [StepItem(s, [5], 400, list(range(30)), False, GREEDY) for s in range(TAIL_SEQS + 1)]
    runner._fill_decode(rows, None, (), len(rows))
    with pytest.raises(Exception, match="sequences"):
        runner._fill_seq_starts(rows, len(rows))


def test_padding_rows_of_a_captured_tail_are_one_sequence(tmp_path, monkeypatch):
    """runner_tail.tail_captures' warm run before each capture: every row a padding row at position 0 of the
    sink block, all one sequence (its rows read the sink block's keys only: the KV cache starts
    zeroed, the padding rows write its slot 0)."""
    runner, _, _ = _build(tmp_path, monkeypatch, False)
    runner._fill_decode([], None, (), 4)
    runner._fill_seq_starts([], 4)
    assert runner._views["seq_starts"][:5].tolist() == [0, 4, 4, 4, 4]
    ld = runner._table_ld
    assert (runner._tables[: 4 * ld] == runner._sink_block).all()
    items = [_item(9, [1, 2], 20 * 16, list(range(22)))]
    rows = [StepItem(9, [t], 320 + j, items[0].block_table, False, GREEDY, prompt_len=322) for j, t in enumerate((1, 2))]
    runner._fill_decode(rows, None, (), 4)
    runner._fill_seq_starts(rows, 4)
    assert runner._views["seq_starts"][:5].tolist() == [0, 2, 4, 4, 4]
    assert np.all(runner._views["positions"][2:4] == 0)
