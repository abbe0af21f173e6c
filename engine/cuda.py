"""The only CUDA driver user: devices, context, memory, streams, events, modules, launches, graphs.

Everything else in memra reaches the GPU through this module, so CI (no GPU, maybe no driver)
imports engine.* freely: ``cuda.bindings.driver`` is imported lazily, and ``detect_devices()``
returns ``[]`` when the driver or a GPU is missing. Every failing driver call raises CudaError
naming the function and the CUresult. Launch arguments are packed once into a reusable buffer
(``KernelArgs``, tinygrad-style ``kernelParams`` = array of pointers into one byte buffer) and
can be updated in place; ``PreparedLaunch`` builds the launch configuration once, optionally with
programmatic dependent launch (PDL, sm_90+), so a launch costs one ``cuLaunchKernelEx`` and no
per-call packing.
Must not import other engine modules except engine.types (for the plain DeviceInfo).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from functools import cache, lru_cache
from typing import Any

import numpy as np

from engine.types import DeviceInfo


class CudaError(RuntimeError):
    """A CUDA driver call failed: ``func`` is the driver function, ``result`` the CUresult name."""

    def __init__(self, func: str, result: str, detail: str = ""):
        super().__init__(f"{func} failed: {result}" + (f" ({detail})" if detail else ""))
        self.func = func
        self.result = result


class CudaUnavailable(CudaError):
    """No usable CUDA driver or GPU on this machine."""


@lru_cache(maxsize=1)
def _driver():
    try:
        from cuda.bindings import driver
    except Exception as exc:  # ImportError, or the bindings failing to load
        raise CudaUnavailable("import cuda.bindings.driver", type(exc).__name__, str(exc)) from exc
    return driver


def _name(result: Any) -> str:
    return getattr(result, "name", None) or str(result)


def _call(func: str, *args: Any) -> Any:
    """Call ``driver.<func>(*args)``; raise CudaError unless CUDA_SUCCESS; return the payload."""
    drv = _driver()
    out = getattr(drv, func)(*args)
    err = out[0]
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaError(func, _name(err))
    if len(out) == 1:
        return None
    return out[1] if len(out) == 2 else out[1:]


def _call_on(stream: Stream | None, func: str, *args: Any) -> Any:
    """``func(*args)``, or its ``...Async`` form queued on ``stream`` when one is given."""
    return _call(func, *args) if stream is None else _call(func + "Async", *args, stream.handle)


_initialised = False


def init() -> None:
    """cuInit(0) once. Raises CudaUnavailable when the driver library or a GPU is missing."""
    global _initialised
    if _initialised:
        return
    try:
        drv = _driver()
        (err,) = drv.cuInit(0)
    except CudaUnavailable:
        raise
    except Exception as exc:  # the driver library itself cannot be found / loaded
        raise CudaUnavailable("cuInit", type(exc).__name__, str(exc)) from exc
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaUnavailable("cuInit", _name(err))
    _initialised = True


def _attr(dev: Any, attr: str) -> int:
    drv = _driver()
    return int(_call("cuDeviceGetAttribute", getattr(drv.CUdevice_attribute, attr), dev))


def device_info(ordinal: int = 0) -> DeviceInfo:
    init()
    dev = _call("cuDeviceGet", ordinal)
    raw = _call("cuDeviceGetName", 256, dev)
    name = bytes(raw).split(b"\x00", 1)[0].decode(errors="replace").strip()
    major = _attr(dev, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR")
    minor = _attr(dev, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR")
    sms = _attr(dev, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")
    total = int(_call("cuDeviceTotalMem", dev))
    return DeviceInfo(name=name, compute_capability=(major, minor), sm_count=sms, total_memory=total)


def detect_devices() -> list[DeviceInfo]:
    """Every visible GPU, or [] when there is no driver, no GPU, or the bindings are missing."""
    try:
        init()
        count = int(_call("cuDeviceGetCount"))
        return [device_info(i) for i in range(count)]
    except CudaError:
        return []


# ---------------------------------------------------------------------------------------------
# context, memory


class Context:
    """The primary context of one device, made current on the calling thread."""

    def __init__(self, ordinal: int = 0):
        init()
        self.ordinal = ordinal
        self.device = _call("cuDeviceGet", ordinal)
        self.handle = _call("cuDevicePrimaryCtxRetain", self.device)
        self.info = device_info(ordinal)
        self.make_current()

    def make_current(self) -> None:
        _call("cuCtxSetCurrent", self.handle)

    def synchronize(self) -> None:
        _call("cuCtxSynchronize")

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes."""
        free, total = _call("cuMemGetInfo")
        return int(free), int(total)

    def close(self) -> None:
        if self.handle is not None:
            try:
                _call("cuCtxSynchronize")
            finally:
                _call("cuDevicePrimaryCtxRelease", self.device)
                self.handle = None


class DeviceBuffer:
    """``nbytes`` of device memory (cuMemAlloc); ``ptr`` is the CUdeviceptr as an int."""

    def __init__(self, nbytes: int):
        self.nbytes = max(int(nbytes), 1)
        self._handle = _call("cuMemAlloc", self.nbytes)
        self.ptr = int(self._handle)

    def free(self) -> None:
        if self._handle is not None:
            _call("cuMemFree", self._handle)
            self._handle = None
            self.ptr = 0

    def __del__(self) -> None:  # best effort; the context may already be gone at exit
        try:
            self.free()
        except Exception:
            pass


alloc = DeviceBuffer  # cuda.alloc(nbytes): ``nbytes`` of device memory


def memset(ptr: int, value: int, nbytes: int, stream: Stream | None = None) -> None:
    """Set ``nbytes`` at ``ptr`` to the byte ``value``."""
    _call_on(stream, "cuMemsetD8", ptr, value & 0xFF, nbytes)


def _host_ptr(arr: np.ndarray) -> int:
    if not arr.flags.c_contiguous:
        raise ValueError("host arrays passed to the device must be C-contiguous")
    return int(arr.ctypes.data)


def htod(ptr: int, host: np.ndarray | bytes | memoryview, stream: Stream | None = None) -> None:
    """Copy a host array/bytes into device memory at ``ptr`` (async on ``stream`` if given:
    the host memory must then stay alive and unchanged until the stream reaches the copy)."""
    arr = np.frombuffer(host, dtype=np.uint8) if isinstance(host, (bytes, memoryview)) else host
    arr = np.ascontiguousarray(arr)
    if arr.nbytes == 0:
        return
    _call_on(stream, "cuMemcpyHtoD", ptr, _host_ptr(arr), arr.nbytes)


def dtoh(host: np.ndarray, ptr: int, stream: Stream | None = None) -> np.ndarray:
    """Copy ``host.nbytes`` from device ``ptr`` into ``host`` (which must be contiguous)."""
    if host.nbytes == 0:
        return host
    _call_on(stream, "cuMemcpyDtoH", _host_ptr(host), ptr, host.nbytes)
    return host


def dtod(dst: int, src: int, nbytes: int, stream: Stream | None = None) -> None:
    _call_on(stream, "cuMemcpyDtoD", dst, src, nbytes)


@cache
def _max_pitch() -> int:
    """The current context's device's largest pitch a 2D copy takes (CU_DEVICE_ATTRIBUTE_MAX_PITCH)."""
    return _attr(_call("cuCtxGetDevice"), "CU_DEVICE_ATTRIBUTE_MAX_PITCH")


@lru_cache(maxsize=8)
def _copy_2d(width: int, rows: int, pitch: int) -> Any:
    drv = _driver()
    c = drv.CUDA_MEMCPY2D()
    c.srcMemoryType = c.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
    c.srcPitch = c.dstPitch = pitch
    c.WidthInBytes, c.Height = width, rows
    return c


def dtod_rows(dst: int, src: int, width: int, rows: int, pitch: int, stream: Stream | None = None) -> None:
    """Copy ``rows`` rows of ``width`` bytes, ``pitch`` bytes apart on both sides, from ``src`` to
    ``dst`` (device to device): one cuMemcpy2D (e.g. one KV block of every layer of a pool), or
    one cuMemcpyDtoD a row where the pitch is past the device's 2D limit."""
    if width > pitch:
        raise ValueError(f"dtod_rows: width {width} > pitch {pitch}")
    if rows > 1 and pitch <= _max_pitch():
        c = _copy_2d(width, rows, pitch)  # (the driver reads it at the call: reused, ~8 us a build)
        c.srcDevice, c.dstDevice = src, dst
        _call_on(stream, "cuMemcpy2D", c)
        return
    for r in range(rows):
        dtod(dst + r * pitch, src + r * pitch, width, stream)


class PinnedBuffer:
    """Page-locked host memory (cuMemHostAlloc) viewed as a numpy array: fast, truly async copies.

    Used for the per-step inputs (token ids, positions, block tables) and the sampled ids, so one
    small H2D and one small D2H per step never go through a staging copy.
    """

    def __init__(self, nbytes: int):
        self.nbytes = max(int(nbytes), 1)
        self.ptr = int(_call("cuMemHostAlloc", self.nbytes, 0))
        raw = (ctypes.c_uint8 * self.nbytes).from_address(self.ptr)
        self.bytes = np.frombuffer(raw, dtype=np.uint8)

    def view(self, dtype: Any, count: int, offset: int = 0) -> np.ndarray:
        itemsize = np.dtype(dtype).itemsize
        if offset + count * itemsize > self.nbytes:
            raise ValueError(f"pinned view of {count} x {dtype} at {offset} exceeds {self.nbytes} bytes")
        return self.bytes[offset : offset + count * itemsize].view(dtype)

    def free(self) -> None:
        if self.ptr:
            self.bytes = np.zeros(0, dtype=np.uint8)
            _call("cuMemFreeHost", self.ptr)
            self.ptr = 0

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------
# streams, events


class Stream:
    def __init__(self) -> None:
        drv = _driver()
        self.handle = _call("cuStreamCreate", drv.CUstream_flags.CU_STREAM_NON_BLOCKING)

    def synchronize(self) -> None:
        _call("cuStreamSynchronize", self.handle)

    def wait(self, event: Event) -> None:
        """Work queued on this stream from now on waits for ``event``'s last record (under stream
        capture: this stream joins the capture, its next nodes depend on the recorded ones)."""
        _call("cuStreamWaitEvent", self.handle, event.handle, 0)

    def destroy(self) -> None:
        if self.handle is not None:
            _call("cuStreamDestroy", self.handle)
            self.handle = None


class Event:
    def __init__(self, timing: bool = True) -> None:
        drv = _driver()
        flags = 0 if timing else drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = _call("cuEventCreate", flags)

    def record(self, stream: Stream) -> None:
        _call("cuEventRecord", self.handle, stream.handle)

    def synchronize(self) -> None:
        _call("cuEventSynchronize", self.handle)

    def elapsed_ms(self, start: Event) -> float:
        """Milliseconds from ``start`` to this event (both recorded, this one synchronised)."""
        return float(_call("cuEventElapsedTime", start.handle, self.handle))

    def destroy(self) -> None:
        if self.handle is not None:
            _call("cuEventDestroy", self.handle)
            self.handle = None


# ---------------------------------------------------------------------------------------------
# modules, kernels, launches

# argument kinds a kernel signature may use -> struct format (native alignment, 8-byte slots)
ARG_FORMATS = {"ptr": "Q", "u64": "Q", "i64": "q", "i32": "i", "u32": "I", "f32": "f"}


class KernelArgs:
    """A kernel's arguments packed once: an 8-byte slot per argument plus the ``void*[]`` that
    ``cuLaunchKernel``'s kernelParams wants. ``set_all(values)`` rewrites the slots in place."""

    def __init__(self, kinds: Sequence[str], values: Sequence[Any] | None = None):
        for k in kinds:
            if k not in ARG_FORMATS:
                raise ValueError(f"unknown kernel argument kind {k!r}; expected one of {sorted(ARG_FORMATS)}")
        self.kinds = tuple(kinds)
        n = max(len(self.kinds), 1)
        self._buf = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(self._buf)
        self._ptrs = (ctypes.c_void_p * n)(*range(base, base + 8 * n, 8))
        self.address = ctypes.addressof(self._ptrs)
        if values is not None:
            self.set_all(values)

    def set_all(self, values: Sequence[Any]) -> None:
        if len(values) != len(self.kinds):
            raise ValueError(f"kernel takes {len(self.kinds)} arguments ({self.kinds}), got {len(values)}")
        if values:  # one pack for all slots: binding a new step shape packs hundreds of these
            ints = [int(v) if f in "Qq" else v for f, v in zip(_slot_formats(self.kinds), values, strict=True)]
            struct.pack_into(_pack_format(self.kinds), self._buf, 0, *ints)


@cache
def _slot_formats(kinds: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(ARG_FORMATS[k] for k in kinds)


@cache
def _pack_format(kinds: tuple[str, ...]) -> str:
    """The struct format of a whole argument block: each value at the start of its 8-byte slot."""
    return "<" + "".join(f + "x" * (8 - struct.calcsize(f)) for f in _slot_formats(kinds))


TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap); its address must be 64-byte aligned


def tensor_map_bf16(ptr: int, rows: int, cols: int, row_bytes: int, box_rows: int) -> bytes:
    """The TMA descriptor (``CUtensorMap``, 128 bytes) of a row-major bf16 matrix of ``rows`` x
    ``cols`` at ``ptr`` (row stride ``row_bytes``), read in boxes of ``box_rows`` x 64 (128 bytes:
    the 128-byte swizzle) and zeros for elements outside the matrix. The bytes go into device
    memory (kernels take a pointer to them); encoding needs the driver but no context."""
    drv = _driver()
    tmap = _call(
        "cuTensorMapEncodeTiled",
        drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        2,
        int(ptr),
        [drv.cuuint64_t(int(cols)), drv.cuuint64_t(int(rows))],
        [drv.cuuint64_t(int(row_bytes))],
        [drv.cuuint32_t(64), drv.cuuint32_t(int(box_rows))],
        [drv.cuuint32_t(1), drv.cuuint32_t(1)],
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    return ctypes.string_at(int(tmap.getPtr()), TENSOR_MAP_BYTES)


class Function:
    """One ``extern "C"`` kernel of a loaded module."""

    def __init__(self, module: Module, name: str):
        self.module = module
        self.name = name
        self.handle = _call("cuModuleGetFunction", module.handle, name.encode())
        self._max_smem = 0
        self._static_smem: int | None = None

    def ensure_smem(self, nbytes: int) -> None:
        """Raise the dynamic shared memory limit when a launch's dynamic plus the kernel's static
        shared memory exceed 48 KiB (the default a launch may use without opting in)."""
        if not nbytes or nbytes <= self._max_smem:
            return
        drv = _driver()
        if self._static_smem is None:
            static = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
            self._static_smem = int(_call("cuFuncGetAttribute", static, self.handle))
        if nbytes + self._static_smem > 48 * 1024:
            attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _call("cuFuncSetAttribute", self.handle, attr, nbytes)
            self._max_smem = nbytes

    def resident_blocks(self, threads: int, smem: int) -> int:
        """Blocks of ``threads`` threads and ``smem`` bytes of dynamic shared memory that one SM
        holds at once (registers, shared memory, thread and block limits of the compiled kernel)."""
        self.ensure_smem(smem)
        return int(_call("cuOccupancyMaxActiveBlocksPerMultiprocessor", self.handle, threads, smem))


class Module:
    """A cubin loaded into the current context (cuModuleLoadData)."""

    def __init__(self, cubin: bytes, label: str = ""):
        self.label = label
        try:
            self.handle = _call("cuModuleLoadData", cubin)
        except CudaError as exc:
            raise CudaError(exc.func, exc.result, f"module {label}") from exc

    def function(self, name: str) -> Function:
        try:
            return Function(self, name)
        except CudaError as exc:
            raise CudaError(exc.func, exc.result, f"kernel {name!r} in module {self.label}") from exc

    def global_address(self, name: str) -> tuple[int, int]:
        """(device address, bytes) of the module's ``__device__`` variable ``name``."""
        ptr, size = _call("cuModuleGetGlobal", self.handle, name.encode())
        return int(ptr), int(size)

    def unload(self) -> None:
        if self.handle is not None:
            _call("cuModuleUnload", self.handle)
            self.handle = None


def _dim3(dims: Sequence[int]) -> tuple[int, int, int]:
    return tuple(int(v) for v in dims) + (1,) * (3 - len(dims))  # type: ignore[return-value]


class PreparedLaunch:
    """One launch of ``fn`` over ``grid`` x ``block`` with ``smem`` dynamic bytes on ``stream``,
    its ``CUlaunchConfig`` built once; ``__call__(args)`` is one ``cuLaunchKernelEx``.

    ``pdl=True`` adds the programmatic-stream-serialization attribute (programmatic dependent
    launch, sm_90+): the kernel may then be launched, and its blocks scheduled, while the previous
    kernel in the stream is still running (once all of that kernel's blocks have called
    ``pdl_trigger()`` or exited). The kernel must call ``pdl_wait()`` (kernels/_common.cuh.j2)
    before it reads anything a previous kernel wrote and before its first global write. Stream
    capture records the attribute as a programmatic edge of the graph (CUDA 12.3+ drivers).
    """

    def __init__(
        self,
        fn: Function,
        grid: Sequence[int],
        block: Sequence[int],
        smem: int = 0,
        stream: Stream | None = None,
        pdl: bool = False,
    ):
        self.fn = fn
        self.grid, self.block = _dim3(grid), _dim3(block)
        self.smem = int(smem)
        self.pdl = bool(pdl)
        if self.smem:
            fn.ensure_smem(self.smem)
        # the CUlaunchConfig: no driver call, so it needs no GPU or context
        drv = _driver()
        self.config = config = drv.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = self.grid
        config.blockDimX, config.blockDimY, config.blockDimZ = self.block
        config.sharedMemBytes = self.smem
        config.hStream = stream.handle if stream is not None else drv.CUstream(0)
        config.numAttrs = 0
        if pdl:
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            config.attrs = [attr]  # copied into the config: set the attribute before assigning it
            config.numAttrs = 1

    def __call__(self, args: KernelArgs) -> None:
        drv = _driver()
        (err,) = drv.cuLaunchKernelEx(self.config, self.fn.handle, args.address, 0)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise CudaError(
                "cuLaunchKernelEx",
                _name(err),
                f"kernel {self.fn.name} grid {self.grid} block {self.block} smem {self.smem}"
                + (" pdl" if self.pdl else ""),
            )


# ---------------------------------------------------------------------------------------------
# graphs


class Graph:
    """An instantiated CUDA graph captured from a stream: ``with capture(stream) as g: ...``."""

    def __init__(self) -> None:
        self.graph = None
        self.exec = None

    def launch(self, stream: Stream) -> None:
        if self.exec is None:
            raise CudaError("cuGraphLaunch", "CUDA_ERROR_INVALID_VALUE", "graph was never instantiated")
        _call("cuGraphLaunch", self.exec, stream.handle)

    def destroy(self) -> None:
        if self.exec is not None:
            _call("cuGraphExecDestroy", self.exec)
            self.exec = None
        if self.graph is not None:
            _call("cuGraphDestroy", self.graph)
            self.graph = None


class capture:
    """Context manager: stream capture (thread-local mode) -> cuGraph -> instantiated Graph."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.graph = Graph()

    def __enter__(self) -> Graph:
        drv = _driver()
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _call("cuStreamBeginCapture", self.stream.handle, mode)
        return self.graph

    def __exit__(self, exc_type, exc, tb) -> None:
        graph = _call("cuStreamEndCapture", self.stream.handle)
        if exc_type is not None:
            if graph is not None:
                _call("cuGraphDestroy", graph)
            return
        self.graph.graph = graph
        self.graph.exec = _call("cuGraphInstantiate", graph, 0)


class profiler_range:
    """Context manager: cuProfilerStart / cuProfilerStop around the block, so a profiler started
    with its collection off (``ncu --profile-from-start off``) sees only the launches inside."""

    def __enter__(self) -> None:
        _call("cuProfilerStart")

    def __exit__(self, exc_type, exc, tb) -> None:
        _call("cuProfilerStop")
