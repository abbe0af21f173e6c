"""The int8 tensor-core bucket GEMV (kernels/_gemv_mmq.cuh.j2, gemv spec mma=true) without a GPU
(issue #34 item 1): its params and rules, NVRTC compiles of the specs the h100 / h200 profiles
would take with gemv_mmq.types = [q4_k], and, under the CPU emulator (tests/fixtures/cuda_emu.py:
the block's threads as fibers, the int8 mma as a warp collective), every output row of it equal
bit for bit to the batch-1 coop q8x GEMV on that row alone: with and without the coop kernel's k
split (virtual lanes without a segment, lanes with one segment fewer), a row tail, the norm
prologue with the residual, the silu prologue, 3 to 17 rows (one or two n tiles, two grid rows),
the block's threads in both orders. tests/gpu/test_gemv_mmq_gpu.py checks the same on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures import cuda_emu
from fixtures.checkpoints import mix_tensor_type, to_bf16_bits
from fixtures.quant_blocks import random_blocks

from engine import kernel_catalog as kc
from engine import quant
from engine.kernel_catalog.layout import MMA_TYPES
from engine.profile import all_profiles
from engine.render import render
from engine.types import ConfigError

# batch-1 knobs the emulator cannot run (inline PTX) or that only reorder loads: the same bits
OFF = dict(wsm=False, trigger=False, l2_pf="", early_res=False)


def _tuning(profile: str = "h100", ksplit: bool = True) -> dict:
    t = dict(all_profiles()[profile].tuning)
    t["gemv_mmq"] = {**dict(t["gemv_mmq"]), "types": ["q4_k", "q6_k", "q8_0", "q4_0", "q4_1"]}
    if not ksplit:  # (no weight is short enough for the coop k split)
        t["gemv_coop"] = {**dict(t["gemv_coop"]), "q8x_ksplit_max_n": 0}
    else:  # (q4_0 / q4_1 split k from n 2048 on: here from the general 0)
        per_type = {ft: {**v, "q8x_ksplit_min_n": 0} for ft, v in dict(t["gemv_coop"]["q8x_type_tuning"]).items()}
        t["gemv_coop"] = {**dict(t["gemv_coop"]), "q8x_type_tuning": per_type}
    return t


def _pro(pro: str, k: int) -> dict:
    if pro == "norm":
        return dict(prologue="norm", x_stride=k, eps=1e-6)
    if pro == "silu":
        return dict(prologue="silu", x_stride=2 * k, u_off=k)
    return {}


def _pair(tuning: dict, n: int, k: int, pro: str, residual: bool, od: str, qt: str = "q4_k"):
    """(batch-1 coop spec, mma spec) of one case."""
    kw = dict(residual=residual, out_dtype=od, sm_count=132)
    b1 = kc.linear_params(qt, n, k, tuning, bmax=1, **kw)
    if pro != "norm":
        b1.pop("early_nw", None)
    bucket = kc.linear_params(qt, n, k, tuning, bmax=kc.decode_bmax(qt, k, tuning), **kw)
    mma = kc.mma_params(bucket, tuning)
    assert mma is not None
    return kc.spec("gemv", **{**b1, **OFF, **_pro(pro, k)}), kc.spec("gemv", **mma, **_pro(pro, k))


def test_mma_kernel_waits_before_touching_memory_written_by_others():
    """Only weights before pdl_wait() (the PDL_PRELOAD contract its spec's pdl field claims)."""
    from fixtures.pdl import waits_first

    t = _tuning()
    for pro in ("none", "norm", "silu"):
        for qt in ("q4_k", "q6_kr"):
            s = _pair(t, 2560, 9728, pro, pro == "norm", "bf16", qt)[1]
            assert s.pdl and waits_first(render(s), s.entry), s.entry


def test_mma_params_follow_the_bucket_coop_signature():
    t = _tuning()
    for n, k in ((6144, 2560), (19456, 2560), (2560, 4096), (2560, 9728)):
        bucket = kc.linear_params("q4_k", n, k, t, bmax=kc.decode_bmax("q4_k", k, t), sm_count=132)
        m = kc.mma_params(bucket, t)
        assert m is not None and m["mma"] and m["coop"] and m["q8x"]
        # the per-row bits: the same coop signature (lanes, k split) as the batch-1 GEMV's
        assert (m.get("lanes", 32), m.get("ksplit", 1)) == (bucket.get("lanes", 32), bucket.get("ksplit", 1))
        assert m["rows_per_block"] % 16 == 0 and m["bmax"] % 8 == 0
        assert kc.gemv_smem(m) <= kc.layout.GEMV_XSMEM_MAX
        c = kc.choice("gemv", **m)
        assert c.grid(33) == (-(-n // m["rows_per_block"]), -(-33 // m["bmax"]), 1) and c.smem == kc.gemv_smem(m)
    assert kc.mma_params(kc.linear_params("q4_k", 2560, 9728, t, bmax=4, sm_count=132), t)["bmax"] == 8  # 16 do not fit
    off = {**t, "gemv_mmq": {**t["gemv_mmq"], "types": []}}  # gemv_mmq.types empty: no mma spec
    assert kc.mma_params(kc.linear_params("q4_k", 6144, 2560, off, bmax=8), off) is None
    t4 = {**t, "gemv_mmq": {**t["gemv_mmq"], "types": ["q4_0"]}}  # (q4_k not named)
    assert kc.mma_params(kc.linear_params("q4_k", 6144, 2560, t4, bmax=8), t4) is None
    assert kc.mma_params(kc.linear_params("q4_0r", 6144, 2560, t4, bmax=8), t4)["mma"]
    base = kc.mma_params(kc.linear_params("q4_k", 6144, 2560, t, bmax=8), t)
    with pytest.raises(ConfigError, match="bmax=12 must be a multiple of 8"):
        kc.spec("gemv", **{**base, "bmax": 12})
    # MMA_FIXED: blocks of 256, 32 x rows, the grid capped at one block per SM (none: SMs unknown)
    fixed = kc.mma_params(kc.linear_params("q4_k", 6144, 2560, t, bmax=8), t, 132)
    assert (fixed["threads"], fixed["bmax"], fixed["unroll"], fixed["stage_rounds"], fixed["grid_cap"]) == (256, 32, 4, 8, 132)
    assert base["grid_cap"] == 0 and not fixed["min_blocks"]
    with pytest.raises(ConfigError, match="mma gemv: no glu, wsm, tile_pf, l2_pf, trigger or min_blocks"):
        kc.spec("gemv", **{**base, "min_blocks": 2})
    with pytest.raises(ConfigError, match="mma gemv: no glu"):
        kc.spec("gemv", **{**base, "wsm": True})


def _nvrtc_ok() -> bool:
    try:
        from engine import nvrtc

        nvrtc.version()
        nvrtc.include_dirs()
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or CUDA headers not available")
def test_mma_specs_compile_for_the_profiles(tmp_path):
    """The h100 / h200 specs (q4_k and q6_kr); an h100 one also for the oldest and the newest
    profile arch (the int8 mma.sync is sm_80+; no other profile has q8x GEMVs for it yet)."""
    from engine.compile import KernelBuilder
    from engine.kcache import KernelCache

    archs = sorted({p.arch for p in all_profiles().values()}, key=lambda a: int(a[3:].rstrip("a")))
    for profile in ("h100", "h200"):
        t = _tuning(profile)
        specs = [_pair(t, 6144, 2560, "norm", True, "bf16")[1], _pair(t, 2560, 9728, "silu", False, "bf16")[1],
                 _pair(t, 1024, 2560, "none", True, "bf16", "q6_kr")[1]]  # fmt: skip
        for arch in [all_profiles()[profile].arch] + ([archs[0], archs[-1]] if profile == "h100" else []):
            some = specs if arch == all_profiles()[profile].arch else specs[:1]
            stats = KernelBuilder(arch, cache=KernelCache(tmp_path / arch), no_compile=False).build_all(some, progress=None)
            assert stats.compiled + stats.hits == len(some) and all(k.cubin for k in stats.kernels)


def _emu(spec, x, rows: int, w, res=None, nw=None, tmp_path=None, reverse=False) -> np.ndarray:
    """The spec's output bits [rows, n] (f32 as uint32, bf16 as uint16) under the CPU emulator."""
    p = spec.params
    n = p["n"]
    if p["out_dtype"] == "f32":
        out = np.full((rows, n), np.nan, np.float32)
    else:
        out = res.copy() if p["residual"] else np.full((rows, n), 0x7FC0, np.uint16)
    args = [out, w, x, out if p["residual"] else None, rows] + ([nw] if p["prologue"] == "norm" else [])
    lib, types = cuda_emu.compile_any(render(spec), spec.entry, tmp_path)
    grid = (kc.gemv_grid_x(p), -(-rows // p["bmax"]), 1)
    cuda_emu.launch_any(lib, types, grid, p["threads"], kc.gemv_smem(p), args, reverse=reverse)
    return out.view(np.uint32) if p["out_dtype"] == "f32" else out


# (n, k, coop k split, prologue, residual, out dtype, rows, type): n 40 = two full 16-row warp tiles and
# a tail of 8; k 512 with the k split: 8 segments for 32 virtual lanes; k 2560: 40 for 32
# (f32 out: the row sums unrounded; a bf16 store hides most last-bit differences); the first one
# with its grid capped at one block (three row tiles, x staged once) and 8 x rows a block; the
# residual's path (bf16 out) is the types' common code: checked on q4_k
CASES = [
    (40, 512, True, "none", False, "f32", 10, "q4_k"),
    (40, 2560, True, "none", False, "f32", 10, "q4_k"),
    (40, 2560, True, "norm", False, "f32", 3, "q4_k"),
    (40, 2560, True, "none", True, "bf16", 5, "q4_k"),
    (40, 1024, False, "none", False, "f32", 17, "q4_k"),
    (40, 1024, False, "silu", False, "f32", 9, "q4_k"),
    # q6_kr (lanes 16, the k split 2): k 512 = 16 segments for 32 virtual lanes, 2560 = 80
    (40, 512, True, "none", False, "f32", 10, "q6_kr"),
    (40, 2560, True, "norm", False, "f32", 3, "q6_kr"),
    (40, 1024, False, "silu", False, "f32", 9, "q6_kr"),
    # q8_0r (lanes 32, the k split 2): k 512 = 32 segments for 64 virtual lanes
    (40, 512, True, "none", False, "f32", 10, "q8_0r"),
    (40, 2560, True, "norm", False, "f32", 3, "q8_0r"),
    (40, 1024, False, "silu", False, "f32", 9, "q8_0r"),
    # q4_0r / q4_1r (lanes 32, the k split 2)
    (40, 512, False, "none", False, "f32", 10, "q4_0r"),
    (40, 512, True, "norm", False, "f32", 3, "q4_0r"),
    (40, 1024, False, "silu", False, "f32", 9, "q4_1r"),
    (40, 512, True, "none", False, "f32", 17, "q4_1r"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[7]}-{c[0]}x{c[1]}-ks{int(c[2])}-{c[3]}-r{c[6]}")
def test_mma_rows_equal_the_batch1_coop_gemv_under_the_emulator(case, tmp_path):
    n, k, ksplit, pro, residual, od, rows, qt = case
    t = _tuning(ksplit=ksplit)
    b1, mma = _pair(t, n, k, pro, residual, od, qt)
    if case == CASES[0]:  # one block over the three row tiles, 8 x rows a block: two grid rows
        mma = kc.spec("gemv", **{**mma.params, "grid_cap": 1, "bmax": 8})
    assert (b1.params["ksplit"] > 1) == ksplit and b1.params["lanes"] == mma.params["lanes"]
    rng = np.random.default_rng(n + k + rows)
    ft = {"q4_k": "q4_k", "q6_kr": "q6_k", "q8_0r": "q8_0", "q4_0r": "q4_0", "q4_1r": "q4_1"}[qt]
    raw = random_blocks(ft, n * k // quant.block(ft)[0], seed=k)
    w = np.ascontiguousarray((raw if qt == ft else quant.repack(raw, qt, n, k)).reshape(-1))
    xs = b1.params["x_stride"] or k
    x = to_bf16_bits(np.ascontiguousarray(rng.standard_normal((rows, xs)) * rng.uniform(0.2, 4.0, (rows, 1)), np.float32))
    x = x.reshape(rows, xs)
    nw = (1.0 + 0.2 * rng.standard_normal(k)).astype(np.float32)
    res = to_bf16_bits(rng.standard_normal((rows, n)).astype(np.float32)).reshape(rows, n)
    got = _emu(mma, x, rows, w, res, nw, tmp_path)
    assert np.array_equal(got, _emu(mma, x, rows, w, res, nw, tmp_path, reverse=True)), "a shared-memory race"
    for r in range(rows):
        want = _emu(b1, np.ascontiguousarray(x[r : r + 1]), 1, w, np.ascontiguousarray(res[r : r + 1]), nw, tmp_path)
        assert not np.isnan(want.view(np.float32) if od == "f32" else 0).any()
        diff = np.flatnonzero(got[r] != want[0])
        assert diff.size == 0, (case, r, diff.size, diff[:8])


def _qwen3_4b_q4_k_m_plans(**profiles) -> dict:
    """Qwen3-4B q4_k_m plans (the q4_k_m mix: q6_k v / down in even layers, q6_k head;
    tests/fixtures/checkpoints) for h100 with each MEMRA_TUNE-style tuning given."""
    from engine.graph import load_family
    from engine.model import dims_for_size
    from engine.plan import build_plan
    from engine.profile import get_profile, with_tuning

    graph = load_family("qwen3")
    dims = dims_for_size("qwen3", "qwen3-4b")
    dtypes = {k: mix_tensor_type("q4_k_m", k, 1) for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    dtypes.update({k: mix_tensor_type("q4_k_m", k, -1) for k in ("embed", "lm_head")})
    dtypes.update({f"{k}@{i}": "q6_k" for k in ("wv", "w_down") for i in range(0, dims["layers"], 2)})
    return {name: build_plan(graph, dims, graph.quant("q4_k_m"), with_tuning(get_profile("h100"), tune),
                             tensor_dtypes=dtypes, rope_style=graph.rope_style["gguf"])
            for name, tune in profiles.items()}  # fmt: skip


def _gemvs(plan, mode):
    return [la for st in plan.steps for la in st.launches.get(mode, ()) if la.spec.template in ("gemv", "gemv_pair")]


def test_the_knob_takes_the_bucket_q4_k_and_q6_k_gemvs_of_a_plan_and_only_those():
    """gemv_mmq.types=[q4_k, q6_k], min_rows 0 on a Qwen3-4B q4_k_m plan: every bucket decode GEMV
    of a q4_k / q6_kr weight with q8x x rows is an mma spec at every row count (the bucket coop
    spec's k split and lanes, its own bmax in grid.y, its capped grid fitted to the resident
    blocks), the batch-1 launches (decode1, gemv_pair parts) are the plan's without the knob, and
    without the knob no launch is an mma spec."""
    from engine.profile import get_profile

    plans = _qwen3_4b_q4_k_m_plans(off="gemv_mmq.types=[]", on="gemv_mmq.types=[q4_k, q6_k]; gemv_mmq.min_rows=0")
    sm_count = get_profile("h100").sm_count
    assert not any(la.spec.params.get("mma") for mode in ("decode1", "decode") for la in _gemvs(plans["off"], mode))
    assert [la.spec for la in _gemvs(plans["on"], "decode1")] == [la.spec for la in _gemvs(plans["off"], "decode1")]
    seen = set()
    for la_on, la_off in zip(_gemvs(plans["on"], "decode"), _gemvs(plans["off"], "decode"), strict=True):
        p, q = la_on.spec.params, la_off.spec.params
        assert (la_on.min_rows, la_on.max_rows) == (0, 0)
        if q["quant"] in ("q4_k", "q6_kr") and q["q8x"]:
            assert p["mma"] and (p["lanes"], p["ksplit"], p["n"], p["k"]) == (q["lanes"], q["ksplit"], q["n"], q["k"])
            assert la_on.grid == (kc.gemv_grid_x(p), f"(n + {p['bmax'] - 1}) // {p['bmax']}") and la_on.fit_grid
            assert p["grid_cap"] == sm_count and la_on.smem == kc.gemv_smem(p) and la_on.args == la_off.args
            seen.add(p["quant"])
        else:
            assert la_on.spec == la_off.spec
    assert seen == {"q4_k", "q6_kr"}


def test_min_rows_keeps_the_smaller_buckets_launches_as_they_are_without_the_knob():
    """The h100 profile's gemv_mmq (every type, min_rows 32) against the same profile without it
    (types []): every launch of every step and mode but decode is the same, and so is every decode
    launch a pass of 1 .. 31 rows runs (the same spec, so the same rendered kernel; the coop GEMVs
    only bounded to 31 rows); a pass of 32 rows and more runs the mma GEMV in place of each coop
    q8x GEMV of an MMA type (its lanes, k split, shape and args; a concurrent one stays so), and
    every other launch as it is."""
    import dataclasses

    from engine.profile import get_profile

    assert dict(get_profile("h100").tuning["gemv_mmq"])["min_rows"] == 32
    plans = _qwen3_4b_q4_k_m_plans(off="gemv_mmq.types=[]", on="")
    on, off = plans["on"], plans["off"]
    assert on.graph_batch_sizes == off.graph_batch_sizes and 32 in on.graph_batch_sizes
    swapped = 0
    for s_on, s_off in zip(on.steps, off.steps, strict=True):
        assert s_on.launches.keys() == s_off.launches.keys()
        for mode, las in s_on.launches.items():
            if mode != "decode":
                assert las == s_off.launches[mode], mode
        for n in on.graph_batch_sizes:
            got = [la for la in s_on.launches.get("decode", ()) if la.runs_at(n)]
            want = [la for la in s_off.launches.get("decode", ()) if la.runs_at(n)]
            if n < 32:
                assert [dataclasses.replace(la, max_rows=0) if la.max_rows == 31 else la for la in got] == want
                continue
            assert len(got) == len(want)
            for a, b in zip(got, want, strict=True):
                p, q = a.spec.params, b.spec.params
                if a == b:
                    assert not (q.get("q8x") and q["quant"] in MMA_TYPES and not q["glu"])
                    continue
                assert p["mma"] and a.min_rows == 32 and b.max_rows == 0 and a.concurrent == b.concurrent
                assert (p["quant"], p["n"], p["k"], p["lanes"], p["ksplit"]) == (q["quant"], q["n"], q["k"], q["lanes"], q["ksplit"])
                assert a.args == b.args
                swapped += n == 32
    assert swapped == 5 * 36 + 1, swapped  # (q|k, v, o, gate|up, down: every layer's, and the head)


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or CUDA headers not available")
def test_mma_kernels_leave_no_product_to_fuse():
    """As tests/test_fp_contraction.py holds the plans' decode kernels: no plain product that NVVM
    or ptxas could fuse into an FFMA (the mma kernel and its batch-1 twin compile separately)."""
    from test_fp_contraction import _ptx, contracted, fusable_pairs

    t = _tuning()
    bad = {}
    for qt, pro in (("q4_k", "norm"), ("q6_kr", "silu"), ("q8_0r", "norm"), ("q4_0r", "none"), ("q4_1r", "norm")):
        s = _pair(t, 2560, 9728 if pro == "silu" else 2560, pro, pro == "norm", "bf16", qt)[1]
        ptx = _ptx(s, True)
        if fusable_pairs(ptx) or contracted(ptx, _ptx(s, False)):
            bad[s.entry] = fusable_pairs(ptx)[:2]
    assert not bad, bad
