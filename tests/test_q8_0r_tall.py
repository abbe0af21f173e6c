"""q8_0r rows of any k % 32 == 0 for a tall q8_0 matrix (Gemma 3 270M's 262,144 x 640 tied head):
the upload rule (gemv_coop.q8_0r_min_rows), the Gemma 3 270M plan (the embedding lookup and the
lm_head read one q8_0r allocation; the head is a coop GEMV), and the kernels' q8_0r addressing on
the CPU (tests/fixtures/cuda_emu.py runs the rendered embedding kernel) against engine.quant. The
GPU twins: tests/gpu/test_gemma_kernels.py (test_gemma_gemvs, test_tall_q8_0r_head_readers)."""

from __future__ import annotations

import pytest

from engine import kernel_catalog as kc
from engine import storage
from engine.graph import load_family
from engine.model import resolve_dims
from engine.plan import build_plan
from engine.profile import get_profile, with_tuning

GEMMA_270M = {
    "hidden_size": 640, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "intermediate_size": 2048, "vocab_size": 262144, "sliding_window": 512,
    "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000.0, "rope_theta": 1e6,
}  # fmt: skip


def gemma_plan(profile):
    g = load_family("gemma3")
    return build_plan(g, resolve_dims(g, "hf", GEMMA_270M, "config.json"), g.quant("q4_k_m_640"), profile)


def test_upload_type_takes_tall_short_row_q8_0_matrices_as_q8_0r():
    t = get_profile("h100").tuning
    tall = int(t["gemv_coop"]["q8_0r_min_rows"])
    assert 49152 < tall <= 262144  # Gemma 3 270M's head, not SmolLM2's (49,152 x 576) yet
    assert kc.upload_type("q8_0", 640, t, 262144) == "q8_0r"
    assert kc.upload_type("q8_0", 640, t, 256) == "q8_0"  # Gemma's attn_v: the classic GEMV
    assert kc.upload_type("q8_0", 640, t) == "q8_0"  # rows unknown
    assert kc.upload_type("q8_0", 2048, t, 256) == "q8_0r"  # k % 256 == 0: any rows, as before
    assert kc.upload_type("q8_0", 640, {"gemv_coop": {"types": ["q8_0"]}}, 262144) == "q8_0"  # knob unset
    assert kc.upload_type("q8_0", 640, {"gemv_coop": {"types": [], "q8_0r_min_rows": 1}}, 262144) == "q8_0"


def test_gemma_270m_head_and_embedding_share_one_q8_0r_allocation():
    """The tied weight is planned once (the embedding), as q8_0r with 688-byte rows; the embedding
    lookup reads it as q8_0r and the lm_head is a coop GEMV on it at batch 1 (the final norm folded
    in: q8x_fuse) and 8. With the knob off the same plan keeps q8_0 and the classic GEMV."""
    plan = gemma_plan(get_profile("h100"))
    (emb,) = [w for w in plan.weights if w.key == "embed"]
    assert (emb.dtype, emb.rows, emb.cols) == ("q8_0r", 262144, 640)
    assert emb.nbytes == 262144 * 688 == 262144 * storage.row_bytes("q8_0r", 640)
    assert not any(w.key == "lm_head" for w in plan.weights)
    specs = {(st.op.op, mode): la.spec for st in plan.steps if st.head or st.op.op == "embed"
             for mode, las in st.launches.items() for la in las if la.spec.template in ("embed", "gemv")}  # fmt: skip
    assert {s.params["quant"] for s in specs.values()} == {"q8_0r"}
    assert specs["embed", "decode1"].params["hidden"] == 640
    one, eight = specs["linear", "decode1"].params, specs["linear", "decode"].params
    assert one["coop"] and one["q8x"] and one["bmax"] == 1 and one["out_dtype"] == "f32" and one["prologue"] == "norm"
    assert eight["coop"] and eight["bmax"] == 8 and (one["n"], one["k"]) == (eight["n"], eight["k"]) == (262144, 640)
    off = gemma_plan(with_tuning(get_profile("h100"), "gemv_coop.q8_0r_min_rows=0"))
    assert next(w for w in off.weights if w.key == "embed").dtype == "q8_0"
    head = [la.spec for st in off.steps if st.head for la in st.launches["decode1"] if la.spec.template == "gemv"]
    assert head and not head[0].params["coop"] and head[0].params["quant"] == "q8_0"


@pytest.mark.parametrize("k", [640, 96, 2560])
def test_q8_0r_specs_take_any_k_multiple_of_32(k):
    """The kernel catalog takes q8_0r rows of any k % 32 == 0 (embed, gemv coop and classic,
    gemm, gemv_mma where k % 64 == 0); the rendered decoders address the qs plane at the padded
    offset (Q8R_QS: 48 for 640)."""
    from engine.render import render

    t = get_profile("h100").tuning
    e = kc.spec("embed", quant="q8_0r", hidden=k, threads=256)
    g = kc.spec("gemv", **kc.linear_params("q8_0r", 4096, k, t, out_dtype="f32", bmax=1, sm_count=132))
    assert g.params["coop"]
    kc.spec("gemm", **kc.gemm_params(4096, k, t, quant="q8_0r"))
    assert (kc.gemv_mma_params("q8_0r", 4096, k, 8) is None) == bool(k % 64)
    for s in (e, g):
        src = render(s)
        assert "#define Q8R_QS(k) (((size_t)(k) / 32 * 2 + 15) / 16 * 16)" in src
        assert "2 * (K / 32)" not in src and f"2 * ({k} / 32)" not in src
