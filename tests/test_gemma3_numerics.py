"""Gemma 3's ``numerics.exact_x`` (models/gemma3.yaml): the attention output and down projections'
decode GEMVs read x unquantised, not as the coop GEMV's int8 32-groups (q8x).

On the real 270M file the int8 x of those two projections is the largest error the CUDA decode adds
to the reference's logits (an emulation of every rounding point of the plan, docs/kernels.md "Exact
x"). The plan check: a Gemma 3 plan with the real file's storage types has both projections' batch-1
and bucket GEMVs on the coop layout without q8x, and every other launch as without the option.
The kernel check: the layer's down projection GEMV (q6_kr, k 2048), rendered as the plan has it and
run under g++ (tests/fixtures/cuda_emu.py) on a GeGLU-like x (a few large values among small ones),
gives the f32 product to f32 summation error, where the same spec with q8x on is off by far more.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fixtures import cuda_emu
from fixtures.checkpoints import to_bf16_bits, write_gemma3_safetensors
from fixtures.quant_blocks import random_blocks

from engine import kernel_catalog as kc
from engine import quant
from engine.graph import load_family
from engine.render import render
from engine.types import ConfigError

# the real file's mix (models/gemma3.yaml q4_k_m_640): q5_0 q/k/gate/up, q4_k attn_output, q6_k
# ffn_down, q8_0 attn_v and token_embd
DTYPES = {"wq": "q5_0", "wk": "q5_0", "wv": "q8_0", "wo": "q4_k", "w_gate": "q5_0", "w_up": "q5_0",
          "w_down": "q6_k", "embed": "q8_0"}  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from engine.model import load_model

    dims = dict(hidden_size=640, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                intermediate_size=2048, vocab_size=512)  # fmt: skip
    return load_model(write_gemma3_safetensors(tmp_path_factory.mktemp("g"), window=512, **dims))


def _plan(model, graph=None):
    from engine.plan import build_plan
    from engine.profile import get_profile

    graph = graph or model.graph
    return build_plan(graph, model.dims, graph.quant("q4_k_m_640"), get_profile("h100"), DTYPES, model.rope_style)


def _gemvs(plan, weight, mode):
    return [
        la.spec.params
        for st in plan.steps
        if st.op.op == "linear" and st.op.weights[0] == weight
        for la in st.launches[mode]
        if la.spec.template == "gemv"
    ]


def test_exact_x_projections_decode_without_q8x(model):
    assert load_family("gemma3").numerics["exact_x"] == ("wo", "w_down")
    plan = _plan(model)
    plain = _plan(model, dataclasses.replace(model.graph, numerics={}))
    for w in ("wo", "w_down"):
        for mode in ("decode1", "decode"):
            got, was = _gemvs(plan, w, mode), _gemvs(plain, w, mode)
            assert len(got) == 2 and all(p["coop"] and not p["q8x"] for p in got), (w, mode)
            assert all(p["q8x"] for p in was), (w, mode)  # (what the profile does without the option)
    # every other launch as without the option (the rmsnorm before gate|up, the head...)
    for st, was in zip(plan.steps, plain.steps, strict=True):
        if not (st.op.op == "linear" and st.op.weights[0] in ("wo", "w_down")):
            assert st.launches == was.launches, (st.op.op, st.layer)


def test_a_bad_exact_x_entry_is_an_error_naming_it(tmp_path):
    from engine.graph import _load_family

    text = (load_family("gemma3").path).read_text().replace("exact_x: [wo, w_down]", "exact_x: [wo, attn_norm]")
    (tmp_path / "gemma3.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"numerics.exact_x.*'attn_norm' is not a matrix"):
        _load_family("gemma3", str(tmp_path))


def _run_down_gemv(tmp_path, params, w, x):
    """The down projection's batch-1 GEMV (``params`` from the plan, f32 output) on x [1, k]."""
    spec = kc.spec("gemv", **{**params, "out_dtype": "f32", "wsm": False, "trigger": False, "l2_pf": ""})
    p = spec.params
    out = np.full((1, p["n"]), np.nan, np.float32)
    lib, types = cuda_emu.compile_any(render(spec), spec.entry, tmp_path)
    args = [out, w, x, None, 1] + ([None] if p["prologue"] == "norm" else [])
    cuda_emu.launch_any(lib, types, (kc.gemv_grid_x(p), 1, 1), p["threads"], kc.gemv_smem(p), args)
    return out[0]


def test_the_exact_down_projection_gemv_is_f32_exact_where_q8x_is_not(model, tmp_path):
    plan = _plan(model)
    plain = _plan(model, dataclasses.replace(model.graph, numerics={}))
    (exact,) = [p for p in _gemvs(plan, "w_down", "decode1") if p["k"] == 2048][:1]
    (q8x,) = [p for p in _gemvs(plain, "w_down", "decode1") if p["k"] == 2048][:1]
    assert exact["quant"] == q8x["quant"] == "q6_kr" and not exact["q8x"] and q8x["q8x"]
    n, k = 2 * max(exact["rows_per_block"], q8x["rows_per_block"]), exact["k"]
    exact, q8x = {**exact, "n": n}, {**q8x, "n": n}
    raw = random_blocks("q6_k", n * k // 256, seed=1)
    want_w = quant.dequantize(raw.reshape(-1), "q6_k", (n, k))
    w = np.ascontiguousarray(quant.repack(raw, "q6_kr", n, k)).reshape(-1)
    rng = np.random.default_rng(2)
    xf = rng.standard_normal(k) * 0.05
    xf[rng.choice(k, 24, replace=False)] = rng.standard_normal(24) * 8.0  # a GeGLU output's outliers
    xb = to_bf16_bits(xf.astype(np.float32)).reshape(1, k)
    x32 = (xb.astype(np.uint32) << 16).view(np.float32)
    want = (want_w.astype(np.float64) @ x32[0].astype(np.float64)).astype(np.float32)

    def rel(a):
        return float(np.linalg.norm(a - want) / np.linalg.norm(want))

    got = _run_down_gemv(tmp_path, exact, w, xb)
    assert rel(got) < 1e-5, rel(got)
    assert rel(_run_down_gemv(tmp_path, q8x, w, xb)) > 100 * max(rel(got), 1e-7)
