"""The key-split flash prefill (kernels/attention_prefill.cu.j2 with ``span``; docs/kernels.md) run
by the CPU emulator (tests/fixtures/cuda_emu.py: mma.sync, ldmatrix, cp.async and the warp
shuffles as the GPU defines them) on a random paged cache, against engine.ops_ref and against
itself: a long (cold) pass through the single-pass launch (one block walks every span and folds
its partials in registers) and the same rows as a prefix hit's tail through the partial launch
(one block per span) + attention_combine (fold) give the same bits, with and without a sliding
window and with several sequences in one pass; rows below the first span end get the bits of the
kernel without the key split (span 0). Outputs and partials start poisoned (NaN), so a row or a
span a launch should write and does not shows."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures import cuda_emu
from fixtures.checkpoints import to_bf16_bits

from engine import kernel_catalog as kc
from engine import ops_ref
from engine.render import render

H, KV, D, BS = 4, 2, 32, 16
BKV, WARPS, SPAN = 16, 2, 32
Q_STRIDE = (H + 2 * KV) * D  # q rows inside a q|k|v row, as the plans lay them out
SCALE = D**-0.5
NAN_BF16 = 0x7FC0


def _bf(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class _Case:
    """A random bf16 paged cache for sequences of ``ctxs`` keys (blocks a random permutation, unused
    table entries pointing at a NaN block, as a released one may hold anything) and a random q
    row for every position of every sequence."""

    def __init__(self, rng, ctxs: list[int]):
        need = [-(-c // BS) for c in ctxs]
        nblocks = sum(need) + 1
        perm = rng.permutation(nblocks - 1)
        self.tables = np.full((len(ctxs), max(need) + 2), nblocks - 1, np.int32)
        at = 0
        for s, n in enumerate(need):
            self.tables[s, :n] = perm[at : at + n]
            at += n
        self.k = to_bf16_bits(rng.standard_normal((nblocks, BS, KV, D)).astype(np.float32))
        self.v = to_bf16_bits(rng.standard_normal((nblocks, BS, KV, D)).astype(np.float32))
        self.k[-1] = self.v[-1] = NAN_BF16
        # a few large scores, so that the spans' maxima differ and the fold's rescaling matters
        self.q = [to_bf16_bits((rng.standard_normal((c, Q_STRIDE)) * rng.uniform(0.5, 3.0)).astype(np.float32)) for c in ctxs]

    def ref(self, s: int, pos0: int, n: int, window: int) -> np.ndarray:
        kk, vv = ops_ref.gather_kv(_bf(self.k), _bf(self.v), self.tables[s], pos0 + n)
        q = _bf(self.q[s][pos0 : pos0 + n, : H * D]).reshape(n, H, D)
        return ops_ref.attention_dense(q.astype(np.float64), kk.astype(np.float64), vv.astype(np.float64), pos0, SCALE,
                                       window or None)  # fmt: skip


def _spec(span: int, partial: bool, window: int, block_kv: int = BKV, warps: int = WARPS, gqa: bool = False):
    return kc.spec(
        "attention_prefill", heads=H, kv_heads=KV, head_dim=D, block_size=BS, scale=repr(SCALE), q_stride=Q_STRIDE,
        out_stride=H * D, block_q=16 * warps, block_kv=block_kv, warps=warps, window=window, span=span, partial=partial,
        gqa=gqa,
    )  # fmt: skip


_LIBS: dict[str, tuple] = {}


def _lib(spec, tmp):
    if spec.entry not in _LIBS:
        _LIBS[spec.entry] = cuda_emu.compile_any(render(spec), spec.entry, tmp)
    return _LIBS[spec.entry]


def _pass(case: _Case, segs: list[tuple[int, int, int]]):
    """Inputs of one prefill pass over ``segs`` [(sequence, first position, rows)]."""
    q = np.concatenate([case.q[s][p0 : p0 + n] for s, p0, n in segs])
    pos = np.concatenate([np.arange(p0, p0 + n, dtype=np.int32) for _, p0, n in segs])
    starts = np.cumsum([0] + [n for _, _, n in segs]).astype(np.int32)
    tables = np.ascontiguousarray(case.tables[[s for s, _, _ in segs]])
    return q, pos, starts, tables, max(n for _, _, n in segs)


def _single(case, segs, spec, tmp, reverse=False) -> np.ndarray:
    q, pos, starts, tables, max_q = _pass(case, segs)
    out = np.full((len(pos), H * D), NAN_BF16, np.uint16)
    lib, types = _lib(spec, tmp)
    p = spec.params
    grid = (-(-max_q // p["block_q"]), H, len(segs))
    cuda_emu.launch_any(lib, types, grid, 32 * p["warps"], kc.attention_prefill_smem(p),
                        [out, q, case.k, case.v, tables, pos, starts, tables.shape[1]], reverse=reverse)  # fmt: skip
    return out


def _split(case, segs, spec, tmp, max_ctx: int, reverse=False) -> np.ndarray:
    q, pos, starts, tables, max_q = _pass(case, segs)
    p = spec.params
    splits = -(-max_ctx // p["span"])
    n = len(pos)
    part_o = np.full((n, H, splits, D), np.nan, np.float32)
    part_ml = np.full((n, H, splits, 2), np.nan, np.float32)
    lib, types = _lib(spec, tmp)
    grid = kc.choice("attention_prefill", **p).grid(len(pos), max_q=max_q, nseq=len(segs), max_splits=splits)
    cuda_emu.launch_any(lib, types, grid, 32 * p["warps"], kc.attention_prefill_smem(p),
                        [None, q, case.k, case.v, tables, pos, starts, tables.shape[1], part_o, part_ml, splits],
                        reverse=reverse)  # fmt: skip
    comb = kc.spec("attention_combine", heads=H, head_dim=D, split=p["span"], out_stride=H * D, window=p["window"],
                   fold=True)  # fmt: skip
    out = np.full((n, H * D), NAN_BF16, np.uint16)
    clib, ctypes_ = _lib(comb, tmp)
    cuda_emu.launch_any(clib, ctypes_, (n, H, 1), D, 0, [out, part_o, part_ml, pos, splits])
    return out


def _check_ref(case, segs, out, window):
    row = 0
    for s, p0, n in segs:
        got = _bf(out[row : row + n]).astype(np.float64)
        want = case.ref(s, p0, n, window)
        assert np.isfinite(got).all(), (s, p0, n)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 1e-2, (s, p0, n, err)
        row += n


@pytest.mark.parametrize("window", [0, 40], ids=["full", "window40"])
def test_span_split_warm_equals_cold_bits(tmp_path, window):
    rng = np.random.default_rng(7 + window)
    ctxs = [150, 75]
    case = _Case(rng, ctxs)
    # cold: every position of both sequences in one pass (3 + 2 query tiles of 32 rows)
    cold_segs = [(0, 0, 150), (1, 0, 75)]
    cold = _single(case, cold_segs, _spec(SPAN, False, window), tmp_path)
    _check_ref(case, cold_segs, cold, window)
    # the same pass in the reversed thread order: no shared-memory race
    assert np.array_equal(cold, _single(case, cold_segs, _spec(SPAN, False, window), tmp_path, reverse=True))
    # warm tails (a prefix hit leaves the last rows): both sequences in one partial pass, tails
    # that start inside a span, on a span boundary and cross several of the tile's spans
    for tails in ([(0, 139, 11), (1, 64, 11)], [(0, 128, 16)], [(0, 100, 20), (1, 31, 3)]):
        warm = _split(case, tails, _spec(SPAN, True, window), tmp_path, max_ctx=160)
        _check_ref(case, tails, warm, window)
        gqa = _split(case, tails, _spec(SPAN, True, window, warps=H // KV, gqa=True), tmp_path, max_ctx=160)
        assert np.array_equal(gqa, warm), tails
        row = 0
        for s, p0, n in tails:
            at = p0 + (0 if s == 0 else 150)
            assert np.array_equal(warm[row : row + n], cold[at : at + n]), (window, s, p0, n)
            row += n
    # the rows of the first span: the bits of the kernel without the key split
    plain = _single(case, cold_segs, _spec(0, False, window), tmp_path)
    first = np.r_[0:SPAN, 150 : 150 + SPAN]
    assert np.array_equal(plain[first], cold[first])
    # and later rows do differ from it somewhere (the spans are folded, not walked through)
    assert not np.array_equal(plain, cold)


@pytest.mark.parametrize("window", [0, 40], ids=["full", "window40"])
def test_span_split_query_tiles_and_gqa_blocks_same_bits(tmp_path, window):
    """The split launch may take another query tile (a tail of <= 16 rows fits one warp) or one
    block per kv head (gqa: its warps the group's query heads): a row's arithmetic depends on the
    span and the K/V tile only, so they all agree with the cold single pass."""
    rng = np.random.default_rng(3)
    case = _Case(rng, [120, 90])
    segs = [(0, 105, 15), (1, 77, 13)]
    cold = _single(case, [(0, 0, 120), (1, 0, 90)], _spec(SPAN, False, window, warps=1), tmp_path)
    want = np.concatenate([cold[105:120], cold[120 + 77 : 120 + 90]])
    for spec in (_spec(SPAN, True, window, warps=1), _spec(SPAN, True, window, warps=2),
                 _spec(SPAN, True, window, warps=H // KV, gqa=True)):  # fmt: skip
        assert np.array_equal(_split(case, segs, spec, tmp_path, max_ctx=128), want), spec.entry
    _check_ref(case, segs, want, window)


def test_span_spec_rules():
    with pytest.raises(Exception, match="span"):
        _spec(24, False, 0)
    with pytest.raises(Exception, match="partial"):
        _spec(0, True, 0)
    with pytest.raises(Exception, match="gqa"):
        _spec(SPAN, True, 0, warps=1, gqa=True)
    g = kc.choice("attention_prefill", **_spec(SPAN, True, 0, warps=H // KV, gqa=True).params)
    assert g.grid(30, max_q=20, nseq=3, max_splits=5) == (2, KV, 15) and g.block == (32 * H // KV, 1, 1)
    c = kc.choice("attention_prefill", **_spec(SPAN, True, 0).params)
    assert [n for n, _ in c.args][-3:] == ["part_o", "part_ml", "max_splits"]
    assert c.grid(10, max_q=10, nseq=2, max_splits=5) == (1, H, 10)
    assert kc.choice("attention_prefill", **_spec(SPAN, False, 0).params).grid(10, max_q=40, nseq=2) == (2, H, 2)
