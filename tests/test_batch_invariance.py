"""Batched equal to solo, by construction (issue #38 item 3; the GPU proof is
tests/gpu/test_batch_invariance_gpu.py): for tiny models of every decode GEMV layout (q4_0, q4_1,
q8_0, q4_k_m, q5_k_m GGUFs; bf16 Llama, Qwen3 and a windowed Gemma 3) on every device profile, and
the families' real sizes on the sm90 / sm80 profiles, the plan's batch-1 and bucket decode
launches (decode1 / short / short1 against decode) differ in no knob that changes a row's bits
(tests/fixtures/batch_invariance.py); and the GEMV norm prologue sums its squares in the rmsnorm kernel's
order (both templates' NORM_T)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from fixtures.batch_invariance import mismatches
from fixtures.checkpoints import (
    Dims,
    write_gemma3_safetensors,
    write_llama_safetensors,
    write_qwen3_safetensors,
    write_random_gguf,
)

from engine import kernel_catalog as kc
from engine.plan import build_plan
from engine.profile import get_profile

ROOT = Path(__file__).resolve().parent.parent
PROFILES = sorted(p.stem for p in (ROOT / "device_profiles").glob("*.yaml"))
QWEN = Dims(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            intermediate_size=1536, vocab_size=768)  # fmt: skip
LLAMA = dataclasses.replace(QWEN, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                            tie_word_embeddings=True)  # fmt: skip
GGUFS = {
    "llama-q4_1": ("llama", LLAMA, "q4_1"),
    "llama-q4_0": ("llama", LLAMA, "q4_0"),
    "llama-q8_0": ("llama", LLAMA, "q8_0"),
    "qwen3-q8_0": ("qwen3", QWEN, "q8_0"),
    "qwen3-q4_k_m": ("qwen3", QWEN, "q4_k_m"),
    "qwen3-q5_k_m": ("qwen3", QWEN, "q5_k_m"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from engine.model import load_model

    out = {}
    for name, (family, dims, q) in GGUFS.items():
        out[name] = load_model(write_random_gguf(tmp_path_factory.mktemp(name) / "m.gguf", family, dims, q, seed=3))
    small = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=512, vocab_size=512)  # fmt: skip
    out["llama-bf16"] = load_model(write_llama_safetensors(tmp_path_factory.mktemp("bf16"), **small))
    out["qwen3-bf16"] = load_model(write_qwen3_safetensors(tmp_path_factory.mktemp("qbf16"), **small))
    # Gemma 3's layout: sliding-window layers (a 512-key window), GeGLU, q/k head norms, (1 + w) norms
    gemma = dict(small, hidden_size=640, num_attention_heads=4, num_key_value_heads=1, head_dim=256)
    out["gemma3-bf16"] = load_model(write_gemma3_safetensors(tmp_path_factory.mktemp("gemma"), window=512, **gemma))
    return out


@pytest.mark.parametrize("profile", PROFILES)
def test_batch1_and_bucket_decode_launches_agree_in_every_bit_changing_knob(models, profile):
    prof = get_profile(profile)
    bad = {}
    for name, m in models.items():
        plan = build_plan(m.graph, m.dims, m.quant, prof, m.tensor_dtypes, m.rope_style)
        lines = mismatches(plan)
        if lines:
            bad[name] = lines[:3]
    assert not bad, bad


SIZES = [("qwen3", "qwen3-4b", "q8_0"), ("qwen3", "qwen3-4b", "q4_k_m"), ("qwen3", "qwen3-0.6b", "bf16"),
         ("llama", "smollm2-135m", "q4_1")]  # fmt: skip


@pytest.mark.parametrize("profile", ["h100", "h200", "generic-sm80"])
def test_real_sizes_decode_launches_agree(profile):
    """The families' real sizes (no weights needed): long-k down projections (9728: int8 x rows
    only 4 to a grid row in the buckets), q4_k_m pairs, short-n classic GEMVs."""
    from engine.graph import load_family
    from engine.model import dims_for_size

    bad = {}
    for family, size, q in SIZES:
        g = load_family(family)
        plan = build_plan(g, dims_for_size(family, size), g.quant(q), get_profile(profile), rope_style="neox")
        if mismatches(plan):
            bad[size, q] = mismatches(plan)[:2]
    assert not bad, bad


def test_the_norm_prologue_and_the_rmsnorm_kernel_sum_over_the_same_threads():
    """Both templates fix the sum of squares' order over the same NORM_T "threads", which the
    rmsnorm kernel's block divides."""
    found = [re.findall(r"set norm_t = (\d+)", (ROOT / "kernels" / f).read_text()) for f in ("gemv.cu.j2", "rmsnorm.cu.j2")]
    assert found[0] == found[1] and len(found[0]) == 1, found
    assert int(found[0][0]) % kc.NORM_THREADS == 0 and int(found[0][0]) // 32 <= 32


def test_mismatches_names_a_bit_changing_knob(models):
    """The check itself: a plan whose batch-1 attention runs other warps than the bucket's, or
    whose batch-1 GEMV (or a bucket GEMV of 32 rows and more only) splits k over other warp
    groups, is reported."""
    m = models["qwen3-q4_k_m"]
    plan = build_plan(m.graph, m.dims, m.quant, get_profile("h100"), m.tensor_dtypes, m.rope_style)
    assert mismatches(plan) == []
    steps = list(plan.steps)
    i = next(i for i, st in enumerate(steps) if st.op.op == "attention")
    la = steps[i].launches["short"][0]
    spec = dataclasses.replace(la.spec, params={**la.spec.params, "warps": la.spec.params["warps"] // 2})
    steps[i].launches["short"] = (dataclasses.replace(la, spec=spec),)
    j = next(i for i, st in enumerate(steps) if st.op.op == "linear" and st.launches["decode1"][0].spec.template == "gemv")
    la = steps[j].launches["decode1"][0]
    p = la.spec.params
    spec = dataclasses.replace(la.spec, params={**p, "ksplit": p["ksplit"] + 1} if p["coop"] else {**p, "threads": 2 * p["threads"]})
    steps[j].launches["decode1"] = (dataclasses.replace(la, spec=spec), *steps[j].launches["decode1"][1:])
    # the bucket launch of 32 rows and more (gemv_mmq.min_rows: the int8 tensor-core GEMV)
    h = next(h for h, st in enumerate(steps) if h != j and any(la.spec.params.get("mma") for la in st.launches.get("decode", ())))
    las = steps[h].launches["decode"]
    e = next(e for e, la in enumerate(las) if la.spec.params.get("mma"))
    assert las[e].min_rows == 32 and any(la.max_rows == 31 for la in las)
    p = las[e].spec.params
    spec = dataclasses.replace(las[e].spec, params={**p, "ksplit": p["ksplit"] + 1})
    steps[h].launches["decode"] = (*las[:e], dataclasses.replace(las[e], spec=spec), *las[e + 1 :])
    lines = mismatches(dataclasses.replace(plan, steps=tuple(steps)))
    assert any(f"step {i} " in x and "short" in x for x in lines), lines
    assert any(f"step {j} " in x and "decode1" in x for x in lines), lines
    assert any(f"step {h} " in x and "decode at 32 rows" in x for x in lines), lines
    assert not any(f"step {h} " in x and "decode at 16 rows" in x for x in lines), lines
