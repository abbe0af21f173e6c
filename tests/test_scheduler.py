"""Scheduler policy (decode first, chunked prefill, FIFO admission, preemption) and stop strings."""

from __future__ import annotations

from fixtures.fake_runner import FakeTokenizer

from engine.block_manager import BlockManager, cache_salt_hash
from engine.scheduler import Scheduler, Sequence
from engine.stop import StopChecker, StopStrings
from engine.types import GenerationRequest, SamplingParams

BS = 4


def make(num_blocks=16, max_running=8, chunk=8, step=32):
    bm = BlockManager(num_blocks, BS)
    return bm, Scheduler(bm, max_running=max_running, prefill_chunk_tokens=chunk, max_step_tokens=step)


def seq(i: int, n: int, max_tokens: int = 8) -> Sequence:
    req = GenerationRequest(
        f"r{i}", list(range(10, 10 + n)), SamplingParams(temperature=0.0), max_tokens=max_tokens
    )
    return Sequence(i, req, req.sampling, list(req.prompt_ids), n, max_tokens, cache_salt_hash("t"))


def run(sched: Scheduler, bm: BlockManager, batch, token: int = 5):
    """Apply a step as the loop would: advance, commit, append a token where sampled."""
    for s in batch:
        s.seq.num_computed = s.start + s.count
        bm.commit(s.seq.seq_id, s.seq.token_ids, s.seq.num_computed)
        if s.sample:
            s.seq.token_ids.append(token)
    bm.check_invariants()


def test_chunked_prefill_respects_budget_and_decode_rows_come_first():
    bm, sc = make(chunk=8)
    a, b = seq(0, 3), seq(1, 20)
    sc.add(a)
    sc.add(b)
    batch = sc.schedule()
    assert [(x.seq.seq_id, x.start, x.count, x.sample) for x in batch] == [(0, 0, 3, True), (1, 0, 5, False)]
    run(sc, bm, batch)
    batch = sc.schedule()  # a decodes first, b continues with a full chunk
    assert [(x.seq.seq_id, x.start, x.count, x.sample) for x in batch] == [(0, 3, 1, True), (1, 5, 8, False)]
    run(sc, bm, batch)
    batch = sc.schedule()
    assert [(x.seq.seq_id, x.count, x.sample) for x in batch] == [(0, 1, True), (1, 7, True)]


def test_oldest_waiting_is_not_overtaken_by_a_younger_one_that_fits():
    bm, sc = make(num_blocks=8)
    big0, big1, small = seq(0, 16, 8), seq(1, 16, 8), seq(2, 2, 2)
    for s in (big0, big1, small):
        sc.add(s)
    batch = sc.schedule()  # big0: 4 blocks + headroom; big1 needs 5 of the 4 left -> small must wait too
    assert [x.seq.seq_id for x in batch] == [0]
    assert [s.seq_id for s in sc.waiting] == [1, 2]


def test_max_running_caps_admission():
    bm, sc = make(max_running=2)
    for i in range(4):
        sc.add(seq(i, 2))
    assert [x.seq.seq_id for x in sc.schedule()] == [0, 1]
    assert len(sc.running) == 2 and len(sc.waiting) == 2


def test_preemption_evicts_the_youngest_and_keeps_order():
    bm, sc = make(num_blocks=5, chunk=64, step=64)
    a, b = seq(0, 7, 9), seq(1, 7, 9)  # 2 blocks each (+1 headroom at admission)
    sc.add(a)
    sc.add(b)
    batch = sc.schedule()
    assert [x.seq.seq_id for x in batch] == [0, 1]
    run(sc, bm, batch)  # both at 8 tokens; the decode of position 7 still fits their second block
    batch = sc.schedule()
    assert [x.seq.seq_id for x in batch] == [0, 1]
    run(sc, bm, batch)
    assert sc.counters.preemptions == 0
    batch = sc.schedule()  # position 8 needs a third block each; one is free: a gets it, b is preempted
    assert [x.seq.seq_id for x in batch] == [0]
    assert sc.counters.preemptions == 1 and [s.seq_id for s in sc.waiting] == [1]
    assert b.num_computed == 0 and not bm.has_seq(1)
    bm.check_invariants()


def test_preempted_sequence_recomputes_with_prefix_hits():
    bm, sc = make(num_blocks=5, chunk=64, step=64)
    a, b = seq(0, 7, 9), seq(1, 7, 9)
    sc.add(a)
    sc.add(b)
    for _ in range(3):
        run(sc, bm, sc.schedule())
    assert sc.counters.preemptions == 1
    sc.remove(a)  # a finishes: b is readmitted and hits its own cached blocks
    batch = sc.schedule()
    assert [x.seq.seq_id for x in batch] == [1]
    assert batch[0].start == 8 and batch[0].count == len(b.token_ids) - 8 and batch[0].sample
    assert b.cached_tokens == 0  # usage reports the first admission's hit only
    assert sc.counters.prefix_hit_tokens == 8


def test_stop_strings_hold_back_possible_prefixes():
    s = StopStrings(["STOP", "xy"])
    assert s.feed("hello S") == ("hello ", False)
    assert s.feed("T") == ("", False)
    assert s.feed("Ox") == ("STO", False)  # "STOx" cannot be STOP, but "x" may start "xy"
    assert s.feed("z") == ("xz", False)
    assert s.feed("a STO") == ("a ", False)
    assert s.feed("P and more") == ("", True)
    assert s.feed("after") == ("", True)
    assert s.flush() == ""


def test_stop_strings_earliest_match_wins_and_flush_releases():
    s = StopStrings(["bc", "abcd"])
    assert s.feed("xab") == ("x", False)
    assert s.feed("cd") == ("", True)  # "abcd" starts before "bc": the earliest start wins
    t = StopStrings(["END"])
    assert t.feed("the EN") == ("the ", False)
    assert t.flush() == "EN"
    assert StopStrings([]).feed("abc") == ("abc", False)
    assert StopStrings([""]).feed("abc") == ("abc", False)


def test_stop_checker_hides_stop_token_text_and_flushes_utf8():
    tok = FakeTokenizer()
    c = StopChecker(tok.incremental_decoder(), [], {tok.EOS, 50})
    assert c.push(tok.encode("A")[0]) == ("A", None)
    assert c.push(97) == ("", None)  # first half of "é"
    assert c.push(98) == ("é", None)
    assert c.push(50) == ("", "stop")
    c = StopChecker(tok.incremental_decoder(), ["é!"], set())
    out = [c.push(t) for t in tok.encode("aé!b")]
    assert "".join(t for t, _ in out) == "a" and out[-2][1] == "stop"


def test_stop_string_completed_by_the_decoder_tail_counts():
    tok = FakeTokenizer()
    c = StopChecker(tok.incremental_decoder(), ["a\ufffd"], set())
    assert c.push(tok.encode("a")[0]) == ("", None)  # "a" may start the stop string
    assert c.push(97) == ("", None)  # a dangling UTF-8 lead byte
    assert c.finish() == ("", True)  # flushed as U+FFFD: "a\ufffd" matches
    c = StopChecker(tok.incremental_decoder(), ["zz"], set())
    c.push(tok.encode("z")[0])
    assert c.finish() == ("z", False)


def test_no_admission_while_a_running_prefill_waits_for_window_blocks():
    """A scarce sliding-window pool (engine.kv_groups, 7 blocks of 4, window 8): a long prompt's chunk
    waits for window blocks a decoding sequence holds; a younger short request that would fit is not
    admitted while it waits (it would take the blocks the older one waits for), and all three finish."""
    from engine.kv_groups import WindowedBlocks

    wb = WindowedBlocks(BlockManager(64, BS), BlockManager(7, BS), 8)
    sc = Scheduler(wb, max_running=4, prefill_chunk_tokens=8, max_step_tokens=16)
    decoding, long, short = seq(0, 6, 12), seq(1, 30, 4), seq(2, 2, 4)
    sc.add(decoding)
    sc.add(long)
    waits = admitted_after_wait = 0
    done: set[int] = set()
    for step in range(200):
        if step == 3:
            sc.add(short)
        before = {s.seq_id for s in sc.running}
        batch = sc.schedule()
        ran = {x.seq.seq_id for x in batch}
        stalled = [s for s in sc.running if s.remaining > 1 and s.seq_id not in ran]
        waits += bool(stalled)
        assert not (stalled and {s.seq_id for s in sc.running} - before), f"step {step}: admitted while a prefill waits"
        admitted_after_wait += bool(waits and 2 in ran and 2 not in before)
        run(sc, wb, batch)
        for s in list(sc.running):
            if s.num_generated >= s.max_tokens:
                sc.remove(s)
                done.add(s.seq_id)
        wb.check_invariants()
        if done == {0, 1, 2}:
            break
    assert waits and admitted_after_wait and done == {0, 1, 2}


def test_prefill_chunks_end_on_the_state_grid():
    """A hybrid runner's state grid (state_align: its chunked delta rule's chunk) cuts every prefill
    chunk that does not finish its sequence at a multiple of it; a budget with no such position
    leaves the sequence for the next step (an admission waits); the last chunk ends anywhere."""
    import pytest

    from engine.types import ConfigError

    bm = BlockManager(32, BS)
    sc = Scheduler(bm, max_running=8, prefill_chunk_tokens=11, max_step_tokens=32, state_align=2)
    a, b = seq(0, 3), seq(1, 23)
    sc.add(a)
    sc.add(b)
    batch = sc.schedule()  # a takes 3 of 11: b's 8 end at 8
    assert [(x.seq.seq_id, x.start, x.count, x.sample) for x in batch] == [(0, 0, 3, True), (1, 0, 8, False)]
    run(sc, bm, batch)
    batch = sc.schedule()  # a's decode row; b 8 + 11 -> 18
    assert [(x.seq.seq_id, x.start, x.count) for x in batch] == [(0, 3, 1), (1, 8, 10)]
    run(sc, bm, batch)
    batch = sc.schedule()  # b's last 5 end its prompt (23: off the grid)
    assert [(x.seq.seq_id, x.start, x.count, x.sample) for x in batch] == [(0, 4, 1, True), (1, 18, 5, True)]
    bm2 = BlockManager(32, BS)
    sc2 = Scheduler(bm2, max_running=8, prefill_chunk_tokens=4, max_step_tokens=32, state_align=4)
    sc2.add(seq(2, 2, max_tokens=1))
    sc2.add(seq(3, 9))
    batch = sc2.schedule()  # the first one's 2 tokens leave 2 of the 4: no cut on the grid for the next
    assert [(x.seq.seq_id, x.count) for x in batch] == [(2, 2)]
    assert [s.seq_id for s in sc2.waiting] == [3] and bm2.num_used == 1
    with pytest.raises(ConfigError, match="must divide the KV block size 4"):
        Scheduler(bm, max_running=8, prefill_chunk_tokens=11, max_step_tokens=32, state_align=3)
    with pytest.raises(ConfigError, match="at least the runner's state grid"):
        Scheduler(bm, max_running=8, prefill_chunk_tokens=2, max_step_tokens=32, state_align=4)
