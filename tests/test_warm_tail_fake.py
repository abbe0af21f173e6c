"""The prompt tail on CudaRunner's fake driver (no GPU; engine.runner_tail): what a prefix-cache hit
leaves to run is at most a block: a dense model's runs its tokens but the last (those a
partial-block copy did not cover) as a prefill pass and its last token as a one-row decode pass;
a hybrid's hit stops at the block boundary and runs the prompt's trailing partial block (1 ..
block_size - 1 tokens) as decode rows of one sequence; a prompt ending on a block boundary runs its
last block as a prefill of block_size tokens. The graphs of the tail passes and of that prefill
are captured when the runner is built, from warm runs that write only the sinks; a warm request
then replays one graph (inputs and sampled id copied by the graph itself) and uploads inputs sized
by its new tokens, never by the cached prompt; a cold prompt runs the same tail rows as the same
decode rows after the prefill of everything before them."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.hybrid import write_qwen3_5_hf
from test_plan_runner_fake import GREEDY, FakeDriver, fake_builder
from test_runner_cuda import write_tiny_llama

from engine.ir import TAIL_SEQS
from engine.runner_tail import run_tails, tail_count
from engine.types import SamplingParams, StepItem


def _build(tmp_path, monkeypatch, hybrid: bool):
    """(runner, driver, events): ("htod", ptr, bytes copy) and ("launch", kernel, in a capture), in order."""
    import engine.runner_cuda as rc
    from engine.model import load_model

    drv = FakeDriver()
    mod = drv.module()
    events: list[tuple] = []
    htod, prepared = mod.htod, mod.PreparedLaunch

    def rec_htod(ptr, host, stream=None):
        events.append(("htod", ptr, np.asarray(host).copy()))
        return htod(ptr, host, stream)

    class RecPrepared(prepared):
        def __call__(self, args):
            events.append(("launch", self.fn.name, drv.capturing))
            return super().__call__(args)

    mod.htod, mod.PreparedLaunch = rec_htod, RecPrepared
    monkeypatch.setattr(rc, "cuda", mod)
    if hybrid:
        path = write_qwen3_5_hf(tmp_path / "m", bf16=True, hidden_size=128, intermediate_size=256,
                                linear_key_head_dim=32, linear_value_head_dim=32)
        runner = rc.CudaRunner(load_model(path), num_blocks=300, max_model_len=4096,
                               builder=fake_builder(tmp_path), state_slots=6)
    else:
        write_tiny_llama(tmp_path / "m")
        runner = rc.CudaRunner(load_model(tmp_path / "m"), num_blocks=300, max_model_len=4096,
                               builder=fake_builder(tmp_path))
    return runner, drv, events


def _view(runner, raw: np.ndarray, name: str, dtype, n: int) -> np.ndarray:
    off = runner._in_off[name]
    return raw[off : off + n * np.dtype(dtype).itemsize].view(dtype)


def _spy_decode(runner) -> list[list[StepItem]]:
    """The rows of every decode pass the runner runs from now on."""
    passes: list[list[StepItem]] = []
    decode = runner._decode
    runner._decode = lambda rows, *a, **k: passes.append(list(rows)) or decode(rows, *a, **k)
    return passes


@pytest.mark.parametrize("hybrid", [False, True], ids=["llama", "qwen3_5"])
def test_tails_are_captured_from_a_warm_run_into_the_sinks(tmp_path, monkeypatch, hybrid):
    runner, drv, events = _build(tmp_path, monkeypatch, hybrid)
    bs = runner.block_size
    assert [k[1] for k in runner._graphs if k[0] == "tail"] == [bs]  # a whole last block: a prefill
    assert runner._graphs[("tail", bs)][1] is runner._prefill_bound[("prefill", bs, 1, bs)]
    rows = [k for k in runner._graphs if k[0] != "tail"]  # the decode-row tails': every row count
    limit = 8  # (the bf16 plans' wide decode: passes of at most 8 rows, engine.spec.cuda_verify.narrow_rows)
    assert {k[1] for k in rows} == {"greedy", "sample"}
    assert all(k[3] for k in rows)  # the io graphs a plain step replays
    if hybrid:  # a trailing partial block's rows, 1 .. 8
        assert {k[0] for k in rows} == set(range(1, limit + 1))
        assert all(k[4] == (1,) * k[0] for k in rows) and runner._tail_keys == set(rows)
    else:  # one-row tails, packed: below short_context up to 8 in a pass; past it (a long class:
        # max_model_len 4096) the TAIL attention's graphs, at most TAIL_SEQS tails a pass
        assert all(k[4] == "verify" and (k[-1] == "tail") == (not k[2]) for k in rows)
        assert {k[0] for k in rows if k[2]} == set(range(1, limit + 1))
        assert {k[0] for k in rows if not k[2]} == set(range(1, TAIL_SEQS + 1))
    assert drv.captures == len(rows) + 1
    # every launch that ran while building (not those recorded into a graph) read inputs that
    # write only the sinks
    last, launched = None, 0
    for ev in events:
        if ev[0] == "htod" and ev[1] == runner._in_dev.ptr:
            last = ev[2]
        elif ev[0] == "launch" and last is not None and not ev[2]:
            launched += 1
            slots = _view(runner, last, "slots", np.int32, 1)  # (the first row: every tail has one)
            assert (slots // bs == runner._sink_block).all(), ev[1]
            tables = last[runner._tables_off : runner._tables_off + 4 * runner._table_ld].view(np.int32)
            assert (tables == runner._sink_block).all(), ev[1]
            if hybrid:
                assert _view(runner, last, "state_in", np.int32, 1)[0] == -1
                assert _view(runner, last, "state_out", np.int32, 1)[0] == runner._state_sink
                assert _view(runner, last, "state_snap", np.int32, 1)[0] == -1
    assert launched > 0


@pytest.mark.parametrize("hybrid", [False, True], ids=["llama", "qwen3_5"])
def test_a_warm_tail_replays_its_graph_and_uploads_by_new_tokens(tmp_path, monkeypatch, hybrid):
    """What a hit leaves of a prompt 5 tokens into its last block: the dense model's last token (a
    partial-block copy took the 4 before it), the hybrid's 5 tokens after the boundary; one graph."""
    runner, drv, events = _build(tmp_path, monkeypatch, hybrid)
    bs = runner.block_size
    state = dict(state_slot=2, state_restore=4) if hybrid else {}
    new = [7, 8, 9, 10, 11] if hybrid else [11]
    k = len(new)
    passes = _spy_decode(runner)
    uploads = []
    for depth in (4 * bs, 200 * bs):  # the same tail after 64 and after 3,200 cached tokens
        drv.reset()
        events.clear()
        table = list(range(depth // bs + 1))
        start = depth + 5 - k
        item = StepItem(0, new, start, table, True, GREEDY, history=[1] * (depth + 5), prompt_len=depth + 5, **state)
        assert runner.step([item]) == [0]
        assert drv.graph_launches == 1 and drv.captures == 0 and not drv.launches  # one graph, nothing else
        uploads.append(sum(drv.h2d))
        v = runner._views
        assert v["tokens"][:k].tolist() == new
        assert v["positions"][:k].tolist() == list(range(start, depth + 5))
        assert v["slots"][:k].tolist() == [table[p // bs] * bs + p % bs for p in range(start, depth + 5)]
        assert [r.sample for r in passes[-1]] == [False] * (k - 1) + [True]  # the last row samples
        if hybrid:  # the snapshot restored into the first row, the live slot after it
            assert v["state_in"][:5].tolist() == [4, 2, 2, 2, 2]
            assert v["state_out"][:5].tolist() == [2] * 5 and v["state_snap"][:5].tolist() == [-1] * 5
    assert uploads[0] == uploads[1]  # the cached prompt's length changes no upload
    # graphs off: the same rows eagerly, through the decode launches
    drv.reset()
    runner.use_graphs = False
    runner.step([StepItem(0, new, 4 * bs + 5 - k, list(range(5)), True, GREEDY, prompt_len=4 * bs + 5, **state)])
    names = [n for n, _, _ in drv.launches]
    assert drv.graph_launches == 0 and names and not any(n.startswith("attention_prefill") for n in names)
    assert len(passes[-1]) == k


def test_a_dense_hit_without_a_partial_copy_prefills_all_but_its_last_token(tmp_path, monkeypatch):
    """A dense model's hit that copied no partial block (5 tokens after 4 cached blocks): its first
    4 tokens one prefill pass (bound when the runner was built), its last a one-row decode pass
    (its graph)."""
    runner, drv, _ = _build(tmp_path, monkeypatch, False)
    bs = runner.block_size
    passes = _spy_decode(runner)
    prefills = []
    pre = runner._run_prefill_pass
    runner._run_prefill_pass = lambda segs: prefills.append([(lo, hi, it) for _, it, lo, hi in segs]) or pre(segs)
    drv.reset()
    item = StepItem(0, [7, 8, 9, 10, 11], 4 * bs, list(range(5)), True, GREEDY, prompt_len=4 * bs + 5)
    assert runner.step([item]) == [0]
    ((lo, hi, part),) = prefills[0]
    assert (lo, hi, part.start_pos, part.token_ids, part.sample) == (0, 4, 4 * bs, [7, 8, 9, 10], False)
    assert [(r.token_ids, r.start_pos, r.sample) for r in passes[-1]] == [([11], 4 * bs + 4, True)]
    assert drv.graph_launches == 1 and drv.captures == 0  # the tail's graph; the prefill bound ahead
    assert any(n.startswith("attention_prefill") for n, _, _ in drv.launches)


@pytest.mark.parametrize("hybrid", [False, True], ids=["llama", "qwen3_5"])
def test_a_cold_prompt_runs_its_tail_as_the_warm_rows(tmp_path, monkeypatch, hybrid):
    """The cold prompt: a prefill pass of everything before its tail (a hybrid's snapshot at the
    boundary taken there), then the same decode rows a warm hit runs, with the same inputs: the
    dense model's last token, the hybrid's five after the boundary."""
    runner, drv, events = _build(tmp_path, monkeypatch, hybrid)
    bs = runner.block_size
    prompt = list(range(3, 3 + 4 * bs + 5))
    k = 5 if hybrid else 1
    table = list(range(5))
    passes = _spy_decode(runner)
    prefills = []
    pre = runner._run_prefill_pass
    runner._run_prefill_pass = lambda segs: prefills.append([(lo, hi, it) for _, it, lo, hi in segs]) or pre(segs)
    cold = dict(state_slot=2, state_snapshots=((4 * bs, 4),)) if hybrid else {}
    drv.reset()
    assert runner.step([StepItem(0, prompt, 0, table, True, GREEDY, prompt_len=len(prompt), **cold)]) == [0]
    ((lo, hi, part),) = prefills[0]
    n = len(prompt) - k
    assert (lo, hi, part.sample, len(part.token_ids)) == (0, n, False, n)
    assert any(n.startswith("attention_prefill") for n, _, _ in drv.launches) and drv.graph_launches == 1
    if hybrid:
        assert part.state_snapshots == ((4 * bs, 4),)
    v = runner._views
    cold_rows = [(r.token_ids[0], r.start_pos, r.sample) for r in passes[-1]]
    assert cold_rows == [(t, n + j, j == k - 1) for j, t in enumerate(prompt[n:])]
    cold_inputs = [v[name][:k].tolist() for name in ("tokens", "positions", "slots")]
    if hybrid:
        assert v["state_in"][:5].tolist() == [2] * 5  # (the prefill part left the state in the live slot)
    warm = dict(state_slot=2, state_restore=4) if hybrid else {}
    runner.step([StepItem(0, prompt[n:], n, table, True, GREEDY, prompt_len=len(prompt), **warm)])
    assert [(r.token_ids[0], r.start_pos, r.sample) for r in passes[-1]] == cold_rows
    assert [v[name][:k].tolist() for name in ("tokens", "positions", "slots")] == cold_inputs


def test_a_prompt_ending_on_a_block_boundary_runs_its_last_block_as_a_prefill(tmp_path, monkeypatch):
    """A hit on a prompt of whole blocks leaves its last block: the prefill tail graph (block_size
    rows), then the batch-1 head eagerly; a one-token tail is a one-row decode pass (its graph)."""
    runner, drv, _ = _build(tmp_path, monkeypatch, False)
    bs = runner.block_size
    depth = 4 * bs
    table = list(range(depth // bs + 2))
    passes = _spy_decode(runner)
    drv.reset()
    runner.step([StepItem(0, list(range(3, 3 + bs)), depth, table, True, GREEDY, prompt_len=depth + bs)])
    assert drv.graph_launches == 1 and not passes
    assert [n for n, _, _ in drv.launches][-1].startswith("argmax")  # the head, eagerly after the tail graph
    drv.reset()
    runner.step([StepItem(0, [7], depth, table, True, GREEDY, history=[1] * depth + [7], prompt_len=depth + 1)])
    assert drv.graph_launches == 1 and drv.captures == 0 and not drv.launches
    assert [(r.start_pos, r.sample) for r in passes[-1]] == [(depth, True)]
    row = StepItem(0, [7], depth, table, True, GREEDY, history=[1] * depth + [7], prompt_len=depth)
    drv.reset()
    runner.step([row])  # a generated token: a plain decode row (its bucket graph: captured now)
    assert drv.captures == 1 and not any(n.startswith("attention_prefill") for n, _, _ in drv.launches)


def test_a_whole_block_tail_longer_than_a_verify_pass_runs_in_several(tmp_path, monkeypatch):
    """A 13-row tail (a trailing partial block's: run_tails, as a plan with a sliding-window pool
    runs it) of a bf16 plan (passes below its wide decode: 8 rows) runs 8 rows, then 5, both
    replayed from graphs; two tails of one step share passes up to 8 rows."""
    runner, drv, _ = _build(tmp_path, monkeypatch, False)
    bs = runner.block_size
    passes = _spy_decode(runner)
    drv.reset()
    item = StepItem(0, list(range(3, 16)), 4 * bs, list(range(5)), True, GREEDY, prompt_len=4 * bs + 13)
    run_tails(runner, [(item, 13)])
    assert [len(p) for p in passes] == [8, 5] and drv.captures == 0 and drv.graph_launches == 2
    assert [r.start_pos for p in passes for r in p] == list(range(4 * bs, 4 * bs + 13))
    passes.clear()
    a = StepItem(1, [5, 6, 7], 4 * bs, list(range(10, 15)), True, GREEDY, prompt_len=4 * bs + 3)
    b = StepItem(2, [8, 9, 10, 11], 2 * bs, list(range(20, 23)), True, GREEDY, prompt_len=2 * bs + 4)
    c = StepItem(3, [1, 2, 3, 4, 5], 3 * bs, list(range(30, 34)), True, GREEDY, prompt_len=3 * bs + 5)
    assert run_tails(runner, [(a, 3), (b, 4), (c, 5)]) == [0, 0, 0]
    assert [[r.seq_id for r in p] for p in passes] == [[1, 1, 1, 2, 2, 2, 2], [3] * 5]


def test_one_row_tails_share_passes_of_up_to_eight(tmp_path, monkeypatch):
    """A step of ten dense prompts, each a few tokens past a block boundary (cold or warm, a
    chunk's end at the prompt's end): each prompt's last token a decode row, ten rows in passes of
    8 and 2 (the bf16 plan's narrow_rows), every pass a captured graph; the rest one prefill pass."""
    runner, drv, _ = _build(tmp_path, monkeypatch, False)
    bs = runner.block_size
    passes = _spy_decode(runner)
    items = [StepItem(s, [5] * (1 + s % 4), 4 * bs + 3 - s % 4, list(range(6 * s, 6 * s + 5)), True, GREEDY,
                      prompt_len=4 * bs + 4) for s in range(10)]  # fmt: skip
    drv.reset()
    assert runner.step(items) == [0] * 10
    assert [[(r.seq_id, r.start_pos) for r in p] for p in passes] == [
        [(s, 4 * bs + 3) for s in range(8)], [(8, 4 * bs + 3), (9, 4 * bs + 3)]]
    assert drv.captures == 0 and drv.graph_launches == 2


def test_the_last_row_carries_the_item_s_sampling_and_logprobs(tmp_path, monkeypatch):
    runner, drv, _ = _build(tmp_path, monkeypatch, False)
    bs = runner.block_size
    passes = _spy_decode(runner)
    hot = SamplingParams(temperature=0.7, seed=3, logprobs=2)
    item = StepItem(0, [5, 6, 7], 4 * bs, list(range(5)), True, hot, history=[1] * (4 * bs + 3),
                    prompt_len=4 * bs + 3, num_generated=0)  # fmt: skip
    assert run_tails(runner, [(item, 3)]) == [0]  # (a trailing partial block's rows)
    rows = passes[-1]
    assert [r.sampling for r in rows[:2]] == [GREEDY, GREEDY] and rows[2].sampling is hot
    assert rows[2].history is item.history and [r.sample for r in rows] == [False, False, True]
    assert item.logprobs_out == (0.0, [(0, 0.0), (0, 0.0)])  # (the fake device's logprobs, into the item)
    item.logprobs_out = None
    assert runner.step([item]) == [0]  # the dense rule: one row, the item's
    (row,) = passes[-1]
    assert row.sampling is hot and row.history is item.history and row.start_pos == 4 * bs + 2
    assert item.logprobs_out == (0.0, [(0, 0.0), (0, 0.0)])


def test_tail_count_is_by_absolute_position():
    def it(start, n, prompt_len, **kw):
        return StepItem(0, [1] * n, start, [0], True, GREEDY, prompt_len=prompt_len, **kw)

    bs = 16
    for whole in (False, True):  # a dense plan's rule: the last position; a hybrid's: the partial block

        def tail(start, n, prompt_len, **kw):
            return tail_count(it(start, n, prompt_len, **kw), bs, whole)  # noqa: B023

        assert tail(64, 7, 71) == (7 if whole else 1)  # a warm hit's tail
        assert tail(0, 71, 71) == (7 if whole else 1)  # the cold prompt: the same positions
        assert tail(60, 11, 71) == (7 if whole else 1)  # a chunk across the boundary
        assert tail(66, 5, 71) == (5 if whole else 1)  # a chunk inside the partial block
        assert tail(70, 1, 71) == 1  # the last token alone (a partial-block copy left it)
        assert tail(64, 6, 71) == (6 if whole else 0)  # a chunk that ends before the prompt's last token
        assert tail(0, 64, 71) == 0  # a chunk that ends at the boundary
        assert tail(0, 10, 10) == (10 if whole else 1)  # a prompt shorter than a block
        assert tail(48, 16, 64) == 0  # a prompt ending on a boundary: its last block prefills
        assert tail(71, 1, 71) == 0  # a generated token: a decode row
        assert tail(0, 80, 71) == 0  # a recompute past the prompt (preemption)
        assert tail(0, 71, 0) == 0  # no prompt_len: a direct call (the MTP head, tools)
        assert tail(64, 7, 71, draft=(1,)) == 0


@pytest.mark.parametrize("whole", [False, True], ids=["dense", "whole_block"])
@pytest.mark.parametrize("chunk", [10, 32])
def test_engine_warm_equals_cold_with_the_tail_on_decode_rows(chunk, whole):
    """Through the engine loop on fixtures.path_bits.PathBitsRunner (tokens change with the path
    that computed each position): prompts whose tail the scheduler's chunks reach whole or cut
    inside, cold and then warm, give the cold greedy tokens; every run computes the prompt's tail
    (its last token; ``whole``, a hybrid's rule: its trailing partial block) as decode rows and
    everything before it as prefill."""
    from fixtures.engine_waves import serve_waves, tokens_of
    from fixtures.path_bits import DECODE, PREFILL, PathBitsRunner

    bs = 4
    prompts = [[(5 * i + k) % 100 + 2 for i in range(n)] for k, n in enumerate((23, 27, 9, 3, 24))]
    runner = PathBitsRunner(block_size=bs, chunk=chunk, whole_block=whole)
    want = [runner.greedy(p, 6) for p in prompts]
    outs, _ = serve_waves(runner, [prompts, prompts, prompts], max_tokens=6, vocab_size=128,
                          prefill_chunk_tokens=chunk)  # fmt: skip
    assert tokens_of(outs) == want * 3
    cached = [c for _, c in outs]
    # the hits: every token but the last (the trailing partial block's copied: engine.partial_blocks;
    # none where the rule is a hybrid's), or up to the last block boundary for a prompt ending on one
    assert cached[5:] == [n - (n % bs or bs) if whole or not n % bs else n - 1 for n in map(len, prompts)] * 2
    for seq, pos, path in runner.paths:
        n = len(prompts[seq % len(prompts)])
        if pos < n:
            assert path == (PREFILL if pos < runner.tail_start(n) else DECODE), (seq, pos, path)


@pytest.mark.parametrize("control", [False, True], ids=["rule", "copies_the_decode_row"])
def test_engine_partial_hits_of_longer_and_shorter_prompts_equal_cold(monkeypatch, control):
    """On PathBitsRunner (8-token blocks): a cached prompt A of 2 blocks + 5 tokens (positions 16..19
    prefill, 20 its decode-row tail), then prompts whose partial block shares A's: A extended by 2
    tokens (copies 16..19; computes 20 by prefill, as its cold run does, and 22 as its tail), A
    cut to 19 tokens (copies 16..17), A cut to 18 plus others (copies 16..17), and A again
    (copies 16..19, recomputes 20 as its tail): each gives its cold greedy tokens. The control
    (``copies_the_decode_row``: a partial match capped only by the new prompt's length, copying
    A's decode-row position 20 into the longer prompt) gives other tokens for it."""
    from fixtures.engine_waves import serve_waves, tokens_of
    from fixtures.path_bits import PathBitsRunner

    from engine.partial_blocks import PartialBlocks, common_prefix

    if control:

        def match(self, prev, rest):  # (the rule before engine.runner_tail's one-row tails)
            best, src = 0, None
            for block, toks in self._partials.get(prev, {}).items():
                n = common_prefix(toks, rest, len(rest) - 1)
                if n > best:
                    best, src = n, block
            return src, best

        monkeypatch.setattr(PartialBlocks, "_partial_match", match)
    bs = 8
    a = [(7 * i) % 90 + 3 for i in range(2 * bs + 5)]
    prompts = [a, a + [91, 92], a[:19], a[:18] + [93, 94, 95], a]
    runner = PathBitsRunner(block_size=bs, chunk=64)
    want = [runner.greedy(p, 6) for p in prompts]
    outs, _ = serve_waves(runner, [[p] for p in prompts], max_tokens=6, vocab_size=128)
    cached = [c for _, c in outs]
    if control:
        assert cached[1] == 2 * bs + 5 and tokens_of(outs)[1] != want[1]
        return
    assert cached == [0, 2 * bs + 4, 2 * bs + 2, 2 * bs + 2, 2 * bs + 4]
    assert tokens_of(outs) == want


@pytest.mark.parametrize("hybrid", [False, True], ids=["llama", "qwen3_5"])
def test_engine_runs_the_same_tail_rows_cold_and_warm(tmp_path, monkeypatch, hybrid):
    """Through the engine loop on the fake driver: a 5-block + 7-token prompt, chunked, then sent
    again; the warm hit's tail runs the cold run's decode rows (tokens, positions): the dense
    model's its last row only, cold too, after one copy of the cached partial block (engine.partial_blocks:
    one strided copy of the block in every layer's K and V, on the step stream), the hybrid's
    (no partial entries) all seven, its first row restoring the snapshot at the cached boundary."""
    from fixtures.engine_waves import serve_waves

    runner, drv, _ = _build(tmp_path, monkeypatch, hybrid)
    runner.ctx.make_current = lambda: None  # (the engine thread makes the context current)
    bs = runner.block_size
    seen = []  # (rows: (token, position), the first row's state input) of every tail pass
    decode = runner._decode

    def spy(rows, *a, **k):
        ids = decode(rows, *a, **k)
        if any(r.start_pos < r.prompt_len for r in rows):
            seen.append(([(r.token_ids[0], r.start_pos) for r in rows], int(runner._views["state_in"][0])))
        return ids

    runner._decode = spy
    prompt = [(7 * i) % 300 + 3 for i in range(5 * bs + 7)]
    outs, _ = serve_waves(runner, [[prompt], [prompt]], max_tokens=3, vocab_size=runner.plan.dims["vocab"],
                          prefill_chunk_tokens=2 * bs)  # fmt: skip
    (cold, cold_in), (warm, warm_in) = seen
    if not hybrid:
        assert cold == [(prompt[-1], 5 * bs + 6)]
        assert [c for _, c in outs] == [0, 5 * bs + 6] and warm == cold
        (dst, src, width, rows, pitch, on_stream), = drv.row_copies
        per, layers = runner._kv_block_bytes, len(runner.kv_full_layers)
        assert (width, rows, pitch, on_stream) == (per, 2 * layers, runner._kv_layer_bytes, True)
        assert (dst - runner.kv.ptr) % per == 0 and (src - runner.kv.ptr) % per == 0 and dst != src
        return
    assert cold == [(t, 5 * bs + j) for j, t in enumerate(prompt[5 * bs :])]
    assert [c for _, c in outs] == [0, 5 * bs] and warm == cold and not drv.row_copies
    if hybrid:
        assert cold_in != warm_in and warm_in not in (-1, runner._state_sink)  # the live slot, then a snapshot
