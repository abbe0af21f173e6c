"""engine.runner_bench's arithmetic on a stand-in runner (the real rows need a GPU): the bytes a
decode step must read, the roofline fractions against the profile and against the measured copy,
and the rows and table `memra bench` prints."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from engine import bench, runner_bench


class _StubRunner:
    """What runner_bench reads of a runner: a plan (weights, dims), a profile, KV geometry, a step
    that takes about ``step_s``, and optionally a copy measurement."""

    def __init__(self, step_s: float, copy_gbs: float | None, tied: bool = False):
        w = lambda key, rows, cols, nbytes, layer=None: SimpleNamespace(  # noqa: E731
            key=key, rows=rows, cols=cols, nbytes=nbytes, layer=layer
        )
        self.plan = SimpleNamespace(
            weights=[w("embed", 1000, 64, 128_000), w("wq", 64, 64, 8192, 0), w("head", 1000, 64, 128_000)],
            dims={"tie_embeddings": tied, "layers": 2, "kv_dim": 16},
            steps=[SimpleNamespace(op=SimpleNamespace(op="attention"), launches={})] * 2,  # (KV bytes: attention layers)
        )
        self.profile = SimpleNamespace(memory_bandwidth_gbs=100.0, tensor_tflops_bf16=1.0)
        self.block_size, self.num_blocks, self.max_model_len = 16, 64, 256
        self.step_s = step_s
        self.steps: list[list] = []
        if copy_gbs is not None:
            self.copy_bandwidth_gbs = lambda: copy_gbs

    def step(self, items):
        self.steps.append(items)
        time.sleep(self.step_s)
        return [1] * len(items)


def test_decode_bytes_count_an_untied_embedding_as_one_row():
    r = _StubRunner(0.0, None)
    assert runner_bench.streamed_weight_bytes(r.plan) == 64 * 2 + 8192 + 128_000
    r.plan.dims["tie_embeddings"] = True
    assert runner_bench.streamed_weight_bytes(r.plan) == 128_000 + 8192 + 128_000
    # KV: batch x (depth + 1) tokens x layers x (k and v) x kv_dim x 2 bytes
    assert runner_bench.kv_bytes_read(r.plan, 4, 9) == 4 * 10 * 2 * 2 * 16 * 2
    # a hybrid: KV of its attention layers only, plus its recurrent state read and written per row
    r.plan.steps = r.plan.steps[:1] + [SimpleNamespace(op=SimpleNamespace(op="gated_delta_rule"))]
    r.plan.states = [SimpleNamespace(slot_bytes=1000), SimpleNamespace(slot_bytes=24)]
    assert runner_bench.kv_bytes_read(r.plan, 4, 9) == 4 * (10 * 1 * 2 * 16 * 2 + 2 * 1024)


def test_roofline_fractions_against_the_profile_and_the_measured_copy():
    r = _StubRunner(0.002, copy_gbs=80.0)
    rows = runner_bench.run_all(r, batches=(1, 2), depths=(0,), prefills=(), steps=4)
    assert [x["kind"] for x in rows] == ["copy", "decode", "decode"]
    assert rows[0] == {"kind": "copy", "gbs": 80.0, "profile_gbs": 100.0, "ratio": 0.8}
    for row in rows[1:]:
        t = row["step_ms"] / 1e3
        assert t >= 0.002
        nbytes = runner_bench.streamed_weight_bytes(r.plan) + runner_bench.kv_bytes_read(r.plan, row["batch"], 0)
        assert row["bytes_per_step"] == nbytes
        assert row["roofline_fraction"] == pytest.approx(nbytes / t / 100e9)
        assert row["copy_roofline_fraction"] == pytest.approx(nbytes / t / 80e9)
        assert row["copy_roofline_fraction"] == pytest.approx(row["roofline_fraction"] * 100 / 80)
        assert row["tok_s"] == pytest.approx(row["batch"] / t)
    # every step of a decode row carries one item per batch row, at consecutive positions
    assert {len(items) for items in r.steps} == {1, 2}
    text = bench.table(rows)
    assert "copy      device-to-device: 80 GB/s read + written (the profile's roofline: 100 GB/s)" in text
    assert "% of the measured copy)" in text


def test_no_copy_row_without_a_measurement(caplog):
    failing = _StubRunner(0.0, None)

    def no_room():
        raise RuntimeError("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY")

    failing.copy_bandwidth_gbs = no_room
    for r, copy in ((_StubRunner(0.0, None), True), (_StubRunner(0.0, 50.0), False), (failing, True)):
        rows = runner_bench.run_all(r, batches=(1,), depths=(0,), prefills=(), steps=2, copy=copy)
        assert [x["kind"] for x in rows] == ["decode"]
        assert "copy_roofline_fraction" not in rows[0]
        assert "measured copy" not in bench.table(rows)
    assert "no copy-bandwidth row: cuMemAlloc failed" in caplog.text


def test_default_batches_are_every_graph_bucket_and_rows_that_do_not_fit_are_skipped():
    r = _StubRunner(0.0, None)
    assert runner_bench.graph_buckets(r) == (1, 8, 32)  # no graph buckets: the old trio
    r.plan.graph_batch_sizes = (4, 1, 2, 64, 8)
    assert runner_bench.graph_buckets(r) == (1, 2, 4, 8, 64)
    rows = runner_bench.run_all(r, depths=(0,), prefills=(), steps=4)
    # 64 blocks of 16: batch 64 needs 64 x 1 block at depth 0 (fits); batches come in bucket order
    assert [x["batch"] for x in rows] == [1, 2, 4, 8, 64]
    r.num_blocks = 40
    rows = runner_bench.run_all(r, depths=(0,), prefills=(), steps=4)
    assert [x["batch"] for x in rows] == [1, 2, 4, 8]


def test_decode_kv_bytes_of_sliding_window_layers_stop_at_the_window():
    """Gemma 3 (5 local layers of window 512 per global one): a local layer reads at most 512 keys."""
    from engine.graph import load_family
    from engine.model import resolve_dims
    from engine.plan import build_plan
    from engine.profile import get_profile

    g = load_family("gemma3")
    hf = {
        "hidden_size": 256, "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "intermediate_size": 512, "vocab_size": 1024, "sliding_window": 512,
    }  # fmt: skip
    plan = build_plan(g, resolve_dims(g, "hf", hf, "config.json"), g.quant("bf16"), get_profile("h200"))
    per_key = 2 * 256 * 2  # k and v, kv_dim 256, bf16
    assert runner_bench.kv_bytes_read(plan, 1, 99) == 12 * 100 * per_key
    assert runner_bench.kv_bytes_read(plan, 2, 4095) == 2 * (2 * 4096 + 10 * 512) * per_key
