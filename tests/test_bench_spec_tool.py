"""tools/bench_spec.py on the reference backend with a tiny random Qwen3 GGUF: every mode runs in
interleaved rounds, each row reports its fastest round, and the replay mode (the target's own greedy
text as the draft) is exact and accepted whole."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fixtures.checkpoints import Dims, write_random_gguf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_spec  # noqa: E402


def test_rounds_interleave_and_report_the_fastest(tmp_path, capsys):
    dims = Dims(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=512, max_position_embeddings=2048)  # fmt: skip
    model = write_random_gguf(tmp_path / "m.gguf", "qwen3", dims, "q8_0", seed=3)
    out = tmp_path / "o.json"
    assert bench_spec.main([str(model), "--backend", "reference", "--max-tokens", "6", "--rounds", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["mode"], r["workload"]) for r in rows} == {
        (m, w) for m in ("off", "ngram", "replay") for w in ("suited", "unsuited")
    }
    for r in rows:
        assert len(r["rounds_tok_s"]) == 2 and r["tok_s"] == max(r["rounds_tok_s"]) > 0
        assert r["exact"]
    off = {r["workload"]: r["tok_s"] for r in rows if r["mode"] == "off"}
    for r in rows:
        assert r["speedup"] == r["tok_s"] / off[r["workload"]]
        if r["mode"] == "replay":
            assert r["spec_acceptance_rate"] == 1.0
    assert "best of 2 rounds" in capsys.readouterr().out
