"""tools/spec_host_round.py on the real SmolLM2 plan and tokenizer over the fake driver (no GPU): speculation
off and replay emit the same text (the tool exits otherwise), replay rounds emit k + 1 tokens each,
and with the pass times emulated the previous round's text and events run inside the pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_replay_rounds_stream_inside_the_pass(smollm2_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools/spec_host_round.py"), str(smollm2_path), "--max-tokens", "61",
         "--repeats", "1", "--plain-us", "50", "--verify-us", "80", "--threaded", "1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {ln.split()[0]: ln for ln in out.stdout.splitlines() if "us/round" in ln}
    assert " 1.00 tok/round" in rows["off"] and " 5.00 tok/round" in rows["replay"]
    in_pass = float(rows["replay"].split("in pass ")[1].split()[0])
    assert in_pass > 0 and float(rows["off"].split("in pass ")[1].split()[0]) < in_pass
    assert "engine thread + client" in out.stdout
