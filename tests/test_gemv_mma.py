"""The batched decode linear (kernels/gemv_mma.cu.j2, engine.lowering.gemv_mma) without a GPU: its
spec rules, the shape rule of its params, how plans wire it into the decode buckets, and that it
renders and NVRTC-compiles for every profile arch (tests/gpu/test_gemv_mma_gpu.py runs it)."""

from __future__ import annotations

import pytest
from test_kernels_compile import _nvrtc_ok

from engine import kernel_catalog as kc
from engine.compile import KernelBuilder
from engine.graph import load_family
from engine.ir import WIDE
from engine.kcache import KernelCache
from engine.model import dims_for_size
from engine.plan import build_plan
from engine.profile import all_profiles, get_profile
from engine.render import render
from engine.types import ConfigError

Q4_K_M = {"wq": "q4_k", "wk": "q4_k", "wv": "q6_k", "w_gate": "q4_k", "w_up": "q4_k", "w_down": "q6_k"}


def _plan(quant: str, profile: str = "h100", dtypes=None):
    graph = load_family("qwen3")
    dims = dims_for_size("qwen3", "qwen3-4b")
    return build_plan(graph, dims, graph.quant(quant), get_profile(profile), tensor_dtypes=dtypes)


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
    assert kc.gemv_mma_params("q8_0r", 2560, 2560 - 64, 8) is None  # q8_0r planes need k % 256
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


def test_decode_buckets_use_one_mma_launch_per_weight_and_batch_1_keeps_the_gemv():
    for quant, dtypes in (("q4_k_m", Q4_K_M), ("bf16", None), ("q8_0", None)):
        plan = _plan(quant, dtypes=dtypes)
        linears = [s for s in plan.steps if s.op.op == "linear"]
        assert linears
        for step in linears:
            assert all(la.spec.template in ("gemv", "gemv_pair") for la in step.launches["decode1"])
            modes = ["decode"] + ([WIDE] if plan.wide_rows else [])
            for mode in modes:
                launches = step.launches[mode]
                assert {la.spec.template for la in launches} == {"gemv_mma"}, (quant, mode)
                for rows in plan.graph_batch_sizes:
                    if rows == 1 or (mode == "decode" and plan.wide_rows and rows >= plan.wide_rows):
                        continue
                    if mode == WIDE and rows < plan.wide_rows:
                        continue
                    running = [la for la in launches if la.runs_at(rows)]
                    weights = {la.args[1].ref for la in running}
                    assert len(running) == len(weights) >= 1, (quant, mode, rows)
                    for la in running:  # one weight pass per bmax rows, at most two passes
                        bmax = la.spec.params["bmax"]
                        assert la.grid_for({"n": rows})[1] == -(-rows // bmax) <= 2
                        assert rows <= bmax or bmax == 64
        # the k split's scratch is sized for the largest bucket of the widest split
        parts = [la for s in linears for la in s.launches["decode"] if la.spec.params["kparts"] > 1]
        assert parts
        need = max(la.spec.params["kparts"] * la.spec.params["n"] for la in parts) * max(plan.graph_batch_sizes) * 4
        assert {sp.name: sp.fixed for sp in plan.scratch}["mma_part"] >= need


def test_logits_in_decode_are_an_f32_mma_launch():
    plan = _plan("bf16")
    (head,) = [s for s in plan.steps if s.op.op == "linear" and "logits" in s.op.outputs]
    assert {la.spec.params["out_dtype"] for la in head.launches["decode"]} == {"f32"}
    assert head.launches["prefill"][0].spec.template == "gemv"


def test_decode_gate_up_stores_silu_gate_times_up_and_down_reads_it():
    """gemv.fuse_glu: the decode gate|up gemv_mma of every bucket stores silu(gate) * up in its gate
    half (glu = intermediate, even mt), silu_mul has no decode launch and the down projection reads
    x there; the wide buckets materialise silu_mul (as prefill) and their gate|up stores both."""
    inter = dims_for_size("qwen3", "qwen3-4b")["intermediate"]
    for quant, dtypes in (("q4_k_m", Q4_K_M), ("bf16", None)):
        plan = _plan(quant, dtypes=dtypes)
        steps = [s for s in plan.steps if s.layer == 1]
        gate_up = next(s for s in steps if s.op.op == "linear" and "w_gate" in s.op.weights[0])
        silu = next(s for s in steps if s.op.op == "silu_mul")
        down = next(s for s in steps if s.op.op == "linear" and "w_down" in s.op.weights[0])
        gl = gate_up.launches["decode"]
        assert {la.spec.params["glu"] for la in gl} == {inter} and all(la.spec.params["mt"] % 2 == 0 for la in gl)
        assert silu.launches["decode"] == ()
        assert {(la.args[2].ref, la.spec.params["x_stride"]) for la in down.launches["decode"]} == {
            (gl[0].args[0].ref, 2 * inter)
        }
        if plan.wide_rows:
            assert {la.spec.params["glu"] for la in gate_up.launches[WIDE]} == {0} and silu.launches[WIDE]
    with pytest.raises(ConfigError, match="glu"):
        kc.spec("gemv_mma", **{**kc.gemv_mma_params("q4_k", 2 * inter, 2560, 8, glu=inter), "mt": 1})


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
