"""`--devices`/`--split` on the command line: the sharded reference gives `memra run` the same greedy
text as one device; flag errors are one line, and without enough CUDA devices the split is refused
with the way out (--backend reference)."""

from __future__ import annotations

import pytest

from engine import cli
from engine.backend import split_devices
from engine.types import MemraError


def _run(capsys, *args):
    code = cli.main(["run", *args, "--prompt", "hello world", "--max-tokens", "6"])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("split", ["tp", "pp"])
def test_run_split_on_reference_equals_one_device(tiny_qwen3_dir, capsys, split):
    code, one, _ = _run(capsys, str(tiny_qwen3_dir), "--backend", "reference")
    assert code == 0 and one
    code, two, err = _run(capsys, str(tiny_qwen3_dir), "--backend", "reference", "--devices", "0,1", "--split", split)
    assert code == 0, err
    assert two == one
    assert f"{split} over 2 devices" in err and "rank 1 (device 1)" in err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--devices", "0,1"], "2 devices need --split pp or --split tp"),
        (["--split", "tp"], "--split tp needs at least 2 devices"),
        (["--devices", "0,0", "--split", "pp"], "device ids must be distinct"),
    ],
)
def test_flag_errors_are_one_line(tiny_qwen3_dir, capsys, flags, message):
    code, _, err = _run(capsys, str(tiny_qwen3_dir), "--backend", "reference", *flags)
    assert code == 2 and message in err and len(err.strip().splitlines()) <= 2  # "loading" + the error


def test_cuda_split_without_devices_names_the_way_out(tiny_qwen3_dir, capsys, monkeypatch):
    from engine import backend

    monkeypatch.setattr(backend, "detect", lambda: backend.Detected([], "no driver"))
    code, _, err = _run(capsys, str(tiny_qwen3_dir), "--backend", "cuda", "--devices", "0,1", "--split", "tp")
    assert code == 2 and "needs 2 CUDA devices; device 0 does not exist" in err and "--backend reference" in err


def test_split_devices_checks_before_loading():
    assert split_devices(None, None) == (0,) and split_devices("0,1", "tp") == (0, 1)
    with pytest.raises(MemraError, match="need --split"):
        split_devices("1,0", None)


def test_serve_checks_the_split_flags_before_loading(tiny_qwen3_dir, capsys):
    code = cli.main(["serve", str(tiny_qwen3_dir), "--backend", "reference", "--devices", "0,1", "--port", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "2 devices need --split pp or --split tp" in err and "serving on" not in err
