"""The bf16 bucket GEMV (kernels/_gemv_rows.cuh.j2: rows_per_warp rows a warp) gives every row the
batch-1 GEMV's bits, on the CPU (tests/fixtures/cuda_emu.py runs the rendered kernels under g++).

The specs are kernel_catalog.linear_params' at bmax 1 and bmax 8 for one bf16 weight on the h100
profile: the bucket one has rows_per_warp > 1, the batch-1 one a warp a row. The bucket one runs
on 13, 8, 5, 2 and 1 x rows (passes of that many rows: 13 takes a second grid row of 5) against
the batch-1 GEMV on each row alone: the same output bits, with and without the residual, f32 and
bf16 outputs, the norm and silu prologues and the glu epilogue, on an n that leaves the last block
a column tail and a k whose units give the lanes 2 or 3 each. Random weights; the outputs start
NaN, so a column or row no block stores fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures import cuda_emu
from fixtures.checkpoints import to_bf16_bits

from engine import kernel_catalog as kc
from engine.lowering.gemv import gemv_signature
from engine.profile import get_profile
from engine.render import render

# n = 1030 (over the h100 profile's short_n_max: 256-thread batch-1 blocks, 2 warps a row, 64-thread
# bucket blocks) leaves the bucket's 4-row blocks a 2-row tail; n = 37 (a short weight: 512-thread
# batch-1 blocks, 4 warps a row, 128-thread bucket blocks) a 1-row tail; k: 145 units, 2 or 3 a lane
N, N_SHORT, K = 1030, 37, 1160


def _bf16(x) -> np.ndarray:
    return to_bf16_bits(np.ascontiguousarray(x, np.float32)).reshape(np.shape(x))


class Gemv:
    """One rendered gemv spec, compiled once, launched on any number of x rows."""

    def __init__(self, spec, tmp_path):
        self.p = spec.params
        self.lib, self.types = cuda_emu.compile_any(render(spec), spec.entry, tmp_path)

    def __call__(self, w, x, rows, residual=None, norm_w=None):
        p = self.p
        if residual is not None:  # (the residual aliases out, as in the plans)
            out = residual.copy()
        elif p["out_dtype"] == "f32":
            out = np.full((rows, p["n"]), np.nan, np.float32)
        else:
            out = np.full((rows, p["n"]), 0x7FC0, np.uint16)  # bf16 NaN
        args = [out, w, x, out if residual is not None else None, rows]
        if p["prologue"] == "norm":
            args.append(norm_w)
        grid = (kc.gemv_grid_x(p), -(-rows // p["bmax"]), 1)
        cuda_emu.launch_any(self.lib, self.types, grid, p["threads"], kc.gemv_smem(p), args)
        return out


def _specs(residual: bool, out_dtype: str, extra: dict) -> tuple:
    t = get_profile("h100").tuning
    n = extra.pop("n", N)
    one, bucket = (
        kc.spec(
            "gemv",
            **{**kc.linear_params("bf16", n, K, t, residual=residual, out_dtype=out_dtype, bmax=b), **extra},
        )
        for b in (1, 8)
    )
    assert bucket.params["rows_per_warp"] > 1 and one.params["rows_per_warp"] == 1
    assert gemv_signature(bucket.params) == gemv_signature(one.params)  # (the same warps per row)
    assert bucket.params["threads"] == (128 if n <= 1024 else 64), bucket.params  # (both block shapes)
    return one, bucket


CASES = {
    "plain-f32": (False, "f32", {}),
    "short-n-f32": (False, "f32", {"n": N_SHORT}),
    "residual": (True, "bf16", {}),
    "norm": (False, "f32", {"prologue": "norm", "x_stride": K, "eps": 1e-6, "n": N_SHORT}),
    "silu": (False, "f32", {"prologue": "silu", "x_stride": 2 * K, "u_off": K, "n": N_SHORT}),
    "glu": (False, "bf16", {"glu": 517, "n": 1034}),  # 2 pairs a block: a 1-pair tail
    "short-n-glu": (False, "bf16", {"glu": 41, "n": 82}),
}


LONG = {"short-n-f32", "norm", "silu", "short-n-glu", "residual", "glu"}  # (.ci/run's long step runs these; README's run the plain one)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.long) if c in LONG else c for c in sorted(CASES)])
def test_bucket_rows_equal_the_batch1_gemv(case, tmp_path):
    residual, out_dtype, extra = CASES[case]
    one, bucket = _specs(residual, out_dtype, dict(extra))
    p = bucket.params
    n, xs = p["n"], p["x_stride"] or K
    rng = np.random.default_rng(3)
    w = _bf16(rng.standard_normal((n, K)) * 0.05).reshape(-1)
    x = _bf16(rng.standard_normal((13, xs)) * rng.uniform(0.3, 3.0, (13, 1)))
    nw = (1.0 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    res = _bf16(rng.standard_normal((13, n))) if residual else None
    g1, gb = Gemv(one, tmp_path), Gemv(bucket, tmp_path)
    solo = [
        g1(w, np.ascontiguousarray(x[r : r + 1]), 1, None if res is None else res[r : r + 1], nw)[0]
        for r in range(13)
    ]
    cols = n // 2 if p["glu"] else n  # (glu: silu(gate) * up in the gate half; the up half is not written)
    for rows in (13, 8, 5, 2, 1):  # (13: a second grid row of 5)
        got = gb(
            w,
            np.ascontiguousarray(x[:rows]),
            rows,
            None if res is None else np.ascontiguousarray(res[:rows]),
            nw,
        )
        for r in range(rows):
            a, b = got[r, :cols], solo[r][:cols]
            assert not np.isnan(
                a if a.dtype == np.float32 else (a.astype(np.uint32) << 16).view(np.float32)
            ).any()
            assert np.array_equal(a, b), (case, rows, r, int((a != b).sum()))
