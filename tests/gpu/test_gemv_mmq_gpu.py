"""The int8 tensor-core decode linear (kernels/gemv_mmq.cu.j2, x quantised by gemv_mmq_x.cu.j2) against
numpy: every layout it decodes (q4_k, q6_kr, q8_0r), batch 1 and every batch size class the decode
buckets use, with the params kernel_catalog.gemv_mmq_params gives on this device's SM count (a k split
over warps and blocks, and the single-part form), a residual that aliases out, f32 logits, more rows
than bmax; the quantiser's int8 x against engine.quant.q8x_round_trip; and a row's output bits the same
alone as in batches of 2..64. Outputs are poisoned with NaN; the reference is q8x_round_trip(x) @
dequantize(W).T in float64 (the kernel's int8 x; dequantisation checked against gguf in
tests/test_quant.py). Run on a GPU machine:
``PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_gemv_mmq_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_harness import DeviceArray, bf_round, poisoned, rel_err, upload, uploaded_weights

from engine import kernel_catalog as kc
from engine import quant
from engine.kernel_catalog.contracts import MMQ_TYPES
from engine.kernel_catalog.gemv_mma import mma_bmax

N, K = 1003, 2560  # an odd n (the last tile's row tail), Qwen3-4B's hidden size as k
BATCHES = (1, 2, 3, 8, 17, 32, 64, 100)


@pytest.fixture(scope="module")
def weights():
    return uploaded_weights(12)


def quantise(kernels, x: np.ndarray) -> tuple[DeviceArray, DeviceArray]:
    """x rows (f64, bf16-exact) quantised by gemv_mmq_x into its padded layout: (xq int8 [rows8, k],
    xs f32 [rows8 / 8, k / 32, 8, 2]), the padding rows poisoned (random bytes, NaN scales)."""
    rows, k = x.shape
    p = kc.gemv_mmq_x_params(k)
    c = kc.choice("gemv_mmq_x", **p)
    r8 = -(-rows // 8) * 8
    xq = DeviceArray((r8, k), "u8").put(np.random.default_rng(rows).integers(0, 256, (r8, k), dtype=np.uint8))
    xs = poisoned((r8 // 8, k // 32, 8, 2), "f32")
    kernels.launch(c, rows, xq=xq, xs=xs, x=upload(x, "bf16"), rows=rows)
    return xq, xs


def launch_mmq(kernels, weights, p: dict, x: np.ndarray, r: np.ndarray | None = None):
    """Launch gemv_mmq ``p`` on x rows (quantised by gemv_mmq_x first unless xstage); (out as f64
    [rows, n], counters left nonzero).
    ``r``: the residual (uploaded as out, which the kernel reads and overwrites)."""
    n, k, od = p["n"], p["k"], p["out_dtype"]
    rows = x.shape[0]
    w, _ = weights(p["quant"], n, k)
    if p["xstage"]:  # (the kernel quantises x itself; a strided x: NaN in the columns past k)
        xp = np.concatenate([x, np.full((rows, p["x_stride"] - k), np.nan)], axis=1) if p["x_stride"] else x
        xin = dict(x=upload(xp, "bf16"))
    else:
        xq, xs = quantise(kernels, x)
        xin = dict(xq=xq, xs=xs)
    out = upload(r, "bf16") if r is not None else poisoned((rows, n), od)
    args = dict(out=out, w=w, **xin, residual=out if r is not None else 0, rows=rows)
    count = None
    if p["kparts"] > 1:
        args["part_sum"] = poisoned((p["kparts"] * rows * n,), "f32")
        tiles = -(-n // (16 * p["mt"] * p["wm"])) * -(-rows // p["bmax"])
        count = args["part_count"] = upload(np.zeros(tiles, np.int32), "i32")
    kernels.launch(kc.choice("gemv_mmq", **p), rows, **args)
    left = int(np.count_nonzero(count.get())) if count is not None else 0
    return out.get(), left


def launch_mmq1(kernels, weights, p: dict, x: np.ndarray, nw: np.ndarray | None = None):
    """Launch gemv_mmq1 ``p`` on x rows (f64, bf16-exact); (out as f64 [rows, n], counters left nonzero)."""
    n, rows = p["n"], x.shape[0]
    w, _ = weights(p["quant"], n, p["k"])
    out = poisoned((rows, n), p["out_dtype"])
    args = dict(out=out, w=w, x=upload(x, "bf16"), residual=0, rows=rows)
    count = None
    if p["kparts"] > 1:
        args["part_sum"] = poisoned((p["kparts"] * rows * n,), "f32")
        tiles = -(-n // kc.mmq1_tile_rows(p)) * -(-rows // p["bmax"])
        count = args["part_count"] = upload(np.zeros(tiles, np.int32), "i32")
    if p["prologue"] == "norm":
        args["norm_w"] = upload(nw, "f32")
    kernels.launch(kc.choice("gemv_mmq1", **p), rows, **args)
    return out.get(), (int(np.count_nonzero(count.get())) if count is not None else 0)


def run_mmq(kernels, weights, p: dict, rows: int, rng) -> tuple[float, int, int]:
    """gemv_mmq ``p`` on ``rows`` random x rows; (rel err, NaN count, counters left nonzero)."""
    n, k = p["n"], p["k"]
    _, deq = weights(p["quant"], n, k)
    x = bf_round(rng.standard_normal((rows, k)))
    r = bf_round(rng.standard_normal((rows, n))) if p["residual"] else None
    got, left = launch_mmq(kernels, weights, p, x, r)
    ref = quant.q8x_round_trip(x).astype(np.float64) @ deq.T + (r if r is not None else 0)
    return rel_err(got, ref), int(np.isnan(got).sum()), left


def _params(qt, n, k, rows, profile, **kw):
    p = kc.gemv_mmq_params(qt, n, k, mma_bmax(rows), sm_count=profile.sm_count, **kw)
    assert p is not None, qt
    return p


def test_the_quantiser_is_q8x(kernels):
    kernels.prebuild([kc.spec("gemv_mmq_x", **kc.gemv_mmq_x_params(K))])
    rng = np.random.default_rng(5)
    x = bf_round(rng.standard_normal((5, K)) * rng.uniform(0.01, 10, (5, 1)))
    x[2, 32:64] = 0.0
    xq, xs = quantise(kernels, x)
    q = xq.get()[:5].view(np.int8).reshape(5, -1, 32).astype(np.float32)
    s = xs.get().astype(np.float32).transpose(0, 2, 1, 3).reshape(8, K // 32, 2)[:5]
    assert np.array_equal((q * s[:, :, :1]).reshape(x.shape), quant.q8x_round_trip(x))
    assert np.array_equal(s[:, :, 1], (s[:, :, 0] * q.sum(-1)).astype(np.float32))


def test_gemv_mmq1_matches_numpy(kernels, weights, profile):
    """gemv_mmq1 (the plan's batch-1 kernel) against q8x_round_trip(x) @ dequantize(W).T, every type,
    on Qwen3-4B-like shapes (k split over blocks and not), a second launch reusing the counters."""
    rng = np.random.default_rng()
    bad = []
    for qt in MMQ_TYPES:
        for n, k in ((N, K), (2560, 9728), (6144, 2560)):
            p1 = kc.gemv_mmq1_params(qt, n, k, sm_count=profile.sm_count, out_dtype="f32")
            assert p1 is not None, (qt, n, k)
            kernels.prebuild([kc.spec("gemv_mmq1", **p1)])
            _, deq = weights(qt, n, k)
            for _ in range(2):
                x = bf_round(rng.standard_normal((1, k)))
                got, left = launch_mmq1(kernels, weights, p1, x)
                err = rel_err(got, quant.q8x_round_trip(x).astype(np.float64) @ deq.T)
                if not (err < 1e-5 and not left and not np.isnan(got).any()):
                    bad.append((qt, n, k, err, left))
    assert not bad, bad


def test_gemv_mmq1_geometries_give_the_same_bits(kernels, weights, profile):
    """gemv_mmq1's geometry (lanes, interleave, warps, depth, min_blocks, grid_cap: which lanes compute what) never a row's
    bits: the plan's launch and the --mmq1-variants kinds of tools/gpu_linear_bench.py on the same x
    rows, every type, a k split over blocks (2560x9728, 1 row) and not (1 row, and 3 at bmax 4)."""
    rng = np.random.default_rng(3)
    overs = ({"lanes": 1, "warps": 4, "depth": 2, "min_blocks": 1}, {"warps": 8, "min_blocks": 4},
             {"warps": 32, "min_blocks": 1}, {"depth": 4, "min_blocks": 1},
             {"interleave": True, "warps": 8, "depth": 1, "min_blocks": 3})  # fmt: skip
    bad = []
    for qt in MMQ_TYPES:
        for n, k, bmax, rows in ((N, K, 1, 1), (N, K, 4, 3), (2560, 9728, 1, 1)):
            p1 = kc.gemv_mmq1_params(qt, n, k, sm_count=profile.sm_count, out_dtype="f32", bmax=bmax)
            # (one k part: 7 blocks looping over the row tiles)
            ovs = (*overs, {"grid_cap": 7}) if p1["kparts"] == 1 else overs
            kernels.prebuild([kc.spec("gemv_mmq1", **{**p1, **o}) for o in ({}, *ovs)])
            x = bf_round(rng.standard_normal((rows, k)))
            want, _ = launch_mmq1(kernels, weights, p1, x)
            for o in ovs:
                got, left = launch_mmq1(kernels, weights, {**p1, **o}, x)
                if left or not np.array_equal(got.astype(np.float32).view(np.uint32), want.astype(np.float32).view(np.uint32)):
                    bad.append((qt, n, k, bmax, o, left))
    assert not bad, bad


def test_gemv_mmq_every_type_and_batch(kernels, weights, profile):
    cases = [(_params(qt, N, K, rows, profile, residual=rows % 2 == 0), rows) for qt in MMQ_TYPES for rows in BATCHES]
    cases += [({**_params(qt, N, K, rows, profile, out_dtype="f32"), "kparts": kp}, rows)
              for qt in MMQ_TYPES for rows, kp in ((1, 1), (5, 4), (64, 1), (40, 3))]  # fmt: skip
    cases += [({**_params(qt, N, K, rows, profile), "xstage": False}, rows) for qt in MMQ_TYPES for rows in (1, 7)]
    cases += [(_params(qt, N, K, rows, profile, x_stride=K + 64), rows) for qt in MMQ_TYPES for rows in (1, 6)]
    kernels.prebuild(dict.fromkeys(kc.spec("gemv_mmq", **p) for p, _ in cases))
    kernels.prebuild([kc.spec("gemv_mmq_x", **kc.gemv_mmq_x_params(K))])
    rng = np.random.default_rng()
    bad = []
    for p, rows in cases:
        for _ in range(2):  # (the second launch reuses the part counters)
            err, nans, left = run_mmq(kernels, weights, p, rows, rng)
            tol = 1e-2 if p["out_dtype"] == "bf16" else 1e-5
            if not (err <= tol and nans == 0 and left == 0):
                bad.append((p["quant"], rows, p["bmax"], p["kparts"], p["out_dtype"], err, nans, left))
    assert not bad, bad


@pytest.mark.parametrize("shape", [(N, K), (2560, 4096), (1024, 9728)])
def test_a_row_gets_the_same_bits_alone_and_in_every_batch(kernels, weights, profile, shape):
    """Rows 0, 1, 7 and 16 of x alone (batch 1: the bmax-8 kernel with one live column, quantising
    its own x, and gemv_mmq1, the batch-1 kernel the plan runs) and as rows of batches of 2, 3, 8,
    17, 32 and 64 (every bucket's kernel, from 17 rows on gemv_mmq_x's x; gemv_mmq1 at 2 and 4 rows
    a grid row, with 1 and 4 lanes a row's k slice; f32 out, the unrounded sums): the same bits. (2560, 4096): the o projection's
    k split over blocks; (1024, 9728): a long k."""
    n, k = shape
    rng = np.random.default_rng(1)
    kernels.prebuild([kc.spec("gemv_mmq_x", **kc.gemv_mmq_x_params(k))])
    bad = []
    for qt in MMQ_TYPES:
        specs = {b: _params(qt, n, k, b, profile, out_dtype="f32") for b in (1, 2, 3, 8, 17, 32, 64)}
        kernels.prebuild(dict.fromkeys(kc.spec("gemv_mmq", **p) for p in specs.values()))
        x = bf_round(rng.standard_normal((64, k)))
        solo = {r: launch_mmq(kernels, weights, specs[1], x[r : r + 1])[0][0] for r in (0, 1, 7, 16)}
        for lanes in (1, 4):  # (a lane or four a row's k slice: the plan's geometry and the other)
            p1 = kc.gemv_mmq1_params(qt, n, k, sm_count=profile.sm_count, out_dtype="f32", lanes=lanes)
            if p1 is None:
                continue
            # the small-batch kernel the plan runs (1, 2, 3-4 rows): the bmax-8 kernel's bits
            kernels.prebuild([kc.spec("gemv_mmq1", **{**p1, "bmax": b}) for b in (1, 2, 4)])
            for r, want in solo.items():
                got1, left = launch_mmq1(kernels, weights, p1, x[r : r + 1])
                if left or not np.array_equal(got1[0].astype(np.float32).view(np.uint32), want.astype(np.float32).view(np.uint32)):
                    bad.append((qt, n, k, f"gemv_mmq1 lanes {lanes}", r, left, float(np.nanmax(np.abs(got1[0] - want)))))
            for bm, rows in ((2, 2), (4, 3), (4, 4), (2, 5)):
                got1, left = launch_mmq1(kernels, weights, {**p1, "bmax": bm}, x[:rows])
                for r, want in solo.items():
                    if r < rows and (left or not np.array_equal(got1[r].astype(np.float32).view(np.uint32),
                                                                want.astype(np.float32).view(np.uint32))):  # fmt: skip
                        bad.append((qt, n, k, f"gemv_mmq1 lanes {lanes} bmax {bm}", rows, r, left))
        for b, p in specs.items():
            got, left = launch_mmq(kernels, weights, p, x[:b])
            for r, want in solo.items():
                if r < b and not np.array_equal(got[r].astype(np.float32).view(np.uint32),
                                                want.astype(np.float32).view(np.uint32)):  # fmt: skip
                    bad.append((qt, n, k, b, r, float(np.abs(got[r] - want).max())))
            if left or np.isnan(got).any():
                bad.append((qt, n, k, b, "nan or counters", left))
    assert not bad, bad[:20]


def test_the_norm_prologue_gives_the_rmsnorm_kernels_bits(kernels, weights, profile):
    """The batch-1 kernel with prologue norm on a raw x row against the rmsnorm kernel's stored output
    fed to it without: the same bits (f32 out), for every type, on a k split over blocks and not."""
    rng = np.random.default_rng(3)
    bad = []
    for qt in MMQ_TYPES:
        for n in (N, 2560):
            p = _params(qt, n, K, 1, profile, out_dtype="f32")
            pn = {**p, "prologue": "norm", "eps": 1e-6}
            rs = kc.choice("rmsnorm", n=K, eps="1e-06", threads=kc.NORM_THREADS, residual=False)
            kernels.prebuild([kc.spec("gemv_mmq", **p), kc.spec("gemv_mmq", **pn), rs.spec])
            x = bf_round(rng.standard_normal((1, K)) * 3.0)
            nw = (1.0 + 0.1 * rng.standard_normal(K)).astype(np.float32)
            normed = poisoned((1, K), "bf16")
            kernels.launch(rs, 1, out=normed, x=upload(x, "bf16"), r=0, w=upload(nw, "f32"), rows=1)
            want, _ = launch_mmq(kernels, weights, p, normed.get())
            w, _ = weights(qt, n, K)
            out = poisoned((1, n), "f32")
            args = dict(out=out, w=w, x=upload(x, "bf16"), residual=0, rows=1, norm_w=upload(nw, "f32"))
            if p["kparts"] > 1:
                tiles = -(-n // (16 * p["mt"] * p["wm"]))
                args.update(part_sum=poisoned((p["kparts"] * n,), "f32"), part_count=upload(np.zeros(tiles, np.int32), "i32"))
            kernels.launch(kc.choice("gemv_mmq", **pn), 1, **args)
            got = out.get()
            if not np.array_equal(got.astype(np.float32).view(np.uint32), want.astype(np.float32).view(np.uint32)):
                bad.append((qt, n, p["kparts"], float(np.nanmax(np.abs(got - want)))))
            p1 = kc.gemv_mmq1_params(qt, n, K, sm_count=profile.sm_count, out_dtype="f32")
            if p1 is not None:  # the batch-1 kernel with the norm folded in: the same bits
                p1 = {**p1, "prologue": "norm", "eps": 1e-6}
                kernels.prebuild([kc.spec("gemv_mmq1", **p1)])
                got1, _ = launch_mmq1(kernels, weights, p1, x, nw)
                if not np.array_equal(got1.astype(np.float32).view(np.uint32), want.astype(np.float32).view(np.uint32)):
                    bad.append((qt, n, "gemv_mmq1", float(np.nanmax(np.abs(got1 - want)))))
    assert not bad, bad


def test_the_batch1_silu_prologue_gives_the_silu_mul_kernels_bits(kernels, weights, profile):
    """gemv_mmq1 with prologue silu on a raw gate|up row (the down projection at batch 1) against the
    silu_mul kernel's stored output fed to it without: the same bits, every type."""
    rng = np.random.default_rng(4)
    k = 9728
    bad = []
    for qt in MMQ_TYPES:
        p1 = kc.gemv_mmq1_params(qt, 2560, k, sm_count=profile.sm_count, out_dtype="f32")
        ps = {**p1, "prologue": "silu", "x_stride": 2 * k, "u_off": k}
        sm = kc.choice("silu_mul", inter=k, in_stride=2 * k, threads=kc.ELEMENTWISE_THREADS)
        kernels.prebuild([kc.spec("gemv_mmq1", **p1), kc.spec("gemv_mmq1", **ps), sm.spec])
        gu = bf_round(rng.standard_normal((1, 2 * k)) * 2.0)
        gud = upload(gu, "bf16")
        act = poisoned((1, k), "bf16")
        kernels.launch(sm, 1, out=act, g=gud, u=gud.at(k), rows=1)
        want, _ = launch_mmq1(kernels, weights, p1, act.get())
        got, left = launch_mmq1(kernels, weights, ps, gu)
        if left or not np.array_equal(got.astype(np.float32).view(np.uint32), want.astype(np.float32).view(np.uint32)):
            bad.append((qt, left, float(np.nanmax(np.abs(got - want)))))
    assert not bad, bad


MMQ_ALL = "gemv_mmq.types=[q4_k, q6_k, q8_0, q4_0, q4_1]"
# a Qwen3 wide enough that some linears split k over blocks (the down projection: 3072 = 24 units)
QWEN3_SPLIT_DIMS = dict(hidden_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=128, intermediate_size=3072)  # fmt: skip


@pytest.mark.parametrize("q", ["q4_k_m", "q8_0", "q4_0", "q4_1"])
def test_plan_on_gemv_mmq_matches_the_reference_and_batched_equals_solo(tmp_path, monkeypatch, q):
    """The plan with tuning gemv_mmq.types naming q4_k, q6_k and q8_0 (MEMRA_TUNE): every quantised
    decode linear quantises its x (gemv_mmq_x) and runs gemv_mmq at batch 1 and in the buckets. 1, 3,
    20 and 40 sequences (bmax 8, 8, 32, 64) decode one step together, graph-replayed: every row's
    logits match the numpy reference's for that sequence alone (int8 x: a looser bound than the bf16
    path's), and rows of the 20- and 40-row steps run again alone (batch 1) give the same logits, bit
    for bit."""
    from fixtures.checkpoints import Dims, write_random_gguf
    from fixtures.decode_linear_checks import plan_matches_the_reference_and_batched_equals_solo

    from engine.model import load_model

    monkeypatch.setenv("MEMRA_TUNE", MMQ_ALL)
    path = write_random_gguf(tmp_path / f"tiny_{q}.gguf", "qwen3", Dims(**QWEN3_SPLIT_DIMS, vocab_size=768), q, seed=7)
    plan_matches_the_reference_and_batched_equals_solo(load_model(path), {"gemv_mmq", "gemv_mmq1"}, split="gemv_mmq",
                                                       tol=5e-2, label=f"qwen3 {q} on gemv_mmq")  # fmt: skip
