"""Quantised decode buckets as dequantising GEMMs (tuning ``gemm_decode.quant_min_rows``; skipped
without a GPU): a tiny random GGUF per storage mix, every linear of a bucket of at least that many
rows through the gemm kernel (weights decoded in its tile loads, bf16 x rows), each row's logits
against the numpy reference on the same file bytes, and its greedy id against that row decoded
alone (the batch-1 GEMVs, int8 x rows: not the same bits by design, so a near tie may flip).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fixtures.checkpoints import write_random_gguf
from runner_harness import GREEDY, rel
from test_quant_models import DIMS, LLAMA_DIMS

from engine import cuda
from engine.ir import WIDE
from engine.types import StepItem

ROWS = 5  # the 8-row bucket


@pytest.mark.parametrize(
    "family,q", [("qwen3", "q8_0"), ("qwen3", "q4_k_m"), ("qwen3", "q5_k_m"), ("qwen3", "q6_k"), ("llama", "q4_1")]
)
def test_wide_quantised_bucket_rows_match_the_reference(tmp_path, family, q):
    from engine.model import load_model
    from engine.profile import select
    from engine.reference import ReferenceRunner
    from engine.runner_cuda import CudaRunner

    dims = LLAMA_DIMS if family == "llama" else DIMS
    model = load_model(write_random_gguf(tmp_path / f"tiny_{q}.gguf", family, dims, q, seed=5))
    prof = select(cuda.detect_devices()[0])
    tuning = {**prof.tuning, "gemm_decode": prof.tuning["gemm_decode"].replace(quant_min_rows=4)}
    runner = CudaRunner(model, dataclasses.replace(prof, tuning=tuning), num_blocks=64, max_model_len=256)
    try:
        assert runner.plan.wide_rows == 4
        gemms = {
            la.spec.params["quant"]
            for st in runner.plan.steps
            if st.op.op == "linear"
            for la in st.launches[WIDE]
            if la.spec.template == "gemm"
        }
        assert gemms and gemms <= {"q8_0r", "q8_0", "q4_k", "q5_k", "q6_k", "q6_kr", "q4_1", "q4_1r", "bf16"}, gemms
        ref = ReferenceRunner(model, num_blocks=64, max_model_len=256)
        rng = np.random.default_rng(3)
        prompts = [[int(t) for t in rng.integers(3, dims.vocab_size, 7 + 3 * i)] for i in range(ROWS)]
        tables = [list(range(4 * i, 4 * i + 4)) for i in range(ROWS)]
        firsts = [runner.step([StepItem(i, p, 0, tables[i], True, GREEDY)])[0] for i, p in enumerate(prompts)]
        items = [StepItem(i, [t], len(prompts[i]), tables[i], True, GREEDY) for i, t in enumerate(firsts)]
        ids = runner.step(items)  # one 8-row pass: the WIDE launches
        wide = np.array(runner.read_logits(ROWS))
        errs, flips = [], 0
        for i, it in enumerate(items):
            want = ref.forward_logits(prompts[i] + [firsts[i]])[-1]
            assert np.isfinite(wide[i]).all() and np.any(wide[i] != 0), i
            errs.append(rel(wide[i], want))
            solo = runner.step([it])[0]  # the same position alone: batch 1's GEMVs
            if solo != ids[i]:
                flips += 1
                top2 = np.sort(want)[-2:]
                assert (top2[1] - top2[0]) / np.abs(want).max() < 2e-2, (i, ids[i], solo)
        print(f"{family} {q}: wide rows rel err {', '.join(f'{e:.2e}' for e in errs)}; {flips} near-tie flips")
        assert max(errs) < 2e-2, errs
    finally:
        runner.close()
