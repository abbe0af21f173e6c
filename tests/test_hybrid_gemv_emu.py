"""The batch-1 decode GEMVs of the tiny hybrid GGUF plans of tests/gpu/test_hybrid_runner.py (h100
profile: coop q8x GEMVs on q8_0r / q4_k / q6_kr rows; the fused qkv|z|b|a projection, whose a / b
parts are 4 rows each; a gemv_pair where the a / b rows are q8_0 and the rest q4_k) rendered and
run on the CPU (tests/fixtures/cuda_emu.py) with the file's own bytes in the upload's layout (the
parts' rows concatenated, then repacked as engine.runner_weights does) against numpy: the
dequantised rows times x cut to int8 per 32 values (engine.quant.q8x_round_trip). Equal to f32
rounding, so a q8_0r layout or concatenation bug at these shapes shows; the int8 x rows' own error
(~1 % on these heavy-tailed x) is the arithmetic the GPU logits tests must allow for
(tests/test_hybrid_conditioning.py). The inline-PTX knobs (bulk-copy rows, trigger, L2 prefetch)
are off, the prologue none and the output f32 without the residual."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures import cuda_emu
from fixtures import hybrid_case as case
from fixtures.checkpoints import to_bf16_bits
from fixtures.hybrid import write_random_hybrid_gguf

from engine import kernel_catalog as kc
from engine import quant, storage
from engine.kernel_catalog.contracts import PAIR_PARTS
from engine.model import load_model
from engine.plan import build_plan
from engine.profile import get_profile
from engine.render import render

OFF = dict(wsm=False, trigger=False, l2_pf="", out_dtype="f32", residual=False, early_res=False, prologue="none")


def _gemvs(model, step) -> list[tuple[dict, list[str]]]:
    """(gemv params, the weights whose rows it reads) of a linear step's batch-1 launches."""
    out = []
    for la in step.launches["decode1"]:
        p = la.spec.params
        parts = [{k[len(x) :]: v for k, v in p.items() if k.startswith(x)} for x in PAIR_PARTS]
        out += parts if la.spec.template == "gemv_pair" else [dict(p)] if la.spec.template == "gemv" else []
    names, got = list(step.op.weights), []
    for p in out:  # each GEMV's rows are the next weights' rows, in order
        rows, take = 0, []
        while rows < p["n"]:
            take.append(names.pop(0))
            rows += model.info(take[-1], step.layer).shape[0]
        assert rows == p["n"], (step.op.weights, p["n"])
        got.append((p, take))
    assert not names, names
    return got


@pytest.mark.parametrize("quant_name", ["q8_0", "q4_k_m"])
def test_decode_gemvs_match_numpy_on_the_files_rows(tmp_path, quant_name):
    model = load_model(write_random_hybrid_gguf(tmp_path / "m.gguf", quant=quant_name, seed=case.SEED, **case.GGUF_DIMS))
    plan = build_plan(model.graph, model.dims, model.quant, get_profile("h100"), model.tensor_dtypes, model.rope_style)
    rng = np.random.default_rng(1)
    seen = set()
    for st in plan.steps:
        if st.op.op != "linear" or st.layer not in (0, None):  # (layer 1: the same kernels at other n)
            continue
        for p, names in _gemvs(model, st):
            spec = kc.spec("gemv", **{**p, **OFF})
            pp = spec.params
            assert pp["coop"] and pp["q8x"], (names, pp["quant"])
            n, k = pp["n"], pp["k"]
            raw = np.concatenate([np.asarray(model.weights.raw(model.file_name(w, st.layer))).reshape(-1) for w in names])
            w = np.ascontiguousarray(quant.repack(raw, pp["quant"], n, k) if pp["quant"] in storage.REPACKED_FROM else raw)
            rows = np.concatenate([np.asarray(model.dequantize(x, st.layer), np.float64) for x in names])
            xb = to_bf16_bits((rng.standard_normal((1, k)) * np.exp(rng.standard_normal((1, k)))).astype(np.float32))
            want = quant.q8x_round_trip((xb.astype(np.uint32) << 16).view(np.float32)).astype(np.float64) @ rows.T
            out = np.full((1, n), np.nan, np.float32)
            lib, types = cuda_emu.compile_any(render(spec), spec.entry, tmp_path)
            cuda_emu.launch_any(lib, types, (kc.gemv_grid_x(pp), 1, 1), pp["threads"], kc.gemv_smem(pp), [out, w, xb, None, 1])
            err = np.linalg.norm(out - want) / np.linalg.norm(want)
            assert err < 1e-6, (st.layer, names, pp["quant"], n, k, err)
            seen.add((pp["quant"], n))
    # the fused Gated DeltaNet input projection (4-row a / b parts) and, in q4_k_m, its q8_0r a / b pair part
    want = {("q8_0r", 648)} if quant_name == "q8_0" else {("q4_k", 640), ("q8_0r", 8)}
    assert want <= seen, sorted(seen)
