"""The attention of a warm-prefix tail at depth (issues #36 / #34: warm TTFT at 1k-16k), on a real
GPU (skipped without one). A prefix hit leaves a few rows of one sequence to prefill after thousands
of cached keys. Without the key split, attention_prefill's grid is (query tiles, heads, sequences):
one block per head walks every key. With the profile's ``attention_prefill.span`` (docs/kernels.md,
"Key-split prefill attention") a pass of at most ``split_rows`` rows runs one block per (head,
span) writing partials, folded by attention_combine (fold); a longer (cold) pass folds the same
spans in one block. Checked here, on the device's own arithmetic:

- the tail's rows through the partial launch + combine have the bits of the same rows computed
  by a cold pass over the whole prompt (the prefix cache's contract: warm == cold), dense and
  hybrid head shapes at depths that end inside and on a span, and a sliding window (Gemma 3's
  heads, the blocks before every window poisoned with NaN); every output row against ops_ref
  (bf16 rounding, rel err <= 1e-2); outputs and partials poisoned.
- timings (printed): per depth (1k / 4k / 16k) and head shape (Qwen3.5-4B's full attention: 16
  heads, 4 KV heads of 256; Qwen3-4B: 32, 8, 128), the GPU time of an 8- and a 16-row tail's
  attention without the split, with it (a block per kv head as the plan; a block per query head of
  4 warps or 1 warp for comparison), and the
  decode path's split attention + combine over the same rows; and the cold pass over the whole
  prompt with and without the span fold (what the split costs a cold prefill).

    python3 -m pytest -q -s tests/gpu/test_tail_attention_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.catalog_specs import attention_params, attention_prefill_params
from gpu_harness import DeviceArray, bf_round, poisoned, rel_err, upload
from test_kernels import PagedCache

from engine import cuda, ops_ref
from engine import kernel_catalog as kc
from engine.ir import TAIL_SEQS

SHAPES = [(16, 4, 256), (32, 8, 128)]
SHAPE_IDS = ["qwen3.5-4b", "qwen3-4b"]


def _span(profile) -> int:
    """The profile's span, or 512 where the profile has the split off (the check still runs)."""
    return int(profile.tuning["attention_prefill"].get("span") or 512)


def _ms(kernels, launches, iters: int = 20) -> float:
    """GPU ms per round of ``launches`` [(choice, grid rows, grid_kw, args)], after one warm round."""
    stream = cuda.Stream()
    prepared = []
    for c, rows, grid_kw, args in launches:
        vals = [args[n].ptr if isinstance(args[n], DeviceArray) else args[n] for n, _ in c.args]
        packed = cuda.KernelArgs([kind for _, kind in c.args], vals)
        prepared.append((cuda.PreparedLaunch(kernels.function(c.spec), c.grid(rows, **grid_kw), c.block, c.smem, stream), packed))

    def round_():
        for run, packed in prepared:
            run(packed)

    round_()
    e0, e1 = cuda.Event(), cuda.Event()
    e0.record(stream)
    for _ in range(iters):
        round_()
    e1.record(stream)
    e1.synchronize()
    ms = e1.elapsed_ms(e0) / iters
    for x in (e0, e1, stream):
        x.destroy()
    return ms


def _bits(a: DeviceArray) -> np.ndarray:
    return cuda.dtoh(np.empty(a.shape, np.uint16), a.ptr)


class _Attn:
    """The launches of one head shape's prefill attention over one sequence's paged cache: the
    single pass (``span`` 0: no split, else the folding one) and the split (partials + fold)."""

    def __init__(self, kernels, profile, shape, window: int = 0, span: int | None = None):
        H, KV, D = shape
        self.kernels, self.H, self.D = kernels, H, D
        self.span = _span(profile) if span is None else span
        dims = dict(heads=H, kv_heads=KV, head_dim=D)
        base = attention_prefill_params(dims, profile.tuning, profile.kv_block_size, q_stride=H * D, out_stride=H * D)
        base["window"] = window
        self.plain = kc.choice("attention_prefill", **base)
        self.single = kc.choice("attention_prefill", **base, span=self.span)
        self.part = {w: kc.choice("attention_prefill", **{**base, "block_q": 16 * w, "warps": w}, span=self.span, partial=True)
                     for w in (kc.PREFILL_WARPS, 1)}  # fmt: skip
        g = H // KV  # the lowering's split_gqa form: a block per kv head, a warp per query head of its group
        self.part["gqa"] = kc.choice("attention_prefill", **{**base, "block_q": 16 * g, "warps": g}, span=self.span,
                                     partial=True, gqa=True)  # fmt: skip
        self.comb = kc.choice("attention_combine", heads=H, head_dim=D, split=self.span, out_stride=H * D, window=window,
                              fold=True)  # fmt: skip
        # a prompt tail's decode pass (engine.ir.TAIL): the gqa form reading a block table per row
        self.tail = kc.choice("attention_prefill", **{**self.part["gqa"].spec.params, "row_tables": True})

    def single_launch(self, c, q, pos, cache, rows):
        out = poisoned((rows, self.H * self.D))
        args = dict(out=out, q=q, k_cache=cache.kd, v_cache=cache.vd, block_tables=cache.td, positions=pos,
                    seq_starts=upload(np.array([0, rows], np.int32), "i32"), max_blocks=cache.tables.shape[1])  # fmt: skip
        return out, [(c, rows, {"max_q": rows, "nseq": 1}, args)]

    def split_launches(self, q, pos, cache, rows, max_ctx, form="gqa"):
        """The split launch (``form``: "gqa" as the plan, or 4 / 1 warps per query head) + the fold."""
        c = self.part[form]
        splits = -(-max_ctx // self.span)
        out = poisoned((rows, self.H * self.D))
        part_o, part_ml = poisoned((rows, self.H, splits, self.D), "f32"), poisoned((rows, self.H, splits, 2), "f32")
        args = dict(out=0, q=q, k_cache=cache.kd, v_cache=cache.vd, block_tables=cache.td, positions=pos,
                    seq_starts=upload(np.array([0, rows], np.int32), "i32"), max_blocks=cache.tables.shape[1],
                    part_o=part_o, part_ml=part_ml, max_splits=splits)  # fmt: skip
        cargs = dict(out=out, part_o=part_o, part_ml=part_ml, positions=pos, max_splits=splits)
        return out, [(c, rows, {"max_q": rows, "nseq": 1, "max_splits": splits}, args), (self.comb, rows, {}, cargs)]

    def tail_launches(self, q, pos, tables: np.ndarray, starts: list[int], cache, rows, max_ctx):
        """The TAIL launches of a decode pass of ``rows`` rows: ``tables`` one per row, ``starts`` the
        sequences' first rows (engine.runner_steps _fill_seq_starts: the grid's other sequences
        empty), nseq = min(rows, TAIL_SEQS) as the runner binds a TAIL pass."""
        splits = -(-max_ctx // self.span)
        ss = np.full(rows + 1, rows, np.int32)
        ss[: len(starts)] = starts
        out = poisoned((rows, self.H * self.D))
        part_o, part_ml = poisoned((rows, self.H, splits, self.D), "f32"), poisoned((rows, self.H, splits, 2), "f32")
        args = dict(out=0, q=q, k_cache=cache.kd, v_cache=cache.vd, block_tables=upload(tables, "i32"), positions=pos,
                    seq_starts=upload(ss, "i32"), max_blocks=tables.shape[1], part_o=part_o, part_ml=part_ml,
                    max_splits=splits)  # fmt: skip
        cargs = dict(out=out, part_o=part_o, part_ml=part_ml, positions=pos, max_splits=splits)
        return out, [(self.tail, rows, {"max_q": rows, "nseq": min(rows, TAIL_SEQS), "max_splits": splits}, args),
                     (self.comb, rows, {}, cargs)]  # fmt: skip

    def run(self, launches) -> None:
        for c, rows, grid_kw, args in launches:
            self.kernels.launch(c, rows, grid_kw=grid_kw, **args)


def _qs(rng, rows: int, width: int) -> np.ndarray:
    return rng.standard_normal((rows, width), dtype=np.float32)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_split_tail_has_the_cold_rows_bits(kernels, profile, shape):
    H, KV, D = shape
    at = _Attn(kernels, profile, shape)
    rng = np.random.default_rng(1)
    bs = profile.kv_block_size
    for depth, tail in ((1000, 8), (4 * at.span, 16), (16384 + 3 * bs, 13)):
        n = depth + tail
        cache = PagedCache(rng, [n], KV, D, bs)
        qh = _qs(rng, n, H * D)
        q, pos = upload(qh, "bf16"), upload(np.arange(n, dtype=np.int32), "i32")
        cold, launches = at.single_launch(at.single, q, pos, cache, n)
        at.run(launches)
        qt, post = upload(qh[depth:], "bf16"), upload(np.arange(depth, n, dtype=np.int32), "i32")
        for form in ("gqa", kc.PREFILL_WARPS):
            warm, launches = at.split_launches(qt, post, cache, tail, max_ctx=n + 100, form=form)
            at.run(launches)
            assert np.array_equal(_bits(warm), _bits(cold)[depth:]), (shape, depth, tail, form)
        got = cold.get()
        for lo, hi in ((0, 64), (depth // 2, depth // 2 + 32), (depth, n)):
            want = cache.ref(0, bf_round(qh[lo:hi]).reshape(hi - lo, H, D), lo, D**-0.5)
            assert rel_err(got[lo:hi], want) <= 1e-2, (shape, depth, lo)
        assert not np.isnan(got).any()


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_tail_pass_form_has_the_cold_rows_bits(kernels, profile, shape):
    """The TAIL form (a prompt tail's decode pass: a block table per row, the rows of two tails
    packed, the grid's sequences as a TAIL pass binds them): each tail's rows have the bits of the cold pass
    over its whole prompt and of the tail alone in its pass; timings (printed) at 16k against the
    decode split attention + combine, which the tail rows ran before."""
    H, KV, D = shape
    at = _Attn(kernels, profile, shape)
    rng = np.random.default_rng(6)
    bs = profile.kv_block_size
    ends = [16384 + 3 * bs + 13, 2000 + 7]
    tails = [13, 7]
    cache = PagedCache(rng, ends, KV, D, bs)
    qs = [_qs(rng, n, H * D) for n in ends]
    colds = []
    for s, n in enumerate(ends):
        one = PagedCache.__new__(PagedCache)  # sequence s's table alone (single_launch reads row 0)
        one.kd, one.vd, one.td, one.tables = cache.kd, cache.vd, upload(cache.tables[s : s + 1], "i32"), cache.tables[s:]
        cold, launches = at.single_launch(at.single, upload(qs[s], "bf16"), upload(np.arange(n, dtype=np.int32), "i32"),
                                          one, n)  # fmt: skip
        at.run(launches)
        colds.append(_bits(cold)[n - tails[s] :])
    rows = sum(tails)
    qt = np.concatenate([q[-t:] for q, t in zip(qs, tails, strict=True)])
    pos = np.concatenate([np.arange(n - t, n, dtype=np.int32) for n, t in zip(ends, tails, strict=True)])
    tables = np.concatenate([np.repeat(cache.tables[s : s + 1], t, axis=0) for s, t in enumerate(tails)])
    packed, lt = at.tail_launches(upload(qt, "bf16"), upload(pos, "i32"), tables, [0, tails[0], rows], cache, rows,
                                  max_ctx=32768)  # fmt: skip
    at.run(lt)
    got = _bits(packed)
    assert np.array_equal(got[: tails[0]], colds[0]) and np.array_equal(got[tails[0] :], colds[1]), shape
    lo = 0
    for s, t in enumerate(tails):
        solo, ls = at.tail_launches(upload(qt[lo : lo + t], "bf16"), upload(pos[lo : lo + t], "i32"), tables[lo : lo + t],
                                    [0, t], cache, t, max_ctx=32768)  # fmt: skip
        at.run(ls)
        assert np.array_equal(_bits(solo), got[lo : lo + t]), (shape, s)
        want = cache.ref(s, bf_round(qt[lo : lo + t]).reshape(t, H, D), ends[s] - t, D**-0.5)
        assert rel_err(solo.get(), want) <= 1e-2, (shape, s)
        lo += t
    # timing at 16k: the first tail alone, the TAIL form against the decode split attention
    t = tails[0]
    q1, p1 = upload(qt[:t], "bf16"), upload(pos[:t], "i32")
    _, ls = at.tail_launches(q1, p1, tables[:t], [0, t], cache, t, max_ctx=32768)
    dims = dict(heads=H, kv_heads=KV, head_dim=D)
    dp = attention_params(dims, profile.tuning, bs, direct=False, q_stride=H * D, out_stride=H * D)
    dec = kc.choice("attention", **dp)
    dcomb = kc.choice("attention_combine", heads=H, head_dim=D, split=dp["split"], out_stride=H * D)
    splits = -(-32768 // dp["split"])
    part_o, part_ml = poisoned((t, H, splits, D), "f32"), poisoned((t, H, splits, 2), "f32")
    out_d = poisoned((t, H * D))
    dargs = dict(q=q1, positions=p1, k_cache=cache.kd, v_cache=cache.vd, out=out_d, part_o=part_o, part_ml=part_ml,
                 max_splits=splits, block_tables=upload(tables[:t], "i32"), max_blocks=tables.shape[1])  # fmt: skip
    for name, _ in kc.kernel_args(dec.spec):
        if name.startswith("pf"):
            dargs[name] = cache.kd
    cargs = dict(out=out_d, part_o=part_o, part_ml=part_ml, positions=p1, max_splits=splits)
    ld = [(dec, t, {"max_splits": splits}, {n: dargs[n] for n, _ in dec.args}), (dcomb, t, {}, cargs)]
    at.run(ld)
    assert rel_err(out_d.get(), cache.ref(0, bf_round(qt[:t]).reshape(t, H, D), ends[0] - t, D**-0.5)) <= 1e-2
    mt, md = _ms(kernels, ls), _ms(kernels, ld)
    print(f"\nTAIL pass {H}x{KV}x{D} {t} rows at depth {ends[0] - t}: span {at.span} partials+fold {mt * 1e3:7.1f} us, "
          f"decode split+combine {md * 1e3:7.1f} us (x{md / mt:4.1f}, {profile.name})")  # fmt: skip


def test_split_tail_window_has_the_cold_rows_bits(kernels, profile):
    """Gemma 3's heads (4, 1 KV head of 256) with a 1024-key window: blocks before every window of
    the tail are NaN in the device table (they may have been released), the cold pass reads its own."""
    H, KV, D, W = 4, 1, 256, 1024
    at = _Attn(kernels, profile, (H, KV, D), window=W)
    rng = np.random.default_rng(2)
    bs = profile.kv_block_size
    depth, tail = 5000, 12
    n = depth + tail
    qh = _qs(rng, n, H * D)
    cache = PagedCache(rng, [n], KV, D, bs)
    cold, launches = at.single_launch(at.single, upload(qh, "bf16"), upload(np.arange(n, dtype=np.int32), "i32"), cache, n)
    at.run(launches)
    released = PagedCache.__new__(PagedCache)  # the same cache with the blocks before the tail's windows NaN
    released.k, released.v, released.tables = cache.k, cache.v, cache.tables
    t = cache.tables.copy()
    nan_block = np.full((1,) + cache.k.shape[1:], np.nan)
    t[0, : ops_ref.window_start(depth, W) // bs] = cache.k.shape[0]
    released.kd = upload(np.concatenate([cache.k, nan_block]), "bf16")
    released.vd = upload(np.concatenate([cache.v, nan_block]), "bf16")
    released.td = upload(t, "i32")
    warm, launches = at.split_launches(upload(qh[depth:], "bf16"), upload(np.arange(depth, n, dtype=np.int32), "i32"),
                                       released, tail, max_ctx=n)  # fmt: skip
    at.run(launches)
    assert np.array_equal(_bits(warm), _bits(cold)[depth:])
    want = cache.ref(0, bf_round(qh[depth:]).reshape(tail, H, D), depth, D**-0.5, W)
    assert rel_err(warm.get(), want) <= 1e-2


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_tail_attention_at_depth(kernels, profile, shape):
    """Timings (printed): the tail's attention per launch form, and the cold pass with / without the fold."""
    H, KV, D = shape
    bs = profile.kv_block_size
    at = _Attn(kernels, profile, shape)
    dims = dict(heads=H, kv_heads=KV, head_dim=D)
    kernels.prebuild([at.plain.spec, at.single.spec, at.comb.spec] + [c.spec for c in at.part.values()])
    dp = attention_params(dims, profile.tuning, bs, direct=False, q_stride=H * D, out_stride=H * D)
    dec = kc.choice("attention", **dp)
    dcomb = kc.choice("attention_combine", heads=H, head_dim=D, split=dp["split"], out_stride=H * D)
    rng = np.random.default_rng(0)
    lines = []
    for depth in (1024, 4096, 16384):
        cache = PagedCache(rng, [depth + 16], KV, D, bs)
        for tail in (8, 16):
            qh = _qs(rng, tail, H * D)
            q, pos = upload(qh, "bf16"), upload(np.arange(depth, depth + tail, dtype=np.int32), "i32")
            ref = cache.ref(0, bf_round(qh).reshape(tail, H, D), depth, D**-0.5)
            out_p, lp = at.single_launch(at.plain, q, pos, cache, tail)
            out_s, ls = at.split_launches(q, pos, cache, tail, max_ctx=32768)  # the tail graphs' grid: max_model_len
            out_4, l4 = at.split_launches(q, pos, cache, tail, max_ctx=32768, form=kc.PREFILL_WARPS)
            out_1, l1 = at.split_launches(q, pos, cache, tail, max_ctx=32768, form=1)
            splits = -(-(depth + tail) // dp["split"])
            part_o, part_ml = poisoned((tail, H, splits, D), "f32"), poisoned((tail, H, splits, 2), "f32")
            out_d = poisoned((tail, H * D))
            dargs = dict(q=q, positions=pos, k_cache=cache.kd, v_cache=cache.vd, out=out_d, part_o=part_o, part_ml=part_ml,
                         max_splits=splits, block_tables=upload(np.repeat(cache.tables, tail, axis=0), "i32"),
                         max_blocks=cache.tables.shape[1])  # fmt: skip
            for name, _ in kc.kernel_args(dec.spec):
                if name.startswith("pf"):
                    dargs[name] = cache.kd  # an L2 prefetch of a later weight: any readable range
            cargs = dict(out=out_d, part_o=part_o, part_ml=part_ml, positions=pos, max_splits=splits)
            ld = [(dec, tail, {"max_splits": splits}, {n: dargs[n] for n, _ in dec.args}), (dcomb, tail, {}, cargs)]
            for launches in (lp, ls, l4, l1, ld):
                at.run(launches)
            for o in (out_p, out_s, out_4, out_1, out_d):
                assert rel_err(o.get(), ref) <= 1e-2
            assert np.array_equal(_bits(out_s), _bits(out_4)) and np.array_equal(_bits(out_s), _bits(out_1))
            ms = [_ms(kernels, x) for x in (lp, ls, l4, l1, ld)]
            lines.append(f"tail {H}x{KV}x{D} {tail:2d} rows at depth {depth:>5}: no split {ms[0] * 1e3:7.1f} us, "
                         f"span {at.span} split+fold gqa {ms[1] * 1e3:7.1f} us (4 warps/head {ms[2] * 1e3:7.1f}, 1 warp "
                         f"{ms[3] * 1e3:7.1f}), decode split+combine {ms[4] * 1e3:7.1f} us; x{ms[0] / ms[1]:5.1f} "
                         f"({profile.name})")  # fmt: skip
        # the cold pass over the whole prompt: the span fold's cost
        n = depth + 16
        q, pos = upload(_qs(rng, n, H * D), "bf16"), upload(np.arange(n, dtype=np.int32), "i32")
        _, lp = at.single_launch(at.plain, q, pos, cache, n)
        _, ls = at.single_launch(at.single, q, pos, cache, n)
        mp, msp = _ms(kernels, lp, 5), _ms(kernels, ls, 5)
        lines.append(f"cold {H}x{KV}x{D} {n:>5} rows: no split {mp * 1e3:8.1f} us, span {at.span} fold {msp * 1e3:8.1f} us "
                     f"(x{msp / mp:5.2f}) ({profile.name})")  # fmt: skip
    print("\n" + "\n".join(lines))


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_span_sweep(kernels, profile, shape):
    """Timings (printed) to pick attention_prefill.span: a 16-row tail's split + fold (gqa) and the
    cold pass's fold, per span, at 4k and 16k (the split's bits checked against the cold pass's)."""
    H, KV, D = shape
    bs = profile.kv_block_size
    rng = np.random.default_rng(4)
    lines = []
    ats = {span: _Attn(kernels, profile, shape, span=span) for span in (256, 512, 1024, 2048)}
    kernels.prebuild([c.spec for at in ats.values() for c in (at.single, at.part["gqa"], at.comb)])  # in parallel
    for depth in (4096, 16384):
        n = depth + 16
        cache = PagedCache(rng, [n], KV, D, bs)
        qh = _qs(rng, n, H * D)
        q, pos = upload(qh, "bf16"), upload(np.arange(n, dtype=np.int32), "i32")
        qt, post = upload(qh[depth:], "bf16"), upload(np.arange(depth, n, dtype=np.int32), "i32")
        for span, at in ats.items():
            cold, lc = at.single_launch(at.single, q, pos, cache, n)
            warm, lw = at.split_launches(qt, post, cache, 16, max_ctx=32768)
            at.run(lc)
            at.run(lw)
            assert np.array_equal(_bits(warm), _bits(cold)[depth:]), (shape, depth, span)
            mw, mc = _ms(kernels, lw), _ms(kernels, lc, 5)
            lines.append(f"span {span:>4} {H}x{KV}x{D} depth {depth:>5}: tail 16 rows split+fold {mw * 1e3:7.1f} us, "
                         f"cold {n} rows fold {mc * 1e3:8.1f} us ({profile.name})")  # fmt: skip
    print("\n" + "\n".join(lines))
