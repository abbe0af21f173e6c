"""The MoE kernels (kernels/moe_topk.cu.j2, moe_gemv.cu.j2, moe_combine.cu.j2, moe_shared.cu.j2) render for every storage type
and mode, open with pdl_wait(), and compile with NVRTC for every device profile's arch (no GPU).

Every storage type's decoder compiles for the primary arch (sm_90a, in the glu kernel; down for the
main types); the other archs compile one spec of each template, which keeps NVRTC to a few seconds.
"""

from __future__ import annotations

import pytest
from fixtures.pdl import waits_first
from test_kernels_compile import _nvrtc_ok

from engine.compile import KernelBuilder
from engine.kcache import KernelCache
from engine.model import dims_for_size
from engine.moe_kernels import (
    GEMM_QUANTS,
    GEMV_QUANTS,
    combine_kernel,
    expert_gemm_kernel,
    expert_gemv_kernel,
    expert_q8_kernel,
    gemm_max_tiles,
    moe_specs,
    q8round_kernel,
    router_counters,
    router_kernel,
    shared_kernel,
    sort_kernel,
    topk_kernel,
)
from engine.profile import all_profiles
from engine.render import render
from engine.types import ConfigError

PRIMARY_ARCH = "sm_90a"


def _all_specs():
    specs = [topk_kernel(128, 8, True).spec, topk_kernel(60, 4, False, warps=2).spec]
    for q in GEMV_QUANTS:
        specs.append(expert_gemv_kernel("glu", q, 768, 2048, 8).spec)
        specs.append(expert_gemv_kernel("down", q, 2048, 768, 8, residual=True).spec)
    specs.append(expert_gemv_kernel("down", "q8_0", 64, 96, 2, rows_per_block=2).spec)  # no residual, n tail
    for q in ("bf16", "q8_0", "q4_k", "q6_k"):
        specs.append(expert_gemv_kernel("glu_grouped", q, 768, 2048, 8, experts=128, max_slots=256).spec)
        specs.append(expert_gemv_kernel("down_grouped", q, 2048, 768, 8, experts=128, max_slots=256).spec)
    specs += [combine_kernel(2048, 8).spec, combine_kernel(64, 2, residual=False, threads=64).spec]
    specs += [shared_kernel(2048).spec, q8round_kernel(2048, 4608).spec, q8round_kernel(768, 768, row_mult=8).spec]
    # (Qwen3.6-35B-A3B's batch-1 routed down with the shared expert's gate folded in)
    specs += [expert_q8_kernel("down", q, 2048, 512, 8, residual=True, trigger=True, shared=256).spec for q in ("q4_k", "q6_k")]
    specs.append(combine_kernel(2048, 8, shared=256).spec)
    specs += [sort_kernel(128, 8, 64).spec, sort_kernel(8, 2, 16, threads=256).spec]
    for q in GEMM_QUANTS:
        specs.append(expert_gemm_kernel("glu", q, 768, 2048, 8, 128).spec)
        specs.append(expert_gemm_kernel("down", q, 2048, 768, 8, 128).spec)
    specs.append(expert_gemm_kernel("glu", "q8_0", 96, 256, 2, 8, tile_m=16, tile_n=64, tile_k=32, warps=4, warps_m=1).spec)
    for q in ("q4_k", "q6_k"):  # the decode buckets' row tiles of 16
        specs.append(expert_gemm_kernel("glu", q, 768, 2048, 8, 128, tile_m=16, warps_m=1).spec)
        specs.append(expert_gemm_kernel("down", q, 2048, 768, 8, 128, tile_m=16, warps_m=1).spec)
    return specs


def test_every_moe_kernel_renders_and_waits_first():
    d = dims_for_size("qwen3_moe", "qwen3-30b-a3b")
    q8 = [s for s in moe_specs(d, ["q4_k", "q5_k", "q6_k"]) if s.template in ("moe_gemv_q8", "moe_router")]
    assert any(s.params.get("route") and s.params.get("mode") == "glu" for s in q8)
    assert not any(s.params.get("route") and s.params.get("mode") == "down" for s in q8)
    d36 = dims_for_size("qwen3_5_moe", "qwen3.6-35b-a3b")
    q36 = [s for s in moe_specs(d36, ["q4_k", "q6_k"]) if s.template in ("moe_gemv_q8", "moe_shared", "moe_combine")]
    assert any(s.template == "moe_combine" and s.params["shared"] for s in q36)
    assert {s.params["quant"] for s in q36 if s.template == "moe_gemv_q8" and s.params["shared"]} == {"q4_k", "q6_k"}
    assert any(s.template == "moe_shared" for s in q36) and not any(s.params.get("shared") for s in q8)
    for s in _all_specs() + q8 + q36:
        src = render(s)
        assert f"{s.entry}(" in src and waits_first(src, s.entry), s.entry
    down = render(expert_gemv_kernel("down", "q4_k", 2048, 768, 8, residual=True).spec)
    assert "#define RESIDUAL 1" in down and "block_q4_K" in down


def test_builders_check_their_inputs():
    with pytest.raises(ConfigError, match="1..512"):
        topk_kernel(600, 8, True)
    with pytest.raises(ConfigError, match="top_k 9"):
        topk_kernel(8, 9, True)
    with pytest.raises(ConfigError, match="not a whole number of 256"):
        expert_gemv_kernel("glu", "q4_k", 768, 1000, 8)
    with pytest.raises(ConfigError, match="not supported"):
        expert_gemv_kernel("glu", "q2_k", 768, 2048, 8)
    k = expert_gemv_kernel("glu", "q8_0", 768, 2048, 8)
    assert k.grid(3) == (192, 24, 1) and k.block == (128, 1, 1)
    with pytest.raises(ConfigError, match="exceed"):
        k.grid(9000)
    d = dims_for_size("qwen3_moe", "qwen3-30b-a3b")
    specs = moe_specs(d, ["q4_k", "q6_k", "q8_0", "bf16"])
    assert len(specs) == 1 + 6 + 4 * 6 + 2 * 6 + 2 + 2 and specs[0].params == {"experts": 128, "top_k": 8, "normalize": True, "warps": 4}
    assert [(s.params["wdtype"], s.params["norm"], s.params["route"]) for s in specs[1:7]] == [
        (w, norm, route) for w in ("f32", "bf16") for norm, route in ((False, True), (True, True), (True, False))]
    g = expert_gemv_kernel("down_grouped", "q4_k", 2048, 768, 8, experts=128, max_slots=256)
    assert g.grid(32) == (512, 128, 1) and [a for a, _ in g.args] == ["partial", "w", "act", "ids", "rows"]
    assert g.grid(2) == (512, 16, 1) and g.grid(3) == (512, 24, 1)  # a block row per expert the step can choose
    assert g.grid(256) == (512, 128, 1)  # an expert's (token, slot) pairs: at most one per token
    with pytest.raises(ConfigError, match="exceed max_slots 256"):
        g.grid(257)
    with pytest.raises(ConfigError, match="max_slots 100000"):
        expert_gemv_kernel("glu_grouped", "q4_k", 768, 2048, 8, experts=128, max_slots=100000)
    assert combine_kernel(2048, 8).grid(5) == (8, 5, 1)
    r = router_kernel(128, 2048, 8, True, "f32", 4608)
    assert r.grid(1) == (64, 1, 1) and r.grid(9) == (64, 2, 1) and r.block == (256, 1, 1)
    assert [a for a, _ in r.args] == ["ids", "weights", "logits", "x", "w", "count", "rows"]
    assert router_counters(128, 8) == 64 and router_counters(9, 8) == 8
    for bad, match in (
        (dict(experts=600), "1..512"),
        (dict(top_k=9, experts=8), "top_k 9"),
        (dict(wdtype="q8_0"), "f32 or bf16"),
        (dict(x_stride=1000), "x stride 1000"),
        (dict(tokens=3), "tokens 3"),
    ):
        args = {"experts": 128, "k": 2048, "top_k": 8, "normalize": True, "wdtype": "f32", "x_stride": 2048, **bad}
        with pytest.raises(ConfigError, match=match):
            router_kernel(**args)
    src = render(r.spec)
    assert "route_token(" in src and waits_first(src, r.spec.entry) and "#define X_STRIDE 4608" in src
    rn = router_kernel(128, 2048, 8, True, "f32", 4608, eps=1e-6, h_stride=2048)
    assert [a for a, _ in rn.args][-2:] == ["nw", "h"] and "#define NORM 1" in render(rn.spec)
    with pytest.raises(ConfigError, match="h stride"):
        router_kernel(128, 2048, 8, True, "f32", 2048, eps=1e-6, h_stride=100)


def test_grouped_gemm_builders():
    glu = expert_gemm_kernel("glu", "q4_k", 768, 2048, 8, 128)
    down = expert_gemm_kernel("down", "q4_k", 2048, 768, 8, 128)
    assert glu.grid(512) == (768 // 64, 512 * 8 // 64 + 128, 1) and down.grid(512) == (2048 // 128, 192, 1)
    assert glu.smem == down.smem == 3 * (64 + 128) * 64 * 2 and glu.block == (256, 1, 1)
    assert [a for a, _ in glu.args] == ["act", "wg", "wu", "x", "perm", "tiles", "rows"]
    assert [a for a, _ in down.args] == ["partial", "w", "act", "perm", "tiles", "rows"]
    assert glu.spec.params["qprefetch"] and not expert_gemm_kernel("glu", "q6_k", 768, 2048, 8, 128).spec.params["qprefetch"]
    # any routing fits the tile bound: each expert's count rounded up to whole tiles
    for counts in ([512 * 8] + [0] * 127, [32] * 128, [65] * 63 + [512 * 8 - 65 * 63] + [0] * 64):
        assert sum(-(-c // 64) for c in counts) <= gemm_max_tiles(512, 8, 128, 64)
    src = render(glu.spec)
    assert "#define GLU 1" in src and "mma.sync.aligned.m16n8k16" in src and "load_raw" in src
    with pytest.raises(ConfigError, match="not supported"):
        expert_gemm_kernel("glu", "q2_k", 768, 2048, 8, 128)
    with pytest.raises(ConfigError, match="multiple of tile_k"):
        expert_gemm_kernel("down", "q8_0", 2048, 800, 8, 128)
    with pytest.raises(ConfigError, match="do not fit"):
        expert_gemm_kernel("down", "q8_0", 2048, 768, 8, 128, tile_n=40)
    with pytest.raises(ConfigError, match="tile_m=48"):
        sort_kernel(128, 8, 48)
    assert sort_kernel(128, 8, 64).grid(4096) == (1, 1, 1)


@pytest.mark.compile_matrix  # (.ci/run's compile step; README's run compiles the MoE plans' kernels: test_moe_warmup)
@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or the CUDA headers are not available")
def test_moe_kernels_compile_for_every_profile_arch(tmp_path):
    archs = sorted({p.arch for p in all_profiles().values()})
    assert PRIMARY_ARCH in archs
    # every decoder on the primary arch in the glu kernel; down and the others' constants-only variants
    # (other quants, top-k sizes) add nothing NVRTC has not compiled once already
    full = [s for s in _all_specs() if s.params.get("mode") != "down" or s.params["quant"] in ("bf16", "q8_0", "q4_k", "q6_k")]
    full = [s for s in full if s.template != "moe_topk" or s.params["experts"] == 128]
    full = [s for s in full if not s.params.get("mode", "").endswith("_grouped") or s.params["quant"] in ("q8_0", "q4_k")]
    full = [s for s in full if s.template != "moe_gemm" or s.params["quant"] in ("bf16", "f16", "q8_0", "q4_k", "q5_k", "q6_k")]
    one_each = [
        full[0],
        expert_gemv_kernel("glu", "q4_k", 768, 2048, 8).spec,
        expert_gemv_kernel("down", "q6_k", 2048, 768, 8, residual=True).spec,
        expert_gemv_kernel("glu_grouped", "q6_k", 768, 2048, 8, experts=128).spec,
        expert_gemv_kernel("down_grouped", "q4_k", 2048, 768, 8, experts=128).spec,
        combine_kernel(2048, 8).spec,
        router_kernel(128, 2048, 8, True, "bf16", 4608, trigger=True).spec,
        router_kernel(128, 2048, 8, True, "f32", 2048, eps=1e-6, h_stride=2048).spec,
        expert_gemv_kernel("glu", "q4_k", 768, 2048, 8, trigger=True).spec,
        shared_kernel(2048).spec,
        q8round_kernel(768, 768, row_mult=8).spec,
        sort_kernel(128, 8, 64).spec,
        expert_gemm_kernel("glu", "q4_k", 768, 2048, 8, 128).spec,
        expert_gemm_kernel("down", "bf16", 2048, 768, 8, 128).spec,
        expert_gemm_kernel("glu", "q6_k", 768, 2048, 8, 128, tile_m=16, warps_m=1).spec,
    ]
    for arch in archs:
        specs = full if arch == PRIMARY_ARCH else one_each
        builder = KernelBuilder(arch, cache=KernelCache(tmp_path / "kcache"), no_compile=False)
        stats = builder.build_all(specs, jobs=2, progress=None)
        assert stats.compiled + stats.hits == len(specs) and all(k.cubin for k in stats.kernels)
