"""Every kernel template renders and NVRTC-compiles for every profile arch, for every family's
sizes and supported storage types (GPU-free; skipped where NVRTC or the CUDA headers are missing).

The default run renders every spec and compiles a representative set (one spec per template and
storage type on PRIMARY_ARCH, one per template on the oldest profile arch). The exhaustive matrix
(every code variant x every profile arch, the option variants on the oldest / primary / newest
arch) is marked ``compile_matrix`` and runs with ``--compile-matrix`` (its own CI step)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fixtures.catalog_specs import all_specs
from fixtures.families import family_cases

from engine import kernel_catalog as kc
from engine.compile import KernelBuilder
from engine.kcache import KernelCache
from engine.profile import all_profiles
from engine.render import render
from engine.types import ConfigError

JOBS = max(2, os.cpu_count() or 2)  # NVRTC releases the GIL: build_all's threads compile in parallel


def _nvrtc_ok() -> bool:
    try:
        from engine import nvrtc

        nvrtc.version()
        nvrtc.include_dirs()
        return True
    except Exception:
        return False


PRIMARY_ARCH = "sm_90a"


def _variant(s) -> tuple:
    """What changes the code (not just constants) of a spec: template, storage type, flags (and
    whether an attention kernel has a sliding window)."""
    flags = sorted(
        (k, v) for k, v in s.params.items() if isinstance(v, (bool, str)) and k not in ("eps", "theta", "scale")
    )
    window = (("window", bool(s.params["window"])),) if "window" in s.params else ()
    return (s.template, *flags, *window)


def _row(s) -> int:
    p = s.params
    return int(p.get("k", p.get("hidden", p.get("head_dim"))) or 0)


def _primary_subset(specs: list) -> list:
    """Per code variant: the shortest and the longest row (k / hidden / head_dim: loop trip counts,
    unrolling, shared memory) and one spec per row tail class (row mod 256) and column tail class
    (n mod 64); the other sizes only change constants. 510 of 2157 sm_90a specs (2026-12-04)."""
    by_variant: dict[tuple, list] = {}
    for s in specs:
        by_variant.setdefault(_variant(s), []).append(s)
    out = []
    for group in by_variant.values():
        group.sort(key=_row)
        keep = {"min": group[0], "max": group[-1]}
        for s in group:
            keep.setdefault((_row(s) % 256, s.params.get("n", 0) % 64), s)
        out += list(dict.fromkeys(keep.values()))
    return out


def _specs_by_arch(full: bool = False):
    """Every spec of every profile, deduplicated per arch. Unless ``full``, PRIMARY_ARCH keeps the
    row-length and tail classes of every code variant (``_primary_subset``) and the other archs one
    spec per code variant, which keeps the CI compile to a few minutes on 2 cores while every
    template x storage type x flag x arch compiles."""
    by_arch: dict[str, dict] = {}
    for prof in all_profiles().values():
        specs = by_arch.setdefault(prof.arch, {})
        for _fam, _size, dims, types, styles, qk in family_cases():
            for s in all_specs(
                dims, types, prof.tuning, block_size=prof.kv_block_size, rope_styles=styles, qk_norm=qk
            ):
                specs[s] = None
    out = {}
    for arch, specs in by_arch.items():
        if full:
            out[arch] = list(specs)
        elif arch == PRIMARY_ARCH:
            out[arch] = _primary_subset(list(specs))
        else:
            out[arch] = list({_variant(s): s for s in reversed(list(specs))}.values())
    out[PRIMARY_ARCH] = list(dict.fromkeys(out[PRIMARY_ARCH] + _pair_specs()))  # (h200's own plans pair too)
    return out


def _pair_specs() -> list:
    """One gemv_pair spec per (q|k type, v type) (the h200 tuning with decode_graph.pair_linears, on
    in that profile): their parts compile alone above, the pair adds the namespaces and the
    dispatch; and the plan's (a grid of resident blocks: the row tiles in shared memory, wsm) of
    Qwen3-4B q4_k_m."""
    from engine.profile import get_profile, with_tuning

    tune = "decode_graph.pair_linears=true"
    prof = with_tuning(get_profile("h200"), tune)
    pairs: dict[tuple, object] = {}
    for _fam, _size, dims, types, styles, qk in family_cases():
        for s in all_specs(dims, types, prof.tuning, block_size=prof.kv_block_size, rope_styles=styles, qk_norm=qk):
            if s.template == "gemv_pair":
                pairs.setdefault((s.params["a_quant"], s.params["b_quant"]), s)
    from test_plan import _q4_k_m_plan

    plan = _q4_k_m_plan(tune)
    wsm = {la.spec for st in plan.steps for la in st.launches["decode1"] if la.spec.template == "gemv_pair"}
    assert len(wsm) == 1 and all(s.params["a_wsm"] and s.params["b_wsm"] for s in wsm)
    return list(dict.fromkeys([*pairs.values(), *wsm]))


def _profile_archs() -> list[str]:
    return sorted({prof.arch for prof in all_profiles().values()}, key=lambda a: int(a[3:].rstrip("a")))


def _variant_archs() -> list[str]:
    """Where the option-variant tests compile: the oldest and the newest profile arch and
    PRIMARY_ARCH. The templates' only arch branches are ``__CUDA_ARCH__ >= 900`` and the sm_90a
    wgmma kernel, so the archs between compile the same source paths (test_all_kernels_compile_for_every_arch
    still compiles every profile's own specs for every arch)."""
    archs = _profile_archs()
    return sorted({archs[0], PRIMARY_ARCH, archs[-1]})


def test_every_template_is_in_the_catalog():
    from engine import linear_attn_kernels, moe_kernels, paths

    templates = {p.name[: -len(".cu.j2")] for p in paths.kernels_dir().glob("*.cu.j2")}
    # (MoE: tests/test_moe_kernels_compile.py; hybrids: tests/test_hybrid_kernels_compile.py)
    assert templates == set(kc.KERNELS) | set(moe_kernels.KERNELS) | set(linear_attn_kernels.KERNELS)


def test_all_specs_render_and_cover_every_template():
    specs = [s for ss in _specs_by_arch(full=True).values() for s in ss]
    assert {s.template for s in specs} == set(kc.KERNELS)
    for s in dict.fromkeys(specs):
        src = render(s)
        assert f"{s.entry}(" in src and "{{" not in src


def test_spec_validation_names_the_problem():
    with pytest.raises(ConfigError, match="q2_k"):
        kc.spec(
            "gemv",
            quant="q2_k",
            n=64,
            k=256,
            bmax=1,
            threads=256,
            rows_per_block=4,
            residual=False,
            out_dtype="bf16",
        )
    with pytest.raises(ConfigError, match="missing params"):
        kc.spec("rmsnorm", n=64)
    with pytest.raises(ConfigError, match="multiple of"):
        kc.spec("rmsnorm", n=60, eps=1e-5, threads=256, residual=False)
    a = kc.spec("rmsnorm", n=64, eps="1e-6", threads=256, residual=True)
    b = kc.spec("rmsnorm", n=64, eps=1.0e-6, threads=256, residual=True)
    assert a == b and a.entry == b.entry


def test_gemv_q8x_rules_and_shared_memory():
    base = dict(
        n=64,
        k=2560,
        bmax=8,
        threads=128,
        rows_per_block=8,
        residual=False,
        out_dtype="bf16",
        coop=True,
        stage=False,
    )
    c = kc.choice("gemv", quant="q4_k", q8x=True, **base)
    assert c.smem == 8 * 2560 * 3 // 2 and "q8x1" in c.spec.entry
    assert "q8x" not in kc.spec("gemv", quant="q4_k", **base).entry  # off: the measured entry names
    with pytest.raises(ConfigError, match="q8x .* is for q4_k, q8_0r, q6_kr"):
        kc.spec("gemv", quant="bf16", q8x=True, **base)
    with pytest.raises(ConfigError, match="q8x is a coop-layout option"):
        kc.spec("gemv", quant="q4_k", q8x=True, **{**base, "coop": False, "rows_per_block": 4})


def test_choice_launch_contract():
    c = kc.choice(
        "gemv",
        quant="q4_1",
        n=1000,
        k=576,
        bmax=8,
        threads=256,
        rows_per_block=4,
        residual=True,
        out_dtype="bf16",
    )
    assert c.grid(17) == (250, 3, 1) and c.block == (256, 1, 1)
    assert [a for a, _ in c.args] == ["out", "w", "x", "residual", "rows"]
    g = kc.choice("gemm", n=576, k=1536, tile_m=128, tile_n=128, tile_k=32, stages=3, warps=8, residual=False)
    assert g.smem == 3 * 256 * 40 * 2 and g.grid(300) == (5, 3, 1)


def _compile(arch: str, specs: list, cache: Path) -> None:
    builder = KernelBuilder(arch, cache=KernelCache(cache), no_compile=False)
    stats = builder.build_all(specs, jobs=JOBS, progress=None)
    assert stats.compiled + stats.hits == len(specs) and all(k.cubin for k in stats.kernels)


def _representative_specs() -> dict[str, list]:
    """The default run's compile set: one spec per (template, storage type) on PRIMARY_ARCH and one
    per template on the oldest profile arch (the templates' arch branches are ``__CUDA_ARCH__ >= 900``
    and the sm_90a wgmma kernel, which compiles only there)."""
    by_arch = _specs_by_arch()
    prim: dict[tuple, object] = {}
    for s in by_arch[PRIMARY_ARCH]:
        prim.setdefault((s.template, s.params.get("quant"), s.params.get("a_quant")), s)
    oldest = _profile_archs()[0]
    old = {s.template: s for s in reversed(by_arch[oldest])}
    return {PRIMARY_ARCH: list(prim.values()), oldest: list(old.values())}


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or CUDA headers not available")
def test_representative_kernels_compile(tmp_path):
    specs = _representative_specs()
    assert {s.template for s in specs[PRIMARY_ARCH]} == set(kc.KERNELS)
    for arch, ss in specs.items():
        _compile(arch, ss, tmp_path / "kcache")


@pytest.mark.compile_matrix
@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or CUDA headers not available")
@pytest.mark.parametrize("arch", _profile_archs())
def test_all_kernels_compile_for_every_arch(tmp_path, arch):
    _compile(arch, _specs_by_arch()[arch], tmp_path / "kcache")


def _signature_params(source: str, entry: str) -> list[str]:
    start = source.index(f"{entry}(") + len(entry) + 1
    depth, i = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(source[i], 0)
        i += 1
    return [p.strip() for p in source[start : i - 1].split(",")]


def test_catalog_args_match_kernel_signatures():
    """KERNELS[t].args is the launch contract: same count, pointers where the kernel takes a
    pointer, ints where it takes an int."""
    seen = set()
    for s in _specs_by_arch()[PRIMARY_ARCH]:
        if _variant(s) in seen:
            continue
        seen.add(_variant(s))
        params = _signature_params(render(s), s.entry)
        args = kc.kernel_args(s)
        assert len(params) == len(args), (s.entry, params)
        for (name, ctype), decl in zip(args, params, strict=True):
            assert ("*" in decl) == (ctype == "ptr"), (s.entry, name, decl)
            if ctype == "i32":
                assert decl.split()[0] == "int", (s.entry, name, decl)


def _gemm_variant_specs():
    """The gemm code variants: bf16 / every GGUF type with a decoder, bf16 / f32 out, residual,
    in-block split-K (the wide-decode tuning), tails (n not a multiple of tile_n, odd n)."""
    base = dict(tile_m=128, tile_n=128, tile_k=32, stages=3, warps=8)
    dec = dict(tile_m=64, tile_n=16, tile_k=128, stages=4, warps=8, warps_m=2, split_k=4)
    out = [
        kc.spec("gemm", n=2560, k=4096, residual=True, **base),
        kc.spec("gemm", n=1000, k=512, residual=True, out_dtype="f32", **base),
        kc.spec("gemm", n=999, k=256, residual=False, **base),
        kc.spec("gemm", n=2560, k=9728, residual=True, **dec),
        kc.spec("gemm", n=19456, k=2560, residual=False, out_dtype="f32", **dec),
    ]
    for q in kc.QUANTS:
        if q != "bf16":
            out.append(kc.spec("gemm", n=6144, k=2560, residual=False, quant=q, **{**base, "tile_k": 64}))
    # swizzled smem (tile_k 32: 4 chunks a row, 64 / 128: the r & 7 XOR) and double-buffered fragments
    sw = dict(swizzle=True, fragbuf=True)
    k128 = dict(tile_k=128, **sw)
    out += [
        kc.spec("gemm", n=2560, k=4096, residual=True, **{**base, **sw}),
        kc.spec("gemm", n=999, k=256, residual=False, out_dtype="f32", **{**base, "tile_k": 64, **sw}),
        kc.spec("gemm", n=2560, k=9728, residual=True, **{**dec, **sw}),
        kc.spec("gemm", n=6144, k=2560, residual=False, quant="q4_k", **{**base, "tile_k": 64, **sw}),
        # long GGUF W tiles (four units a row)
        *(
            kc.spec("gemm", n=6144, k=2560, residual=True, quant=q, **{**base, **k128})
            for q in ("q4_k", "q5_k", "q6_k")
            if q in kc.QUANTS
        ),
        kc.spec("gemm", n=6144, k=2560, residual=False, **{**base, "tile_k": 64, "swizzle": True}),
    ]
    return out


def test_gemm_validation_and_launch_contract():
    with pytest.raises(ConfigError, match="no fused GEMM decoder"):
        kc.spec(
            "gemm",
            n=64,
            k=256,
            tile_m=64,
            tile_n=64,
            tile_k=32,
            stages=2,
            warps=4,
            residual=False,
            quant="iq2_xs",
        )
    with pytest.raises(ConfigError, match="split_k"):
        kc.spec(
            "gemm", n=64, k=256, tile_m=64, tile_n=64, tile_k=32, stages=2, warps=8, split_k=4, residual=False
        )
    with pytest.raises(ConfigError, match="shared memory"):
        kc.spec("gemm", n=64, k=256, tile_m=256, tile_n=256, tile_k=128, stages=4, warps=8, residual=False)
    c = kc.choice(
        "gemm", n=2560, k=9728, tile_m=64, tile_n=16, tile_k=128, stages=4, warps=8, split_k=4, residual=True
    )
    assert c.grid(100) == (160, 2, 1) and c.block == (256, 1, 1)
    assert c.smem == max(4 * (64 + 16) * 136 * 2, 3 * 64 * 16 * 4)
    p = kc.gemm_params(
        2560, 4096, {"gemm_decode": {**dict(c.spec.params), "min_rows": 16}}, section="gemm_decode"
    )
    assert p["split_k"] == 4 and p["tile_k"] == 128 and p["quant"] == "bf16"


@pytest.mark.compile_matrix
@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or CUDA headers not available")
@pytest.mark.parametrize("arch", _variant_archs())
def test_gemm_variants_compile_for_every_arch(tmp_path, arch):
    _compile(arch, _gemm_variant_specs(), tmp_path / "kcache")


def _gemv_variant_specs():
    """The gemv options the plan does not pick by default (the prologues, the staged path's chunk
    prefetch) on every storage type."""
    tun = {"gemv": {}}
    out = []
    for q in kc.QUANTS:
        staged = kc.STAGED_DEFAULT[q]
        p = kc.linear_params(q, 1003, 2560, tun, bmax=1, residual=True)
        silu = dict(prologue="silu", x_stride=5120, u_off=2560)
        out.append(kc.spec("gemv", **p, prefetch=staged, **silu))
        p = kc.linear_params(q, 1003, 2560, tun, bmax=8, out_dtype="f32")
        out.append(kc.spec("gemv", **p, prologue="norm", x_stride=2560, eps=1e-6))
        if staged:
            p = {**kc.linear_params(q, 1003, 2560, tun), "unroll": 4}
            out.append(kc.spec("gemv", **p, prefetch=True))

    # the warp-cooperative layout on every type it decodes (q8_0r / q6_kr / q4_0r / q4_1r: the
    # repacked planes)
    coop = {
        **tun,
        "gemv_coop": {
            "types": ["bf16", "q4_k", "q8_0", "q6_k", "q4_0", "q4_1"],
            "unroll": 4,
        },
    }
    for q in kc.COOP_TYPES:
        for bm in (1, 8):
            p = kc.linear_params(q, 1003, 2560, coop, bmax=bm, residual=bm == 8)
            assert p["coop"], q
            out.append(kc.spec("gemv", **p))
            if bm == 1:  # with the fused prologues (x = rmsnorm(x) * w, or silu(gate) * up)
                out.append(kc.spec("gemv", **p, prologue="norm", x_stride=2560, eps=1e-6))
            else:
                out.append(kc.spec("gemv", **p, prologue="silu", x_stride=5120, u_off=2560))
                out.append(kc.spec("gemv", **{**p, "pipeline": True}, tile_pf=True))
    # q8x with k split over warp groups (n <= q8x_ksplit_max_n) and a capped grid
    q8 = {
        **tun,
        "gemv_coop": {
            "types": ["q4_k", "q8_0", "q6_k", "q4_0", "q4_1"],
            "unroll": 2,
            "pipeline": True,
            "q8x": True,
            "q8x_threads": 256,
            "q8x_rows_per_warp": 2,
            "q8x_ksplit": 4,
            "q8x_ksplit_max_n": 4096,
            "q8x_blocks_per_sm": 4,
        },
    }
    for q in kc.Q8X_TYPES:
        for bm in (1, 8):
            p = kc.linear_params(q, 1003, 2560, q8, bmax=bm, residual=True, sm_count=132)
            assert (p["ksplit"], p["grid_cap"], p["rows_per_block"]) == (4, 528, 4), p
            out.append(kc.spec("gemv", **p))
            out.append(kc.spec("gemv", **p, tile_pf=True))  # the next tile's loads in the last step
            out.append(kc.spec("gemv", **p, min_blocks=3))  # registers capped for 3 blocks per SM
            for pro in (
                {"prologue": "silu", "x_stride": 5120, "u_off": 2560},
                {"prologue": "norm", "x_stride": 2560, "eps": 1e-6},
            ):
                out.append(
                    kc.spec("gemv", **{**p, "ksplit": 1, "rows_per_block": 16, "stage_rounds": 6, **pro})
                )
    # q8x with 8 / 4 lanes per row: whole steps on every lane (k = 2560), then k = 576 / 768 (a
    # tail step for q4_0r / q4_1r / q4_k, whole steps for q6_kr / q8_0r)
    for q in kc.Q8X_TYPES:
        for lanes, k in ((8, 2560), (4, 2560), (8, 576 if q not in ("q4_k", "q6_kr", "q8_0r") else 768)):
            lq = {**q8, "gemv_coop": {**q8["gemv_coop"], "q8x_lanes_per_row": lanes}}
            p = kc.linear_params(q, 1003, k, lq, bmax=1, residual=True, sm_count=132)
            assert p["lanes"] == lanes, p
            out.append(kc.spec("gemv", **p))
            out.append(kc.spec("gemv", **{**p, "ksplit": 1, "rows_per_block": 32 * 8 // lanes, "tile_pf": True}))
    # the early pdl_trigger of the batch-1 coop GEMVs (decode_graph.early_trigger), and the norm
    # weights read before pdl_wait (early_nw: one staging round in 320-thread blocks)
    for q in kc.Q8X_TYPES:
        out.append(kc.spec("gemv", **kc.linear_params(q, 1003, 2560, q8, bmax=1, sm_count=132), trigger=True))
        p = kc.linear_params(q, 1003, 2560, q8, bmax=1, sm_count=132)
        p.update(threads=320, rows_per_block=40, ksplit=1, early_nw=True, prologue="norm", x_stride=2560, eps=1e-6)
        out.append(kc.spec("gemv", **p))
        # the coop glu epilogue (gemv_coop.q8x_glu): a tile's gate and up rows paired, silu(gate) * up
        # stored; with the next tile's loads in the last step, at batch 1 and 8
        for bm in (1, 8):
            p = kc.linear_params(q, 2006, 2560, q8, bmax=bm, sm_count=132)
            p.update(threads=320, rows_per_block=40, ksplit=1, lanes=8, glu=1003, tile_pf=True)
            out.append(kc.spec("gemv", **p))
        # the L2 prefetch of a later weight once x is staged (l2_pf)
        p = kc.linear_params(q, 1003, 2560, q8, bmax=1, residual=True, sm_count=132)
        out.append(kc.spec("gemv", **p, l2_pf="0:0:65536,0:1048576:4096"))
        out.append(kc.spec("gemv", **p, l2_pf="0:0:4096,1:32:4096"))
    return out


def _wsm_specs() -> list:
    """q8x with the row tile bulk-copied into shared memory (wsm: cp.async.bulk + an mbarrier,
    sm_90+), batch 1 with the norm prologue and batch 8 with the silu one, a capped grid (the next
    tile's copy once the current one is read), on every q8x type."""
    q8 = {
        "gemv": {},
        "gemv_coop": {"types": ["q8_0", "q4_k", "q6_k", "q4_0", "q4_1"], "q8x_threads": 256, "unroll": 2,
                      "pipeline": True, "q8x": True, "q8x_lanes_per_row": 8},
    }
    specs = []
    for q in kc.Q8X_TYPES:
        p = kc.linear_params(q, 1003, 2560, q8, bmax=1, residual=True, sm_count=132)
        p = {**p, "wsm": True, "grid_cap": 7}
        specs.append(kc.spec("gemv", **{**p, "prologue": "norm", "eps": 1e-6}))
        specs.append(kc.spec("gemv", **{**p, "bmax": 8, "prologue": "silu", "x_stride": 5120, "u_off": 2560}))
        specs.append(kc.spec("gemv", **{**p, "l2_pf": "0:0:65536"}))  # once the tile landed
    return specs


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or CUDA headers not available")
def test_gemv_wsm_compiles_for_sm90a_and_refuses_below(tmp_path):
    """The wsm options of one type compile for PRIMARY_ARCH (every type on every arch from sm_90:
    the compile matrix); below sm_90 the source stops with an #error naming wsm."""
    specs = _wsm_specs()
    _compile(PRIMARY_ARCH, [s for s in specs if s.params["quant"] == specs[0].params["quant"]], tmp_path / "kc")
    with pytest.raises(Exception, match="wsm"):
        KernelBuilder("sm_80", cache=KernelCache(tmp_path / "kc80"), no_compile=False).build_all(
            specs[:1], jobs=1, progress=None
        )


@pytest.mark.compile_matrix
@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or CUDA headers not available")
@pytest.mark.parametrize("arch", [a for a in _variant_archs() if int(a[3:].rstrip("a")) >= 90])
def test_gemv_wsm_compiles_for_sm90_and_up(tmp_path, arch):
    _compile(arch, _wsm_specs(), tmp_path / "kcache")


def test_tile_prefetch_is_a_pipelined_coop_option():
    tun = {"gemv": {}}
    coop = {"types": ["q8_0", "q4_k"], "unroll": 2, "q8x": True}
    for extra, want in (({}, False), ({"tile_prefetch": True}, False), ({"pipeline": True, "tile_prefetch": True}, True)):
        p = kc.linear_params("q4_k", 2560, 2560, {**tun, "gemv_coop": {**coop, **extra}}, bmax=1)
        assert bool(p.get("tile_pf")) is want, extra
        assert ("tile_pf1" in kc.spec("gemv", **p).entry) is want
    with pytest.raises(ConfigError, match="tile_pf is a pipelined coop option"):
        kc.spec("gemv", **{**p, "pipeline": False})
    with pytest.raises(ConfigError, match="tile_pf is a pipelined coop option"):
        kc.spec("gemv", **kc.linear_params("q8_0", 2560, 2560, tun), tile_pf=True)
    # min_blocks: a coop register cap (__launch_bounds__ min blocks; decode_graph.pair_min_blocks)
    mb = {**p, "min_blocks": 3}
    s = kc.spec("gemv", **mb)
    assert s.entry.endswith("min_blocks3") and "__launch_bounds__(THREADS, 3)" in render(s)
    assert "min_blocks" not in kc.spec("gemv", **p).entry
    with pytest.raises(ConfigError, match="min_blocks=3: a coop option"):
        kc.spec("gemv", **kc.linear_params("q8_0", 2560, 2560, tun), min_blocks=3)
    with pytest.raises(ConfigError, match="at most 2048 threads"):
        kc.spec("gemv", **{**mb, "min_blocks": 17})  # 17 x 128 threads


def test_gemv_options_validation_and_smem():
    tun = {"gemv": {}}
    p = kc.linear_params("q8_0", 1024, 2560, tun)
    with pytest.raises(ConfigError, match="residual needs out_dtype bf16"):
        kc.spec("gemv", **{**p, "residual": True, "out_dtype": "f32"})
    with pytest.raises(ConfigError, match="prefetch"):
        kc.spec("gemv", **{**p, "stage": False, "prefetch": True})
    plain = kc.choice("gemv", **p)
    assert plain.smem == 0 and "prefetch" not in plain.spec.entry
    pf = kc.choice("gemv", **p, prefetch=True)
    assert pf.smem == 0 and pf.spec.entry.endswith("_prefetch1")


@pytest.mark.compile_matrix
@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or CUDA headers not available")
@pytest.mark.parametrize("arch", _variant_archs())
def test_gemv_variants_compile_for_every_arch(tmp_path, arch):
    _compile(arch, _gemv_variant_specs(), tmp_path / "kcache")


def _attention_variant_specs():
    """attention_prefill for head_dim 64 / 128, GQA groups 1 / 3 / 4 / 8, a few tile shapes;
    paged decode attention (split + combine, direct) for the same shapes."""
    out = []
    for heads, kvh, hd in ((9, 3, 64), (32, 8, 128), (16, 16, 64), (32, 4, 128)):
        qs = (heads + 2 * kvh) * hd
        common = dict(heads=heads, kv_heads=kvh, head_dim=hd, block_size=16, scale=hd**-0.5)
        for bq, bkv, w in ((64, 64, 4), (128, 32, 8), (64, 32, 4)):
            out.append(
                kc.spec(
                    "attention_prefill",
                    **common,
                    q_stride=qs,
                    out_stride=heads * hd,
                    block_q=bq,
                    block_kv=bkv,
                    warps=w,
                )
            )
        for direct, vec16, warps in ((True, False, 4), (False, False, 4), (True, True, 4), (False, True, 8)):
            out.append(
                kc.spec(
                    "attention",
                    **common,
                    split=512,
                    q_stride=qs,
                    out_stride=heads * hd,
                    direct=direct,
                    warps=warps,
                    vec16=vec16,
                )
            )
        out.append(kc.spec("attention_combine", heads=heads, head_dim=hd, split=512, out_stride=heads * hd))
        # the direct kernel with its early trigger (attention_decode.trigger_b1)
        direct = out[-3].params  # (True, True, 4)
        assert direct["direct"] and direct["vec16"]
        out.append(kc.spec("attention", **{**direct, "trigger": True}))
        # and its L2 prefetch of later weights (attention_decode.l2_prefetch_o), at the start
        out.append(kc.spec("attention", **{**direct, "l2_pf": "0:0:40960,1:160:8192"}))
        out.append(kc.spec("attention", **{**direct, "l2_pf": "0:0:4096"}))
    # sliding-window attention (Gemma 3 270M's heads: 4 / 1 KV head / head_dim 256): split and
    # direct decode (vec16 and scalar), the combine, the prefill with the K/V tile that fits
    common = dict(heads=4, kv_heads=1, head_dim=256, block_size=16, scale=0.0625, window=512)
    for direct, vec16, warps in ((True, True, 8), (False, True, 4), (True, False, 4), (False, False, 4)):
        out.append(kc.spec("attention", **common, split=256, q_stride=1536, out_stride=1024,
                           direct=direct, warps=warps, vec16=vec16, qsplit=4 if direct else 1))  # fmt: skip
    out.append(kc.spec("attention_combine", heads=4, head_dim=256, split=256, out_stride=1024, window=512))
    out.append(kc.spec("attention_prefill", **common, q_stride=1536, out_stride=1024, block_q=64, block_kv=32, warps=4))
    # the key split (attention_prefill.span): the folding single pass, the span partials, the fold
    for w in (0, 512):
        sc = {**common, "window": w}
        out.append(kc.spec("attention_prefill", **sc, q_stride=1536, out_stride=1024, block_q=64, block_kv=32, warps=4,
                           span=512))  # fmt: skip
        out.append(kc.spec("attention_prefill", **sc, q_stride=1536, out_stride=1024, block_q=64, block_kv=32, warps=4,
                           span=512, partial=True))  # fmt: skip
        out.append(kc.spec("attention_combine", heads=4, head_dim=256, split=512, out_stride=1024, window=w, fold=True))
        out.append(kc.spec("attention_prefill", **sc, q_stride=1536, out_stride=1024, block_q=64, block_kv=32, warps=4,
                           span=512, partial=True, gqa=True))  # fmt: skip
    # the rope-fused batch-1 kernel of the Qwen3-4B q4_k_m plan with its prefetch
    from test_plan import _q4_k_m_plan

    plan = _q4_k_m_plan("attention_decode.l2_prefetch_o=true")
    out.append(next(la.spec for st in plan.steps for la in st.launches.get("short1", ()) if la.spec.params["l2_pf"]))
    return list(dict.fromkeys(out))


def test_attention_prefill_contract():
    p = dict(heads=32, kv_heads=8, head_dim=128, block_size=16, scale=128**-0.5, q_stride=6144)
    c = kc.choice("attention_prefill", **p, out_stride=4096, block_q=64, block_kv=64, warps=4)
    assert c.grid(300, max_q=130, nseq=3) == (3, 32, 3) and c.block == (128, 1, 1)
    assert c.smem == (64 + 4 * 64) * 136 * 2
    assert [a for a, _ in c.args][-2:] == ["seq_starts", "max_blocks"]
    d = dict(p, split=512, out_stride=4096, direct=False, warps=4)
    assert "vec16" not in kc.spec("attention", **d).entry and kc.spec(
        "attention", **d, vec16=True
    ).entry.endswith("vec161")
    with pytest.raises(ConfigError, match="vec16 needs head_dim"):
        kc.spec("attention", **{**d, "head_dim": 96, "q_stride": 96 * 48}, vec16=True)
    with pytest.raises(ConfigError, match="16 \\* warps"):
        kc.spec("attention_prefill", **p, out_stride=4096, block_q=64, block_kv=64, warps=8)


def test_attention_l2_prefetch_args_ranges_and_rules():
    """l2_pf: "A:OFF:BYTES" ranges read by kc.l2_pf_ranges (16-byte aligned, A < L2_PF_MAX_ARGS),
    one pointer arg pfA per weight after the kernel's own (the signature agrees), each range
    prefetched once, at the start, by bulk prefetches on sm_90; the rules name what is wrong."""
    assert kc.l2_pf_ranges("0:0:4096,1:160:8192") == ((0, 0, 4096), (1, 160, 8192))
    for bad in ("0:0", "0:8:4096", "0:0:100", "0:0:0", "9:0:16", "a:0:16"):
        with pytest.raises(ValueError):
            kc.l2_pf_ranges(bad)
    specs = [s for s in _attention_variant_specs() if s.template == "attention" and s.params["l2_pf"]]
    assert len(specs) >= 3
    gemvs = [s for s in _gemv_variant_specs() if s.params["l2_pf"]]
    assert len(gemvs) == 2 * len(kc.Q8X_TYPES)
    for s in gemvs:  # (the call once x is staged, in the kernel after the signature)
        src = render(s)
        params, args = _signature_params(src, s.entry), kc.kernel_args(s)
        assert len(params) == len(args) and params[-1].endswith(args[-1][0]) and args[-1][0].startswith("pf")
        assert src.count("L2_PF_CALL();") == 1
    with pytest.raises(ConfigError, match="batch-1 q8x coop option"):
        kc.spec("gemv", **{**gemvs[0].params, "bmax": 8})
    with pytest.raises(ConfigError, match="takes no l2_pf"):
        kc.pair_spec(gemvs[0], gemvs[0])
    for s in specs:
        src = render(s)
        ranges = kc.l2_pf_ranges(s.params["l2_pf"])
        params = _signature_params(src, s.entry)
        args = kc.kernel_args(s)
        assert len(params) == len(args) and args[-1][0] == f"pf{max(a for a, _, _ in ranges)}", s.entry
        assert params[-1].endswith(args[-1][0])
        for a, off, n in ranges:
            assert src.count(f"l2_prefetch(pf{a} + {off}ull, {n}u, t, nt);") == 1
        body = src[src.index(f"{s.entry}(") :]
        call = body.index("L2_PF_CALL();")
        assert call < body.index("pdl_wait();"), s.entry
        assert body.count("L2_PF_CALL();") == 1
        assert 'asm volatile("cp.async.bulk.prefetch.L2' in src
    d = dict(specs[0].params)
    with pytest.raises(ConfigError, match="l2_pf=.*A:OFF:BYTES"):
        kc.spec("attention", **{**d, "l2_pf": "0:0"})
    with pytest.raises(ConfigError, match="needs the direct decode kernel"):
        kc.spec("attention", **{**d, "direct": False})
    assert kc.spec("attention", **d).entry != kc.spec("attention", **{**d, "l2_pf": "0:0:4096"}).entry


@pytest.mark.compile_matrix
@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or CUDA headers not available")
@pytest.mark.parametrize("arch", _variant_archs())
def test_attention_variants_compile_for_every_arch(tmp_path, arch):
    _compile(arch, _attention_variant_specs(), tmp_path / "kcache")


def _wgmma_spec(**over):
    p = dict(n=1000, k=1024, tile_n=256, consumers=2, m_frags=1, stages=4, residual=False, out_dtype="bf16")
    return kc.spec("gemm_wgmma", **{**p, **over})


def test_gemm_wgmma_rules_name_the_problem():
    with pytest.raises(ConfigError, match="multiple of 64"):
        _wgmma_spec(k=1000)
    with pytest.raises(ConfigError, match="tile_n=96"):
        _wgmma_spec(tile_n=96)
    with pytest.raises(ConfigError, match="accumulators per thread"):
        _wgmma_spec(m_frags=2)
    with pytest.raises(ConfigError, match="shared memory"):
        _wgmma_spec(stages=5)
    with pytest.raises(ConfigError, match="multiple of 8"):
        _wgmma_spec(n=1001)
    c = kc.choice("gemm_wgmma", **_wgmma_spec(residual=True).params)
    assert c.block == (384, 1, 1) and c.grid(300) == (4, 3, 1)
    assert c.smem == 4 * (128 + 256) * 128 + 1024
    # the profile section is what turns it on; enabling it needs sm_90a
    off = {"gemm_wgmma": {"enabled": False}}
    assert kc.gemm_wgmma_params(2560, 4096, off) is None
    on = {"gemm_wgmma": {"enabled": True}}
    assert kc.gemm_wgmma_params(2560, 4096, on)["tile_n"] == 256
    assert kc.gemm_wgmma_params(2560, 4100, on) is None
    # below wide_min_n the narrow tile (more blocks for the o / down projections' n = 2560)
    split = {"gemm_wgmma": {"enabled": True, "wide_min_n": 5120}}
    wide, narrow = kc.gemm_wgmma_params(6144, 2560, split), kc.gemm_wgmma_params(2560, 4096, split)
    assert (wide["tile_n"], wide["stages"], wide["maxnreg"]) == (256, 4, True)
    assert (narrow["tile_n"], narrow["stages"], narrow["maxnreg"]) == (128, 6, False)


def test_gemm_wgmma_needs_an_sm90a_profile(tmp_path):
    from engine.profile import load_profile

    src = (Path(__file__).resolve().parents[1] / "device_profiles" / "rtx-5090.yaml").read_text()
    bad = tmp_path / "rtx-5090.yaml"
    bad.write_text(src + "tuning:\n  gemm_wgmma: {enabled: true}\n")
    with pytest.raises(ConfigError, match="gemm_wgmma.enabled.*sm_90a"):
        load_profile(bad)


@pytest.mark.compile_matrix
@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or CUDA headers not available")
def test_gemm_wgmma_tile_configs_compile(tmp_path):
    """The tile configs tests/gpu/test_kernels.py::test_gemm_wgmma checks (the profile's compile via all_specs)."""
    specs = [
        _wgmma_spec(
            tile_n=tn, consumers=c, m_frags=mf, stages=st, residual=res, out_dtype=od, maxnreg=tn * mf >= 256
        )
        for tn, c, mf, st in ((256, 2, 1, 3), (128, 2, 1, 6), (128, 2, 2, 4), (128, 1, 1, 8), (64, 2, 1, 8))
        for res, od in ((False, "bf16"), (True, "f32"))
    ]
    _compile("sm_90a", specs, tmp_path / "kcache")


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or CUDA headers not available")
def test_gpu_tools_inline_sources_compile():
    """The micro-benchmarks' own CUDA sources (tools/gpu_handoff_bench.py, tools/gpu_l2_bench.py)
    compile for the primary arch, so a GPU session does not find a typo first."""
    import importlib
    import sys

    from engine import nvrtc

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    try:
        for name in ("gpu_handoff_bench", "gpu_l2_bench"):
            cubin, _ = nvrtc.compile_to_cubin(importlib.import_module(name).SOURCE, name, PRIMARY_ARCH)
            assert cubin
    finally:
        sys.path.pop(0)
