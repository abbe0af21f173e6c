"""CudaRunner's weights on the device: each plan weight uploaded once at load. A weight stored as
the device reads it goes straight from its file through engine.upload (pinned staging, parallel
reads, no mapping); a vector (to f32) or a repacked layout (engine.quant) goes through numpy, and its
file pages are evicted right after, so the host's peak resident set stays near one weight.
``WeightLoading`` is a base class of CudaRunner (engine.runner_cuda), which passes in the
engine.cuda module it drives; must not import CUDA (neither cuda-python nor engine.cuda).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from engine import quant, storage
from engine.ir import ROPE_FREQ
from engine.progress import bar
from engine.types import MemraError
from engine.upload import FileUploader

log = logging.getLogger("memra.runner_cuda")


class WeightLoading:
    """The weight upload of CudaRunner (engine.runner_cuda); see the module docstring."""

    def _upload_weights(self, cuda: Any) -> None:
        m = self.model
        self._weights: dict[str, Any] = {}  # key -> cuda.DeviceBuffer
        files = FileUploader(cuda, self.stream)
        for w in bar(self.plan.weights, "memra: loading weights", unit="tensor"):
            if w.key == ROPE_FREQ:
                self._weights[w.key] = self._upload_array(cuda, self._rope_freq_factors())
                continue
            ranges = self._file_ranges(w)
            if ranges is not None:
                _check_size(m, w, sum(n for *_, n in ranges))
                buf = self._weights[w.key] = cuda.alloc(w.nbytes)
                at = 0
                for path, off, n in ranges:
                    files.add(buf.ptr + at, path, off, n)
                    at += n
                continue
            chunks = []
            for part in w.parts:
                spec = m.graph.tensors[part]
                if spec.kind == "vector":  # f32, plus a norm's offset (WeightPlan.offset: Gemma's 1 + w)
                    vec = np.asarray(m.dequantize(part, w.layer), dtype=np.float32)
                    if w.offset:
                        vec = np.float32(w.offset) + vec
                    chunks.append(np.ascontiguousarray(vec, dtype=np.float32).view(np.uint8))
                    continue
                info = m.info(part, w.layer)
                if info.dtype != storage.REPACKED_FROM.get(w.dtype, w.dtype):
                    raise MemraError(
                        f"{m.path}: tensor {m.file_name(part, w.layer)} is {info.dtype} but the plan expects "
                        f"{w.dtype}",
                        code="invalid_model",
                    )
                chunks.append(np.asarray(m.weights.raw(m.file_name(part, w.layer))).reshape(-1))
            data = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
            if w.dtype in storage.REPACKED_FROM:  # a device layout the plan chose (e.g. q8_0r)
                data = quant.repack(data, w.dtype, w.rows, w.cols)
            _check_size(m, w, data.nbytes)
            buf = cuda.alloc(w.nbytes)
            cuda.htod(buf.ptr, np.ascontiguousarray(data))  # synchronous: the source is read
            self._weights[w.key] = buf
            del chunks, data
            for part in w.parts:  # its file pages leave the resident set (peak RSS ~ one weight)
                m.weights.evict(m.file_name(part, w.layer))
        files.finish()
        log.info("weights: %.2f GB read from the files, %d tensors", files.bytes / 1e9, len(self._weights))

    def _upload_array(self, cuda: Any, data: np.ndarray) -> Any:
        data = np.ascontiguousarray(data)
        buf = cuda.alloc(data.nbytes)
        cuda.htod(buf.ptr, data)
        return buf

    def _file_ranges(self, w: Any) -> list[tuple[Any, int, int]] | None:
        """The file byte ranges that are weight ``w``'s device bytes, in order; None when it needs
        host work (a vector to f32, a repacked layout) or the source cannot give ranges."""
        m = self.model
        if w.dtype in storage.REPACKED_FROM or any(m.graph.tensors[p].kind == "vector" for p in w.parts):
            return None
        ranges = []
        for part in w.parts:
            info = m.info(part, w.layer)
            if info.dtype != w.dtype:
                raise MemraError(
                    f"{m.path}: tensor {m.file_name(part, w.layer)} is {info.dtype} but the plan "
                    f"expects {w.dtype}",
                    code="invalid_model",
                )
            got = m.weights.file_ranges(m.file_name(part, w.layer))
            if got is None:
                return None
            ranges += got
        return ranges


def _check_size(m: Any, w: Any, nbytes: int) -> None:
    if nbytes != w.nbytes:
        raise MemraError(f"{m.path}: weight {w.key} has {nbytes} bytes, the plan expects {w.nbytes}", code="invalid_model")
