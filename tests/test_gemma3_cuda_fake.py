"""Gemma 3 through CudaRunner's host logic on the fake driver (no GPU): the plan binds and runs
prefill chunks past the window and decode steps, the norm vectors are uploaded with the norm offset
added (offset 1 for a transformers-layout file: (1 + w)), and every attention launch of a local layer
carries the window."""

from __future__ import annotations

import numpy as np
from fixtures.checkpoints import write_gemma3_safetensors
from test_plan_runner_fake import FakeDriver, fake_builder

from engine.types import SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)


def test_tiny_gemma3_binds_and_uploads_offset_norms(tmp_path, monkeypatch):
    import engine.runner_cuda as rc
    from engine.model import load_model

    drv = FakeDriver()
    mod = drv.module()
    uploads: list[np.ndarray] = []
    htod = mod.htod
    mod.htod = lambda ptr, host, stream=None: (uploads.append(np.array(host, copy=True)), htod(ptr, host, stream))
    monkeypatch.setattr(rc, "cuda", mod)
    model = load_model(write_gemma3_safetensors(tmp_path / "g", window=8, num_hidden_layers=7, head_dim=256))
    runner = rc.CudaRunner(model, num_blocks=64, max_model_len=512, builder=fake_builder(tmp_path))
    try:
        norm = np.asarray(model.dequantize("attn_norm", 0), dtype=np.float32)
        f32 = [u.view(np.float32) for u in uploads if u.dtype == np.uint8 and u.nbytes == norm.nbytes]
        assert any(np.array_equal(u, np.float32(1.0) + norm) for u in f32)
        assert not any(np.array_equal(u, norm) for u in f32)
        runner.step([StepItem(0, list(range(3, 40)), 0, [0, 1, 2, 3], False, GREEDY)])
        runner.step([StepItem(0, list(range(3, 13)), 37, [0, 1, 2, 3], True, GREEDY)])
        runner.step([StepItem(0, [5], 47, [0, 1, 2, 3], True, GREEDY)])
        names = [n for n, _, _ in drv.launches]
        assert any("window8" in n for n in names if n.startswith("attention_prefill"))
        assert any("window8" in n for n in names if n.startswith("attention__"))
        assert any(n.startswith("add__") for n in names) and any("actgelutanh" in n for n in names)
    finally:
        runner.close()
