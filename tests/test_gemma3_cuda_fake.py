"""Gemma 3 through CudaRunner's host logic on the fake driver (no GPU): the plan binds and runs
prefill chunks past the window and decode steps, the norm vectors are uploaded with the norm offset
added (offset 1 for a transformers-layout file: (1 + w)), and every attention launch of a local layer
carries the window."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.checkpoints import write_gemma3_safetensors
from fixtures.engine_waves import engine_for, run_waves, tokens_of
from test_plan_runner_fake import FakeDriver, fake_builder

from engine.types import SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)


def test_tiny_gemma3_binds_and_uploads_offset_norms(tmp_path, monkeypatch):
    import engine.runner_cuda as rc
    from engine.model import load_model

    drv = FakeDriver()
    mod = drv.module()
    uploads: list[np.ndarray] = []
    htod = mod.htod
    mod.htod = lambda ptr, host, stream=None: (uploads.append(np.array(host, copy=True)), htod(ptr, host, stream))
    monkeypatch.setattr(rc, "cuda", mod)
    model = load_model(write_gemma3_safetensors(tmp_path / "g", window=8, num_hidden_layers=7, head_dim=256))
    runner = rc.CudaRunner(model, num_blocks=64, max_model_len=512, builder=fake_builder(tmp_path), window_kv_blocks=0)
    try:
        norm = np.asarray(model.dequantize("attn_norm", 0), dtype=np.float32)
        f32 = [u.view(np.float32) for u in uploads if u.dtype == np.uint8 and u.nbytes == norm.nbytes]
        assert any(np.array_equal(u, np.float32(1.0) + norm) for u in f32)
        assert not any(np.array_equal(u, norm) for u in f32)
        runner.step([StepItem(0, list(range(3, 40)), 0, [0, 1, 2, 3], False, GREEDY)])
        runner.step([StepItem(0, list(range(3, 13)), 37, [0, 1, 2, 3], True, GREEDY)])
        runner.step([StepItem(0, [5], 47, [0, 1, 2, 3], True, GREEDY)])
        names = [n for n, _, _ in drv.launches]
        assert any("window8" in n for n in names if n.startswith("attention_prefill"))
        assert any("window8" in n for n in names if n.startswith("attention__"))
        assert any(n.startswith("add__") for n in names) and any("actgelutanh" in n for n in names)
    finally:
        runner.close()


def test_a_window_pool_holds_the_window_layers_kv_and_takes_each_items_window_table(tmp_path, monkeypatch):
    """window_kv_blocks: the window layers' K/V pointers lie in the window pool, the full layers'
    in the full one; a step fills the window slots and tables from the item's window_table (released
    entries read as the pool's sink); an item without one is refused. Without a pool
    (window_kv_blocks=0) the window inputs are the block tables and slots themselves."""
    import engine.runner_cuda as rc
    from engine.block_manager import RELEASED
    from engine.ir import Arg
    from engine.model import load_model
    from engine.types import MemraError

    monkeypatch.setattr(rc, "cuda", FakeDriver().module())
    model = load_model(write_gemma3_safetensors(tmp_path / "g", window=8, num_hidden_layers=7, head_dim=256))
    plain = rc.CudaRunner(model, num_blocks=64, max_model_len=512, builder=fake_builder(tmp_path), window_kv_blocks=0)
    try:
        assert plain.window_kv_blocks == 0
        assert plain._in_off["window_tables"] == plain._in_off["block_tables"]
        assert plain._in_off["window_slots"] == plain._in_off["slots"]
    finally:
        plain.close()
    runner = rc.CudaRunner(model, num_blocks=64, max_model_len=512, builder=fake_builder(tmp_path), window_kv_blocks=10)
    try:
        assert (runner.window_kv_blocks, runner.kv_window) == (10, 8)
        shape = runner._shape(1, 1)
        lo, hi = runner.kv_win.ptr, runner.kv_win.ptr + runner.kv_win.nbytes
        for layer in range(7):
            ptr = runner._resolve(Arg("kv", "v", layer=layer), shape)
            assert (lo <= ptr < hi) == (layer != 5)  # layer 5 is the global one
        assert runner._in_off["window_tables"] != runner._in_off["block_tables"]
        bs = runner.block_size
        runner.step([StepItem(0, list(range(3, 43)), 0, [0, 1, 2], True, GREEDY, window_table=[5, 6, 7])])
        pos = np.arange(40)
        assert runner._win_slots[:40].tolist() == (np.array([5, 6, 7])[pos // bs] * bs + pos % bs).tolist()
        runner.step([StepItem(0, [9], 40, [0, 1, 2], True, GREEDY, window_table=[RELEASED, 6, 7])])
        ld = runner._table_ld
        assert runner._win_tables[:3].tolist() == [10, 6, 7] and (runner._win_tables[3:ld] == 10).all()
        assert runner._win_slots[0] == 7 * bs + 40 % bs
        with pytest.raises(MemraError, match="needs a window_table"):
            runner.step([StepItem(0, [9], 41, [0, 1, 2], True, GREEDY)])
    finally:
        runner.close()


def test_the_engine_drives_a_cuda_window_pool(tmp_path, monkeypatch):
    """Engine + CudaRunner(window_kv_blocks) on the fake driver: chunked prompts past the window and
    decode steps run (every item's window_table covers its positions: the runner refuses one that
    does not), the engine's window group stays within one window and chunk per sequence."""
    import engine.runner_cuda as rc
    from engine.kv_groups import WindowedBlocks, min_window_blocks
    from engine.model import load_model

    monkeypatch.setattr(rc, "cuda", FakeDriver().module())
    model = load_model(write_gemma3_safetensors(tmp_path / "g", window=8, num_hidden_layers=7, head_dim=256))
    runner = rc.CudaRunner(model, num_blocks=64, max_model_len=512, builder=fake_builder(tmp_path), window_kv_blocks=12)
    runner.ctx.make_current = lambda: None  # (the engine thread; the fake context has no binding)
    held: list[int] = []

    def watch(e):
        held.extend(e.blocks.window_blocks(s.seq_id) for s in e.scheduler.running)

    e = engine_for(runner, watch=watch, max_running=3, prefill_chunk_tokens=16, max_step_tokens=32)
    assert isinstance(e.blocks, WindowedBlocks)
    rng = np.random.default_rng(0)
    try:
        run_waves(e, [[[int(t) for t in rng.integers(3, 128, n)] for n in (60, 45, 70)]], max_tokens=24)
    finally:
        runner.close()
    assert held and max(held) <= min_window_blocks(8, 16, runner.block_size)


def _engine_items(runner, prompts, cfg, held=None):
    """Greedy outputs of ``prompts`` through an engine over ``runner``, and every item it stepped
    (seq, start, tokens, table, window table, sample); ``held`` gets each running sequence's window
    blocks after every step."""
    items: list[tuple] = []
    step = runner.step

    def recording(batch, *a, **k):
        items.extend(
            (it.seq_id, it.start_pos, len(it.token_ids), list(it.block_table), it.window_table and list(it.window_table), it.sample)
            for it in batch
        )
        return step(batch, *a, **k)

    runner.step = recording

    def watch(e):
        if held is not None:
            held.extend(e.blocks.window_blocks(s.seq_id) for s in e.scheduler.running)

    e = engine_for(runner, watch=watch, **cfg)
    outs, _ = run_waves(e, [prompts], max_tokens=16)
    return tokens_of(outs), items, e


def test_a_default_cuda_runner_has_a_window_pool_sized_for_its_engine(tmp_path, monkeypatch):
    """No window_kv_blocks: a windowed model gets a window pool of kv_groups.auto_window_blocks for
    the engine it is told of (the profile's max_running and prefill chunk by default), capped at the
    fixed num_blocks; with the KV sized from free memory the full pool takes the rest of the budget
    (more blocks than one pool over every layer would have). window_kv_blocks=0 and a model without
    windows keep one pool; a negative count and a count for a model without windows are refused."""
    from test_runner_cuda import write_tiny_llama

    import engine.runner_cuda as rc
    from engine.kv_groups import auto_window_blocks
    from engine.model import load_model
    from engine.types import MemraError

    drv = FakeDriver()
    monkeypatch.setattr(rc, "cuda", drv.module())
    model = load_model(write_gemma3_safetensors(tmp_path / "g", window=8, num_hidden_layers=7, head_dim=256))
    b = fake_builder(tmp_path)

    def built(**kw):
        r = rc.CudaRunner(model, max_model_len=512, builder=b, **kw)
        r.close()
        return r

    r = built()  # KV from the fake's 100 GiB free: the profile's engine limits
    prof = r.profile
    want = auto_window_blocks(8, r.block_size, prof.max_running, prof.prefill_chunk_tokens)
    assert (r.window_kv_blocks, r.kv_window, len(r.kv_full_layers), len(r.kv_window_layers)) == (want, 8, 1, 6)
    d = model.dims
    per_layer = r.block_size * d["kv_heads"] * d["head_dim"] * 2  # one layer's K of one block, bf16
    budget = int((100 << 30) * prof.kv_memory_fraction)
    assert r.num_blocks == (budget - (want + 1) * per_layer * 2 * 6) // (per_layer * 2)
    assert r.num_blocks > budget // (per_layer * 2 * 7)  # more than one pool over all 7 layers
    assert r.kv_win.nbytes == (want + 1) * per_layer * 2 * 6
    assert built(max_running=3, prefill_chunk_tokens=16).window_kv_blocks == auto_window_blocks(8, 16, 3, 16) == 13
    assert built(num_blocks=64, max_running=3, prefill_chunk_tokens=16).window_kv_blocks == 13
    assert built(num_blocks=8, max_running=3, prefill_chunk_tokens=16).window_kv_blocks == 8  # capped
    assert built(num_blocks=64, window_kv_blocks=0).window_kv_blocks == 0
    with pytest.raises(MemraError, match="must be >= 0"):
        built(num_blocks=64, window_kv_blocks=-1)
    write_tiny_llama(tmp_path / "l")
    llama = load_model(tmp_path / "l")
    plain = rc.CudaRunner(llama, num_blocks=64, max_model_len=512, builder=b)
    plain.close()
    assert plain.window_kv_blocks == 0 and plain.kv_win is None
    with pytest.raises(MemraError, match="--window-kv-blocks"):
        rc.CudaRunner(llama, num_blocks=64, max_model_len=512, builder=b, window_kv_blocks=4)


def test_the_engine_over_a_default_cuda_window_pool_steps_as_the_reference(tmp_path, monkeypatch):
    """A default CudaRunner sized for the engine (3 sequences, 16-token chunks: a 13-block window
    pool) runs three prompts past the window through the engine: every sequence within one window and
    chunk of window blocks, window blocks released behind the window (RELEASED entries in the items'
    window tables) and all back in the pool at the end; the items it is stepped with (block and
    window tables) are the ones a ReferenceRunner with the same pools gets, whose greedy tokens equal
    the one-pool reference's."""
    import engine.runner_cuda as rc
    from engine.block_manager import RELEASED
    from engine.kv_groups import WindowedBlocks, min_window_blocks
    from engine.model import load_model
    from engine.reference import ReferenceRunner

    monkeypatch.setattr(rc, "cuda", FakeDriver().module())
    model = load_model(write_gemma3_safetensors(tmp_path / "g", window=8, num_hidden_layers=7, head_dim=256))
    cfg = dict(max_running=3, prefill_chunk_tokens=16, max_step_tokens=32)
    runner = rc.CudaRunner(model, num_blocks=64, max_model_len=512, builder=fake_builder(tmp_path), max_running=3, prefill_chunk_tokens=16)
    runner.ctx.make_current = lambda: None  # (the engine thread; the fake context has no binding)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 128, n)] for n in (40, 25, 50)]
    held: list[int] = []
    try:
        assert runner.window_kv_blocks == 13
        _, cuda_items, e = _engine_items(runner, prompts, cfg, held)
    finally:
        runner.close()
    assert isinstance(e.blocks, WindowedBlocks) and e.blocks.window_group.num_used == 0
    assert held and max(held) <= min_window_blocks(8, 16, runner.block_size)
    assert any(wt and wt[0] == RELEASED for *_, wt, _s in cuda_items)
    ref = ReferenceRunner(model, num_blocks=64, block_size=runner.block_size, max_model_len=512, window_kv_blocks=13)
    pooled, ref_items, _ = _engine_items(ref, prompts, cfg)
    assert ref_items == cuda_items
    one = ReferenceRunner(model, num_blocks=64, block_size=runner.block_size, max_model_len=512, window_kv_blocks=0)
    assert pooled == _engine_items(one, prompts, cfg)[0]


def test_bench_steps_a_window_pool_and_reports_each_groups_kv_bytes(tmp_path, monkeypatch):
    """engine.runner_bench on a default CudaRunner of a windowed model: every step's window table
    maps the blocks its queries can see (window and tokens) to distinct pool blocks, reusing the ones
    behind the window; the KV row gives each group's bytes (the window group's bounded per
    sequence), and its line says so; a row whose window blocks do not fit is skipped."""
    import dataclasses

    import engine.runner_cuda as rc
    from engine import bench, runner_bench
    from engine.model import load_model
    from engine.ops_ref import window_start
    from engine.profile import get_profile

    monkeypatch.setattr(rc, "cuda", FakeDriver().module())
    model = load_model(write_gemma3_safetensors(tmp_path / "g", window=40, num_hidden_layers=7, head_dim=256))
    prof = dataclasses.replace(get_profile("h200"), prefill_chunk_tokens=64)  # prompts run in passes of 64
    runner = rc.CudaRunner(model, prof, num_blocks=256, max_model_len=1024, builder=fake_builder(tmp_path), max_running=4)
    seen: list = []
    step = runner.step
    runner.step = lambda batch: (seen.extend(batch), step(batch))[1]
    try:
        assert runner.window_kv_blocks == 4 * 6 + 4  # auto_window_blocks(40, 16, 4, 64)
        rows = runner_bench.run_all(runner, batches=(1, 4, 8), depths=(0, 207), prefills=(300,), steps=4, copy=False)
    finally:
        runner.close()
    bs, chunk = runner.block_size, runner.profile.prefill_chunk_tokens
    for it in seen:
        wt = it.window_table
        # the runner runs a prompt in passes of `chunk` tokens: each pass sees its window and tokens
        for s in range(it.start_pos, it.start_pos + len(it.token_ids), chunk):
            e = min(s + chunk, it.start_pos + len(it.token_ids))
            live = [wt[j] for j in range(window_start(s, 40) // bs, (e - 1) // bs + 1)]
            assert len(set(live)) == len(live), (it.start_pos, len(it.token_ids))
    assert any(len(set(it.window_table)) < len(it.window_table) for it in seen)  # reused behind the window
    kinds = [(r["kind"], r.get("batch")) for r in rows]
    # (depth 207: 5 window blocks a row, 8 rows do not fit the 28-block pool)
    assert kinds == [("kv", None)] + [("decode", b) for b in (1, 4, 8, 1, 4)] + [("prefill", None)], kinds
    kv = rows[0]
    token = 2 * 2 * model.dims["kv_heads"] * 256
    assert kv["full_bytes_per_token"] == token and kv["window_bytes_per_token"] == 6 * token
    assert kv["window_bytes_per_seq_max"] == (3 + 1) * bs * 6 * token  # ceil(40 / 16) + 1 blocks
    assert "a decoding sequence (window pool 28 blocks)" in bench.table([kv])
