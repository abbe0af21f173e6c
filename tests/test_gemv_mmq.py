"""The int8 tensor-core decode linear (kernels/gemv_mmq.cu.j2) and its x quantiser (gemv_mmq_x.cu.j2)
without a GPU: spec rules, a weight's k split the same at every batch size, both kernels run under g++
(tests/fixtures/cuda_emu.py: the int8 m16n8k32 / m16n8k16 mma as an exact warp collective) against
``engine.quant.q8x_round_trip(x) @ dequantize(W).T`` for every type it decodes on fresh random inputs
and NaN-poisoned outputs, and every row's output bits the same alone (batch 1) as in buckets of 3, 11
and 17 rows. NVRTC compiles every type and bucket for the profiles' archs (tests/gpu/test_gemv_mmq_gpu.py
runs it on a GPU)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from fixtures import cuda_emu
from fixtures.decode_linear_checks import profiles_render_and_compile
from test_gemv_mma import _bf16, _weight

from engine import kernel_catalog as kc
from engine import quant
from engine.kernel_catalog.contracts import MMQ_TYPES
from engine.render import render
from engine.types import ConfigError

N = 40  # two m tiles and a half (the last block's row tail)
ROOT = Path(__file__).resolve().parent.parent


def test_spec_rules_name_the_problem():
    ok = kc.gemv_mmq_params("q4_k", 2560, 9728, 8)
    assert ok is not None and kc.spec("gemv_mmq", **ok).entry.startswith("gemv_mmq__quantq4k_n2560_k9728_bmax8")
    for over, msg in (
        (dict(bmax=24), "bmax=24"),
        (dict(mt=3), "mt=3"),
        (dict(k=9728 + 64), "128-element unit"),
        (dict(kparts=1000), "kparts=1000"),
        (dict(quant="q5_0r"), "q5_0r"),
        (dict(residual=True, out_dtype="f32"), "residual"),
        (dict(wm=8, wk=8), "exceed"),
        (dict(depth=9), "depth=9"),
    ):
        with pytest.raises(ConfigError, match=msg):
            kc.spec("gemv_mmq", **{**ok, **over})
    assert kc.gemv_mmq_params("q4_k", 2560, 2560 + 128, 8) is None  # not whole q4_k super-blocks
    assert kc.gemv_mmq_params("q8_0r", 2560, 2560 - 64, 8) is None  # not whole 128-element units
    assert kc.gemv_mmq_params("bf16", 2560, 2560, 8) is None
    with pytest.raises(ConfigError, match="x_stride"):
        kc.spec("gemv_mmq_x", k=2560, x_stride=2564, threads=128)
    assert kc.gemv_mmq_x_params(2560, 2564) is None
    with pytest.raises(ConfigError, match="xstage needs bmax 8"):
        kc.spec("gemv_mmq", **{**ok, "bmax": 16, "xstage": True})
    big = kc.gemv_mmq_params("q4_k", 19456, 19456, 8, sm_count=132)  # (one k part of 19456: 195 KB)
    assert big["kparts"] == 1 and not big["xstage"] and ok["xstage"]
    with pytest.raises(ConfigError, match="exceed 227 KB"):
        kc.spec("gemv_mmq", **{**big, "k": 32768, "xstage": True})
    one = kc.gemv_mmq1_params("q4_k", 2560, 9728, sm_count=132)  # the batch-1 kernel: the bmax-8 split
    assert (one["wk"], one["kparts"]) == (ok["wk"], ok["kparts"]) and kc.choice("gemv_mmq1", **one).smem == 3328 * 5 // 4 + 4 * 128  # (lanes=4: + wk units)
    with pytest.raises(ConfigError, match="wk=3"):
        kc.spec("gemv_mmq1", **{**one, "wk": 3})
    for over, msg in ((dict(lanes=2), "lanes=2"), (dict(grid_cap=100), "grid_cap=100"), (dict(min_blocks=9), "exceed")):
        with pytest.raises(ConfigError, match=msg):  # (grid_cap: this weight has 3 k parts)
            kc.spec("gemv_mmq1", **{**one, **over})
    tall = kc.gemv_mmq1_params("q4_k", 19456, 2560, sm_count=132)  # one k part, more row tiles than resident blocks
    assert (tall["kparts"], tall["grid_cap"]) == (1, tall["min_blocks"] * 132) and one["grid_cap"] == 0
    assert kc.choice("gemv_mmq1", **tall).grid(1) == (tall["min_blocks"] * 132, 1, 1) and tall["min_blocks"] * 132 < 19456 // kc.mmq1_tile_rows(tall)
    assert kc.gemv_mmq_params("q4_k", 64, 768, 8)["wk"] == 3 and kc.gemv_mmq1_params("q4_k", 64, 768) is None


def test_the_k_split_is_the_same_at_every_batch_size():
    for qt, n, k in (("q4_k", 2560, 4096), ("q6_kr", 2560, 9728), ("q4_k", 19456, 2560), ("q8_0r", 1024, 512)):
        ps = [kc.gemv_mmq_params(qt, n, k, b, sm_count=132) for b in (8, 16, 32, 64)]
        assert len({(p["wk"], p["kparts"]) for p in ps}) == 1, (qt, n, k)  # a row's sum order
    assert kc.gemv_mmq_params("q4_k", 2560, 4096, 8, sm_count=132)["kparts"] == 3


def _quantise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """gemv_mmq_x under the emulator on x rows (f32 values, bf16-exact), from poisoned buffers: (xq
    int8 [rows, k], xs f32 [rows, k / 32, 2]) unpacked from its padded layout."""
    rows, k = x.shape
    p = kc.gemv_mmq_x_params(k)
    s = kc.spec("gemv_mmq_x", **p)
    lib, types = cuda_emu.compile_any(render(s), s.entry)
    xb = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    r8 = -(-rows // 8) * 8
    xq = np.full((r8, k), 0x55, np.uint8)
    xs = np.full((r8 // 8, k // 32, 8, 2), np.nan, np.float32)
    cuda_emu.launch_any(lib, types, kc.choice("gemv_mmq_x", **p).grid(rows), p["threads"], 0, [xq, xs, xb, rows])
    return xq[:rows].view(np.int8), xs.transpose(0, 2, 1, 3).reshape(r8, k // 32, 2)[:rows]


def pack(xq: np.ndarray, xs: np.ndarray, rng=None) -> tuple[np.ndarray, np.ndarray]:
    """x rows (xq int8 [rows, k], xs [rows, k / 32, 2]) in gemv_mmq's padded layout: xq [rows8, k],
    xs [rows8 / 8, k / 32, 8, 2]; the padding rows hold random bytes and NaN scales (never stored)."""
    rng = rng or np.random.default_rng(0)
    rows, k = xq.shape
    r8 = -(-rows // 8) * 8
    q = rng.integers(0, 256, (r8, k), dtype=np.uint8)
    q[:rows] = xq.view(np.uint8)
    sc = np.full((r8, k // 32, 2), np.nan, np.float32)
    sc[:rows] = xs
    return q, np.ascontiguousarray(sc.reshape(r8 // 8, 8, k // 32, 2).transpose(0, 2, 1, 3))


def _poisoned_out(p: dict, rows: int, residual: np.ndarray | None) -> np.ndarray:
    """The out buffer of a launch: NaN-poisoned (f32 or bf16), or a copy of ``residual`` (aliased as out)."""
    if p["out_dtype"] == "f32":
        return np.full((rows, p["n"]), np.nan, np.float32)
    return np.full((rows, p["n"]), 0x7FC0, np.uint16) if residual is None else residual.copy()


def _run(p: dict, w: np.ndarray, x: np.ndarray, residual: np.ndarray | None = None, x_pad: int = 0,
         norm_w: np.ndarray | None = None) -> np.ndarray:
    """gemv_mmq ``p`` under the emulator on x rows (f32, bf16-exact; quantised by gemv_mmq_x first
    unless xstage, which reads them as bf16 with ``x_pad`` more columns a row): its output [rows, n]
    as f32, from a NaN-poisoned out (or ``residual``, aliased as out, for a residual spec)."""
    s = kc.spec("gemv_mmq", **p)
    lib, types = cuda_emu.compile_any(render(s), s.entry)
    rows = x.shape[0]
    out = _poisoned_out(p, rows, residual)
    if p["xstage"]:
        xp = np.concatenate([x, np.full((rows, x_pad), np.nan, np.float32)], axis=1) if x_pad else x
        xin = [np.ascontiguousarray((xp.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))]
    else:
        xin = list(pack(*_quantise(x)))
    args = [out, w, *xin, out if residual is not None else None, rows]
    count = np.zeros(1024, np.uint32)
    if p["kparts"] > 1:
        args += [np.full(p["kparts"] * rows * p["n"], np.nan, np.float32), count]
    if p.get("prologue") == "norm":
        args.append(norm_w)
    c = kc.choice("gemv_mmq", **p)
    cuda_emu.launch_any(lib, types, c.grid(rows), c.block[0], c.smem, args)
    assert not count.any(), "the tile counters are left zero"
    if p["out_dtype"] == "f32":
        return out
    return (out.astype(np.uint32) << 16).view(np.float32)


def test_the_x_quantiser_is_q8x():
    rng = np.random.default_rng(11)
    x = _bf16(rng.standard_normal((3, 1024 + 256)) * rng.uniform(0.01, 10, (3, 1)))
    x[1, 64:96] = 0.0  # a block of zeros: q 0, dx 0
    xq, xs = _quantise(x)
    deq = (xq.reshape(3, -1, 32).astype(np.float32) * xs[:, :, :1]).reshape(x.shape)
    assert np.array_equal(deq, quant.q8x_round_trip(x))
    sums = xq.reshape(3, -1, 32).astype(np.int64).sum(-1)
    assert np.array_equal(xs[:, :, 1], (xs[:, :, 0] * sums.astype(np.float32)).astype(np.float32))


# (wk, kparts, depth, units of k): a k split over warps and blocks; one warp per row tile walking 5
# units through a ring of 2 (refills and a partial last round); 6 units in 4 parts of 2 (the last
# part empty, its block's partial sums zero)
SPLITS = ((2, 2, 2, 4), (1, 1, 2, 5), (1, 4, 1, 6))


@pytest.mark.parametrize("qt", MMQ_TYPES)
def test_matches_numpy_and_a_row_gets_the_same_bits_in_every_bucket(qt):
    rng = np.random.default_rng(7)
    for wk, kparts, depth, units in SPLITS if qt == "q4_k" else SPLITS[:1]:
        k = units * 128
        if k % 256 and qt != "q8_0r":
            k += 128  # (whole super-blocks)
        w, deq = _weight(qt, N, k, rng)
        x = _bf16(rng.standard_normal((17, k)))
        base = dict(quant=qt, n=N, k=k, wk=wk, kparts=kparts, depth=depth, residual=False, out_dtype="f32",
                    min_blocks=1, xstage=False, x_stride=0)  # fmt: skip
        b8 = {**base, "bmax": 8, "mt": 1, "wm": 2}
        solo = np.stack([_run(b8, w, x[r : r + 1])[0] for r in (0, 5, 16)])
        ref = quant.q8x_round_trip(x).astype(np.float64) @ deq.T
        for r, got in zip((0, 5, 16), solo, strict=True):
            err = np.linalg.norm(got - ref[r]) / np.linalg.norm(ref[r])
            assert err < 1e-5, (qt, r, err)
        # the bmax-8 kernel quantising its own x (xstage, a strided x) and the buckets on gemv_mmq_x's
        for over, rows in (({"bmax": 8, "xstage": True, "x_stride": k + 64}, 1), ({"bmax": 8, "xstage": True}, 3),
                           ({"bmax": 8}, 3), ({"bmax": 16, "mt": 2, "wm": 1}, 11), ({"bmax": 64}, 17)):  # fmt: skip
            p = {**b8, **over}
            got = _run(p, w, x[:rows], x_pad=64 if p["x_stride"] else 0)
            assert not np.isnan(got).any()
            for i, r in enumerate((0, 5, 16)):
                if r < rows:  # the same bits alone and in the bucket
                    assert np.array_equal(got[r].view(np.uint32), solo[i].view(np.uint32)), (qt, over, r)


def _run1(p: dict, w: np.ndarray, x: np.ndarray, residual: np.ndarray | None = None, norm_w=None) -> np.ndarray:
    """gemv_mmq1 ``p`` under the emulator on x rows (f32, bf16-exact): its output [rows, n] as f32,
    from a NaN-poisoned out (or ``residual``, aliased as out)."""
    s = kc.spec("gemv_mmq1", **p)
    lib, types = cuda_emu.compile_any(render(s), s.entry)
    rows = x.shape[0]
    out = _poisoned_out(p, rows, residual)
    xb = np.ascontiguousarray((x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
    args = [out, w, xb, out if residual is not None else None, rows]
    count = np.zeros(1024, np.uint32)
    if p["kparts"] > 1:
        args += [np.full(p["kparts"] * rows * p["n"], np.nan, np.float32), count]
    if p["prologue"] == "norm":
        args.append(norm_w)
    c = kc.choice("gemv_mmq1", **p)
    cuda_emu.launch_any(lib, types, c.grid(rows), c.block[0], c.smem, args)
    assert not count.any(), "the tile counters are left zero"
    return out if p["out_dtype"] == "f32" else (out.astype(np.uint32) << 16).view(np.float32)


# (lanes=1, the previous geometry: q4_k and q6_kr, whose staged-x reads cover the others'; interleave
# "4i": the three chain-term forms)
@pytest.mark.parametrize(
    ("qt", "lanes"),
    [(qt, 4) for qt in MMQ_TYPES] + [("q4_k", 1), ("q6_kr", 1)] + [(qt, "4i") for qt in ("q4_k", "q6_kr", "q8_0r")],
)
def test_the_batch1_kernel_gives_the_bmax8_kernels_bits(qt, lanes):
    """gemv_mmq1 (dp4a dots; ``lanes`` lanes a weight row's k slice: 4 reduce their integer dots and
    pass the row's f32 chain lane to lane) against the bmax-8 gemv_mmq on the same x rows: the same
    output bits, at 1 row and at 2 and 4 rows a grid row, with its k split over warps (wk 1, 2, 4; the
    slices of a warp unequal: groups idling through the last units) and blocks, a ring refill, the
    norm prologue and a residual; and against numpy."""
    rng = np.random.default_rng(5)
    splits = ((4, 1, 2, 8), (1, 3, 4, 6), (4, 2, 3, 12), (2, 2, 1, 6))  # (wk, kparts, depth, units)
    # (the split code: any type's; wk 1 and 2 for every type: a lane's read position steps by units)
    for wk, kparts, depth, units in splits if qt == "q4_k" else (splits[1], splits[-1]):
        k = units * 128
        w, deq = _weight(qt, N, k, rng)
        x = _bf16(rng.standard_normal((1, k)) * 2.0)
        p8 = dict(quant=qt, n=N, k=k, bmax=8, mt=1, wm=2, wk=wk, kparts=kparts, depth=2, residual=False,
                  out_dtype="f32", min_blocks=1, xstage=True, x_stride=0)  # fmt: skip
        p1 = dict(quant=qt, n=N, k=k, wk=wk, kparts=kparts, warps=2, depth=depth, residual=False, out_dtype="f32",
                  x_stride=0, prologue="none", eps=0.0, lanes=4 if lanes == "4i" else lanes,
                  interleave=lanes == "4i")  # fmt: skip
        want = _run(p8, w, x)
        got = _run1(p1, w, x)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (qt, wk, kparts)
        ref = quant.q8x_round_trip(x).astype(np.float64) @ deq.T
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5
        if lanes == 4 and kparts == 1 or (lanes == 4 and qt != "q4_k" and wk == 1):
            # grid_cap: 2 blocks looping over the row tiles (10 at wk 4, 3 at wk 1; x staged once a block)
            want1 = _run({**p8, "kparts": 1}, w, x) if kparts > 1 else want
            got = _run1({**p1, "kparts": 1, "grid_cap": 2}, w, x)
            assert np.array_equal(got.view(np.uint32), want1.view(np.uint32)), (qt, wk, "grid_cap")
    # 2 and 4 rows a grid row (3 rows: a partial second grid row at bmax 2, a partial one at 4)
    x3 = _bf16(rng.standard_normal((3, k)))
    want3 = _run(p8, w, x3)
    for bmax in (2, 4):
        got3 = _run1({**p1, "bmax": bmax}, w, x3)
        assert np.array_equal(got3.view(np.uint32), want3.view(np.uint32)), (qt, bmax)
    nw = (1.0 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    res = _bf16(rng.standard_normal((1, N)))
    rb = (res.view(np.uint32) >> 16).astype(np.uint16)
    # (the norm from the staging loads at one k part, from a pass of its own over the row at two)
    overs = ({"prologue": "norm", "eps": 1e-6}, {"prologue": "norm", "eps": 1e-6, "kparts": 1},
             {"residual": True, "out_dtype": "bf16"})  # (the staging and store code: any type's)
    if lanes == 4:  # (grid_cap: blocks looping over row tiles, the norm and a residual in each)
        overs += ({"prologue": "norm", "eps": 1e-6, "kparts": 1, "residual": True, "out_dtype": "bf16", "grid_cap": 2},)
    for over in overs if qt == "q4_k" else ():
        p8o = {**p8, **{key: v for key, v in over.items() if key != "grid_cap"}}
        want = _run(p8o, w, x, norm_w=nw, residual=rb if over.get("residual") else None)
        got = _run1({**p1, **over}, w, x, norm_w=nw, residual=rb if over.get("residual") else None)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (qt, over)


def test_the_batch1_silu_prologue_gives_the_silu_mul_kernels_bits():
    """gemv_mmq1 with prologue silu on a raw gate|up row (the down projection at batch 1, as the plan
    folds the silu_mul) against the silu_mul kernel's stored output fed to it without: the same
    bits (the staging computes bf16(silu(gate) * up) as that kernel stores it)."""
    rng = np.random.default_rng(13)
    k = 6 * 128
    w, _ = _weight("q4_k", N, k, rng)
    gu = _bf16(rng.standard_normal((1, 2 * k)) * 2.0)
    sm = kc.spec("silu_mul", inter=k, in_stride=2 * k, threads=kc.ELEMENTWISE_THREADS)
    lib, types = cuda_emu.compile_any(render(sm), sm.entry)
    gb = (gu.view(np.uint32) >> 16).astype(np.uint16)
    act = np.full((1, k), 0x7FC0, np.uint16)
    grid = (-(-k // (8 * kc.ELEMENTWISE_THREADS)), 1, 1)
    cuda_emu.launch_any(lib, types, grid, kc.ELEMENTWISE_THREADS, 0, [act, gb, gb[:, k:].copy(), 1])
    xa = (act.astype(np.uint32) << 16).view(np.float32)
    p1 = dict(quant="q4_k", n=N, k=k, wk=2, kparts=2, warps=2, depth=2, residual=False, out_dtype="f32",
              x_stride=0, prologue="none", eps=0.0, u_off=0)  # fmt: skip
    want = _run1(p1, w, xa)
    for lanes in (1, 4):
        got = _run1({**p1, "prologue": "silu", "x_stride": 2 * k, "u_off": k, "lanes": lanes}, w, gu)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), lanes
    with pytest.raises(ConfigError, match="prologue silu"):
        kc.spec("gemv_mmq1", **{**p1, "prologue": "silu", "x_stride": 2 * k, "u_off": k + 8})


def test_residual_aliasing_out():
    rng = np.random.default_rng(3)
    k = 512
    w, deq = _weight("q4_k", N, k, rng)
    x = _bf16(rng.standard_normal((3, k)))
    res = _bf16(rng.standard_normal((3, N)))
    rb = (res.view(np.uint32) >> 16).astype(np.uint16)
    p = dict(quant="q4_k", n=N, k=k, bmax=8, mt=1, wm=2, wk=2, kparts=2, depth=2, residual=True, out_dtype="bf16",
             min_blocks=1, xstage=False, x_stride=0)  # fmt: skip
    ref = quant.q8x_round_trip(x).astype(np.float64) @ deq.T + res
    for xstage in (False, True):
        got = _run({**p, "xstage": xstage}, w, x, residual=rb)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2  # (bf16 out)


def test_the_norm_prologue_gives_the_rmsnorm_kernels_bits():
    """xstage with prologue norm on raw x rows (batch 1, as the plan folds it) against the rmsnorm
    kernel's stored output fed to gemv_mmq without it: the same output bits (the prologue sums the
    squares in the rmsnorm kernel's order and rounds bf16((x * inv) * w) as it stores), with a k
    split over blocks (each block normalises with the whole row's RMS)."""
    rng = np.random.default_rng(11)
    k = 6 * 128
    w, _ = _weight("q4_k", N, k, rng)
    x = _bf16(rng.standard_normal((1, k)) * 3.0)
    nw = (1.0 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    rs = kc.spec("rmsnorm", n=k, eps="1e-06", threads=kc.NORM_THREADS, residual=False)
    lib, types = cuda_emu.compile_any(render(rs), rs.entry)
    xb = (x.view(np.uint32) >> 16).astype(np.uint16)
    normed = np.full_like(xb, 0x7FC0)
    cuda_emu.launch_any(lib, types, (1, 1, 1), kc.NORM_THREADS, 0, [normed, xb, None, nw, 1])
    xn = (normed.astype(np.uint32) << 16).view(np.float32)
    base = dict(quant="q4_k", n=N, k=k, bmax=8, mt=1, wm=2, wk=2, kparts=2, depth=2, residual=False, out_dtype="f32",
                min_blocks=1, xstage=True, x_stride=0)  # fmt: skip
    want = _run(base, w, xn)
    got = _run({**base, "prologue": "norm", "eps": 1e-6}, w, x, norm_w=nw)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    found = [re.findall(r"set norm_t = (\d+)", (ROOT / "kernels" / f).read_text()) for f in ("_mmq_norm.cuh.j2", "rmsnorm.cu.j2")]
    assert found[0] == found[1] and len(found[0]) == 1, found
    with pytest.raises(ConfigError, match="prologue norm needs xstage"):
        kc.spec("gemv_mmq", **{**base, "xstage": False, "prologue": "norm"})


def test_every_profile_renders_and_every_type_compiles(tmp_path):
    more = [kc.spec("gemv_mmq", **kc.gemv_mmq_params(t, 1024, 2560 + 512, b, out_dtype="f32")) for t in MMQ_TYPES
            for b in (8, 64)]  # fmt: skip
    more.append(kc.spec("gemv_mmq_x", **kc.gemv_mmq_x_params(2560)))
    profiles_render_and_compile("gemv_mmq", kc.gemv_mmq_params, tmp_path, more)


MMQ_ALL = "gemv_mmq.types=[q4_k, q6_k, q8_0, q4_0, q4_1]"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from fixtures.checkpoints import Dims, write_random_gguf

    from engine.model import load_model

    dims = Dims(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                intermediate_size=1536, vocab_size=768)  # fmt: skip
    return {q: load_model(write_random_gguf(tmp_path_factory.mktemp(q) / "m.gguf", "qwen3", dims, q, seed=3))
            for q in ("q4_k_m", "q8_0", "q4_1")}  # fmt: skip


def test_the_plan_runs_every_quantised_decode_linear_on_gemv_mmq(tiny_models):
    """With tuning gemv_mmq.types naming q4_k, q6_k and q8_0: each decode linear of a tiny Qwen3 (q4_k_m:
    q4_k and q6_kr weights; q8_0r; q4_1r) runs gemv_mmq1 at batch 1 and for 1, 2 and 3-4 rows,
    gemv_mmq in the larger bucket ranges (the bmax-8 kernels quantising their own x, the larger
    buckets after one gemv_mmq_x launch from 9 rows into the mmq_xq / mmq_xs scratch), with one k
    split per weight
    (tests/fixtures/batch_invariance.py finds no bit-changing difference); the rmsnorms folded into
    their readers and the silu_mul into the down projection at batch 1 (prologue norm / silu) and
    their own launches in the buckets; without the knob (the h100 profile as it is) no plan has
    gemv_mmq; gemv_mmq wins where gemv_mma.types names the type too."""
    from fixtures.batch_invariance import mismatches

    from engine.plan import build_plan
    from engine.profile import get_profile, with_tuning

    for tune in (MMQ_ALL, MMQ_ALL + "; gemv_mma.types=[q4_k, q6_k, q8_0]"):
        prof = with_tuning(get_profile("h100"), tune)
        for name, m in tiny_models.items():
            plan = build_plan(m.graph, m.dims, m.quant, prof, m.tensor_dtypes, m.rope_style)
            assert mismatches(plan) == [], (name, mismatches(plan)[:3])
            assert {"mmq_xq", "mmq_xs"} <= {s.name for s in plan.scratch}
            for st in plan.steps:
                for mode in ("decode1", "decode"):
                    las = st.launches[mode]
                    if st.op.op == "linear":
                        tpl = [la.spec.template for la in las]
                        mmq = [la for la in las if la.spec.template == "gemv_mmq"]
                        assert not any(la.concurrent for la in las), tpl
                        if mode == "decode1":  # gemv_mmq1 (the bmax-8 kernel's bits, no dead columns)
                            assert set(tpl) == {"gemv_mmq1"}, (name, tpl)
                            continue
                        assert set(tpl) == {"gemv_mmq_x", "gemv_mmq1", "gemv_mmq"}, tpl
                        # 1, 2 and 3-4 rows: gemv_mmq1; 5-8 rows: the bmax-8 gemv_mmq staging its own
                        # x; the quantiser runs from 9 rows, before the larger buckets
                        quant = [la for la in las if la.spec.template == "gemv_mmq_x"]
                        assert all(la.spec.params["xstage"] == (la.spec.params["bmax"] == 8) for la in mmq), tpl
                        assert [la.min_rows for la in quant] == [9], (name, mode, tpl)
                        assert tpl.index("gemv_mmq") > tpl.index("gemv_mmq_x")
                        small = sorted((la.spec.params["bmax"], la.min_rows, la.max_rows) for la in las
                                       if la.spec.template == "gemv_mmq1")  # fmt: skip
                        assert small == sorted([(1, 0, 1), (2, 2, 2), (4, 3, 4)] * (len(small) // 3)), small
                        ranges = sorted((la.min_rows, la.max_rows) for la in mmq)
                        assert ranges[0] == (5, 8) and ranges[-1][1] == 0 and len(mmq) % 4 == 0, ranges
                    if st.op.op == "rmsnorm" and not st.head:  # folded at batch 1 only
                        assert [la.spec.template for la in las] == ([] if mode == "decode1" else ["rmsnorm"]), (name, mode)
                    if st.op.op == "silu_mul":  # folded into the down projection's gemv_mmq1 at batch 1
                        assert [la.spec.template for la in las] == ([] if mode == "decode1" else ["silu_mul"]), (name, mode)
            pro = [la.spec.params["prologue"] for st in plan.steps if st.op.op == "linear" and not st.head
                   for la in st.launches["decode1"]]  # fmt: skip
            assert pro.count("norm") >= 2 * 2 and pro.count("silu") == 2, pro  # q|k|v and gate|up; down, 2 layers
            types = {la.spec.params["quant"] for st in plan.steps for la in st.launches["decode"]
                     if la.spec.template == "gemv_mmq"}  # fmt: skip
            assert types == {"q4_k_m": {"q4_k", "q6_kr"}, "q8_0": {"q8_0r"}, "q4_1": {"q4_1r"}}[name], (name, types)
    off = build_plan(m.graph, m.dims, m.quant, get_profile("h100"), m.tensor_dtypes, m.rope_style)
    assert not any(la.spec.template.startswith("gemv_mmq") for st in off.steps for ls in st.launches.values() for la in ls)


def test_the_cuda_runner_binds_and_runs_the_mmq_plan_on_a_fake_driver(tmp_path, monkeypatch):
    """CudaRunner on the fake driver (tests/test_plan_runner_fake.py) with tuning gemv_mmq.types on a
    tiny q4_k_m Qwen3: every launch binds (the x scratch, split-k scratch, norm weights), decode at
    1, 2 and 4 rows runs gemv_mmq1, a 20-row step the quantiser and the bmax-32 gemv_mmq."""
    from fixtures.checkpoints import Dims, write_random_gguf
    from test_plan_runner_fake import FakeDriver, fake_builder

    import engine.runner_cuda as rc
    from engine.model import load_model
    from engine.types import SamplingParams, StepItem

    monkeypatch.setenv("MEMRA_TUNE", MMQ_ALL)
    drv = FakeDriver()
    monkeypatch.setattr(rc, "cuda", drv.module())
    dims = Dims(hidden_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                intermediate_size=3072, vocab_size=768)  # fmt: skip
    model = load_model(write_random_gguf(tmp_path / "m.gguf", "qwen3", dims, "q4_k_m", seed=3))
    runner = rc.CudaRunner(model, num_blocks=64, max_model_len=256, builder=fake_builder(tmp_path))
    greedy = SamplingParams(temperature=0.0)
    try:
        for rows in (1, 2, 4, 20):
            items = [StepItem(i, [5, 6, 7], 0, [2 * i, 2 * i + 1], True, greedy) for i in range(rows)]
            runner.step(items)
            drv.reset()
            runner.step([StepItem(i, [8], 3, [2 * i, 2 * i + 1], True, greedy) for i in range(rows)])
            names = {n.split("__")[0] for n, _, _ in drv.launches}
            want = {"gemv_mmq1"} if rows <= 4 else {"gemv_mmq_x", "gemv_mmq"}  # (20 rows: bmax 32)
            assert want <= names and not ({"gemv_mmq_x", "gemv_mmq"} - want) & names, (rows, sorted(names))
            assert not names & {"gemv", "gemv_pair", "gemv_mma"}, (rows, sorted(names))  # (every linear: q4_k / q6_k)
    finally:
        runner.close()


def test_real_sizes_run_gemv_mmq1_at_batch1_with_the_norms_and_silus_folded():
    """Qwen3-4B shapes (no weights), q8_0 and q4_0 with the knob: every batch-1 linear is gemv_mmq1
    (the q|k|v and gate|up with their rmsnorm, the down projection with its silu_mul), every bucket
    linear gemv_mmq after one quantiser per op, and no bit-changing difference between the modes."""
    from fixtures.batch_invariance import mismatches

    from engine.graph import load_family
    from engine.model import dims_for_size
    from engine.plan import build_plan
    from engine.profile import get_profile, with_tuning

    g = load_family("qwen3")
    for q in ("q8_0", "q4_0"):
        plan = build_plan(g, dims_for_size("qwen3", "qwen3-4b"), g.quant(q), with_tuning(get_profile("h100"), MMQ_ALL),
                          rope_style="neox")  # fmt: skip
        assert mismatches(plan) == [], mismatches(plan)[:3]
        one = [la.spec for st in plan.steps if st.op.op == "linear" for la in st.launches["decode1"]]
        assert {s.template for s in one} == {"gemv_mmq1"}
        pro = [s.params["prologue"] for s in one]
        assert (pro.count("norm"), pro.count("silu")) == (2 * 36 + 1, 36), (q, pro.count("norm"), pro.count("silu"))
        quant = [la for st in plan.steps if st.op.op == "linear" for la in st.launches["decode"]
                 if la.spec.template == "gemv_mmq_x"]  # fmt: skip
        assert len(quant) == 4 * 36 + 1 and all(la.min_rows == 9 for la in quant)
    # decode_graph.early_trigger (h200): the batch-1 launches trigger the next kernel early, every
    # grid being resident at once (the tall ones through grid_cap)
    plan = build_plan(g, dims_for_size("qwen3", "qwen3-4b"), g.quant("q4_0"), with_tuning(get_profile("h200"), MMQ_ALL),
                      rope_style="neox")  # fmt: skip
    assert mismatches(plan) == [], mismatches(plan)[:3]
    one = [la.spec for st in plan.steps if st.op.op == "linear" for la in st.launches["decode1"]]
    assert {s.template for s in one} == {"gemv_mmq1"} and all(s.params["trigger"] for s in one)
    assert any(s.params["grid_cap"] for s in one)  # (the gate|up rows and the lm head)
