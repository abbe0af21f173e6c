"""CudaRunner's probes (engine/runner_probes.py) on the fake driver of tests/test_plan_runner_fake.py
(no GPU): without MEMRA_TRACE the trace calls are a MemraError naming it; with it, the runner
allocates one trace buffer, writes its address into every loaded module's ``memra_trace_buf`` and
trace_reset writes the empty header. tests/gpu/test_quant_models.py checks the records on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from test_plan_runner_fake import FakeDriver, fake_builder, write_tiny_llama

from engine.runner_probes import TRACE_RECORDS
from engine.types import MemraError


def _runner(tmp_path, monkeypatch, trace: bool):
    import engine.runner_cuda as rc
    from engine.model import load_model

    drv = FakeDriver()
    mod = drv.module()
    symbols: list[tuple[str, int]] = []  # (module label, address of its memra_trace_buf)
    writes: list[tuple[int, list[int]]] = []  # (device address, u64 values) of each htod

    class TracedModule(mod.Module):
        def global_address(self, name):
            assert name == "memra_trace_buf", name
            symbols.append((self.label, 0x1000 * (len(symbols) + 1)))
            return symbols[-1][1], 8

    htod = mod.htod

    def record(ptr, host, stream=None):
        if np.asarray(host).dtype == np.uint64:
            writes.append((ptr, np.asarray(host).tolist()))
        return htod(ptr, host, stream)

    mod.Module, mod.htod = TracedModule, record
    monkeypatch.setattr(rc, "cuda", mod)
    monkeypatch.setenv("MEMRA_TRACE", "1" if trace else "0")
    write_tiny_llama(tmp_path / "m")
    runner = rc.CudaRunner(load_model(tmp_path / "m"), num_blocks=64, max_model_len=512, builder=fake_builder(tmp_path))
    return runner, symbols, writes


def test_without_memra_trace_the_trace_calls_name_it(tmp_path, monkeypatch):
    runner, symbols, _ = _runner(tmp_path, monkeypatch, trace=False)
    assert symbols == [] and runner._trace is None
    for call in (runner.trace_reset, runner.trace_read):
        with pytest.raises(MemraError, match="MEMRA_TRACE=1"):
            call()


def test_with_memra_trace_every_module_points_at_one_buffer(tmp_path, monkeypatch):
    runner, symbols, writes = _runner(tmp_path, monkeypatch, trace=True)
    buf = runner._trace
    assert buf is not None and buf.nbytes == 8 * (8 + 6 * TRACE_RECORDS)
    assert len(symbols) == len(runner._modules) > 1
    pointed = {ptr: vals for ptr, vals in writes if ptr != buf.ptr}
    assert all(pointed[addr] == [buf.ptr] for _, addr in symbols), (symbols, pointed)
    header = [0, TRACE_RECORDS] + [0] * 6
    assert (buf.ptr, header) in writes  # the reset before the kernels run
    writes.clear()
    runner.trace_reset()
    assert writes == [(buf.ptr, header)]
