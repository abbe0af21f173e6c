"""CudaRunner's measurement probes: the block timeline trace of kernels built with MEMRA_TRACE=1
(``trace_reset`` / ``trace_read``: tools/gpu_trace_decode.py) and the device's copy bandwidth
(``copy_bandwidth_gbs``: the roofline denominator `memra bench` reports). Serving uses neither.
``RunnerProbes`` is a CudaRunner base class; driver calls go through the ``engine.cuda`` module
CudaRunner passes in (tests put a fake driver there). Must not import cuda-python.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine import env
from engine.types import MemraError

TRACE_RECORDS = 1 << 22  # block records the MEMRA_TRACE buffer holds (192 MB, allocated only under MEMRA_TRACE)


class RunnerProbes:
    """The probes of CudaRunner (engine.runner_cuda); see the module docstring."""

    def _init_probes(self, cuda: Any, modules: list[Any]) -> None:
        """Keep the driver module; with MEMRA_TRACE=1 (kernels built with the block timeline trace,
        engine.render) allocate the trace buffer and point every module's memra_trace_buf at it."""
        self._probe_cuda = cuda
        self._trace: Any = None  # cuda.DeviceBuffer
        if env.MEMRA_TRACE.get():
            self._trace = cuda.alloc(8 * (8 + 6 * TRACE_RECORDS))
            self.trace_reset()
            for mod in modules:
                addr, _ = mod.global_address("memra_trace_buf")
                cuda.htod(addr, np.array([self._trace.ptr], dtype=np.uint64))

    def _trace_buffer(self) -> Any:
        """The trace buffer, once both streams are idle (MEMRA_TRACE=1 builds only)."""
        if self._trace is None:
            raise MemraError("the kernels were not built with MEMRA_TRACE=1", code="invalid_request")
        self.stream.synchronize()
        self._side.synchronize()
        return self._trace

    def trace_reset(self) -> None:
        """Empty the block timeline trace."""
        self._probe_cuda.htod(self._trace_buffer().ptr, np.array([0, TRACE_RECORDS] + [0] * 6, dtype=np.uint64))

    def trace_read(self) -> np.ndarray:
        """The block records written since trace_reset: u64 [n, 6] = (smid << 32 | entry tag, block,
        start, pdl_wait return, mark, end), times in ns (kernels/_common.cuh.j2)."""
        cuda, buf = self._probe_cuda, self._trace_buffer()
        head = cuda.dtoh(np.empty(8, dtype=np.uint64), buf.ptr)
        n = int(min(head[0], TRACE_RECORDS))
        recs = np.empty((n, 6), dtype=np.uint64)
        if n:
            cuda.dtoh(recs, buf.ptr + 64)
        return recs

    def copy_bandwidth_gbs(self, nbytes: int = 1 << 30, repeats: int = 5) -> float:
        """The device's memory bandwidth as a device-to-device copy of ``nbytes`` measures it: bytes
        read + written / time, GB/s, the median of ``repeats`` copies after one warm-up, on this
        runner's stream (the issue's roofline denominator; `memra bench` reports both it and the
        profile's number). The size shrinks to an eighth of free memory where that is less, but not
        below 256 MiB, so the copy stays several times the L2."""
        cuda = self._probe_cuda
        free, _ = self.ctx.mem_info()
        nbytes = max(min(nbytes, free // 8) // 4096 * 4096, 256 << 20)
        src, dst = cuda.alloc(nbytes), cuda.alloc(nbytes)
        start, end = cuda.Event(), cuda.Event()
        try:
            cuda.dtod(dst.ptr, src.ptr, nbytes, self.stream)
            times = []
            for _ in range(repeats):
                start.record(self.stream)
                cuda.dtod(dst.ptr, src.ptr, nbytes, self.stream)
                end.record(self.stream)
                end.synchronize()
                times.append(end.elapsed_ms(start) / 1e3)
        finally:
            self.stream.synchronize()
            start.destroy()
            end.destroy()
            src.free()
            dst.free()
        return 2 * nbytes / sorted(times)[len(times) // 2] / 1e9
