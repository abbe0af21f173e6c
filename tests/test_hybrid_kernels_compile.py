"""The hybrid families on the CUDA lowering without a GPU: every hybrid family's size plans for every
device profile (bf16, q4_k_m; every storage combo on the h100 profile; bf16 again with the chunked
delta-rule prefill; one full-attention period of layers), its hybrid kernels render,
open with pdl_wait() and NVRTC-compile for every profile arch; the plan's steps, state and launch
geometry; the builders' checks."""

from __future__ import annotations

import functools
import itertools

import pytest
from fixtures.pdl import waits_first
from test_kernels_compile import _nvrtc_ok

from engine import linear_attn_kernels as lk
from engine.compile import KernelBuilder
from engine.graph import all_families
from engine.ir import Arg, kernel_specs
from engine.kcache import KernelCache
from engine.ops import OPS
from engine.plan import build_plan
from engine.profile import all_profiles, get_profile
from engine.render import render
from engine.types import ConfigError

PRIMARY_ARCH = "sm_90a"
COMBOS = ("bf16", "q4_k_m")


def _hybrid_cases():
    """(family, size, layers of one full-attention period, graph) of every hybrid family size."""
    for fam, graph in sorted(all_families().items()):
        if not any(OPS[op.op].state is not None for op, _ in graph.ops()):
            continue
        for size, dims in sorted(graph.sizes.items()):
            yield fam, size, int(dims.get("full_attention_interval", 4)), graph


def _plans():
    from engine.model import dims_for_size

    for fam, size, layers, graph in _hybrid_cases():
        full = dims_for_size(fam, size)
        full["layers"], full["layer_types"] = layers, full["layer_types"][:layers]
        for prof in all_profiles().values():
            for combo in graph.quants:  # every combo on one profile, bf16 and q4_k_m on every profile
                if combo in COMBOS or prof.name == "h100":
                    yield fam, size, prof, combo, build_plan(graph, full, graph.quant(combo), prof)
            plan = build_plan(graph, full, graph.quant("bf16"), prof, delta_prefill="recurrent")
            yield fam, size, prof, "bf16+recurrent", plan


@functools.cache
def _hybrid_specs() -> dict[str, list]:
    by_arch: dict[str, dict] = {}
    for *_, prof, _combo, plan in _plans():
        for s in kernel_specs(plan):
            if s.template in lk.KERNELS:
                by_arch.setdefault(prof.arch, {})[s] = None
    return {a: list(s) for a, s in by_arch.items()}


def test_every_hybrid_size_plans_on_every_profile():
    seen = set()
    for fam, size, prof, combo, plan in _plans():
        seen.add(fam)
        ops = [st.op.op for st in plan.steps if st.layer == 0]
        assert "gated_delta_rule" in ops and "attention" not in ops, (fam, size)
        last = [st.op.op for st in plan.steps if st.layer == plan.dims["layers"] - 1]
        assert "attention" in last and "split_heads" in last and "sigmoid_mul" in last
        d = plan.dims
        delta = next(sp for sp in plan.states if sp.name == "L0.gated_delta_rule")
        assert delta.slot_bytes == 4 * d["lin_v_heads"] * d["lin_k_dim"] * d["lin_v_dim"]
        assert len(plan.states) == 2 * (d["layers"] - 1), (fam, prof.name, combo)
        step = next(st for st in plan.steps if st.op.op == "gated_delta_rule")
        (pre,) = step.launches["prefill"]
        (dec,) = step.launches["decode"]
        chunked = not combo.endswith("+recurrent")
        assert pre.spec.template == ("gated_delta_chunk" if chunked else "gated_delta_rule")
        # (the chunked kernel also reads positions; rows: nseq, n)
        base = len(lk.DELTA_ARGS) - 1  # (decode: the gated norm after it fused in, its four args before rows)
        assert dec.spec.template == "gated_delta_rule" and tuple(a for a in pre.args if a.ref != "positions")[:-1] == dec.args[:base]
        assert dec.spec.params["norm"] and dec.spec.params["conv"] == d["lin_conv_kernel"]
        assert dec.args[base : base + 2] == (Arg("weight", "L0.la_conv"), Arg("state", "L0.causal_conv1d"))
        assert dec.args[base + 5] == Arg("weight", "L0.la_norm")
        at = plan.steps.index(step)
        for st, name in ((plan.steps[at - 1], "causal_conv1d"), (plan.steps[at + 1], "gated_rmsnorm")):
            assert st.op.op == name and not st.launches["decode"] and not st.launches["decode1"]
            assert [la.spec.template for la in st.launches["prefill"]] == [name]
        if chunked:  # its chunks divide the KV block: the prefix cache's snapshots end chunks
            assert plan.block_size % pre.spec.params["chunk"] == 0 and Arg("input", "positions") in pre.args
        assert pre.smem <= lk.DELTA_CHUNK_SMEM and (pre.smem > 0) == chunked
        assert pre.grid == ("nseq", d["lin_v_heads"], d["lin_v_dim"] // pre.spec.params["v_block"])
        assert dec.grid == ("n", d["lin_v_heads"], d["lin_v_dim"] // dec.spec.params["v_block"])
        assert Arg("state", "L0.gated_delta_rule") in dec.args and Arg("input", "state_snap") in dec.args
        assert pre.spec.params["varlen"] and not dec.spec.params["varlen"]
    assert seen == {f for f, *_ in _hybrid_cases()}


def test_hybrid_kernels_render_and_wait_first():
    specs = {s for group in _hybrid_specs().values() for s in group}
    assert {s.template for s in specs} == set(lk.KERNELS)
    for s in specs:
        src = render(s)
        assert f"{s.entry}(" in src and waits_first(src, s.entry), s.entry


def test_builders_check_their_inputs():
    with pytest.raises(ConfigError, match="bad head shape"):
        lk.delta_rule_kernel(3, 4, 128, 128, 2048, 4, 4, 512, False, False)
    with pytest.raises(ConfigError, match="narrower"):
        lk.delta_rule_kernel(2, 4, 32, 32, 100, 4, 4, 128, False, False)
    with pytest.raises(ConfigError, match="causal_conv1d"):
        lk.conv1d_kernel(96, 1, 96, 96, False)
    k = lk.delta_rule_kernel(16, 32, 128, 128, 12352, 32, 32, 4096, False, True)
    assert k.spec.params["ksplit"] == 8 and k.block == (256, 1, 1) and k.grid(3) == (3, 32, 4)
    assert lk.delta_rule_kernel(2, 4, 16, 16, 256, 4, 4, 64, True, False).spec.params["ksplit"] == 16
    with pytest.raises(ConfigError, match="chunk must be"):
        lk.delta_chunk_kernel(16, 32, 128, 128, 12352, 32, 32, 4096, False, True, chunk=48)
    with pytest.raises(ConfigError, match="v_block"):
        lk.delta_chunk_kernel(2, 4, 16, 24, 256, 4, 4, 96, False, True)  # 24 columns: no row groups
    ck = lk.delta_chunk_kernel(16, 32, 128, 128, 12352, 32, 32, 4096, False, True)
    assert ck.spec.params["chunk"] == 32 and ck.block == (256, 1, 1) and ck.grid(3) == (3, 32, 4)
    assert ck.args == (*k.args[:-1], ("positions", "ptr"), k.args[-1])
    assert ck.smem == lk.delta_chunk_smem(32, 128, 32) <= lk.DELTA_CHUNK_SMEM
    # the longest chunk that fits and divides the KV block (16 at the profiles' blocks; 64 fits here)
    assert lk.delta_chunk_kernel(16, 32, 128, 128, 12352, 32, 32, 4096, False, True, block=16).spec.params["chunk"] == 16
    assert lk.delta_chunk_kernel(2, 4, 16, 16, 256, 4, 4, 64, True, True, block=32).spec.params["chunk"] == 32
    assert not lk.delta_chunk_fits(16, 32, 128, 128, block=8)  # no chunk divides it: the recurrent prefill
    assert lk.delta_chunk_kernel(2, 4, 16, 16, 256, 4, 4, 64, True, True).spec.params["chunk"] == 64
    nk = lk.delta_rule_kernel(16, 32, 128, 128, 12352, 32, 32, 4096, False, False, norm=(12352, 4096, 1e-6))
    assert nk.args == lk.DELTA_NORM_ARGS and nk.block == k.block and nk.spec.entry != k.spec.entry
    with pytest.raises(ConfigError, match="decode"):
        lk.delta_rule_kernel(16, 32, 128, 128, 12352, 32, 32, 4096, False, True, norm=(12352, 4096, 1e-6))
    ck = lk.delta_rule_kernel(16, 32, 128, 128, 12352, 32, 32, 4096, False, False, norm=(12352, 4096, 1e-6), conv=4)
    assert ck.args == (*k.args[:-1], *lk.CONV_ARGS, *lk.NORM_ARGS, k.args[-1])
    with pytest.raises(ConfigError, match="fused conv"):
        lk.delta_rule_kernel(16, 32, 128, 128, 12352, 32, 32, 4096, False, True, conv=4)
    with pytest.raises(ConfigError, match="norm strides"):
        lk.delta_rule_kernel(16, 32, 128, 128, 12352, 32, 32, 4096, False, False, norm=(2048, 4096, 1e-6))
    c = lk.conv1d_kernel(8192, 4, 12352, 12352, False)
    assert c.grid(5) == (64, 5, 1) and [n for n, _ in c.args][-6:] == [
        "state", "state_in", "state_out", "state_snap", "seq_starts", "rows"]


def test_qwen3_next_routes_512_experts():
    from engine.model import dims_for_size

    g = all_families()["qwen3_next"]
    d = {**dims_for_size("qwen3_next", "qwen3-next-80b-a3b"), "layers": 4}
    plan = build_plan(g, d, g.quant("bf16"), get_profile("h100"))
    topk = {la.spec for st in plan.steps for la in st.launches["decode"] if la.spec.template in ("moe_topk", "moe_router")}
    assert {s.params["experts"] for s in topk} == {512}
    assert any(la.spec.template == "unpack_qkvz_ba" for st in plan.steps for la in st.launches["decode1"])


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or the CUDA headers are not available")
def test_hybrid_kernels_compile_for_every_profile_arch(tmp_path):
    """Each code variant (template, flags, k split) on the oldest, primary and newest profile arch;
    the other sizes change constants only."""
    by_arch = _hybrid_specs()
    archs = sorted(by_arch, key=lambda a: int(a[3:].rstrip("a")))
    for arch in sorted({archs[0], PRIMARY_ARCH, archs[-1]}):
        variants = {
            (s.template, s.params.get("ksplit"), s.params.get("chunk"), *sorted((k, v) for k, v in s.params.items() if isinstance(v, bool))): s
            for s in by_arch[arch]
        }
        specs = list(variants.values())
        if arch in (archs[0], archs[-1]):  # the FMA form of the chunked delta rule (mma is the plans')
            specs.append(lk.delta_chunk_kernel(16, 32, 128, 128, 12352, 32, 32, 4096, False, True, mma=False).spec)
        builder = KernelBuilder(arch, cache=KernelCache(tmp_path / "kcache"), no_compile=False)
        stats = builder.build_all(specs, jobs=2, progress=None)
        assert stats.compiled + stats.hits == len(specs) and all(k.cubin for k in stats.kernels), arch


def test_delta_prefill_form_choice():
    """build_plan's delta_prefill beats the default (chunked); a bad name is an error; the state grid
    is the chunk of the plan's chunked launches (1 without)."""
    assert lk.delta_prefill_form() == lk.DELTA_PREFILL_DEFAULT == "chunked"
    assert lk.delta_prefill_form("recurrent") == "recurrent"
    with pytest.raises(ConfigError, match="delta_prefill='wy'"):
        lk.delta_prefill_form("wy")
    for *_, plan in itertools.islice(_plans(), 4):
        pre = [la for st in plan.steps for la in st.launches["prefill"]]
        chunks = {la.spec.params["chunk"] for la in pre if la.spec.template == "gated_delta_chunk"}
        assert lk.state_align(pre) == (max(chunks) if chunks else 1)


def test_chunked_prefill_falls_back_where_the_head_shape_does_not_fit(tmp_path):
    """A head shape gated_delta_chunk cannot take (v_dim 48: 256 threads do not split into 48-column
    row groups) plans the recurrent prefill under the chunked form; 32-wide heads plan the chunk kernel."""
    from fixtures.hybrid import write_qwen3_5_hf

    from engine.model import load_model

    assert lk.delta_chunk_fits(16, 32, 128, 128) and lk.delta_chunk_fits(2, 4, 32, 32)
    assert not lk.delta_chunk_fits(2, 4, 32, 48)
    with pytest.raises(ConfigError, match="v_block 48 must divide"):
        lk.delta_chunk_kernel(2, 4, 32, 48, 320, 4, 4, 192, False, True)
    for vd, want in ((48, "gated_delta_rule"), (32, "gated_delta_chunk")):
        m = load_model(write_qwen3_5_hf(tmp_path / str(vd), hidden_size=128, intermediate_size=256,
                                        linear_key_head_dim=32, linear_value_head_dim=vd))  # fmt: skip
        plan = build_plan(m.graph, m.dims, m.quant, get_profile("h100"), m.tensor_dtypes, m.rope_style,
                          delta_prefill="chunked")  # fmt: skip
        step = next(st for st in plan.steps if st.op.op == "gated_delta_rule")
        assert [la.spec.template for la in step.launches["prefill"]] == [want], vd
