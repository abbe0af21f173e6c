"""The chunked delta rule without a GPU: kernels/gated_delta_chunk.cu.j2 (both forms, mma and FMA)
run on the CPU (tests/fixtures/cuda_emu.py: g++, the block's threads as fibers, barriers and
warp-wide mma checked) against the numpy reference of the kernels' contract
(engine.ops_ref_linear.delta_rule_varlen): chunk tails, sequences shorter than a chunk, several
sequences, state from a slot / zeros / in place, snapshots; in thread order and reversed (a
shared-memory race shows as a difference). And the lowering choice on the fake-driver CudaRunner
(the default: prefill passes launch gated_delta_chunk with its shared memory and chunks that
divide the KV block size, decode keeps gated_delta_rule). The GPU check is tests/gpu/test_delta_chunk_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures import cuda_emu

from engine import linear_attn_kernels as lk
from engine import ops_ref_linear as L
from engine.render import render

SLOTS = 24


def _bf16_bits(x) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _from_bits(h) -> np.ndarray:
    return (np.asarray(h, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("mma", [True, False])
@pytest.mark.parametrize(
    "lens,kh,vh,kd,vd,tiled,chunk,v_block",
    [
        ([1, 15, 16, 17, 40], 1, 2, 32, 32, False, 16, 0),
        ([33, 5], 2, 4, 16, 16, True, 32, 0),
        ([70], 1, 1, 32, 64, False, 64, 64),
        ([70, 3], 1, 2, 128, 128, True, 0, 0),  # Qwen3.5's head dims, the default chunk (32)
        ([130], 1, 1, 128, 128, False, 64, 0),
        ([50, 20], 1, 2, 128, 64, True, 32, 16),  # 16 state columns per block
    ],
)
def test_delta_chunk_on_cpu(tmp_path, lens, kh, vh, kd, vd, tiled, chunk, v_block, mma):
    rng = np.random.default_rng(7)
    rows = len(lens)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(starts[-1])
    qkv_w = 2 * kh * kd + vh * vd
    qs, bs = qkv_w + (3 if tiled else 8), vh + 4  # an odd stride: the scalar q / k loads
    qkv = _bf16_bits(rng.standard_normal((total, qs)))
    b, a = _bf16_bits(rng.standard_normal((total, bs))), _bf16_bits(rng.standard_normal((total, bs)))
    A = -np.exp(rng.uniform(-2, 1.5, vh)).astype(np.float32)
    dt = (0.5 * rng.standard_normal(vh)).astype(np.float32)
    state0 = (rng.standard_normal((SLOTS, vh, kd, vd)) * 0.1).astype(np.float32)
    outs = np.arange(rows, dtype=np.int32)
    ins = np.array([-1 if s % 3 == 0 else (outs[s] if s % 3 == 1 else SLOTS - 1 - s) for s in range(rows)], np.int32)
    snap = np.full(total, -1, np.int32)
    free = iter(range(rows, SLOTS - rows))
    points = {int(starts[-2]) + 15, int(starts[0]), total - 1, int(starts[1]) + 3}
    if rows == 1:  # a snapshot after every 16th token (the prefix cache's block boundaries)
        points |= set(range(15, total, 16))
    for t in sorted(p for p in points if p < total):
        snap[t] = next(free)
    # each sequence's first position (a pass resumed mid-prompt: its first chunk runs to the grid)
    pos = np.concatenate([(7 * s * s) % 45 + np.arange(n) for s, n in enumerate(lens)]).astype(np.int32)
    k_ = lk.delta_chunk_kernel(kh, vh, kd, vd, qs, bs, bs, vh * vd, tiled, True, chunk, v_block, mma)
    lib, types = cuda_emu.compile_any(render(k_.spec), k_.spec.entry, tmp_path)
    q, k, v = L.split_qkv(_from_bits(qkv)[:, :qkv_w], k_heads=kh, v_heads=vh, k_dim=kd, v_dim=vd, v_tiled=tiled)
    g, beta = L.delta_gates(_from_bits(a)[:, :vh], _from_bits(b)[:, :vh], A, dt)
    want, want_state = L.delta_rule_varlen(q, k, v, g, beta, state0, starts, ins, outs, snap,
                                           k_.spec.params["chunk"], pos)
    for reverse in (False, True):
        out = np.full((total, vh * vd), 0x7FC0, np.uint16)  # NaN-poisoned
        state = state0.copy()
        cuda_emu.launch_any(lib, types, k_.grid(rows), k_.block[0], k_.smem,
                            [out, qkv, b, a, A, dt, state, ins, outs, snap, starts, pos, rows], reverse)
        got = _from_bits(out).reshape(total, vh, vd)
        assert np.isfinite(got).all()
        err = np.linalg.norm(got - want, axis=(1, 2)) / np.linalg.norm(want, axis=(1, 2))
        assert err.max() < 1e-2, (int(err.argmax()), float(err.max()))
        st_err = np.linalg.norm(state - want_state) / np.linalg.norm(want_state)
        assert st_err < 1e-5, st_err


def test_chunked_prefill_on_the_fake_runner(tmp_path, monkeypatch):
    from fixtures.hybrid import write_qwen3_5_hf
    from test_plan_runner_fake import GREEDY, FakeDriver, fake_builder

    import engine.runner_cuda as rc
    from engine.model import load_model
    from engine.types import StepItem

    drv = FakeDriver()
    monkeypatch.setattr(rc, "cuda", drv.module())
    path = write_qwen3_5_hf(tmp_path / "m", bf16=True, hidden_size=128, intermediate_size=256,
                            linear_key_head_dim=32, linear_value_head_dim=32)
    runner = rc.CudaRunner(load_model(path), num_blocks=300, max_model_len=4096, builder=fake_builder(tmp_path),
                           state_slots=6)
    drv.reset()
    d = runner.plan.dims
    pre = [la for st in runner.plan.steps for la in st.launches["prefill"] if la.spec.template.startswith("gated_delta")]
    assert pre and all(la.spec.template == "gated_delta_chunk" and la.smem > 0 for la in pre)
    # its chunk (64 fits the shared memory at these heads) divides the KV block: the runner's state grid
    assert {la.spec.params["chunk"] for la in pre} == {runner.state_align} == {16}
    a = StepItem(0, list(range(3, 40)), 0, [0, 1, 2], False, GREEDY, state_slot=2, state_snapshots=((16, 4),))
    b = StepItem(1, list(range(3, 8)), 0, [3], True, GREEDY, state_slot=3)
    runner.step([a, b])
    chunk = [g for n, g, _ in drv.launches if n.startswith("gated_delta_chunk")]
    assert chunk and all(g == (2, d["lin_v_heads"], d["lin_v_dim"] // 32) for g in chunk)
    drv.launches.clear()
    runner.step([StepItem(1, [5], 5, [3], True, GREEDY, state_slot=3)])
    names = {n.split("__")[0] for n, _, _ in drv.launches}
    assert "gated_delta_rule" in names and "gated_delta_chunk" not in names


def test_chunked_prefill_is_as_exact_as_the_recurrent_kernel(tmp_path):
    """The default chunked kernel (mma, the longest chunk that fits) and the recurrent prefill kernel
    on one 150-token sequence at the tiny GPU test's heads (fixtures.hybrid_case.DIMS): both give
    the exact (f64) output rounded to bf16 but for under 1 % of the values one ulp off (a few near
    zero more) and the same error norm (the chunked form's gain may not cost accuracy; the GPU's end-to-end check is
    tests/gpu/test_delta_chunk_gpu.py's, which runs both forms)."""
    rng = np.random.default_rng(3)
    kh, vh, kd, vd, n = 2, 4, 32, 32, 150
    qs = 2 * kh * kd + vh * vd
    qkv = _bf16_bits(rng.standard_normal((n, qs)))
    b, a = _bf16_bits(2.0 * rng.standard_normal((n, vh))), _bf16_bits(2.0 * rng.standard_normal((n, vh)))
    A = -np.exp(rng.uniform(-2, 1.0, vh)).astype(np.float32)
    dt = (0.5 * rng.standard_normal(vh)).astype(np.float32)
    starts, ins, outs, snap = (np.array(x, np.int32) for x in ([0, n], [-1], [0], [-1] * n))
    state0 = np.zeros((1, vh, kd, vd), np.float32)
    q, k, v = L.split_qkv(_from_bits(qkv), k_heads=kh, v_heads=vh, k_dim=kd, v_dim=vd, v_tiled=False)
    g, beta = L.delta_gates(_from_bits(a), _from_bits(b), A, dt)
    want, _ = L.delta_rule_varlen(q, k, v, g, beta, state0, starts, ins, outs, snap)
    want = np.asarray(want).reshape(n, vh * vd)
    args = lambda out: [out, qkv, b, a, A, dt, state0.copy(), ins, outs, snap, starts]  # noqa: E731
    chunk = lk.delta_chunk_kernel(kh, vh, kd, vd, qs, vh, vh, vh * vd, False, True)
    out_c = np.full((n, vh * vd), 0x7FC0, np.uint16)
    lib, types = cuda_emu.compile_any(render(chunk.spec), chunk.spec.entry, tmp_path)
    cuda_emu.launch_any(lib, types, chunk.grid(1), chunk.block[0], chunk.smem, [*args(out_c), np.arange(n, dtype=np.int32), 1])
    rec = lk.delta_rule_kernel(kh, vh, kd, vd, qs, vh, vh, vh * vd, False, True, lk.DELTA_PREFILL_THREADS)
    out_r = np.full((n, vh * vd), 0x7FC0, np.uint16)
    lib, types = cuda_emu.compile_any(render(rec.spec), rec.spec.entry, tmp_path)
    cuda_emu.launch_any(lib, types, rec.grid(1), rec.block[0], 0, [*args(out_r), 1])
    exact = _bf16_bits(want).astype(np.int32)
    for name, out in (("chunked", out_c), ("recurrent", out_r)):
        ulps = np.abs(out.astype(np.int32) - exact)  # (same-sign values: the bit distance is the ulp count)
        err = np.linalg.norm(_from_bits(out) - want, axis=1) / np.linalg.norm(want, axis=1)
        floor = np.linalg.norm(_from_bits(_bf16_bits(want)) - want, axis=1) / np.linalg.norm(want, axis=1)
        # more than one ulp only where that is under 1e-5 of the row's largest value (f32 rounding)
        far = (np.abs(_from_bits(out) - want) / np.abs(want).max(axis=1, keepdims=True))[ulps > 1]
        assert (ulps > 0).mean() < 0.01 and (far < 1e-5).all(), (name, int((ulps > 0).sum()), far.max(initial=0))
        assert err.max() < 1.02 * floor.max() and err.mean() < 1.01 * floor.mean(), (name, err.max(), floor.max())


def test_chunks_end_on_the_position_grid(tmp_path):
    """A pass of positions 7..70 cuts its chunks where positions are multiples of the chunk (16), so
    it gives the bits of two passes split at 16 (the second resumed from the first's state); split
    at 20 instead (off the grid) the state differs: the cuts are the arithmetic."""
    rng = np.random.default_rng(5)
    kh, vh, kd, vd, p0, n = 1, 2, 32, 32, 7, 64
    qs = 2 * kh * kd + vh * vd
    qkv = _bf16_bits(rng.standard_normal((n, qs)))
    b, a = _bf16_bits(2.0 * rng.standard_normal((n, vh))), _bf16_bits(2.0 * rng.standard_normal((n, vh)))
    A = -np.exp(rng.uniform(-6, -4, vh)).astype(np.float32)  # slow decay: a cut's rounding lasts
    dt = (0.5 * rng.standard_normal(vh)).astype(np.float32)
    k_ = lk.delta_chunk_kernel(kh, vh, kd, vd, qs, vh, vh, vh * vd, False, True, block=16)
    assert k_.spec.params["chunk"] == 16
    lib, types = cuda_emu.compile_any(render(k_.spec), k_.spec.entry, tmp_path)
    state0 = (rng.standard_normal((2, vh, kd, vd)) * 0.1).astype(np.float32)

    def run(cuts):
        out, state = np.full((n, vh * vd), 0x7FC0, np.uint16), state0.copy()
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            o = np.full((hi - lo, vh * vd), 0x7FC0, np.uint16)
            args = [o, np.ascontiguousarray(qkv[lo:hi]), np.ascontiguousarray(b[lo:hi]), np.ascontiguousarray(a[lo:hi]),
                    A, dt, state, np.array([0], np.int32), np.array([1], np.int32), np.full(hi - lo, -1, np.int32),
                    np.array([0, hi - lo], np.int32), np.arange(p0 + lo, p0 + hi, dtype=np.int32), 1]
            cuda_emu.launch_any(lib, types, k_.grid(1), k_.block[0], k_.smem, args)
            out[lo:hi] = o
            state[0] = state[1]  # the next pass continues from the live slot
        return out, state[1].copy()

    whole, on_grid, off_grid = run([0, n]), run([0, 16 - p0, n]), run([0, 20 - p0, n])
    assert np.array_equal(whole[0], on_grid[0]) and np.array_equal(whole[1], on_grid[1])
    assert not np.array_equal(whole[1], off_grid[1])
