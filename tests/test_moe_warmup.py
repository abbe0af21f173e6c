"""`memra warmup` for the MoE family: every kernel its CUDA plans need is listed and compiles (no GPU).

The CPU tests compile one profile's MoE kernels; the exhaustive matrix (every combo x every profile,
``memra warmup --family qwen3_moe --all-profiles``) is the ``compile_matrix`` CI step:
``python -m pytest -q --compile-matrix -m compile_matrix``.
"""

from __future__ import annotations

import pytest
from test_kernels_compile import _nvrtc_ok
from test_moe_plan import _plan

from engine import cli
from engine.ir import kernel_specs


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MEMRA_NO_COMPILE", raising=False)
    return tmp_path / "cache"


def test_warmup_lists_the_moe_kernels_of_every_combo(capsys, cache):
    assert cli.main(["warmup", "--family", "qwen3_moe", "--device-profile", "h100", "--list"]) == 0
    names = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("sm_90a ")]
    moe = {n.split("__")[0] for n in names if n.startswith("moe_")}
    for q in ("bf16", "q8_0", "q4_k", "q5_k", "q6_k"):  # every expert storage type the combos list
        # per slot (batch 1): q4_k / q5_k / q6_k stacks take moe_gemv_q8 on this profile (int8 x rows)
        solo = {f"moe_gemv_q8_glu_{q}", f"moe_gemv_q8_down_{q}"} if q in ("q4_k", "q5_k", "q6_k") else {f"moe_gemv_glu_{q}", f"moe_gemv_down_{q}"}
        assert solo | {f"moe_gemv_glu_grouped_{q}", f"moe_gemv_down_grouped_{q}"} <= moe, q
        assert {f"moe_gemm_glu_{q}", f"moe_gemm_down_{q}"} <= moe, q
    assert {"moe_topk", "moe_router_f32", "moe_combine", "moe_sort"} <= moe


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or the CUDA headers are not available")
def test_moe_plan_kernels_compile_for_h100(cache):
    from engine.compile import KernelBuilder

    _, _, plan = _plan("q8_0", profile="h100")
    specs = [s for s in kernel_specs(plan) if s.template.startswith("moe_")]
    # topk (prefill), router (decode1 with its early trigger, decode), glu and down (decode1 with
    # the trigger, small decode buckets), glu_grouped, down_grouped, combine; sort, gemm glu, gemm
    # down for prefill (row tiles of 64) and for the larger decode buckets (of 16); the wide decode
    # buckets' router (from gemm_decode.quant_min_rows rows: the norm before it a launch of its own)
    assert len(specs) == 17
    stats = KernelBuilder("sm_90a").build_all(specs, jobs=1)
    assert stats.compiled == len(specs) and all(k.cubin for k in stats.kernels)


@pytest.mark.compile_matrix
@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or the CUDA headers are not available")
def test_warmup_compiles_every_qwen3_moe_kernel_for_every_profile(cache, monkeypatch):
    assert cli.main(["warmup", "--family", "qwen3_moe", "--all-profiles"]) == 0
    monkeypatch.setenv("MEMRA_NO_COMPILE", "1")  # a second pass: all hits
    assert cli.main(["warmup", "--family", "qwen3_moe", "--all-profiles"]) == 0
