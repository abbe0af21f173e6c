"""The attention of a warm-prefix tail at depth (issue #36's warm TTFT at 16k), on a real GPU (skipped
without one): a prefix hit leaves a few rows of one sequence to prefill after thousands of cached
keys, and a prefill pass runs attention_prefill, whose grid is (query tiles, heads, sequences) with
no split over the keys: one block per head walks every key. This prints, per depth (1k / 4k / 16k
cached keys) and head shape (Qwen3.5-4B's full attention: 16 heads, 4 KV heads of 256; Qwen3-4B:
32, 8, 128), the GPU time of that launch for an 8-row tail against the decode path's split-KV
attention + combine over the same 8 rows (each row its own decode row with the sequence's table:
what a key-split tail would cost), both checked against ops_ref on the profile's tiles. The
per-layer difference times the model's attention layers is what a split tail attention would take
off a warm request's GPU time (the split would have to be the arithmetic of the cold passes too,
to keep warm == cold bits: docs/engine-loop.md).

    python3 -m pytest -q -s tests/gpu/test_tail_attention_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.catalog_specs import attention_params, attention_prefill_params
from gpu_harness import DeviceArray, bf_round, poisoned, rel_err, upload
from test_kernels import PagedCache

from engine import cuda
from engine import kernel_catalog as kc

TAIL = 8


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


@pytest.mark.parametrize("shape", [(16, 4, 256), (32, 8, 128)], ids=["qwen3.5-4b", "qwen3-4b"])
def test_tail_attention_at_depth(kernels, profile, shape):
    H, KV, D = shape
    bs = profile.kv_block_size
    dims = dict(heads=H, kv_heads=KV, head_dim=D)
    q_stride, out_stride = (H + 2 * KV) * D, H * D
    pre = kc.choice("attention_prefill", **attention_prefill_params(dims, profile.tuning, bs, q_stride=q_stride,
                                                                    out_stride=out_stride))
    dp = attention_params(dims, profile.tuning, bs, mode="decode", direct=False, q_stride=q_stride, out_stride=out_stride)
    dec = kc.choice("attention", **dp)
    comb = kc.choice("attention_combine", heads=H, head_dim=D, split=dp["split"], out_stride=out_stride)
    rng = np.random.default_rng(0)
    lines = []
    for depth in (1024, 4096, 16384):
        cache = PagedCache(rng, [depth + TAIL], KV, D, bs)
        qkv = bf_round(rng.standard_normal((TAIL, q_stride)))
        pos = np.arange(depth, depth + TAIL, dtype=np.int32)
        q = qkv[:, : H * D].reshape(TAIL, H, D)
        ref = cache.ref(0, q, depth, D**-0.5).reshape(TAIL, H * D)
        common = dict(q=upload(qkv, "bf16"), k_cache=cache.kd, v_cache=cache.vd, positions=upload(pos, "i32"))
        # the prefill pass: one sequence of TAIL rows, block table row 0
        out_p = poisoned((TAIL, out_stride))
        pargs = dict(common, out=out_p, block_tables=cache.td, seq_starts=upload(np.array([0, TAIL], np.int32), "i32"),
                     max_blocks=cache.tables.shape[1])
        pgrid = {"max_q": TAIL, "nseq": 1}
        kernels.launch(pre, TAIL, grid_kw=pgrid, **pargs)
        # the decode path: TAIL rows, each with the sequence's table, split over the keys + combine
        splits = -(-(depth + TAIL) // dp["split"])
        part_o, part_ml = poisoned((TAIL, H, splits, D), "f32"), poisoned((TAIL, H, splits, 2), "f32")
        out_d = poisoned((TAIL, out_stride))
        dargs = dict(common, out=out_d, part_o=part_o, part_ml=part_ml, max_splits=splits,
                     block_tables=upload(np.repeat(cache.tables, TAIL, axis=0), "i32"), max_blocks=cache.tables.shape[1])
        for name, _ in kc.kernel_args(dec.spec):
            if name.startswith("pf"):
                dargs[name] = cache.kd  # an L2 prefetch of a later weight: any readable range
        cargs = dict(out=out_d, part_o=part_o, part_ml=part_ml, positions=common["positions"], max_splits=splits)
        kernels.launch(dec, TAIL, grid_kw={"max_splits": splits}, **{n: dargs[n] for n, _ in dec.args})
        kernels.launch(comb, TAIL, **cargs)
        assert rel_err(out_p.get()[:, : H * D], ref) <= 1e-2 and rel_err(out_d.get()[:, : H * D], ref) <= 1e-2
        ms_p = _ms(kernels, [(pre, TAIL, pgrid, pargs)])
        ms_d = _ms(kernels, [(dec, TAIL, {"max_splits": splits}, {n: dargs[n] for n, _ in dec.args}), (comb, TAIL, {}, cargs)])
        lines.append(f"tail attention {H}x{KV}x{D}, {TAIL} rows at depth {depth:>5}: prefill kernel {ms_p * 1e3:8.1f} us "
                     f"(grid {pre.grid(TAIL, **pgrid)}), split decode + combine {ms_d * 1e3:8.1f} us "
                     f"({splits} splits), x{ms_p / ms_d:5.1f} ({profile.name})")
    print("\n" + "\n".join(lines))
