"""Programmatic dependent launch on a real GPU (skipped without an sm_90+ one): a chain of kernels
launched with PreparedLaunch(pdl=True), eagerly and replayed from a CUDA graph, stays exact."""

from __future__ import annotations

import numpy as np
import pytest

from engine import cuda, paths

_devices = cuda.detect_devices()
pytestmark = pytest.mark.skipif(
    not _devices or _devices[0].compute_capability < (9, 0), reason="no sm_90+ CUDA GPU"
)

_KERNEL = r"""
extern "C" __global__ void pdl_step(float* out, const float* in, int n) {
    pdl_wait(); pdl_trigger();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (blockIdx.x == 0) __nanosleep(20000);  // a late block: a kernel that ran ahead would read stale data
    if (i < n) out[i] = in[n - 1 - i] + 1.0f;  // reads other blocks' outputs of the previous kernel
}
"""


@pytest.mark.parametrize("graph", [False, True])
def test_a_pdl_chain_is_exact(graph):
    from engine import nvrtc

    ctx = cuda.Context(0)
    src = (paths.kernels_dir() / "_common.cuh.j2").read_text() + _KERNEL
    cubin, _ = nvrtc.compile_to_cubin(src, "pdl_step", "sm_90a")
    mod = cuda.Module(cubin, "pdl_step")
    n, steps = 1 << 18, 64
    a, b = cuda.alloc(4 * n), cuda.alloc(4 * n)
    stream = cuda.Stream()
    x0 = (np.arange(n) % 7).astype(np.float32)
    fwd = cuda.KernelArgs(["ptr", "ptr", "i32"], [b.ptr, a.ptr, n])
    back = cuda.KernelArgs(["ptr", "ptr", "i32"], [a.ptr, b.ptr, n])
    step = cuda.PreparedLaunch(mod.function("pdl_step"), ((n + 255) // 256,), (256,), 0, stream, pdl=True)

    def run():
        for k in range(steps):
            step(fwd if k % 2 == 0 else back)

    try:
        cuda.htod(a.ptr, x0)
        if graph:
            with cuda.capture(stream) as g:
                run()
            g.launch(stream)
        else:
            run()
        stream.synchronize()
        out = cuda.dtoh(np.empty(n, np.float32), a.ptr)  # an even number of steps ends in a
        expect = x0.copy()
        for _ in range(steps):
            expect = expect[::-1] + 1.0
        np.testing.assert_array_equal(out, expect)
        if graph:
            g.destroy()
    finally:
        a.free()
        b.free()
        stream.destroy()
        mod.unload()
        ctx.close()
