"""The tensor-core batched decode linear (kernels/gemv_mma.cu.j2; in no plan yet, docs/kernels.md says
why) without a GPU: its spec rules, the shape rule of its params, and that it renders and
NVRTC-compiles for every profile arch (tests/gpu/test_gemv_mma_gpu.py runs it)."""

from __future__ import annotations

import pytest
from test_kernels_compile import _nvrtc_ok

from engine import kernel_catalog as kc
from engine.compile import KernelBuilder
from engine.kcache import KernelCache
from engine.profile import all_profiles
from engine.render import render
from engine.types import ConfigError


def test_spec_rules_name_the_problem():
    ok = kc.gemv_mma_params("q4_k", 2560, 9728, 8)
    assert ok is not None and kc.spec("gemv_mma", **ok).entry.startswith("gemv_mma__quantq4k_n2560_k9728_bmax8")
    for over, msg in (
        (dict(bmax=24), "bmax=24"),
        (dict(mt=3), "mt=3"),
        (dict(k=2560 + 32), "multiple of 64"),
        (dict(kparts=1000), "kparts=1000"),
        (dict(quant="q2_k"), "q2_k"),
        (dict(x_stride=2564), "x_stride"),
        (dict(residual=True, out_dtype="f32"), "residual"),
        (dict(wm=3), "multiple of wm"),
    ):
        with pytest.raises(ConfigError, match=msg):
            kc.spec("gemv_mma", **{**ok, **over})
    assert kc.gemv_mma_params("q4_k", 2560, 2560 + 32, 8) is None  # k not a whole number of steps
    assert kc.gemv_mma_params("q8_0r", 2560, 2560 - 64, 8) is not None  # q8_0r: any k (d plane padded)
    assert kc.gemv_mma_params("q2_k", 2560, 2560, 8) is None  # no decoder
    assert kc.gemv_mma_params("bf16", 2560, 2560, 8, x_stride=2564) is None


def test_params_grow_the_m_tiles_with_the_batch_and_split_k_to_fill_the_sms():
    ps = [kc.gemv_mma_params("q4_k", 2560, 9728, b, sm_count=132) for b in (8, 16, 32, 64)]
    assert [(p["mt"], p["wm"]) for p in ps] == [(1, 4), (2, 2), (2, 4), (4, 4)]
    rows = [16 * p["mt"] * p["wm"] for p in ps]
    assert rows == sorted(rows)  # more rows a block (x shared by more of them) as the batch grows
    wide = kc.gemv_mma_params("q4_k", 19456, 2560, 8, sm_count=132)
    assert wide["kparts"] == 2  # 304 row tiles of 64: two parts make 4 blocks per SM
    down = kc.gemv_mma_params("q6_kr", 2560, 9728, 64, sm_count=132)
    assert 10 * down["kparts"] >= 2 * 132 > 10 * (down["kparts"] - 1)  # 10 tiles of 256 rows
    # the partial sums stay within a row's weight bytes: a short q4_k row at bmax 64 splits less
    short = kc.gemv_mma_params("q4_k", 2560, 2560, 64, sm_count=132)
    assert short["kparts"] * 64 * 4 <= 1440 < (short["kparts"] + 1) * 64 * 4
    assert kc.gemv_mma_params("q4_k", 1024, 512, 8, sm_count=132)["kparts"] == 2  # 8 steps: a round each


def test_every_profile_renders_and_the_primary_arch_compiles(tmp_path):
    specs = []
    for prof in all_profiles().values():
        for bmax in (8, 16, 32, 64):
            p = kc.gemv_mma_params("q4_k", 2560, 9728, bmax, sm_count=prof.sm_count, residual=True)
            specs.append((prof.arch, kc.spec("gemv_mma", **p)))
    for _, s in specs:
        src = render(s)
        assert f"{s.entry}(" in src and "{{" not in src
    if not _nvrtc_ok():
        pytest.skip("NVRTC or the CUDA headers are missing")
    # one spec per arch (the templates' only arch branch is PDL's), every fast / generic decoder on sm_90a
    per_arch = {arch: s for arch, s in specs}
    for arch, s in per_arch.items():
        KernelBuilder(arch, cache=KernelCache(tmp_path / arch), no_compile=False).build_all([s], progress=None)
    types = ["bf16", "q4_0r", "q4_1r", "q6_kr", "q8_0r", "q5_0"]  # the other fast paths and two generic ones
    fast = [kc.spec("gemv_mma", **kc.gemv_mma_params(t, 1024, 2560, 8, out_dtype="f32")) for t in types]
    KernelBuilder("sm_90a", cache=KernelCache(tmp_path / "types"), no_compile=False).build_all(fast, progress=None)
