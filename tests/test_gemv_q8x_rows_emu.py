"""The bucket coop q8x GEMVs (kernels/_gemv_coop.cuh.j2, q8x=true, bmax > 1: the quantised decode
linears of 2..31-row passes on the h100 / h200 profiles) under the CPU emulator
(tests/fixtures/cuda_emu.py), for every q8x type (q4_k, q6_kr, q8_0r, q4_0r, q4_1r) at the plan's
bmax (kernel_catalog.decode_bmax) on 1 to 16 rows (16 and 9: two grid rows of 8) and short n (a
row tile's tail): every output row equal bit for bit to the batch-1 GEMV (bmax 1, its own block
shape and unroll) on that row alone, and all rows within the int8-x tolerance of the numpy
reference (engine.quant.q8x_round_trip of x against the dequantised weight). A block loads and
decodes each weight segment once (its nibbles masked once) for all of its x rows; these tests hold
that each row still gets its batch-1 bits. tests/gpu/test_batch_invariance_gpu.py checks the
plans' kernels on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures import cuda_emu
from fixtures.checkpoints import to_bf16_bits
from fixtures.quant_blocks import random_blocks

from engine import kernel_catalog as kc
from engine import quant
from engine.profile import all_profiles
from engine.render import render

# batch-1 knobs the emulator cannot run (inline PTX) or that only reorder loads: the same bits
OFF = dict(wsm=False, trigger=False, l2_pf="", early_res=False, early_nw=False)
FILE_TYPE = {"q4_k": "q4_k", "q6_kr": "q6_k", "q8_0r": "q8_0", "q4_0r": "q4_0", "q4_1r": "q4_1"}


def _specs(qt: str, n: int, k: int, ksplit: bool):
    """(batch-1 spec, bucket spec) of the h100 profile for a [n, k] weight uploaded as ``qt``; with
    ``ksplit`` the type's k split on (its min / max n widened to n), else off."""
    t = dict(all_profiles()["h100"].tuning)
    c = dict(t["gemv_coop"])
    per_type = {ft: {**v, "q8x_ksplit_min_n": 0} for ft, v in dict(c["q8x_type_tuning"]).items()}
    c.update(q8x_type_tuning=per_type, q8x_ksplit_max_n=n if ksplit else 0)
    t["gemv_coop"] = c
    kw = dict(residual=False, out_dtype="f32", sm_count=132)
    b1 = kc.linear_params(qt, n, k, t, bmax=1, **kw)
    bucket = kc.linear_params(qt, n, k, t, bmax=kc.decode_bmax(qt, k, t), **kw)
    assert b1["q8x"] and bucket["q8x"] and bucket["bmax"] > 1
    return kc.spec("gemv", **{**b1, **OFF}), kc.spec("gemv", **bucket)


def _emu(spec, x: np.ndarray, rows: int, w: np.ndarray, tmp_path) -> np.ndarray:
    """The spec's f32 outputs [rows, n] as uint32 bits under the CPU emulator."""
    p = spec.params
    out = np.full((rows, p["n"]), np.nan, np.float32)
    lib, types = cuda_emu.compile_any(render(spec), spec.entry, tmp_path)
    grid = (kc.gemv_grid_x(p), -(-rows // p["bmax"]), 1)
    cuda_emu.launch_any(lib, types, grid, p["threads"], kc.gemv_smem(p), [out, w, x, None, rows])
    return out.view(np.uint32)


# (type, n, k, k split, rows): n 44 / 36 / 20 leave a row tile's tail; k 512 / 1024 / 2560 short
# rows of 2-40 segments; 16 and 9 rows run two grid rows of bmax 8
CASES = [
    ("q4_k", 44, 512, False, 2),
    ("q4_k", 44, 512, False, 16),
    ("q4_k", 44, 2560, True, 5),
    ("q4_k", 36, 1024, True, 9),
    ("q6_kr", 44, 512, False, 3),
    ("q6_kr", 20, 1024, True, 16),
    ("q6_kr", 36, 2560, False, 8),
    ("q8_0r", 36, 512, False, 4),
    ("q8_0r", 20, 1024, True, 11),
    ("q4_0r", 36, 512, True, 6),
    ("q4_1r", 44, 1024, False, 2),
    ("q4_1r", 20, 512, True, 16),
]


# README's run: one case a type (two grid rows, a k split where the type has one); the rest in the long step
README_CASES = {("q4_k", 44, 512, False, 16), ("q6_kr", 20, 1024, True, 16), ("q8_0r", 20, 1024, True, 11),
                ("q4_0r", 36, 512, True, 6), ("q4_1r", 20, 512, True, 16)}  # fmt: skip


@pytest.mark.parametrize(
    "case",
    [c if c in README_CASES else pytest.param(c, marks=pytest.mark.long) for c in CASES],
    ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-ks{int(c[3])}-r{c[4]}",
)
def test_bucket_rows_equal_batch1_and_the_reference(case, tmp_path):
    qt, n, k, ksplit, rows = case
    b1, bucket = _specs(qt, n, k, ksplit)
    assert (bucket.params["ksplit"] > 1) == ksplit
    ft = FILE_TYPE[qt]
    raw = random_blocks(ft, n * k // quant.block(ft)[0], seed=k + n)
    w = np.ascontiguousarray((raw if qt == ft else quant.repack(raw, qt, n, k)).reshape(-1))
    rng = np.random.default_rng(n + k + rows)
    xf = (rng.standard_normal((rows, k)) * rng.uniform(0.2, 4.0, (rows, 1))).astype(np.float32)
    x = to_bf16_bits(np.ascontiguousarray(xf)).reshape(rows, k)
    got = _emu(bucket, x, rows, w, tmp_path)
    for r in range(rows):
        want = _emu(b1, np.ascontiguousarray(x[r : r + 1]), 1, w, tmp_path)
        assert not np.isnan(want.view(np.float32)).any()
        diff = np.flatnonzero(got[r] != want[0])
        assert diff.size == 0, (case, r, diff.size, diff[:8])
    # the numpy reference: the int8 x rows against the dequantised weight (f32 order aside)
    xb = (x.astype(np.uint32) << 16).view(np.float32)
    ref = quant.q8x_round_trip(xb) @ quant.dequantize(raw, ft, (n, k)).T
    y = got.view(np.float32)
    scale = np.abs(ref).max()
    assert np.abs(y - ref).max() <= 2e-4 * scale + 1e-3, (case, np.abs(y - ref).max(), scale)
