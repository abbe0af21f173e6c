"""The only module that loads NCCL: version, communicators, all-reduce, send and recv over ctypes.

libnccl comes from the ``nvidia-nccl-cu13`` wheel (memra's optional ``multigpu`` extra), found
through cuda.pathfinder as engine.nvrtc finds its CUDA headers, else from the system loader path
(``libnccl.so.2``). Importing this module needs neither NCCL nor a GPU; the first call that needs
the library raises NcclUnavailable, naming the extra to install, when it cannot be loaded. NVLink
multicast (NVLS) stays off: ``NCCL_NVLS_ENABLE=0`` is set before the library loads, overriding
the environment (NVLS reserves memory and its buffer registration does not survive memra's
graph-captured decode).

Pointers and streams are plain ints (device addresses, ``CUstream`` handles from engine.cuda), so
this module imports no cuda-python binding and no other engine module; every NCCL failure is an
NcclError with NCCL's own message. Calls issued between ``group_start()`` and ``group_end()``
(several devices driven from one thread) are launched together, as NCCL requires.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

# ncclDataType_t and ncclRedOp_t (nccl.h)
DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
          "f16": 6, "f32": 7, "f64": 8, "bf16": 9}
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
INSTALL_HINT = "install memra's multigpu extra (pip install 'memra[multigpu]', the nvidia-nccl-cu13 wheel)"


class NcclUnavailable(RuntimeError):
    """libnccl cannot be found or loaded on this machine."""


class NcclError(RuntimeError):
    """An NCCL call returned an error; the message is NCCL's."""


def _find() -> str:
    try:
        import cuda.pathfinder as pathfinder

        return pathfinder.load_nvidia_dynamic_lib("nccl").abs_path
    except Exception:
        return "libnccl.so.2"  # a system NCCL on the loader path


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The loaded libnccl with its prototypes declared; raises NcclUnavailable."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    path = _find()
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise NcclUnavailable(f"NCCL could not be loaded ({path}: {exc}); {INSTALL_HINT}") from None
    p, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    protos = {
        "ncclGetVersion": [ctypes.POINTER(i)],
        "ncclCommInitAll": [ctypes.POINTER(p), i, ctypes.POINTER(i)],
        "ncclCommDestroy": [p],
        "ncclAllReduce": [p, p, sz, i, i, p, p],
        "ncclSend": [p, sz, i, i, p, p],
        "ncclRecv": [p, sz, i, i, p, p],
        "ncclGroupStart": [],
        "ncclGroupEnd": [],
    }
    for name, args in protos.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        msg = library().ncclGetErrorString(result)
        raise NcclError(f"{what} failed: {msg.decode() if msg else result} (ncclResult_t {result})")


def version() -> tuple[int, int, int]:
    """NCCL (major, minor, patch) of the loaded library (needs no GPU)."""
    v = ctypes.c_int()
    _check(library().ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
    code = v.value
    return code // 10000, code % 10000 // 100, code % 100


def _dtype(dtype: str) -> int:
    if dtype not in DTYPES:
        raise ValueError(f"NCCL dtype {dtype!r}; known: {', '.join(DTYPES)}")
    return DTYPES[dtype]


class Communicator:
    """One rank's ncclComm_t; make them with ``init_all`` (every device of this process at once)."""

    def __init__(self, handle: int, rank: int, nranks: int):
        self.handle, self.rank, self.nranks = handle, rank, nranks

    @classmethod
    def init_all(cls, devices: list[int]) -> list[Communicator]:
        """ncclCommInitAll: one communicator per device of ``devices``, rank = position."""
        n = len(devices)
        comms = (ctypes.c_void_p * n)()
        devs = (ctypes.c_int * n)(*devices)
        _check(library().ncclCommInitAll(comms, n, devs), "ncclCommInitAll")
        return [cls(int(comms[r] or 0), r, n) for r in range(n)]

    def all_reduce(self, send: int, recv: int, count: int, dtype: str, stream: int, op: str = "sum") -> None:
        """recv = op over every rank's send (``count`` elements; send == recv is in place)."""
        _check(
            library().ncclAllReduce(send, recv, count, _dtype(dtype), OPS[op], self.handle, stream), "ncclAllReduce"
        )

    def send(self, buf: int, count: int, dtype: str, peer: int, stream: int) -> None:
        _check(library().ncclSend(buf, count, _dtype(dtype), peer, self.handle, stream), "ncclSend")

    def recv(self, buf: int, count: int, dtype: str, peer: int, stream: int) -> None:
        _check(library().ncclRecv(buf, count, _dtype(dtype), peer, self.handle, stream), "ncclRecv")

    def destroy(self) -> None:
        if self.handle:
            _check(library().ncclCommDestroy(self.handle), "ncclCommDestroy")
            self.handle = 0


def group_start() -> None:
    _check(library().ncclGroupStart(), "ncclGroupStart")


def group_end() -> None:
    _check(library().ncclGroupEnd(), "ncclGroupEnd")


__all__ = [
    "Communicator", "NcclError", "NcclUnavailable", "group_end", "group_start", "library", "version",
]
