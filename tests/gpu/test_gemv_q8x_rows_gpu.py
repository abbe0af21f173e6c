"""The quantised bucket GEMVs (the coop q8x GEMVs of bmax > 1, kernels/_gemv_coop.cuh.j2: a weight
segment loaded and decoded once for all of a block's x rows) against the batch-1 GEMV, bit for bit,
and against numpy, on a real GPU (skipped without one; issue #34 item 1).

For random q4_k weights of the Qwen3-4B shapes (q|k|v 6144 x 2560, gate|up 19456 x 2560, the k-split
o 2560 x 4096 and down 2560 x 9728 with the residual, a 1003 x 2560 with a row tail), random q6_kr
ones (a q4_k_m file's q6_k v 1024 x 2560 and down 2560 x 9728), q8_0r / q4_0r / q4_1r ones (6144 x
2560) and random x rows, every output of this device's profile's bucket spec
(kernel_catalog.linear_params at decode_bmax) run over 1, 2, 3, 4, 5, 8, 9, 13 and 16 rows in one
launch must have the bits of the batch-1 spec (bmax 1, its bulk-copied row tile and triggers
included) run on that row alone, and be within the int8-x tolerance of numpy: x rows through
engine.quant.q8x_round_trip times the dequantised weight, in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_harness import bf_round, gemv_rows_bits, rel_err, upload, uploaded_weights

from engine import kernel_catalog as kc
from engine import quant

# (device layout, n, k, residual, out dtype)
CASES = (
    ("q4_k", 6144, 2560, False, "f32"),
    ("q4_k", 19456, 2560, False, "f32"),
    ("q4_k", 2560, 4096, True, "bf16"),
    ("q4_k", 2560, 9728, True, "bf16"),
    ("q4_k", 1003, 2560, False, "f32"),
    ("q6_kr", 1024, 2560, False, "f32"),
    ("q6_kr", 2560, 9728, True, "bf16"),
    ("q8_0r", 6144, 2560, False, "f32"),
    ("q4_0r", 6144, 2560, False, "f32"),
    ("q4_1r", 6144, 2560, False, "f32"),
)
ROWS = (1, 2, 3, 4, 5, 8, 9, 13, 16)


@pytest.fixture(scope="module")
def weights():
    return uploaded_weights(23)


@pytest.mark.parametrize("case", CASES, ids=[f"{q}-{n}x{k}{'-res' if r else ''}-{od}" for q, n, k, r, od in CASES])
def test_quantised_bucket_gemv_rows_equal_batch1_and_numpy(kernels, profile, device, weights, case):
    qt, n, k, residual, od = case
    t = profile.tuning
    kw = dict(residual=residual, out_dtype=od, sm_count=device.sm_count)
    b1 = kc.linear_params(qt, n, k, t, bmax=1, **kw)
    bucket = kc.linear_params(qt, n, k, t, bmax=kc.decode_bmax(qt, k, t), **kw)
    if not (bucket.get("coop") and bucket.get("q8x")):
        pytest.skip(f"the {profile.name} profile's {qt} bucket GEMV is not the coop q8x one")
    b1.pop("early_nw", None)  # (a norm prologue's only)
    if not residual:
        b1.pop("early_res", None)
    b1, bucket = kc.spec("gemv", **b1), kc.spec("gemv", **bucket)
    kernels.prebuild([b1, bucket])
    w, deq = weights(qt, n, k)
    rng = np.random.default_rng(n + k)
    for rows in ROWS:
        xh = bf_round(rng.standard_normal((rows, k)) * rng.uniform(0.2, 4.0, (rows, 1)))
        res = bf_round(rng.standard_normal((rows, n)))
        x = upload(xh, "bf16")
        ref = gemv_rows_bits(kernels, b1, w, x, res, per_row=True)
        got = gemv_rows_bits(kernels, bucket, w, x, res, per_row=False)
        diff = np.argwhere(got != ref)
        assert not diff.size, f"rows={rows}: {len(diff)} of {got.size} outputs differ, first at {tuple(diff[0])}"
        vals = got.view(np.float32) if od == "f32" else (got.astype(np.uint32) << 16).view(np.float32)
        assert not np.isnan(vals).any(), f"rows={rows}: outputs left unwritten"
        want = quant.q8x_round_trip(xh.astype(np.float32)).astype(np.float64) @ deq.T + (res if residual else 0.0)
        err = rel_err(vals.astype(np.float64), want)
        assert err <= (1e-5 if od == "f32" else 1e-2), (rows, err)
