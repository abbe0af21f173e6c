"""Copy weight bytes from their files to device buffers without mapping them: reader threads fill a
ring of pinned staging buffers with ``os.preadv`` (the kernel copies from the page cache, no page
faults, no resident file pages) while the stream copies the filled ones to the device.

A ``FileUploader`` is used once, by CudaRunner, at load: ``add(dst_ptr, path, offset, nbytes)`` per
file range, then ``finish()``, which returns once every byte is on the device and frees the staging
memory. Must not import cuda-python (it goes through engine.cuda, passed in as ``cuda``).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

CHUNK_BYTES = 32 << 20  # one staging buffer
DEPTH = 4  # staging buffers (and reader threads): reads of the next chunks overlap a copy


class FileUploader:
    """File ranges to device memory through ``depth`` pinned buffers of ``chunk`` bytes."""

    def __init__(self, cuda: Any, stream: Any, chunk: int | None = None, depth: int | None = None):
        self.cuda, self.stream = cuda, stream
        self.chunk, self.depth = chunk or CHUNK_BYTES, depth or DEPTH
        self._jobs: list[tuple[int, Path, int, int]] = []  # (dst, file, offset, nbytes) per chunk
        self.bytes = 0

    def add(self, dst: int, path: Path, offset: int, nbytes: int) -> None:
        """Queue ``nbytes`` of ``path`` from ``offset`` for device address ``dst``."""
        for at in range(0, nbytes, self.chunk):
            self._jobs.append((dst + at, path, offset + at, min(self.chunk, nbytes - at)))
        self.bytes += nbytes

    def finish(self) -> None:
        """Run every queued copy; returns when all are on the device. Raises OSError naming the file
        if one is shorter than a range (a truncated checkpoint)."""
        if not self._jobs:
            return
        cuda, jobs = self.cuda, self._jobs
        depth = min(self.depth, len(jobs))
        size = min(self.chunk, max(n for *_, n in jobs))
        bufs = [cuda.PinnedBuffer(size) for _ in range(depth)]
        done = [cuda.Event(timing=False) for _ in range(depth)]
        fds: dict[Path, int] = {}
        reads: dict[int, Future] = {}
        issued = 0

        def read(j: int) -> None:
            _, path, off, n = jobs[j]
            view = bufs[j % depth].bytes[:n]
            got = 0
            while got < n:  # preadv may return short counts
                k = os.preadv(fds[path], [view[got:]], off + got)
                if k == 0:
                    raise OSError(f"{path}: file ends before byte {off + n} (truncated?)")
                got += k

        def issue_through(j: int) -> None:  # queue the copies of chunks issued..j, in order
            nonlocal issued
            while issued <= j:
                reads.pop(issued).result()
                dst, _, _, n = jobs[issued]
                b = issued % depth
                cuda.htod(dst, bufs[b].bytes[:n], self.stream)
                done[b].record(self.stream)
                issued += 1

        try:
            for _, path, _, _ in jobs:
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
            with ThreadPoolExecutor(depth, thread_name_prefix="memra-upload") as pool:
                for j in range(len(jobs)):
                    if j >= depth:  # buffer j % depth held chunk j - depth: its copy must be done
                        issue_through(j - depth)
                        done[j % depth].synchronize()
                    reads[j] = pool.submit(read, j)
                issue_through(len(jobs) - 1)
            self.stream.synchronize()
        finally:
            self.stream.synchronize()  # no queued copy may read a buffer freed below
            for fd in fds.values():
                os.close(fd)
            for f in reads.values():  # a failed run: let the reads end before freeing their buffers
                f.exception()
            for buf in bufs:
                buf.free()
            for ev in done:
                ev.destroy()
            self._jobs = []
