"""engine.cuda without a GPU: detection degrades to [], launch arguments pack once and update in place."""

from __future__ import annotations

import ctypes
import struct

import pytest

from engine import cuda


def test_detect_devices_returns_a_list_without_raising():
    devices = cuda.detect_devices()
    assert isinstance(devices, list)
    for d in devices:  # on a GPU machine: plain DeviceInfo values
        assert d.name and d.compute_capability[0] >= 5 and d.total_memory > 0


def test_kernel_args_pack_every_kind_into_8_byte_slots():
    args = cuda.KernelArgs(["ptr", "i32", "f32", "u32", "i64"], [0xDEADBEEF00, -7, 1.5, 3, -(2**40)])
    # kernelParams: args.address points at an array of pointers, one per argument slot
    ptrs = (ctypes.c_void_p * 5).from_address(args.address)
    assert [ptrs[i + 1] - ptrs[i] for i in range(4)] == [8] * 4
    slots = [struct.unpack(f, ctypes.string_at(ptrs[i], 8))[0] for i, f in enumerate(["<Q", "<i4x", "<f4x", "<I4x", "<q"])]
    assert slots == [0xDEADBEEF00, -7, 1.5, 3, -(2**40)]


def test_kernel_args_update_in_place_keeps_the_same_addresses():
    args = cuda.KernelArgs(["ptr", "i32"], [1, 2])
    before = args.address
    slot = (ctypes.c_void_p * 2).from_address(args.address)[1]
    args.set_all([1, 99])
    assert args.address == before
    assert struct.unpack("<i", ctypes.string_at(slot, 4))[0] == 99


def test_kernel_args_reject_unknown_kinds_and_wrong_counts():
    with pytest.raises(ValueError, match="unknown kernel argument kind"):
        cuda.KernelArgs(["float64"])
    with pytest.raises(ValueError, match="takes 2 arguments"):
        cuda.KernelArgs(["ptr", "i32"], [1])


def test_cuda_error_names_function_and_result():
    err = cuda.CudaError("cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY", "arena")
    assert "cuMemAlloc" in str(err) and "CUDA_ERROR_OUT_OF_MEMORY" in str(err)
    assert err.func == "cuMemAlloc" and err.result == "CUDA_ERROR_OUT_OF_MEMORY"
