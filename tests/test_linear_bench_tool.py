"""tools/gpu_linear_bench.py on the fake driver of tests/test_plan_runner_fake.py (no GPU, no
compile): a bucket row times the GEMV the plan runs, at kernel_catalog.decode_bmax rows a grid row
(the q4_k down projection's k = 9728: 4 rows of int8 x, not GEMV_MAX_BATCH rows of f32 x), its
capped grid fitted to the resident blocks as the runner fits it (gemv_coop.q8x_resident_grid); a
--variants entry times that GEMV with a spec param changed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from test_plan_runner_fake import FakeDriver

import engine
import engine.compile as compile_mod
from engine import kernel_catalog as kc
from engine.kcache import KernelCache
from engine.profile import get_profile

TOOL = Path(__file__).resolve().parent.parent / "tools" / "gpu_linear_bench.py"


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_linear_bench", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bucket_rows_time_the_plans_gemv(tmp_path, monkeypatch):
    drv = FakeDriver()
    fake = drv.module()

    class Event(fake.Event):
        def elapsed_ms(self, other):
            return 1.0

    fake.Event = Event
    fake.detect_devices = lambda: [fake.Context().info]
    monkeypatch.setattr(engine, "cuda", fake)
    monkeypatch.setitem(__import__("sys").modules, "engine.cuda", fake)
    real = compile_mod.KernelBuilder
    monkeypatch.setattr(
        compile_mod, "KernelBuilder",
        lambda arch, cache=None, no_compile=False: real(
            arch, KernelCache(tmp_path / "cache"), compiler=lambda *a: (b"\0cubin", ""), compiler_version=(13, 0)
        ),
    )  # fmt: skip
    out = tmp_path / "rows.json"
    assert _tool().main(["--types", "q4_k", "--shapes", "2560x9728", "--batches", "1,2", "--iters", "2",
                         "--variants", "u4=unroll:4", "--json", str(out)]) == 0  # fmt: skip
    got = json.loads(out.read_text())["rows"]
    rows = {r["batch"]: r for r in got if r["kernel"].startswith("gemv") and ":" not in r["kernel"]}
    tuning = get_profile("h200").tuning  # (the fake device is an H200)
    want = kc.linear_params("q4_k", 2560, 9728, tuning, bmax=kc.decode_bmax("q4_k", 9728, tuning), sm_count=132)
    assert want["q8x"] and want["bmax"] == 4
    assert rows[2]["entry"] == kc.spec("gemv", **want).entry
    # the bucket launch's grid: the capped grid fitted to 4 resident blocks an SM (the fake's)
    grids = {grid for name, grid, _ in drv.launches if name == rows[2]["entry"]}
    assert grids == {(min(kc.gemv_grid_x(want), 4 * 132), 1, 1)}, grids
    # --variants: the same GEMV with a spec param changed, at the bucket batches only
    (var,) = [r for r in got if r["kernel"] == "gemv:u4"]
    assert var["batch"] == 2 and var["entry"] == kc.spec("gemv", **{**want, "unroll": 4}).entry
