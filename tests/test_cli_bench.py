"""`memra bench` through the engine loop on the reference backend (the CUDA rows need a GPU)."""

from __future__ import annotations

import json

from engine import cli


def test_bench_concurrency_rows(tiny_qwen3_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = cli.main(
        [
            "bench",
            str(tiny_qwen3_dir),
            "--backend",
            "reference",
            "--concurrency",
            "1,3",
            "--quick",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["device"]["backend"] == "reference" and result["device"]["name"].startswith("CPU ")
    rows = result["rows"]
    engine_rows = [r for r in rows if r["kind"] == "engine"]
    assert [r["concurrency"] for r in engine_rows] == [1, 3]
    for r in engine_rows:
        assert r["generated"] == r["concurrency"] * r["gen_tokens"]
        assert r["aggregate_tok_s"] > 0 and r["ttft_p50_ms"] <= r["ttft_p99_ms"]
    printed = capsys.readouterr().out
    assert "concurrency   3" in printed
    assert printed.startswith(f"device    {result['device']['name']} (reference, profile -)")
