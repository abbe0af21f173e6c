"""The int8 tensor-core bucket GEMV (kernels/_gemv_mmq.cuh.j2) against the batch-1 coop q8x GEMV,
bit for bit, on a real GPU (skipped without one; issue #34 item 1).

For random q4_k weights of the Qwen3-4B shapes (q|k|v 6144 x 2560, gate|up 19456 x 2560, the k-split
o 2560 x 4096 and down 2560 x 9728, and a k-split 1003 x 2560 with a row tail), random q6_kr ones
(a q4_k_m file's q6_k v 1024 x 2560 and down 2560 x 9728, and 6144 x 2560 without the k split),
random q8_0r, q4_0r and q4_1r ones (6144 x 2560, the k-split 2560 x 9728) and random x rows,
every output of the mma kernel run over 2, 8, 16 and 32 rows must have the bits of the batch-1
coop GEMV (the plan's decode1 spec: linear_params at bmax 1) run on that row alone: with no
prologue and f32 out (the row sums unrounded), with the rmsnorm prologue and the residual (bf16
out), and on the down shape with the silu_mul prologue. The current bucket coop GEMV (bmax
decode_bmax) is checked the same way as a control: if it differs too, the harness is wrong, not
the new kernel. The mma specs are the ones the plan takes with gemv_mmq.types = [q4_k, q6_k, q8_0,
q4_0, q4_1] on this device's profile (the h100 / h200 ones: from 32 rows), and the same with one
block per row tile and 16 x rows a block.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.quant_blocks import random_blocks
from gpu_harness import DeviceArray, upload

from engine import cuda, quant, storage
from engine import kernel_catalog as kc

SHAPES = {
    "q4_k": ((6144, 2560), (19456, 2560), (2560, 4096), (2560, 9728), (1003, 2560)),
    "q6_kr": ((1024, 2560), (2560, 9728), (6144, 2560)),
    "q8_0r": ((6144, 2560), (2560, 9728)),
    "q4_0r": ((6144, 2560), (2560, 9728)),
    "q4_1r": ((6144, 2560), (2560, 9728)),
}
ROWS = (2, 8, 16, 32)
# (prologue, residual, out dtype)
VARIANTS = (("none", False, "f32"), ("norm", True, "bf16"), ("silu", False, "bf16"))


# the mma spec's launch shape: the plan's (MMA_FIXED: the grid capped at one block per SM, each
# block staging x once and looping over row tiles; 32 x rows a block, four n tiles, where they
# fit), and one block per row tile (no SM count) with 16 x rows a block (a longer k's halved bmax)
SHAPES_MMA = ({}, {"grid_cap": 0, "bmax": 16})


def _tuning(profile) -> dict:
    t = dict(profile.tuning)
    t["gemv_mmq"] = {**dict(t.get("gemv_mmq") or {}), "types": ["q4_k", "q6_k", "q8_0", "q4_0", "q4_1"]}
    return t


def _specs(tuning: dict, sm_count: int, qt: str, n: int, k: int, pro: str, residual: bool, od: str, shape: dict):
    """(batch-1 coop, bucket coop, mma) gemv specs of one case (``shape``: the mma spec's
    SHAPES_MMA entry over the plan's)."""
    extra: dict = {}
    if pro == "norm":
        extra = dict(prologue="norm", x_stride=k, eps=1e-6)
    elif pro == "silu":
        extra = dict(prologue="silu", x_stride=2 * k, u_off=k)
    kw = dict(residual=residual, out_dtype=od, sm_count=sm_count)
    b1 = kc.linear_params(qt, n, k, tuning, bmax=1, **kw)
    bucket = kc.linear_params(qt, n, k, tuning, bmax=kc.decode_bmax(qt, k, tuning), **kw)
    mma = kc.mma_params(bucket, tuning, sm_count)
    assert mma is not None, (n, k)
    mma = {**mma, **{key: min(v, mma[key]) if key == "bmax" else v for key, v in shape.items()}}
    for p in (b1, bucket):  # (batch-1 only knobs that the plan drops without a residual / norm)
        if pro != "norm":
            p.pop("early_nw", None)
        if not residual:
            p.pop("early_res", None)
    return [kc.spec("gemv", **p, **extra) for p in (b1, bucket, mma)]


def _cases(tuning: dict, sm_count: int, shape: dict) -> list[tuple]:
    out = []
    for qt, shapes in SHAPES.items():
        for n, k in shapes:
            for pro, residual, od in VARIANTS:
                if pro == "silu" and k != 9728:
                    continue
                out.append((qt, n, k, pro, residual, od, _specs(tuning, sm_count, qt, n, k, pro, residual, od, shape)))
    return out


def _bits(arr: DeviceArray, shape, od: str) -> np.ndarray:
    dt = np.uint32 if od == "f32" else np.uint16
    return cuda.dtoh(np.empty(shape, dtype=dt), arr.ptr)


def _nans(bits: np.ndarray, od: str) -> int:
    if od == "f32":
        return int(np.isnan(bits.view(np.float32)).sum())
    return int(((bits & 0x7F80) == 0x7F80).sum() - ((bits & 0x7FFF) == 0x7F80).sum())  # (not inf)


def _run(kernels, spec, rows: int, w, x: DeviceArray, xs: int, res_host, nw, n: int, od: str, per_row: bool):
    """The spec's output bits [rows, n]: one launch over all rows, or (per_row) one launch per row."""
    out = DeviceArray((rows, n), od)
    if spec.params["residual"]:
        out.put(res_host)
    else:
        out.put(np.full((rows, n), np.nan, np.float32))
    c = kc.choice("gemv", **spec.params)
    extra = {"norm_w": nw} if spec.params["prologue"] == "norm" else {}
    for r0, nr in ([(r, 1) for r in range(rows)] if per_row else [(0, rows)]):
        o = out.at(r0 * n)
        kernels.launch(c, nr, out=o, w=w, x=x.at(r0 * xs), residual=o if spec.params["residual"] else 0, rows=nr, **extra)
    return _bits(out, (rows, n), od)


@pytest.mark.parametrize("shape", SHAPES_MMA, ids=["plan", "tile_per_block_bmax16"])
def test_mma_bucket_gemv_rows_equal_batch1(kernels, profile, device, shape):
    if device.compute_capability[0] < 8:
        pytest.skip("mma.sync m16n8k32 int8 needs sm_80+")
    tuning = _tuning(profile)
    cases = _cases(tuning, device.sm_count, shape)
    kernels.prebuild(s for *_, specs in cases for s in specs)
    rng = np.random.default_rng(34)
    bad, control = [], []
    for qt, n, k, pro, residual, od, (b1, bucket, mma) in cases:
        ft = {"q4_k": "q4_k", "q6_kr": "q6_k", "q8_0r": "q8_0", "q4_0r": "q4_0", "q4_1r": "q4_1"}[qt]
        raw = random_blocks(ft, n * k // quant.block(ft)[0], seed=n + k)
        raw = (raw if qt == ft else quant.repack(raw, qt, n, k)).reshape(n, -1)
        assert raw.shape[1] == storage.row_bytes(qt, k)
        w = upload(raw, "u8")
        xs = b1.params["x_stride"] or k
        nw = upload(rng.uniform(0.5, 1.5, k).astype(np.float32), "f32")
        for rows in ROWS:
            xh = rng.standard_normal((rows, xs)) * (3.0 if pro == "norm" else 1.0)
            x = upload(xh, "bf16")
            res = rng.standard_normal((rows, n))
            ref = _run(kernels, b1, rows, w, x, xs, res, nw, n, od, per_row=True)
            got = _run(kernels, mma, rows, w, x, xs, res, nw, n, od, per_row=False)
            ctl = _run(kernels, bucket, rows, w, x, xs, res, nw, n, od, per_row=False)
            tag = f"{qt} {n}x{k} {pro} res={residual} {od} rows={rows}"
            if not np.array_equal(got, ref):
                diff = np.argwhere(got != ref)
                bad.append(f"{tag}: {len(diff)} of {got.size} outputs differ, first at (row, col) {tuple(diff[0])}")
            if not np.array_equal(ctl, ref):
                control.append(f"{tag}: the bucket coop GEMV differs from batch 1 in {int((ctl != ref).sum())} outputs")
            assert not _nans(ref, od), f"{tag}: the batch-1 GEMV left {_nans(ref, od)} outputs unwritten"
    # (control: the existing bucket coop GEMV against batch 1; a failure there is the harness's)
    assert not bad and not control, {"mma": bad, "control": control}
