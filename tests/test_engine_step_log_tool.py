"""tools/engine_step_log.py: the per-kind summary's arithmetic, and a run on the reference backend
(a tiny random Qwen3 GGUF) that logs every runner step with its rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from fixtures.checkpoints import Dims, write_random_gguf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import engine_step_log  # noqa: E402


def test_summary_counts_rows_and_the_time_before_the_median_first_token():
    calls = [("step", 0.0, 10.0, 100), ("step", 10.0, 10.0, 4), ("tail pass", 2.0, 3.0, 7)]
    rows = {r["kind"]: r for r in engine_step_log.summary(calls, ttft_p50_ms=15.0)}
    assert rows["step"]["calls"] == 2 and rows["step"]["rows"] == 104
    assert rows["step"]["total_ms"] == 20.0 and rows["step"]["mean_ms"] == 10.0
    assert rows["step"]["before_ttft_ms"] == 15.0  # all of the first, half of the second
    assert rows["tail pass"]["before_ttft_ms"] == 3.0


@pytest.fixture()
def restore_tails():
    import engine.runner_steps as rs

    saved = rs.run_tails
    yield
    rs.run_tails = saved


def test_reference_run_logs_each_step(tmp_path, capsys, restore_tails):
    dims = Dims(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=512, max_position_embeddings=2048)  # fmt: skip
    model = write_random_gguf(tmp_path / "m.gguf", "qwen3", dims, "q8_0", seed=3)
    out = tmp_path / "o.json"
    argv = [str(model), "--backend", "reference", "--concurrency", "3", "--prompt-tokens", "24",
            "--gen-tokens", "3", "--json", str(out)]  # fmt: skip
    assert engine_step_log.main(argv) == 0
    got = json.loads(out.read_text())
    assert got["run"]["generated"] == 9
    steps = [c for c in got["calls"] if c[0] == "step"]
    assert sum(c[3] for c in steps) == 3 * 24 + 3 * 2  # every prompt token once, then 2 decode rows each
    assert all(c[2] > 0 for c in steps)
    assert "tok/s, TTFT p50" in capsys.readouterr().out
