"""A prompt tail's TAIL attention (engine.ir.TAIL: a decode pass's rows through the prefill key
split's partial launch with ``row_tables`` + attention_combine's fold; engine.runner_tail) run by
the CPU emulator (tests/fixtures/cuda_emu.py) with the launches of a real plan (a tiny Llama on the
h200 profile with a span of 32 keys) on a random paged cache laid out as a decode pass fills it:
a block table per row, ``seq_starts`` as StepLogic._fill_seq_starts writes them (the grid's
sequences as a TAIL pass binds them: min(rows, TAIL_SEQS)), padding rows (one more sequence) at
position 0 of a NaN sink block (their rows are not read). Each tail's rows equal, bit for bit, the same rows of the cold
prefill pass over the whole prompt (the single folding launch) and of the tail alone in its pass
(batched == solo), and agree with engine.ops_ref; with and without a sliding window. Outputs and
partials start poisoned (NaN), so a row a launch should write and does not shows."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from fixtures import cuda_emu
from test_attention_span_emu import BS, NAN_BF16, Q_STRIDE, _Case, _check_ref, _single, _spec
from test_attention_span_warm import _plan

from engine import kernel_catalog as kc
from engine.ir import TAIL, TAIL_SEQS
from engine.render import render
from engine.runner_steps import StepLogic
from engine.types import SamplingParams, StepItem

SPAN = 32
GREEDY = SamplingParams(temperature=0.0)


def _tail_launches(window: int):
    launches, _ = _plan(SPAN, window, TAIL)
    assert launches[0].spec.params["q_stride"] == Q_STRIDE and launches[0].spec.params["block_size"] == BS
    return launches


_LIBS: dict = {}


def _lib(spec, tmp):
    if spec.entry not in _LIBS:
        _LIBS[spec.entry] = cuda_emu.compile_any(render(spec), spec.entry, tmp)
    return _LIBS[spec.entry]


def _seq_starts(items: list[StepItem], bucket: int) -> np.ndarray:
    """StepLogic._fill_seq_starts on a stand-in runner's views."""
    fake = SimpleNamespace(_views={"seq_starts": np.full(bucket + 1, -1, np.int32)})
    StepLogic._fill_seq_starts(fake, items, bucket)
    return fake._views["seq_starts"]


def _tail_pass(case: _Case, tails, launches, tmp, max_ctx: int, pad: int = 0) -> np.ndarray:
    """The rows of ``tails`` [(sequence, first position, rows)] as one decode pass of
    ``len(rows) + pad`` rows (padding rows: position 0, a table of the NaN block)."""
    sink = case.k.shape[0] - 1
    ld = case.tables.shape[1]
    items, q, tables = [], [], []
    for s, p0, n in tails:
        for j in range(n):
            items.append(StepItem(s, [0], p0 + j, [], False, GREEDY))
            q.append(case.q[s][p0 + j])
            tables.append(case.tables[s])
    rows = len(items) + pad
    q += [case.q[0][0]] * pad
    tables += [np.full(ld, sink, np.int32)] * pad
    pos = np.array([it.start_pos for it in items] + [0] * pad, np.int32)
    bufs = {"q": np.ascontiguousarray(np.stack(q)), "positions": pos, "seq_starts": _seq_starts(items, rows),
            "block_tables": np.ascontiguousarray(np.stack(tables))}  # fmt: skip
    shape = {"n": rows, "nseq": min(rows, TAIL_SEQS), "max_q": 1, "max_blocks": ld, "block_size": BS, "max_ctx": max_ctx}
    out = np.full((rows, launches[1].spec.params["out_stride"]), NAN_BF16, np.uint16)
    scratch = {}
    for la in launches:
        args = []
        for a in la.args:
            if a.kind == "value":
                args.append(bufs["q"] if a.ref == "q" else out)
            elif a.kind == "kv":
                args.append(case.k if a.ref == "k" else case.v)
            elif a.kind == "input":
                args.append(bufs["block_tables" if a.ref == "window_tables" else a.ref])
            elif a.kind == "scratch":
                splits = -(-max_ctx // SPAN)
                size = (rows, 4, splits, 32 if a.ref == "pattn_o" else 2)
                args.append(scratch.setdefault(a.ref, np.full(size, np.nan, np.float32)))
            elif a.kind == "shape":
                args.append(-(-max_ctx // SPAN) if a.ref.startswith("splits:") else shape[a.ref])
            else:
                raise AssertionError(a)
        lib, types = _lib(la.spec, tmp)
        grid = (la.grid_for(shape) + (1, 1))[:3]
        cuda_emu.launch_any(lib, types, grid, la.block[0], la.smem, args)
    return out


@pytest.mark.parametrize("window", [0, 40], ids=["full", "window40"])
def test_tail_rows_equal_the_cold_pass_and_their_solo_pass(tmp_path, window):
    rng = np.random.default_rng(11 + window)
    case = _Case(rng, [150, 75, 120])
    launches = _tail_launches(window)
    assert launches[0].spec.params["row_tables"] and launches[1].spec.params["fold"]
    cold_segs = [(0, 0, 150), (1, 0, 75), (2, 0, 120)]
    cold = _single(case, cold_segs, _spec(SPAN, False, window), tmp_path)
    at = {0: 0, 1: 150, 2: 225}
    # tails that start inside a span, on a span boundary, cross spans; one row; padding rows after
    packs = ([(0, 139, 11), (1, 64, 1), (2, 100, 15)], [(0, 128, 15)], [(2, 90, 7), (1, 70, 5)])
    for pack in packs:
        for pad in (0, 3):
            got = _tail_pass(case, pack, launches, tmp_path, max_ctx=160, pad=pad)
            _check_ref(case, pack, got, window)
            row = 0
            for s, p0, n in pack:
                rows = got[row : row + n]
                assert np.array_equal(rows, cold[at[s] + p0 : at[s] + p0 + n]), (window, pack, s)
                solo = _tail_pass(case, [(s, p0, n)], launches, tmp_path, max_ctx=160)
                assert np.array_equal(rows, solo), (window, pack, s)
                row += n


def test_a_partial_hit_s_one_row_pass_equals_that_row_of_the_cold_tail_pass(tmp_path):
    """A prompt's last position as a tail pass row of its own (engine.runner_tail's dense rule,
    cold or after a partial-block copy, engine.partial_blocks; a pass of one row, or of each
    sequence's last row) equals, bit for bit, the same row of a pass of the whole trailing partial
    block's rows (a sliding-window pool's rule) and of the cold prefill pass."""
    rng = np.random.default_rng(21)
    case = _Case(rng, [150, 75, 120])
    launches = _tail_launches(0)
    cold = _single(case, [(0, 0, 150), (1, 0, 75), (2, 0, 120)], _spec(SPAN, False, 0), tmp_path)
    at = {0: 0, 1: 150, 2: 225}
    tails = [(0, 144, 6), (1, 64, 11), (2, 112, 8)]  # each prompt's trailing partial block
    cold_tail = _tail_pass(case, tails, launches, tmp_path, max_ctx=160)
    last = np.cumsum([n for *_, n in tails]) - 1
    warm = _tail_pass(case, [(s, p0 + n - 1, 1) for s, p0, n in tails], launches, tmp_path, max_ctx=160)
    for i, (s, p0, n) in enumerate(tails):
        solo = _tail_pass(case, [(s, p0 + n - 1, 1)], launches, tmp_path, max_ctx=160)
        assert np.array_equal(solo[0], cold_tail[last[i]]) and np.array_equal(warm[i], solo[0]), s
        assert np.array_equal(solo[0], cold[at[s] + p0 + n - 1]), s


def test_a_tail_pass_reads_each_sequence_s_first_row_table(tmp_path):
    """The control: without row_tables the kernel reads table row s (a prefill pass's layout), so
    the second tail of a packed pass reads the first tail's rows' table and gets other values."""
    rng = np.random.default_rng(5)
    case = _Case(rng, [100, 100])
    launches = _tail_launches(0)
    pack = [(0, 90, 5), (1, 80, 9)]
    good = _tail_pass(case, pack, launches, tmp_path, max_ctx=128)
    _check_ref(case, pack, good, 0)
    plain = (dataclasses.replace(launches[0], spec=kc.spec("attention_prefill", **{**launches[0].spec.params,
                                                                                   "row_tables": False})),
             launches[1])  # fmt: skip
    bad = _tail_pass(case, pack, plain, tmp_path, max_ctx=128)
    assert np.array_equal(bad[:5], good[:5]) and not np.array_equal(bad[5:], good[5:])


def test_row_tables_needs_partial():
    with pytest.raises(Exception, match="row_tables"):
        kc.spec("attention_prefill", **{**_spec(SPAN, False, 0).params, "row_tables": True})
    assert "row_tables1" in kc.spec("attention_prefill", **{**_spec(SPAN, True, 0).params, "row_tables": True}).entry
