"""Kernel-level GPU checks on memra's own driver module: device arrays, compiled kernels launched by
their catalog contract, random weights of every storage type with their numpy dequantisation.

Everything goes through ``engine.cuda`` (no torch, no direct cuda-python). A kernel's arguments are
given by name and ordered by its ``KernelChoice.args``, so a new argument fails loudly (KeyError)
instead of shifting the others. Outputs are poisoned with NaN before a launch; ``rel_err`` is
||out - ref|| / ||ref|| in float64.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fixtures.quant_blocks import F16_FIELDS  # the f16 scale / min fields of each block type

from engine import cuda, quant, storage
from engine import kernel_catalog as kc
from engine.compile import KernelBuilder
from engine.kcache import KernelCache

BF16_NAN = 0x7FC0


def to_bf16(x) -> np.ndarray:
    """float -> bf16 bits (uint16), round to nearest even (NaN stays NaN)."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(BF16_NAN), r)


def from_bf16(h: np.ndarray) -> np.ndarray:
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf_round(x) -> np.ndarray:
    """x rounded to bf16, as float64."""
    return from_bf16(to_bf16(x)).astype(np.float64)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(np.nan_to_num(out) - ref) / max(np.linalg.norm(ref), 1e-30))


def needs_sm90(device) -> None:
    """Skip unless the device is sm_90 (Hopper: wgmma, TMA, bulk copies)."""
    major, minor = device.compute_capability
    if major != 9:
        pytest.skip(f"needs an sm_90 GPU, this one is sm_{major}{minor}")


class DeviceArray:
    """A device buffer holding a row-major array of ``dtype`` (bf16, f32, i32, i64, u8)."""

    HOST = {"bf16": np.uint16, "f32": np.float32, "i32": np.int32, "i64": np.int64, "u8": np.uint8}

    def __init__(self, shape, dtype: str):
        self.shape, self.dtype = tuple(int(s) for s in shape), dtype
        self.nbytes = int(np.prod(self.shape)) * np.dtype(self.HOST[dtype]).itemsize
        self.buf = cuda.alloc(self.nbytes)
        self.ptr = self.buf.ptr

    def at(self, elems: int) -> int:
        """The device address ``elems`` elements in (a column offset into a strided row)."""
        return self.ptr + int(elems) * np.dtype(self.HOST[self.dtype]).itemsize

    def put(self, host) -> DeviceArray:
        h = to_bf16(host) if self.dtype == "bf16" else np.ascontiguousarray(host, dtype=self.HOST[self.dtype])
        assert h.nbytes == self.nbytes, (h.shape, self.shape)
        cuda.htod(self.ptr, h)
        return self

    def get(self) -> np.ndarray:
        """The contents: float64 for bf16 / f32, the integer dtype otherwise."""
        h = cuda.dtoh(np.empty(self.shape, dtype=self.HOST[self.dtype]), self.ptr)
        if self.dtype == "bf16":
            return from_bf16(h).astype(np.float64)
        return h.astype(np.float64) if self.dtype == "f32" else h


def upload(host, dtype: str) -> DeviceArray:
    return DeviceArray(np.shape(host), dtype).put(host)


def poisoned(shape, dtype: str = "bf16") -> DeviceArray:
    """An array full of NaN (bf16 / f32) or -1 (integers): unwritten elements show."""
    fill = np.full(shape, np.nan, np.float32) if dtype in ("bf16", "f32") else np.full(shape, -1)
    return DeviceArray(shape, dtype).put(fill)


class Kernels:
    """Specs compiled through the cubin cache for one arch, loaded once, launched by argument name."""

    def __init__(self, ctx: cuda.Context, arch: str, cache_dir: Path):
        self.ctx = ctx
        self.builder = KernelBuilder(arch, cache=KernelCache(cache_dir), no_compile=False)
        self._fns: dict = {}
        self._mods: list = []

    def prebuild(self, specs) -> None:
        """Compile ``specs`` in parallel up front (the launches then hit the cache)."""
        self.builder.build_all(list(specs), progress=None)

    def function(self, spec) -> cuda.Function:
        if spec not in self._fns:
            mod = cuda.Module(self.builder.get(spec).cubin, spec.entry)
            self._mods.append(mod)
            self._fns[spec] = mod.function(spec.entry)
        return self._fns[spec]

    def launch(self, c: kc.KernelChoice, grid_rows: int, /, grid_kw: dict | None = None, **args) -> None:
        """Launch ``c`` over the grid of ``grid_rows`` rows (``grid_kw``: the grid's runtime values);
        ``args`` by the contract's names (DeviceArray, address or number; every one is needed, 0 for
        an unused pointer)."""
        missing = [name for name, _ in c.args if name not in args]
        extra = set(args) - {name for name, _ in c.args}
        assert not missing and not extra, (c.spec.entry, missing, extra)
        vals = [args[name].ptr if isinstance(args[name], DeviceArray) else args[name] for name, _ in c.args]
        packed = cuda.KernelArgs([kind for _, kind in c.args], vals)
        cuda.PreparedLaunch(self.function(c.spec), c.grid(grid_rows, **(grid_kw or {})), c.block, c.smem)(packed)
        self.ctx.synchronize()  # a fault shows at its launch, not at a later copy


# ---- random weights of every storage type -----------------------------------------------------

def random_weight(qt: str, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(raw uint8 bytes [n, row_bytes] in device storage type ``qt``, its dequantisation f64 [n, k]):
    random blocks with sane f16 scales, dequantised by engine.quant (the reference); a repacked
    device layout (q8_0r ...) is the file type's weight repacked as at upload."""
    if qt in storage.REPACKED_FROM:
        raw, deq = random_weight(storage.REPACKED_FROM[qt], n, k, rng)
        return quant.repack(raw, qt, n, k).reshape(n, -1), deq
    if qt in ("bf16", "f16", "f32"):
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        raw = {"bf16": to_bf16(w), "f16": w.astype(np.float16), "f32": w}[qt]
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
        return raw, quant.dequantize(raw.reshape(-1), qt, (n, k)).astype(np.float64)
    elems, nbytes = storage.BLOCK_SIZES[qt]
    nb = n * k // elems
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    scale = 0.002 if qt.endswith("_k") else 0.01
    for off in F16_FIELDS[qt]:
        raw[:, off : off + 2] = (rng.uniform(0.2, 1.0, nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)
    deq = quant.dequantize(raw.reshape(-1), qt, (n, k)).astype(np.float64)
    return raw.reshape(n, -1), deq


def uploaded_weights(seed: int):
    """``get(qt, n, k)`` -> (device bytes, dequantised f64) of a random weight (random_weight), made
    once per (type, n, k) (dequantising is the slow part): a module-scoped fixture returns it."""
    cache: dict = {}
    rng = np.random.default_rng(seed)

    def get(qt: str, n: int, k: int):
        if (qt, n, k) not in cache:
            raw, deq = random_weight(qt, n, k, rng)
            cache[qt, n, k] = (upload(raw, "u8"), deq)
        return cache[qt, n, k]

    return get


def gemv_rows_bits(kernels: Kernels, spec, w, x: DeviceArray, res: np.ndarray, per_row: bool) -> np.ndarray:
    """The output bits [rows, n] of the gemv ``spec`` over x's rows: one launch of all of them, or
    one launch per row (the batch-1 reference); l2-prefetch args get any bytes (the weight's)."""
    p = spec.params
    rows, n, k, od = x.shape[0], p["n"], p["k"], p["out_dtype"]
    out = DeviceArray((rows, n), od).put(res if p["residual"] else np.full((rows, n), np.nan, np.float32))
    c = kc.choice("gemv", **p)
    extra = {name: w.ptr for name, _ in c.args if name.startswith("pf")}
    for r0, nr in [(r, 1) for r in range(rows)] if per_row else [(0, rows)]:
        o = out.at(r0 * n)
        kernels.launch(c, nr, out=o, w=w, x=x.at(r0 * k), residual=o if p["residual"] else 0, rows=nr, **extra)
    return cuda.dtoh(np.empty(out.shape, dtype=np.uint32 if od == "f32" else np.uint16), out.ptr)
