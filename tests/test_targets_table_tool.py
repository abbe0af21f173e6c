"""tools/targets_table.py: issue #4's targets against `memra bench` / decode-profile results, with
the card each figure came from (a figure from another card than the H200 is never "met")."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("targets_table", ROOT / "tools" / "targets_table.py")
tt = importlib.util.module_from_spec(_spec)
sys.modules["targets_table"] = tt  # its dataclass looks its module up while the class is built
_spec.loader.exec_module(tt)

H200 = {"backend": "cuda", "name": "NVIDIA H200", "profile": "h200"}
H100 = {"backend": "cuda", "name": "NVIDIA H100 80GB HBM3", "profile": "h100"}


def _decode(batch: int, tok_s: float, copy_fraction: float) -> dict:
    return {"kind": "decode", "batch": batch, "depth": 0, "tok_s": tok_s, "copy_roofline_fraction": copy_fraction}


def _bench(tmp_path: Path, name: str, device: dict, rows: list[dict]) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"model": name, "date": "2026-12-05", "device": device, "rows": rows}))
    return path


def _row(text: str, model: str, measure: str) -> list[str]:
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[:2] == [model, measure]:
            return cells
    raise AssertionError(f"no row {model} / {measure} in\n{text}")


def test_verdicts_by_value_and_card(tmp_path, capsys):
    q4 = _bench(tmp_path, "q4", H200, [_decode(1, 850.0, 0.512), _decode(8, 1200.0, 0.1)])
    q8 = _bench(tmp_path, "q8", H100, [_decode(1, 534.0, 0.767)])
    bf16 = _bench(
        tmp_path,
        "bf16",
        H200,
        [
            _decode(1, 400.0, 0.70),
            _decode(32, 4200.0, 0.5),
            {"kind": "prefill", "tokens": 512, "tok_s": 33000.0, "roofline_fraction": 0.3},
            {"kind": "prefill", "tokens": 4096, "tok_s": 50000.0, "roofline_fraction": 0.425},
        ],
    )
    profile = tmp_path / "decode_profile.json"
    profile.write_text(
        json.dumps({"qwen3-0.6b": {"default": {"b1": {"tok_s": 1542.5}, "device": H200}, "t512": {}}})
    )
    rc = tt.main(
        [
            "--result", f"qwen3-4b-q4_k_m={q4}",
            "--result", f"qwen3-4b-q8_0={q8}",
            "--result", f"qwen3-4b-bf16={bf16}",
            "--result", f"qwen3-0.6b-bf16={profile}#qwen3-0.6b",
        ]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 1  # some targets are not met on an H200
    assert _row(text, "qwen3-4b-q4_k_m", "decode b1, of the measured copy")[2:] == [
        "51.2 %", ">= 50.0 %", "NVIDIA H200", "met"
    ]
    q8_cells = _row(text, "qwen3-4b-q8_0", "decode b1, of the measured copy")
    assert q8_cells[2] == "76.7 %" and q8_cells[5] == "at or above the goal, not on an H200"
    assert _row(text, "qwen3-4b-bf16", "decode b1, of the measured copy")[5] == "missed"
    assert _row(text, "qwen3-4b-bf16", "prefill 512")[2:] == ["33,000.0 tok/s", ">= 32,000.0 tok/s", "NVIDIA H200", "met"]
    assert _row(text, "qwen3-4b-bf16", "prefill 4096, of tensor-core peak")[5] == "met"
    assert _row(text, "qwen3-4b-bf16", "decode b32 aggregate over b1")[2:4] == ["10.5x", ">= 10.0x"]
    assert _row(text, "qwen3-0.6b-bf16", "decode b1")[2] == "1,542.5 tok/s"
    assert _row(text, "smollm2-135m-q4_1", "decode b1")[2:] == ["-", ">= 2,000.0 tok/s", "-", "not measured"]
    assert text.rstrip().endswith("5 of 8 targets met on an H200")


def test_all_met_exits_zero():
    good = {"device": H200, "rows": [_decode(1, 1.0, 0.9)]}
    targets = [t for t in tt.TARGETS if t.unit == "%" and "decode" in t.measure]
    text, open_count = tt.render({t.model: good for t in targets}, targets)
    assert open_count == 0 and text.count("| met |") == len(targets)


def test_bad_results_are_named(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"qwen3-0.6b": {"default": {}}}))
    with pytest.raises(SystemExit, match="no entry 'smol'"):
        tt.main(["--result", f"smollm2-135m-q4_1={tmp_path / 'x.json'}#smol"])
    with pytest.raises(SystemExit, match="not a `memra bench --json` file"):
        tt.main(["--result", f"qwen3-4b-q8_0={tmp_path / 'x.json'}"])
    with pytest.raises(SystemExit, match="unknown model key"):
        tt.main(["--result", f"qwen3-4b-q5={tmp_path / 'x.json'}#qwen3-0.6b"])
    with pytest.raises(SystemExit, match="expected KEY=PATH"):
        tt.main(["--result", "qwen3-4b-q8_0"])
    with pytest.raises(SystemExit, match="missing.json"):
        tt.main(["--result", f"qwen3-4b-q8_0={tmp_path / 'missing.json'}"])
