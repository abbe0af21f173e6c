"""The tensor-core decode linear (kernels/gemv_mma.cu.j2) without a GPU: its spec rules, the shape rule
of its params (a weight's k split the same at every batch size), the kernel run under g++
(tests/fixtures/cuda_emu.py: fibers for threads, the m16n8k16 mma as a warp collective, fma.rn.bf16x2
rounded once) against ``x @ engine.quant.dequantize(W).T`` for every storage type it decodes, and every
row's output bits the same alone (batch 1) as in buckets of 3, 11 and 17 rows. NVRTC compiles it for
every profile arch (tests/gpu/test_gemv_mma_gpu.py runs it on a GPU)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from fixtures import cuda_emu
from fixtures.decode_linear_checks import profiles_render_and_compile
from fixtures.quant_blocks import random_blocks

from engine import kernel_catalog as kc
from engine import quant, storage
from engine.kernel_catalog.contracts import MMA_UNIT
from engine.render import render
from engine.storage import BLOCK_SIZES
from engine.types import ConfigError

ROOT = Path(__file__).resolve().parent.parent
N = 40  # two m tiles and a half (the last block's row tail)


def test_spec_rules_name_the_problem():
    ok = kc.gemv_mma_params("q4_k", 2560, 9728, 8)
    assert ok is not None and kc.spec("gemv_mma", **ok).entry.startswith("gemv_mma__quantq4k_n2560_k9728_bmax8")
    for over, msg in (
        (dict(bmax=24), "bmax=24"),
        (dict(mt=3), "mt=3"),
        (dict(k=9728 + 64), "multiple of the q4_k unit"),
        (dict(kparts=1000), "kparts=1000"),
        (dict(quant="q2_k"), "q2_k"),
        (dict(quant="q5_0"), "q5_0"),
        (dict(x_stride=2564), "x_stride"),
        (dict(residual=True, out_dtype="f32"), "residual"),
        (dict(wm=8, wk=8), "exceed"),
        (dict(depth=9), "depth=9"),
    ):
        with pytest.raises(ConfigError, match=msg):
            kc.spec("gemv_mma", **{**ok, **over})
    assert kc.gemv_mma_params("q4_k", 2560, 2560 + 128, 8) is None  # k not a whole number of units
    assert kc.gemv_mma_params("q8_0r", 2560, 2560 - 64, 8) is not None
    assert kc.gemv_mma_params("q5_0", 2560, 2560, 8) is None  # no gemv_mma decoder: the GEMV keeps it
    assert kc.gemv_mma_params("bf16", 2560, 2560, 8, x_stride=2564) is None


def test_the_k_split_is_the_same_at_every_batch_size_and_fills_the_sms():
    for qt, n, k in (("q4_k", 2560, 4096), ("q6_kr", 2560, 9728), ("q4_k", 19456, 2560), ("bf16", 1024, 576)):
        ps = [kc.gemv_mma_params(qt, n, k, b, sm_count=132) for b in (8, 16, 32, 64)]
        assert len({(p["wk"], p["kparts"]) for p in ps}) == 1, (qt, n, k)  # a row's sum order
        p = ps[0]
        blocks = -(-n // (16 * p["mt"] * p["wm"])) * p["kparts"]
        if n >= 2560:  # waves of 2 blocks per SM, filled (a small matrix cannot fill them)
            assert blocks / (-(-blocks // 264) * 264) >= 0.7, (qt, n, k, p)
    # o: 80 row tiles x 3 parts = 240 blocks, one wave (4 parts: 320, a second wave of 56)
    assert kc.gemv_mma_params("q4_k", 2560, 4096, 8, sm_count=132)["kparts"] == 3
    assert kc.gemv_mma_params("q4_k", 19456, 2560, 8, sm_count=132)["kparts"] == 1  # 608 blocks already
    assert kc.gemv_mma_params("q4_k", 1024, 512, 8)["wk"] == 2  # 4 units: 2 a warp


def _weight(qt: str, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(uploaded bytes [n, row bytes], dequantised f64 [n, k]) of a random ``qt`` weight."""
    if qt == "bf16":
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        bits = (w.view(np.uint32) + 0x7FFF + ((w.view(np.uint32) >> 16) & 1)) >> 16
        raw = bits.astype(np.uint16).view(np.uint8).reshape(n, -1)
        return raw, quant.dequantize(raw.reshape(-1), "bf16", (n, k)).astype(np.float64)
    ft = storage.REPACKED_FROM.get(qt, qt)
    elems, _ = BLOCK_SIZES[ft]
    raw = random_blocks(ft, n * k // elems, seed=int(rng.integers(1 << 30))).reshape(n, -1)
    deq = quant.dequantize(raw.reshape(-1), ft, (n, k)).astype(np.float64)
    if qt != ft:
        raw = quant.repack(raw, qt, n, k).reshape(n, -1)
    return np.ascontiguousarray(raw), deq


def _bf16(a: np.ndarray) -> np.ndarray:
    u = np.asarray(a, np.float32).view(np.uint32)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).view(np.float32)


def _run(p: dict, w: np.ndarray, x: np.ndarray, residual: np.ndarray | None = None, norm_w=None,
         reverse: bool = False) -> np.ndarray:
    """gemv_mma ``p`` under the emulator on x rows (f32 values, bf16-exact): its output [rows, n]
    as f32, from a NaN-poisoned out (or ``residual``, aliased as out, for a residual spec); its
    dynamic shared memory (the x stages) NaN-filled, a guard past it. ``reverse``: the block's
    threads run to each barrier in reverse order."""
    c = kc.choice("gemv_mma", **p)
    s = c.spec
    lib, types = cuda_emu.compile_any(render(s), s.entry)
    rows = x.shape[0]
    xb = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if p["out_dtype"] == "f32":
        out = np.full((rows, p["n"]), np.nan, np.float32)
    else:
        out = np.full((rows, p["n"]), 0x7FC0, np.uint16) if residual is None else residual.copy()
    args = [out, w, xb, out if residual is not None else None, rows]
    count = np.zeros(1024, np.uint32)
    if p["kparts"] > 1:
        args += [np.full(p["kparts"] * rows * p["n"], np.nan, np.float32), count]
    if p.get("prologue") == "norm":
        args.append(norm_w)
    cuda_emu.launch_any(lib, types, c.grid(rows), c.block[0], c.smem, args, reverse=reverse)
    assert not count.any(), "the tile counters are left zero"
    if p["out_dtype"] == "f32":
        return out
    return (out.astype(np.uint32) << 16).view(np.float32)


# (wk, kparts, depth, units of k): a k split over warps and blocks with a unit each; one warp per
# row tile walking 6 units through a ring of 4 (refills and a partial last round); 6 units in 4
# parts of 2 (the last part empty, its block's partial sums zero)
SPLITS = ((2, 2, 2, 4), (1, 1, 4, 6), (1, 4, 1, 6))


@pytest.mark.parametrize("qt", sorted(MMA_UNIT))
def test_matches_numpy_and_a_row_gets_the_same_bits_in_every_bucket(qt):
    rng = np.random.default_rng(7)
    for wk, kparts, depth, units in SPLITS if qt in ("q4_k", "bf16") else SPLITS[:1]:  # (the ring: any type's)
        k = units * MMA_UNIT[qt]
        w, deq = _weight(qt, N, k, rng)
        x = _bf16(rng.standard_normal((17, k)))
        base = dict(quant=qt, n=N, k=k, wk=wk, kparts=kparts, depth=depth, residual=False, out_dtype="f32",
                    x_stride=0, glu=0)  # fmt: skip
        solo = np.stack([_run({**base, "bmax": 8, "mt": 1, "wm": 2}, w, x[r : r + 1])[0] for r in (0, 5, 16)])
        ref = x.astype(np.float64) @ deq.T
        for r, got in zip((0, 5, 16), solo, strict=True):
            err = np.linalg.norm(got - ref[r]) / np.linalg.norm(ref[r])
            assert err < (1e-6 if qt == "bf16" else 1e-2), (qt, r, err)
        for bmax, mt, wm, rows in ((8, 1, 2, 3), (16, 2, 1, 11), (64, 1, 2, 17)):
            got = _run({**base, "bmax": bmax, "mt": mt, "wm": wm}, w, x[:rows])
            assert not np.isnan(got).any()
            for i, r in enumerate((0, 5, 16)):
                if r < rows:  # the same bits alone and in the bucket
                    assert np.array_equal(got[r].view(np.uint32), solo[i].view(np.uint32)), (qt, bmax, r)


# x staged in shared memory (xsm: unit rounds per x chunk) against x from global memory (xsm=0):
# the same arithmetic, so the same bits. (wk, kparts, depth, units, xsm): the whole part in one
# stage; chunks of 1 round in 2 stages with a ring of 2 (a chunk barrier inside the ring's round);
# chunks of 2 rounds under a ring of 3 (5 rounds: 3 chunks, the last partial); warps with fewer
# units than the block's rounds (6 units over 4 warps); 3 parts of uneven units (4, 4, 2: the last
# part has fewer chunks) in chunks of 2 rounds
XSM_CASES = ((2, 1, 2, 4, 2), (2, 2, 2, 8, 1), (2, 1, 3, 10, 2), (4, 1, 3, 6, 1), (1, 3, 1, 10, 2))


@pytest.mark.parametrize("qt", ["bf16", "q4_k", "q6_kr", "q8_0r", "q5_0r"])
def test_x_staged_in_shared_memory_gives_the_same_bits(qt):
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 30))
    rng = np.random.default_rng(seed)
    cases = XSM_CASES if qt == "bf16" else XSM_CASES[1:3] + XSM_CASES[4:] if qt == "q4_k" else XSM_CASES[1:2]
    for wk, kparts, depth, units, xsm in cases:
        k = units * MMA_UNIT[qt]
        w, deq = _weight(qt, N, k, rng)
        x = _bf16(rng.standard_normal((17, k)))
        base = dict(quant=qt, n=N, k=k, wk=wk, kparts=kparts, depth=depth, residual=False, out_dtype="f32",
                    x_stride=0, glu=0)  # fmt: skip
        solo = {r: _run({**base, "bmax": 8, "mt": 1, "wm": 2}, w, x[r : r + 1])[0] for r in (0, 5, 16)}
        ref = x.astype(np.float64) @ deq.T
        for bmax, mt, wm, rows, rev in ((8, 1, 2, 1, False), (16, 2, 1, 11, True), (64, 1, 2, 17, True)):
            p = {**base, "bmax": bmax, "mt": mt, "wm": wm, "xsm": xsm}
            assert kc.choice("gemv_mma", **p).smem > 0
            got = _run(p, w, x[:rows], reverse=rev)
            assert not np.isnan(got).any(), (seed, qt, p)
            err = np.linalg.norm(got - ref[:rows]) / np.linalg.norm(ref[:rows])
            assert err < (1e-6 if qt == "bf16" else 1e-2), (seed, qt, p, err)
            for r, want in solo.items():
                if r < rows:
                    assert np.array_equal(got[r].view(np.uint32), want.view(np.uint32)), (seed, qt, p, r)


def test_x_staging_with_the_norm_prologue_a_strided_x_and_a_residual():
    """xsm with prologue norm (x normalised from the staged raw rows) and with a strided x and a
    residual aliasing out: the bits of the same launch without xsm."""
    rng = np.random.default_rng(13)
    k = 6 * 128
    w, _ = _weight("q4_k", N, k, rng)
    x = _bf16(rng.standard_normal((1, k)) * 3.0)
    nw = (1.0 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    base = dict(quant="q4_k", n=N, k=k, bmax=8, mt=1, wm=2, wk=2, kparts=2, depth=2, residual=False,
                out_dtype="f32", x_stride=0, glu=0, prologue="norm", eps=1e-6)  # fmt: skip
    want = _run(base, w, x, norm_w=nw)
    for xsm in (1, 2):
        got = _run({**base, "xsm": xsm}, w, x, norm_w=nw, reverse=xsm == 2)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), xsm
    xp = _bf16(rng.standard_normal((5, k + 64)))  # rows k + 64 apart, x at column 32 of each
    xin = np.ascontiguousarray(xp[:, 32 : 32 + k])
    res = (_bf16(rng.standard_normal((5, N))).view(np.uint32) >> 16).astype(np.uint16)
    p = dict(base, prologue="none", eps=0.0, residual=True, out_dtype="bf16")
    want = _run(p, w, xin, residual=res)
    s = dict(p, x_stride=k + 64, xsm=1)
    c = kc.choice("gemv_mma", **s)
    lib, types = cuda_emu.compile_any(render(c.spec), c.spec.entry)
    xb = (xp.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    out = res.copy()
    xv = np.ascontiguousarray(xb.reshape(-1)[32:])  # the column view: x starts 32 elements in
    cuda_emu.launch_any(lib, types, c.grid(5), c.block[0], c.smem,
                        [out, w, xv, out, 5, np.full(2 * 5 * N, np.nan, np.float32), np.zeros(64, np.uint32)])  # fmt: skip
    assert np.array_equal(out, (want.view(np.uint32) >> 16).astype(np.uint16))


def test_the_plan_stages_x_within_the_budget_and_keeps_the_k_split():
    """gemv_mma_params with stage_x turns xsm on where a chunk of one unit round fits (the whole k
    part where it fits MMA_XSM_BYTES: one stage), never changing wk / kparts; the spec rules bound
    it. By default only MMA_STAGED's (type, bmax) stage x (bf16 at bmax 8: measured faster)."""
    from engine.kernel_catalog.gemv_mma import MMA_STAGED, MMA_XSM_BYTES

    for qt, n, k in (("bf16", 6144, 2560), ("bf16", 2560, 9728), ("q4_k", 2560, 9728), ("q6_kr", 19456, 2560)):
        for bmax in (8, 16, 32, 64):
            p = kc.gemv_mma_params(qt, n, k, bmax, sm_count=132, stage_x=True)
            c = kc.choice("gemv_mma", **p)
            assert c.smem == kc.mma_smem(p) <= MMA_XSM_BYTES[bmax], (qt, n, k, bmax)
            assert (c.smem > 0) == (p["xsm"] > 0)
            if bmax == 8:
                assert p["xsm"] > 0, (qt, n, k)
            default = kc.gemv_mma_params(qt, n, k, bmax, sm_count=132)
            assert (default["xsm"] > 0) == ((qt, bmax) in MMA_STAGED), (qt, bmax)
            assert (default["wk"], default["kparts"]) == (p["wk"], p["kparts"])
    one = kc.gemv_mma_params("bf16", 6144, 2560, 8, sm_count=132)  # 80 units / 4 warps: 20 rounds, 41 KB
    assert one["xsm"] == 20 and kc.mma_smem(one) == 8 * (2560 + 32) * 2
    assert kc.mma_smem({**one, "xsm": 10}) == 2 * 8 * (1280 + 32) * 2  # two stages of half the part
    for over, msg in ((dict(xsm=21), "xsm=21 exceeds the 20"), (dict(xsm=20, bmax=64, mt=2), "xsm=20: x stages")):
        with pytest.raises(ConfigError, match=msg):
            kc.spec("gemv_mma", **{**one, **over})


def test_the_row_tile_fills_one_wave_without_touching_the_k_split():
    """At bmax 8 / 16 mma_row_tile picks the tile whose grid runs in one wave of resident blocks and
    spreads most evenly over the SMs; wk / kparts (a row's bits) stay those of the weight's shape,
    whatever the tile and x staging; bmax 32 / 64 keep MMA_SHAPES; without fit_tile / stage_x the
    launches are MMA_SHAPES' with x from global memory (tools/gpu_linear_bench.py's plan=base)."""
    from engine.kernel_catalog.gemv_mma import MMA_SHAPES, SM_SMEM, mma_red_bytes

    for qt, n, k in (("bf16", 6144, 2560), ("bf16", 2560, 9728), ("bf16", 19456, 2560), ("q4_k", 2560, 9728),
                     ("q4_k", 19456, 2560), ("q6_kr", 2560, 4096), ("q8_0r", 1024, 512)):  # fmt: skip
        for bmax in (8, 16, 32, 64):
            p = kc.gemv_mma_params(qt, n, k, bmax, sm_count=132)
            base = kc.gemv_mma_params(qt, n, k, bmax, sm_count=132, stage_x=False, fit_tile=False)
            assert (p["wk"], p["kparts"]) == (base["wk"], base["kparts"]), (qt, n, k, bmax)
            assert (base["mt"], base["wm"], base["xsm"]) == (*MMA_SHAPES[bmax], 0)
            if bmax > 16:
                assert (p["mt"], p["wm"]) == MMA_SHAPES[bmax]
                continue
            blocks = -(-n // (16 * p["mt"] * p["wm"])) * p["kparts"]
            smem = kc.mma_smem(p) + mma_red_bytes(bmax, p["mt"], p["wm"], p["wk"]) + 1024
            resident = min(p["min_blocks"], SM_SMEM // smem)
            if (p["mt"], p["wm"]) != MMA_SHAPES[bmax]:
                assert blocks <= resident * 132, (qt, n, k, bmax, p["mt"], p["wm"])
    tall = kc.gemv_mma_params("bf16", 19456, 2560, 8, sm_count=132)  # 608 blocks of 32 rows: 2.3 waves
    assert (tall["mt"], tall["wm"], tall["depth"]) == (4, 1, 1)  # 304 blocks of 4 warps, 1 KB x 4 in flight each
    small = kc.gemv_mma_params("bf16", 6144, 2560, 8, sm_count=132)  # 192 of 8 warps: 60 SMs hold 2, 72 one
    assert (small["mt"], small["wm"], small["min_blocks"]) == (1, 1, 4)  # 384 of 4: 2.9 an SM
    assert kc.gemv_mma_params("q4_k", 19456, 2560, 8, sm_count=132)["mt"] == 1  # (mt 4 would spill)


def test_residual_aliasing_out_and_the_glu_epilogue():
    rng = np.random.default_rng(3)
    k = 4 * 128
    w, deq = _weight("q4_k", N, k, rng)
    x = _bf16(rng.standard_normal((3, k)))
    res = _bf16(rng.standard_normal((3, N)))
    rb = (res.view(np.uint32) >> 16).astype(np.uint16)
    p = dict(quant="q4_k", n=N, k=k, bmax=8, mt=1, wm=2, wk=2, kparts=2, depth=2, residual=True, out_dtype="bf16",
             x_stride=0, glu=0)  # fmt: skip
    got = _run(p, w, x, residual=rb)
    ref = x.astype(np.float64) @ deq.T + res
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
    # glu: gate rows 0..19, up rows 20..39 (an m tile: 8 of each); silu(bf16(gate)) * bf16(up) stored
    # at columns 0..19 only
    for kparts, mt in ((1, 1), (2, 1), (1, 2)):
        g = dict(p, residual=False, glu=N // 2, mt=mt, wm=1 if mt == 2 else 2, kparts=kparts)
        out = _run(g, w, x)
        sums = x.astype(np.float64) @ deq.T
        gate, up = _bf16(sums[:, : N // 2]).astype(np.float64), _bf16(sums[:, N // 2 :]).astype(np.float64)
        want = gate / (1.0 + np.exp(-gate)) * up
        assert np.linalg.norm(out[:, : N // 2] - want) / np.linalg.norm(want) < 2e-2
        assert np.isnan(out[:, N // 2 :]).all()  # the up half is not written


@pytest.mark.parametrize("qt", ["q4_k", "bf16"])
def test_the_norm_prologue_gives_the_rmsnorm_kernels_bits(qt):
    """gemv_mma with prologue norm on raw x rows (batch 1, as the plan folds it) against the rmsnorm
    kernel's stored output fed to gemv_mma without it: the same output bits (the prologue sums the
    squares in the rmsnorm kernel's order and rounds bf16((x * inv) * w) as it stores)."""
    rng = np.random.default_rng(11)
    k = 6 * MMA_UNIT[qt]
    w, _ = _weight(qt, N, k, rng)
    x = _bf16(rng.standard_normal((1, k)) * 3.0)
    nw = (1.0 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    rs = kc.spec("rmsnorm", n=k, eps="1e-06", threads=kc.NORM_THREADS, residual=False)
    lib, types = cuda_emu.compile_any(render(rs), rs.entry)
    xb = (x.view(np.uint32) >> 16).astype(np.uint16)
    normed = np.full_like(xb, 0x7FC0)
    cuda_emu.launch_any(lib, types, (1, 1, 1), kc.NORM_THREADS, 0, [normed, xb, None, nw, 1])
    xn = (normed.astype(np.uint32) << 16).view(np.float32)
    base = dict(quant=qt, n=N, k=k, bmax=8, mt=1, wm=2, wk=2, kparts=2, depth=2, residual=False, out_dtype="f32",
                x_stride=0, glu=0)  # fmt: skip
    want = _run(base, w, xn)
    got = _run({**base, "prologue": "norm", "eps": 1e-6}, w, x, norm_w=nw)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # (a last-bit difference of the inverse RMS rarely survives the bf16 rounding: the order is the
    # rmsnorm kernel's by construction, over the same NORM_T "threads")
    found = [re.findall(r"set norm_t = (\d+)", (ROOT / "kernels" / f).read_text()) for f in ("gemv_mma.cu.j2", "rmsnorm.cu.j2")]
    assert found[0] == found[1] and len(found[0]) == 1, found


def test_q5_0r_rows_decode_as_gguf_in_the_embed_and_gemm_decoder():
    """q5_0r (q5_0 repacked for gemv_mma) through _quant.cuh.j2's decode_unit, which the embedding
    lookup, the prefill GEMM and the dequantise-to-bf16 step share: the emulated embed kernel on
    every row of a repacked q5_0 matrix gives bf16 of engine.quant's dequantisation (gguf's); the
    upload rule repacks q5_0 only where gemv_mma reads it (its type named, k whole units)."""
    from engine.profile import get_profile, with_tuning

    rng = np.random.default_rng(5)
    n, k = 7, 384
    w, deq = _weight("q5_0r", n, k, rng)
    c = kc.choice("embed", quant="q5_0r", hidden=k, threads=kc.ELEMENTWISE_THREADS)
    lib, types = cuda_emu.compile_any(render(c.spec), c.spec.entry)
    ids = np.arange(n, dtype=np.int32)
    out = np.full((n, k), 0x7FC0, np.uint16)
    cuda_emu.launch_any(lib, types, c.grid(n), c.block[0], c.smem, [out, w, ids, n])
    got = (out.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got, _bf16(deq.astype(np.float32)))  # (values: -0 == +0)
    on = with_tuning(get_profile("h100"), MMA_ALL + "; gemv_mma.types=[q5_0]").tuning
    assert kc.upload_type("q5_0", 384, on) == "q5_0r" and kc.upload_type("q5_0", 576, on) == "q5_0"
    assert kc.upload_type("q5_0", 384, get_profile("h100").tuning) == "q5_0"


def test_every_profile_renders_and_the_primary_arch_compiles(tmp_path):
    types = [kc.spec("gemv_mma", **kc.gemv_mma_params(t, 1024, 2560 + 512, 64, out_dtype="f32")) for t in MMA_UNIT]
    profiles_render_and_compile("gemv_mma", kc.gemv_mma_params, tmp_path, types)


MMA_ALL = "gemv_mma.types=[bf16, q8_0, q4_k, q6_k, q4_0, q4_1, q5_0]"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from fixtures.checkpoints import Dims, write_qwen3_safetensors, write_random_gguf

    from engine.model import load_model

    dims = Dims(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                intermediate_size=1536, vocab_size=768)  # fmt: skip
    out = {q: load_model(write_random_gguf(tmp_path_factory.mktemp(q) / "m.gguf", "qwen3", dims, q, seed=3))
           for q in ("q4_k_m", "q8_0", "q4_0")}  # fmt: skip
    small = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=512, vocab_size=512)  # fmt: skip
    out["bf16"] = load_model(write_qwen3_safetensors(tmp_path_factory.mktemp("bf16"), **small))
    return out


def test_real_sizes_split_k_over_blocks_with_scratch():
    """Qwen3-4B q4_k_m / bf16 shapes (no weights): the o and down projections split k over blocks
    (the tiny models never do), with the mma_part / mma_count scratch; every decode mode agrees in
    the bit-changing params."""
    from fixtures.batch_invariance import mismatches

    from engine.graph import load_family
    from engine.model import dims_for_size
    from engine.plan import build_plan
    from engine.profile import get_profile, with_tuning

    g = load_family("qwen3")
    for q in ("q4_k_m", "bf16"):
        plan = build_plan(g, dims_for_size("qwen3", "qwen3-4b"), g.quant(q), with_tuning(get_profile("h100"), MMA_ALL),
                          rope_style="neox")  # fmt: skip
        assert mismatches(plan) == [], mismatches(plan)[:3]
        mma = [la.spec.params for st in plan.steps for m in ("decode1", "decode") for la in st.launches[m]
               if la.spec.template == "gemv_mma"]  # fmt: skip
        assert [p for p in mma if p["kparts"] > 1], q
        assert {"mma_part", "mma_count"} <= {s.name for s in plan.scratch}


def test_the_plan_runs_every_decode_linear_on_gemv_mma_and_a_row_gets_its_batch1_bits(tiny_models):
    """With tuning gemv_mma.types naming every type: each decode linear of a tiny Qwen3 (q4_k_m: q|k
    q4_k and v q6_kr; q8_0r; q4_0r; bf16, no wide-decode GEMM) runs gemv_mma at batch 1 and in every
    bucket range, with one k split per weight (tests/fixtures/batch_invariance.py finds no
    bit-changing difference), the gate|up storing silu(gate) * up (no silu_mul launch), the
    rmsnorms folded into their readers at batch 1 (prologue norm) and their own launches in the
    buckets; without the knob
    (the h100 profile as it is) no plan has gemv_mma."""
    from fixtures.batch_invariance import mismatches

    from engine.plan import build_plan
    from engine.profile import get_profile, with_tuning

    prof = with_tuning(get_profile("h100"), MMA_ALL)
    for name, m in tiny_models.items():
        plan = build_plan(m.graph, m.dims, m.quant, prof, m.tensor_dtypes, m.rope_style)
        assert mismatches(plan) == [], (name, mismatches(plan)[:3])
        assert plan.wide_rows == 0
        for st in plan.steps:
            for mode in ("decode1", "decode"):
                las = st.launches[mode]
                if st.op.op == "linear":
                    assert las and {la.spec.template for la in las} == {"gemv_mma"}, (name, st.layer, mode)
                    # the x stages' dynamic shared memory travels with the launch (staged at bmax 8)
                    assert all(la.smem == kc.mma_smem(la.spec.params) for la in las), (name, mode)
                    assert all(la.smem > 0 for la in las if (la.spec.params["quant"], la.spec.params["bmax"]) == ("bf16", 8)), (name, mode)
                    ranges = sorted((la.min_rows, la.max_rows) for la in las)
                    if mode == "decode":
                        assert ranges[0] == (0, 8) and ranges[-1][1] == 0 and len(las) % 4 == 0, ranges
                if st.op.op == "rmsnorm" and not st.head:  # folded at batch 1 only
                    assert [la.spec.template for la in las] == ([] if mode == "decode1" else ["rmsnorm"]), (name, mode)
                if st.op.op == "silu_mul":
                    assert las == (), (name, mode)
        pro = [la.spec.params["prologue"] for st in plan.steps if st.op.op == "linear" and not st.head
               for la in st.launches["decode1"]]  # fmt: skip
        assert pro.count("norm") >= 2 * 2 and set(pro) == {"norm", "none"}, pro  # q|k|v and gate|up, 2 layers
        glu = [la for st in plan.steps for la in st.launches["decode"] if la.spec.params.get("glu")]
        assert glu and all(la.spec.template == "gemv_mma" for la in glu)
        off = build_plan(m.graph, m.dims, m.quant, get_profile("h100"), m.tensor_dtypes, m.rope_style)
        assert not any(la.spec.template == "gemv_mma" for st in off.steps for ls in st.launches.values() for la in ls)
