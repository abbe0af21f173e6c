"""tools/plan_variants.py and ``DRYRUN=1 STAGES=variants bash tools/gpu_session.sh``: the A/B
variants of tools/variants.txt give plans, checked without a GPU (a misspelt knob or a shell slip
would otherwise cost device time)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("plan_variants", ROOT / "tools" / "plan_variants.py")
pv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pv)

NEXT_STAGES = "variants"  # the stage that runs tools/variants.txt


def test_variants_are_planned_and_bad_ones_named(capsys):
    rc = pv.main(
        [
            "--model", "/dev/shm/q4b_q4_k_m.gguf",
            "--out", "ignored", "--batches", "1",
            "--variant", "p3=decode_graph.pair_min_blocks=3",
            "--variant", "same=",
            "--variant", "typo=decode_graph.pair_min_block=3",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert rc == 1
    assert out[0] == "qwen3-4b q4_k_m on h200: 3 variants"
    assert out[1].startswith("OK   p3: 2 of ")  # the two q|k|v pair kernels (q6_k v, q4_k v)
    assert out[2].startswith("OK   same: 0 of ")
    assert out[3].startswith("FAIL typo: ConfigError:") and "did you mean 'pair_min_blocks'" in out[3]
    assert pv.main(["--quant", "q8_0", "--variant", "u=gemv_coop.unroll=4"]) == 0
    with pytest.raises(SystemExit):
        pv.main(["--variant", "x=gemv_coop.unroll=4"])  # no quant, no model, no shapes


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_next_sessions_stages_dry_run_clean(tmp_path):
    env = {
        **os.environ,
        "DRYRUN": "1",
        "DRY_PY": sys.executable,
        "STAGES": NEXT_STAGES,
        "RES": str(tmp_path / "res"),
        "OUT": str(tmp_path / "out"),
    }
    run = subprocess.run(
        ["bash", "tools/gpu_session.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "unbound variable" not in run.stderr + run.stdout
    logs = sorted((tmp_path / "res").glob("*_q*.log"))
    stages = {p.name.split("_q")[0] for p in logs}
    assert set(NEXT_STAGES.split()) <= stages, stages
    for log in logs:
        text = log.read_text()
        lines = [line for line in text.splitlines() if line.startswith(("OK ", "FAIL "))]
        assert lines and not any(line.startswith("FAIL") for line in lines), (log.name, text)
        # a variant that changes nothing is the profile again: only the repeats named profile*
        same = [line.split(":")[0].split()[1] for line in lines if ": 0 of " in line]
        assert all(name.startswith("profile") for name in same), (log.name, same)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(
    ("card", "ran"), [("NVIDIA H200", "variants"), ("NVIDIA H100 80GB HBM3", "runner")]
)
def test_stages_h200_replace_stages_only_on_an_h200(tmp_path, card, ran):
    env = {
        **os.environ,
        "DRYRUN": "1",
        "DRY_PY": sys.executable,
        "DRY_GPU": card,
        "STAGES": "runner",
        "STAGES_H200": "variants",
        "RES": str(tmp_path / "res"),
        "OUT": str(tmp_path / "out"),
    }
    run = subprocess.run(
        ["bash", "tools/gpu_session.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    times = (tmp_path / "res" / "times.log").read_text()
    assert f"card: {card}; stages: {ran}\n" in times
    assert f"[{ran} done at" in times
    assert ("[runner done at" in times) == (ran == "runner")
