"""The block timeline trace (MEMRA_TRACE=1) without a GPU: every kernel's source gets the trace
scope and still waits first, traced kernels compile, and tools/gpu_trace_decode.py splits records
into the pass's launches."""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from fixtures.pdl import waits_first
from test_kernels_compile import _nvrtc_ok
from test_pdl import _specs

from engine.render import TRACE_SCOPE, render, trace_tag

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import gpu_trace_decode  # noqa: E402


def test_traced_source_opens_every_kernel_with_the_scope_and_still_waits_first(monkeypatch):
    specs = _specs()
    plain = {s.entry: render(s) for s in specs}
    monkeypatch.setenv("MEMRA_TRACE", "1")
    for s in specs:
        src = render(s)
        assert src.startswith("#define MEMRA_TRACE 1\n") and src != plain[s.entry]
        body = src[src.index(f"{s.entry}(") :]
        first = body[body.index("{") + 1 :].lstrip()
        assert first.startswith(f"{TRACE_SCOPE}(0x{zlib.crc32(s.entry.encode()):08x}u);"), s.entry
        assert trace_tag(s.entry) == zlib.crc32(s.entry.encode())
        assert waits_first(src, s.entry), f"{s.entry}: the trace scope hides its pdl_wait() contract"
    monkeypatch.delenv("MEMRA_TRACE")
    assert all(render(s) == plain[s.entry] for s in specs)  # off again: the plain source, same cache key


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or CUDA headers not available")
def test_traced_kernels_compile_for_sm90(monkeypatch):
    """One traced spec per template (the coop GEMV with its bulk-copied tile, whose mark is the
    tile's arrival, among them) compiles for sm_90a."""
    from engine import nvrtc

    monkeypatch.setenv("MEMRA_TRACE", "1")
    by_template = {}
    for s in _specs():
        if s.template not in by_template or s.params.get("wsm"):
            by_template[s.template] = s
    assert by_template["gemv"].params.get("wsm")
    for s in by_template.values():
        cubin, _ = nvrtc.compile_to_cubin(render(s), s.entry, "sm_90a", s.options)
        assert b"memra_trace_buf" in cubin, s.entry  # the global the runner points at its buffer


def _records(blocks: list[tuple[str, int, int]], t0: int = 1000) -> np.ndarray:
    """Records of launches (entry, blocks, wait time) in the trace layout, shuffled."""
    rows = []
    for entry, n, wait in blocks:
        for b in range(n):
            rows.append([(3 << 32) | trace_tag(entry), b, t0, wait, 0, wait + 500])
    recs = np.array(rows, dtype=np.uint64)
    return recs[np.random.default_rng(0).permutation(len(recs))]


def test_split_launches_orders_an_entrys_launches_by_their_wait():
    pass_ = [("a", 2), ("b", 3), ("a", 2)]
    recs = _records([("a", 2, 2000), ("b", 3, 3000), ("a", 2, 4000), ("a", 2, 6000), ("b", 3, 7000), ("a", 2, 8000)])
    parts = gpu_trace_decode.split_launches(recs, pass_, 2)
    assert isinstance(parts, list) and [len(p) for p in parts] == [2, 3, 2, 2, 3, 2]
    waits = [sorted({int(w) for w in p[:, 3]}) for p in parts]
    assert waits == [[2000], [3000], [4000], [6000], [7000], [8000]]
    rows = gpu_trace_decode.launch_rows(parts[3:], ["x:a", "x:b", "x:a"], [False, False, False], t0=5000)
    assert [r["gap"] for r in rows] == [None, 0.5, 0.5]  # each wait 0.5 us after the last end before it
    assert [r["body"] for r in rows] == [0.5, 0.5, 0.5] and rows[0]["sms"] == 1


def test_split_launches_names_missing_and_left_over_records():
    recs = _records([("a", 2, 2000), ("b", 3, 3000)])
    assert "b: 3 records" in gpu_trace_decode.split_launches(recs, [("a", 2), ("b", 4)], 1)
    assert "left over" in gpu_trace_decode.split_launches(recs, [("a", 2), ("b", 2)], 1)
