"""The bf16 bucket GEMV (kernels/_gemv_rows.cuh.j2: rows_per_warp rows a warp) against the batch-1
bf16 GEMV, bit for bit, and against numpy, on a real GPU (skipped without one; issue #34 item 1).

For random bf16 weights of the Qwen3-4B shapes (q|k|v 6144 x 2560, o 2560 x 4096 and down
2560 x 9728 with the residual, gate|up 19456 x 2560 with the glu epilogue, a 1003 x 2560 with a row
tail and f32 out as the head stores logits) and random x rows, every output of the plan's bucket
spec (kernel_catalog.linear_params at the bucket bmax, this device's profile) run over 1, 2, 3, 5, 8
and 13 rows in one launch must have the bits of the batch-1 spec (bmax 1) run on that row alone,
and the bucket's rows must be within bf16 rounding of x @ W.T (+ residual) in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_harness import bf_round, gemv_rows_bits, rel_err, upload, uploaded_weights

from engine import kernel_catalog as kc

# (n, k, residual, out dtype, glu)
CASES = (
    (6144, 2560, False, "bf16", 0),
    (2560, 4096, True, "bf16", 0),
    (2560, 9728, True, "bf16", 0),
    (19456, 2560, False, "bf16", 9728),
    (1003, 2560, False, "f32", 0),
)
ROWS = (1, 2, 3, 5, 8, 13)


@pytest.mark.parametrize(
    "case", CASES, ids=[f"{n}x{k}{'-res' if r else ''}{'-glu' if g else ''}-{od}" for n, k, r, od, g in CASES]
)
def test_bf16_bucket_gemv_rows_equal_batch1(kernels, profile, device, case):
    n, k, residual, od, glu = case
    kw = dict(residual=residual, out_dtype=od, sm_count=device.sm_count)
    b1, bucket = (
        kc.linear_params("bf16", n, k, profile.tuning, bmax=b, **kw)
        for b in (1, kc.decode_bmax("bf16", k, profile.tuning))
    )
    if bucket.get("coop") or bucket.get("rows_per_warp", 1) == 1:
        pytest.skip(f"the {profile.name} profile's bf16 bucket GEMV is not the rows_per_warp layout")
    b1, bucket = (kc.spec("gemv", **p, **({"glu": glu} if glu else {})) for p in (b1, bucket))
    kernels.prebuild([b1, bucket])
    w, deq = uploaded_weights(11)("bf16", n, k)
    rng = np.random.default_rng(n + k)
    cols = glu or n  # (glu: silu(gate) * up in the first half; the up half is not written)
    for rows in ROWS:
        xh = bf_round(rng.standard_normal((rows, k)))
        res = bf_round(rng.standard_normal((rows, n)))
        x = upload(xh, "bf16")
        ref = gemv_rows_bits(kernels, b1, w, x, res, per_row=True)[:, :cols]
        got = gemv_rows_bits(kernels, bucket, w, x, res, per_row=False)[:, :cols]
        diff = np.argwhere(got != ref)
        assert not diff.size, (
            f"rows={rows}: {len(diff)} of {got.size} outputs differ, first at {tuple(diff[0])}"
        )
        y = xh @ deq.T
        if glu:
            g, u = bf_round(y[:, :glu]), bf_round(y[:, glu:])
            want = g / (1.0 + np.exp(-g)) * u
        else:
            want = y + (res if residual else 0.0)
        vals = got.view(np.float32) if od == "f32" else (got.astype(np.uint32) << 16).view(np.float32)
        assert not np.isnan(vals).any(), f"rows={rows}: outputs left unwritten"
        err = rel_err(vals.astype(np.float64), want)
        assert err <= (1e-5 if od == "f32" else 1e-2), (rows, err)
