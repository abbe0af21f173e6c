"""Footprint: the CUDA runner unmaps the weight files once the device holds the weights (fake
driver, no GPU), evict drops a tensor's pages from the resident set, and the sources stay usable."""

from __future__ import annotations

import gc
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import test_plan_runner_fake as base  # noqa: E402
from fixtures.engine_probes import mapped_files  # noqa: E402

from engine import memstat  # noqa: E402
from engine.types import StepItem  # noqa: E402


def _runner(tmp_path, monkeypatch, model_path):
    import engine.runner_cuda as rc
    from engine.model import load_model

    monkeypatch.setattr(rc, "cuda", base.FakeDriver().module())
    model = load_model(model_path)
    runner = rc.CudaRunner(model, num_blocks=64, max_model_len=512, builder=base.fake_builder(tmp_path))
    return model, runner


def _mapped(paths) -> set[str]:
    gc.collect()
    return {str(p) for p in paths} & mapped_files()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_cuda_runner_unmaps_safetensors_after_upload(tmp_path, monkeypatch):
    base.write_tiny_llama(tmp_path / "m")
    files = [p.resolve() for p in (tmp_path / "m").glob("*.safetensors")]
    from engine.model import load_model

    probe = load_model(tmp_path / "m")
    probe.weights.raw(probe.weights.tensor_names()[0])
    assert _mapped(files), "the probe should map the file (the check below would prove nothing)"
    del probe
    model, runner = _runner(tmp_path, monkeypatch, tmp_path / "m")
    assert not _mapped(files), "the weight file is still mapped after the upload"
    assert runner.step([StepItem(0, [1, 2, 3], 0, [0], True, base.GREEDY)]) == [0]
    # closed, not broken: the model's weights can still be read (mapped again on demand)
    name = model.weights.tensor_names()[0]
    assert model.weights.raw(name).nbytes == model.weights.info(name).nbytes


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_cuda_runner_unmaps_gguf_and_keeps_its_metadata(tmp_path, monkeypatch):
    from fixtures.checkpoints import write_llama_gguf

    from engine.tokenizer import load_tokenizer

    path = write_llama_gguf(tmp_path / "m.gguf", quant="q8_0", hidden_size=256, head_dim=64, intermediate_size=512)
    model, _ = _runner(tmp_path, monkeypatch, path)
    assert not _mapped([path.resolve()]), "the GGUF file is still mapped after the upload"
    md = model.weights.metadata
    assert md["llama.block_count"] == 2 and "llama.block_count" in md and len(md) == len(list(md))
    # the vocabulary was never read before the close: it is read from the file again, then let go
    tok = load_tokenizer(model.weights)
    assert tok.vocab_size == len(md["tokenizer.ggml.tokens"]) > 64
    assert not _mapped([path.resolve()])


def _write_big_safetensors(d: Path, nbytes: int) -> Path:
    d.mkdir()
    (d / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [0, nbytes]}}).encode()
    with (d / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.write(np.arange(nbytes // 4, dtype=np.float32).tobytes())
    return d


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_evict_drops_a_tensors_pages_from_the_resident_set(tmp_path):
    from engine.weights import open_weights

    size = 64 << 20
    src = open_weights(_write_big_safetensors(tmp_path / "big", size))
    before = memstat.rss_bytes()
    assert int(src.raw("w")[:: 4096].sum()) >= 0  # touch every page
    touched = memstat.rss_bytes()
    assert touched - before > size // 2
    src.evict("w")
    assert touched - memstat.rss_bytes() > size // 2
    assert src.array("w")[-1] == size // 4 - 1  # still readable after the eviction
    assert memstat.peak_rss_bytes() >= touched


def test_rss_is_reported_by_metrics_and_bench():
    import re

    from engine.bench import memory_row, table
    from engine.server.metrics import Metrics

    text = Metrics().render(None, alive=True, draining=False)
    num = r"([0-9.e+]+)$"  # prometheus_client writes floats (1.2e+08)
    rss = float(re.search(r"^process_resident_memory_bytes " + num, text, re.M).group(1))
    peak = float(re.search(r"^memra_process_peak_resident_bytes " + num, text, re.M).group(1))
    assert 10e6 < rss <= peak  # a Python process with numpy loaded holds more than 10 MB
    row = memory_row("after load")
    assert row["kind"] == "memory" and 10e6 < row["rss_bytes"] <= row["peak_rss_bytes"]
    assert re.fullmatch(r"memory    after load: RSS \d+ MB, peak \d+ MB", table([row]))


class _DeviceMemory:
    """Fake device memory for the fake driver: every allocation a bytearray, htod writes into it."""

    def __init__(self, drv, monkeypatch, rc):
        self.bufs: dict[int, bytearray] = {}
        mod = rc.cuda
        real_alloc = mod.alloc

        def alloc(n):
            b = real_alloc(n)
            self.bufs[b.ptr] = bytearray(b.nbytes)
            return b

        def htod(ptr, host, stream=None):
            data = np.ascontiguousarray(host).view(np.uint8).reshape(-1).tobytes()
            base = max(p for p in self.bufs if p <= ptr)
            self.bufs[base][ptr - base : ptr - base + len(data)] = data

        monkeypatch.setattr(mod, "alloc", alloc)
        monkeypatch.setattr(mod, "htod", htod)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf", "no-ranges", "moe-stacked"])
def test_weights_reach_the_device_byte_exact(tmp_path, monkeypatch, fmt):
    from fixtures.checkpoints import write_llama_gguf, write_qwen3_moe_safetensors

    import engine.runner_cuda as rc
    from engine import quant, storage
    from engine.model import load_model
    from engine.plan import ROPE_FREQ

    monkeypatch.setattr("engine.upload.CHUNK_BYTES", 4096)  # many chunks per tensor, a busy ring
    if fmt == "gguf":
        path = write_llama_gguf(tmp_path / "m.gguf", quant="q8_0", hidden_size=256, head_dim=64, intermediate_size=512)
    elif fmt == "moe-stacked":  # HF per-expert tensors behind a StackedSource: its ranges are the members'
        path = write_qwen3_moe_safetensors(
            tmp_path / "m", seed=3, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=256,
            num_experts=4, num_experts_per_tok=2,
        )
    else:
        base.write_tiny_llama(tmp_path / "m")
        path = tmp_path / "m"
    if fmt == "no-ranges":  # a source that cannot give file ranges (e.g. stacked experts): via numpy
        from engine.weights import SafetensorsSource

        monkeypatch.setattr(SafetensorsSource, "file_ranges", lambda self, name: None)
    drv = base.FakeDriver()
    monkeypatch.setattr(rc, "cuda", drv.module())
    mem = _DeviceMemory(drv, monkeypatch, rc)
    model = load_model(path)
    runner = rc.CudaRunner(model, num_blocks=64, max_model_len=512, builder=base.fake_builder(tmp_path))
    m, checked = model, 0
    if fmt == "moe-stacked":
        from engine.weights.stacked import StackedSource

        assert isinstance(m.weights, StackedSource) and m.weights._stacks
        for name, members in m.weights._stacks.items():  # every stack goes the file path
            assert m.weights.file_ranges(name) == [r for mb in members for r in m.weights.base.file_ranges(mb)]
    for w in runner.plan.weights:
        if w.key == ROPE_FREQ:
            continue
        parts = []
        for part in w.parts:
            if m.graph.tensors[part].kind == "vector":
                parts.append(np.ascontiguousarray(m.dequantize(part, w.layer), dtype=np.float32).view(np.uint8))
            else:
                parts.append(np.asarray(m.weights.raw(m.file_name(part, w.layer))).reshape(-1))
        want = np.concatenate(parts)
        if w.dtype in storage.REPACKED_FROM:
            want = quant.repack(want, w.dtype, w.rows, w.cols)
        got = bytes(mem.bufs[runner._weights[w.key].ptr][: w.nbytes])
        assert got == want.tobytes(), w.key
        checked += 1
    assert checked == len(runner.plan.weights) - sum(w.key == ROPE_FREQ for w in runner.plan.weights)


def test_file_uploader_copies_ranges_through_a_small_ring_and_names_a_short_file(tmp_path, monkeypatch):
    import engine.runner_cuda as rc
    from engine.upload import FileUploader

    drv = base.FakeDriver()
    monkeypatch.setattr(rc, "cuda", drv.module())
    mem = _DeviceMemory(drv, monkeypatch, rc)
    rng = np.random.default_rng(0)
    f = tmp_path / "blob"
    blob = rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    f.write_bytes(blob)
    up = FileUploader(rc.cuda, rc.cuda.Stream(), chunk=777, depth=3)
    ranges = [(0, 100_000), (5, 1), (99_000, 1000), (1234, 40_000)]
    dst = [rc.cuda.alloc(n) for _, n in ranges]
    for d, (off, n) in zip(dst, ranges, strict=True):
        up.add(d.ptr, f, off, n)
    up.finish()
    for d, (off, n) in zip(dst, ranges, strict=True):
        assert bytes(mem.bufs[d.ptr][:n]) == blob[off : off + n]
    up.add(rc.cuda.alloc(10).ptr, f, 99_995, 10)
    with pytest.raises(OSError, match="blob: file ends before byte 100005"):
        up.finish()
