"""CudaRunner's host logic on a fake driver (no GPU): binding, buckets, padding, graph reuse, inputs."""

from __future__ import annotations

import dataclasses
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from engine import cuda as real_cuda
from engine.compile import KernelBuilder
from engine.kcache import KernelCache
from engine.types import SamplingParams, StepItem

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
from test_runner_cuda import write_tiny_llama  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


class FakeDriver:
    """Just enough of engine.cuda: allocations get distinct fake addresses, launches are recorded."""

    def __init__(self):
        self.next_ptr = 1 << 32
        self.launches: list[tuple[str, tuple, tuple]] = []
        self.graph_launches = 0
        self.captures = 0
        self.capturing = False
        self.h2d: list[int] = []  # bytes of each direct host-to-device copy
        self.h2d_graph: list[int] = []  # ... of each one captured into a graph
        self.pdl: dict[str, bool] = {}  # kernel name -> launched with programmatic dependent launch
        self.tensor_maps: list[
            tuple
        ] = []  # (ptr, rows, cols, row_bytes, box_rows) of each TMA descriptor built
        self.sm_count = 132
        self.resident = 4  # blocks per SM the occupancy query reports
        self.occupancy: list[tuple[str, int, int]] = []  # (kernel, threads, smem) of each query
        self.streams = 0
        # ("launch", stream id, kernel) and ("wait", waiting stream id, recording stream id), in order
        self.order: list[tuple] = []
        self.row_copies: list[tuple] = []  # (dst, src, width, rows, pitch, on a stream) of each dtod_rows

    def reset(self) -> None:
        """Forget what was recorded so far: a test calls it after building the runner, whose
        construction already captures the warm-prefix tail graphs (engine.runner_warm.capture_prefill_tail)."""
        self.launches.clear()
        self.h2d.clear()
        self.h2d_graph.clear()
        self.order.clear()
        self.graph_launches = self.captures = 0

    def module(self):
        fake = self
        m = types.SimpleNamespace(KernelArgs=real_cuda.KernelArgs, CudaError=real_cuda.CudaError)

        class Buf:
            def __init__(self, n):
                self.nbytes = max(int(n), 1)
                self.ptr = fake.next_ptr
                fake.next_ptr += (self.nbytes + 255) // 256 * 256

            def free(self):
                pass

        class Ctx:
            def __init__(self, ordinal=0):
                self.info = real_cuda.DeviceInfo("NVIDIA H200", (9, 0), fake.sm_count, 141 << 30)

            def mem_info(self):
                return (100 << 30, 141 << 30)

            def make_current(self):  # (the engine loop steps from its own thread)
                pass

            def synchronize(self):
                pass

        class Stream:
            def __init__(self):
                self.id = fake.streams
                fake.streams += 1

            def synchronize(self):
                pass

            def wait(self, event):
                fake.order.append(("wait", self.id, event.stream))

        class Event:
            def __init__(self, timing=True):
                self.stream = None

            def record(self, stream):
                self.stream = stream.id

            def synchronize(self):
                pass

            def destroy(self):
                pass

        class Fn:
            def __init__(self, name):
                self.name = name

            def resident_blocks(self, threads, smem):
                fake.occupancy.append((self.name, threads, smem))
                return fake.resident

        class Mod:
            def __init__(self, cubin, label=""):
                self.label = label

            def function(self, name):
                return Fn(name)

            def unload(self):
                pass

        class Graph:
            def launch(self, stream):
                fake.graph_launches += 1

            def destroy(self):
                pass

        class Capture:
            def __init__(self, stream):
                pass

            def __enter__(self):
                fake.captures += 1
                fake.capturing = True
                return Graph()

            def __exit__(self, *exc):
                fake.capturing = False

        class Pinned:
            def __init__(self, n):
                self.nbytes = n
                self.bytes = np.zeros(n, np.uint8)

            def view(self, dtype, count, offset=0):
                return self.bytes[offset : offset + count * np.dtype(dtype).itemsize].view(dtype)

            def free(self):
                pass

        def launch(fn, grid, block, args, smem=0, stream=None):
            grid = tuple(grid) + (1,) * (3 - len(grid))
            assert all(isinstance(g, int) and g >= 1 for g in grid), (fn.name, grid)
            fake.launches.append((fn.name, grid, tuple(block)))

        m.Context, m.Stream, m.Module, m.capture, m.PinnedBuffer = Ctx, Stream, Mod, Capture, Pinned
        m.Event = Event

        class Prepared:
            def __init__(self, fn, grid, block, smem=0, stream=None, pdl=False):
                self.fn, self.grid, self.block, self.smem, self.pdl = fn, grid, block, smem, pdl
                self.stream = stream.id if stream is not None else None

            def __call__(self, args):
                fake.pdl[self.fn.name] = self.pdl
                fake.order.append(("launch", self.stream, self.fn.name))
                launch(self.fn, self.grid, self.block, args, self.smem)

        m.alloc = Buf
        m.launch = launch
        m.PreparedLaunch = Prepared
        m.memset = lambda *a, **k: None
        m.htod = lambda ptr, host, stream=None: (fake.h2d_graph if fake.capturing else fake.h2d).append(
            np.asarray(host).nbytes
        )
        m.dtoh = lambda host, ptr, stream=None: host
        m.dtod = lambda *a, **k: None
        m.dtod_rows = lambda dst, src, width, rows, pitch, stream=None: fake.row_copies.append(
            (dst, src, width, rows, pitch, stream is not None)
        )
        m.TENSOR_MAP_BYTES = real_cuda.TENSOR_MAP_BYTES
        m.tensor_map_bf16 = lambda ptr, rows, cols, row_bytes, box_rows: (
            fake.tensor_maps.append((ptr, rows, cols, row_bytes, box_rows))
            or bytes(real_cuda.TENSOR_MAP_BYTES)
        )
        m.DeviceBuffer = Buf
        m.Graph = Graph
        m.Function = Fn
        return m


def fake_builder(tmp_path) -> KernelBuilder:
    """A kernel builder for sm_90a whose compiler returns a placeholder cubin (the fake driver
    never loads it)."""
    return KernelBuilder(
        "sm_90a", KernelCache(tmp_path / "cache"), compiler=lambda *a: (b"\0cubin", ""), compiler_version=(13, 0)
    )


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    import engine.runner_cuda as rc
    from engine.model import load_model

    drv = FakeDriver()
    monkeypatch.setattr(rc, "cuda", drv.module())
    write_tiny_llama(tmp_path / "m")
    builder = fake_builder(tmp_path)
    runner = rc.CudaRunner(load_model(tmp_path / "m"), num_blocks=64, max_model_len=512, builder=builder)
    drv.reset()
    return runner, drv


def test_prefill_runs_layers_then_head_at_one_row(fake):
    runner, drv = fake
    out = runner.step([StepItem(0, list(range(1, 21)), 0, [0, 1], True, GREEDY)])
    assert out == [0]  # the fake D2H leaves the pinned out_ids at 0
    names = [n for n, _, _ in drv.launches]
    assert names[0].startswith("embed") and names[-1].startswith("argmax")
    assert drv.launches[0][1] == (20, 1, 1)  # embed: one block per token
    assert drv.launches[-1][1] == (1, 1, 1)  # the head samples the last row only
    assert any(n.startswith("gemm") for n in names) and drv.graph_launches == 0


def test_decode_pads_to_the_bucket_and_replays_one_graph(fake):
    runner, drv = fake
    items = [StepItem(i, [5], 3 + i, [2 * i, 2 * i + 1], True, GREEDY) for i in range(3)]
    runner.step(items)
    runner.step(items)
    assert drv.captures == 1 and drv.graph_launches == 2  # bucket 4 captured once, replayed
    assert runner._views["slots"][:4].tolist() == [
        0 * 16 + 3,
        2 * 16 + 4,
        4 * 16 + 5,
        runner._sink_block * 16,
    ]
    tables = runner._tables[: 4 * runner._table_ld].reshape(4, -1)
    assert tables[1, :2].tolist() == [2, 3] and (tables[3] == runner._sink_block).all()
    grids = {n: g for n, g, _ in drv.launches if n.startswith("attention__")}
    assert all(g[0] == 4 for g in grids.values())


def test_eager_decode_issues_the_same_launches_as_the_graph(fake):
    runner, drv = fake
    items = [StepItem(0, [5], 7, [0], True, GREEDY)]
    runner.step(items)  # captures bucket 1: one warm run + the captured run
    graph_run = list(drv.launches)
    drv.launches.clear()
    runner.use_graphs = False
    runner.step(items)
    assert drv.launches == graph_run[: len(drv.launches)] and len(graph_run) == 2 * len(drv.launches)
    assert any("bmax1" in n for n, _, _ in drv.launches)  # batch 1 uses the batch-1 GEMV


def test_sampled_rows_use_the_sample_kernel_and_one_small_upload(fake):
    runner, drv = fake
    drv.h2d.clear()
    hot = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    runner.step([StepItem(0, [5], 7, [0], True, hot)])
    assert any(n.startswith("sample") for n, _, _ in drv.launches)
    # building the graph: one upload for the warm run and the same one captured into the graph
    assert len(drv.h2d) == 1 and drv.h2d_graph == drv.h2d and drv.h2d[0] < 64 * 1024
    assert runner._views["temperature"][0] == pytest.approx(0.8) and runner._views["seeds"][0] == 3
    drv.h2d.clear()
    runner.step([StepItem(0, [6], 8, [0], True, hot)])
    assert drv.h2d == [] and len(drv.h2d_graph) == 1  # replays copy the inputs themselves


def test_decode_inputs_stay_exact_across_steps_that_change_rows(fake):
    """The decode step rewrites only what changed (block-table rows past their last length, the
    sampling fields of a row whose params object changed): whatever the order of steps (longer
    then shorter tables, a used row turned padding, a prefill in between, other sampling params),
    the pinned inputs equal a from-scratch fill."""
    runner, _ = fake
    ld, sink = runner._table_ld, runner._sink_block
    hot = SamplingParams(temperature=0.7, top_k=5, seed=9, presence_penalty=0.0)

    def check(items):
        bucket = runner._bucket_of[len(items)]
        want = np.full((bucket, ld), sink, np.int32)
        for r, it in enumerate(items):
            want[r, : len(it.block_table)] = it.block_table
        got = runner._tables[: bucket * ld].reshape(bucket, ld)
        assert np.array_equal(got, want)
        v = runner._views
        for r in range(bucket):
            s = items[r].sampling if r < len(items) else SamplingParams(temperature=0.0)
            assert v["temperature"][r] == pytest.approx(s.temperature) and v["top_k"][r] == s.top_k
            assert v["seeds"][r] == (s.seed or 0 if r < len(items) else 0)
            assert v["counters"][r] == (items[r].num_generated if r < len(items) else 0)

    steps = [
        [StepItem(0, [5], 40, [1, 2, 3], True, hot), StepItem(1, [6], 20, [4, 5], True, GREEDY)],
        [StepItem(1, [6], 21, [4, 5], True, GREEDY), StepItem(2, [7], 3, [9], True, hot)],
        [StepItem(2, [7], 4, [9], True, hot)],
        [StepItem(i, [5], 9, [20 + i, 30 + i], True, hot if i % 2 else GREEDY) for i in range(4)],
        [StepItem(i, [5], 10, [20 + i, 30 + i], True, GREEDY) for i in range(3)],  # row 3 now padding
    ]
    for items in steps:
        runner.step(items)
        check(items)
    runner.step([StepItem(3, list(range(1, 30)), 0, [10, 11], True, hot)])  # a prefill pass between
    items = [StepItem(2, [7], 5, [9], True, GREEDY), StepItem(0, [5], 41, [1, 2, 3], True, hot)]
    runner.step(items)
    check(items)
    items = [dataclasses.replace(items[0], num_generated=4), items[1]]
    runner.step(items)
    check(items)


def test_context_overflow_is_a_clear_error(fake):
    from engine.types import MemraError

    runner, _ = fake
    with pytest.raises(MemraError, match="601 tokens exceed the maximum context length") as ei:
        runner.step([StepItem(0, [1], 600, list(range(40)), True, GREEDY)])
    assert ei.value.code == "context_length_exceeded"


def test_penalised_rows_run_the_penalties_kernel_with_uploaded_entries(fake):
    runner, drv = fake
    drv.h2d.clear()
    pen = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5)
    hist = [5, 9, 9, 4, 9]  # prompt 5 9 9, generated 4 9
    items = [
        StepItem(0, [9], 5, [0], True, pen, history=hist, prompt_len=3, num_generated=2),
        StepItem(1, [3], 8, [1], True, GREEDY, history=[3] * 9, prompt_len=8, num_generated=1),
    ]
    runner.step(items)
    names = [n for n, _, _ in drv.launches]
    assert any(n.startswith("penalties") for n in names) and any(n.startswith("sample") for n in names)
    assert not any(n.startswith("argmax") for n in names)
    assert len(drv.h2d) == 2  # the row inputs, then the entries (header + 3 tokens x 3 int32)
    assert drv.h2d[1] == (4 + 3 * 3) * 4
    ent = runner._pen[4 : 4 + 9].reshape(3, 3)
    assert runner._pen[0] == 3
    assert ent.tolist() == [[0, 4, 2 * 1 + 1], [0, 5, 1], [0, 9, 2 * 1 + 1]]
    assert runner._views["repetition"][:2].tolist() == pytest.approx([1.3, 1.0])
    assert runner._views["counters"].dtype == np.int32  # the sample kernel reads int32 counters


def test_prefill_items_pack_into_passes_by_chunk(fake):
    runner, _ = fake
    chunk = runner.profile.prefill_chunk_tokens
    mk = lambda i, n: StepItem(i, [1] * n, 0, list(range(64)), True, GREEDY)  # noqa: E731
    items = [mk(0, 10), mk(1, chunk + 5), mk(2, 7)]
    runner._varlen = True
    passes = runner._prefill_passes(items)
    spans = [[(idx, lo, hi) for idx, _, lo, hi in p] for p in passes]
    assert spans == [[(0, 0, 10), (1, 0, chunk - 10)], [(1, chunk - 10, chunk + 5), (2, 0, 7)]]
    runner._varlen = False  # a plan without varlen prefill attention: one sequence per pass
    spans = [[(idx, lo, hi) for idx, _, lo, hi in p] for p in runner._prefill_passes(items)]
    assert spans == [[(0, 0, 10)], [(1, 0, chunk)], [(1, chunk, chunk + 5)], [(2, 0, 7)]]


def test_a_varlen_pass_sets_seq_starts_and_samples_every_finished_sequence(fake):
    runner, drv = fake
    runner._varlen = True
    items = [
        StepItem(0, list(range(1, 11)), 0, [0], True, GREEDY),
        StepItem(1, list(range(1, 6)), 16, [1, 2], False, GREEDY),  # a middle chunk: no sample
        StepItem(2, list(range(1, 8)), 0, [3], True, GREEDY),
    ]
    out = runner.step(items)
    assert out == [0, None, 0]
    assert runner._views["seq_starts"][:4].tolist() == [0, 10, 15, 22]
    assert runner._views["positions"][10:15].tolist() == [16, 17, 18, 19, 20]
    assert runner._views["slots"][10:15].tolist() == [2 * 16 + i for i in range(5)]
    assert drv.launches[0][1] == (22, 1, 1)  # embed over every row of the pass
    assert drv.launches[-1][1] == (2, 1, 1)  # the head samples the two finished sequences


def test_wide_buckets_replay_the_gemm_graph_and_small_ones_the_gemv(fake):
    runner, drv = fake
    assert runner.plan.wide_rows == 16
    items = [StepItem(i, [5], 3, [i], True, GREEDY) for i in range(12)]  # bucket 16
    runner.use_graphs = False
    runner.step(items)
    names = {n.split("__")[0] for n, _, _ in drv.launches}
    assert "gemm" in names and "rmsnorm" in names
    drv.launches.clear()
    runner.step(items[:5])  # bucket 8: the GEMV
    assert not any(n.startswith("gemm") for n, _, _ in drv.launches)


def test_launches_use_pdl_on_sm90_except_kernels_that_do_not_wait(fake, monkeypatch):
    runner, drv = fake
    assert runner._pdl  # the h200 profile on a cc 9.0 device
    runner.step([StepItem(0, list(range(1, 21)), 0, [0, 1], True, GREEDY)])
    runner.step([StepItem(0, [5], 20, [0, 1], True, GREEDY)])
    assert drv.pdl and any(drv.pdl.values())
    for name, pdl in drv.pdl.items():
        assert pdl == next(s for s in runner._fns if s.entry == name).pdl, name
        assert pdl, name  # every template's spec says it waits first (tests/test_pdl.py)


def test_memra_pdl_0_launches_plainly(tmp_path, monkeypatch):
    import engine.runner_cuda as rc
    from engine.model import load_model

    drv = FakeDriver()
    monkeypatch.setattr(rc, "cuda", drv.module())
    monkeypatch.setenv("MEMRA_PDL", "0")
    write_tiny_llama(tmp_path / "m")
    builder = fake_builder(tmp_path)
    runner = rc.CudaRunner(load_model(tmp_path / "m"), num_blocks=64, max_model_len=512, builder=builder)
    drv.reset()
    runner.step([StepItem(0, [5, 6, 7], 0, [0], True, GREEDY)])
    assert not runner._pdl and drv.pdl and not any(drv.pdl.values())


def test_short_decode_binds_the_fused_rope_attention_and_long_decode_the_rope_kernel(fake):
    """h200 profile (fuse_rope, fuse_glu): a decode pass below split_kv_tokens launches no rope and
    no silu_mul kernel (the direct attention rotates q/k, the gate|up GEMV stores silu(g) * u); a
    pass past it launches the rope kernel and the split attention + combine, still without silu_mul."""
    runner, drv = fake
    assert runner.plan.short_context == 256
    runner.step([StepItem(0, [5], 7, [0], True, GREEDY)])
    short = [n for n, _, _ in drv.launches]
    assert not any(n.startswith(("rope__", "silu_mul__")) for n in short)
    att = [n for n in short if n.startswith("attention__")]
    assert att and all("direct1" in n and "rope_dim" in n for n in att)
    assert any("glu" in n for n in short if n.startswith("gemv__"))
    drv.launches.clear()
    runner.step([StepItem(0, [5], 300, list(range(20)), True, GREEDY)])
    long = [n for n, _, _ in drv.launches]
    assert any(n.startswith("rope__") for n in long) and any(n.startswith("attention_combine") for n in long)
    assert not any(n.startswith("attention__") and "rope_dim" in n for n in long)
    assert not any(n.startswith("silu_mul__") for n in long)


def test_decode_profile_labels_follow_the_runner_bind_order(fake):
    """tools/gpu_decode_profile.py names each bound launch of a pass; it must walk the plan in
    CudaRunner._bind_pass order (its per-kernel table zips the two)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from gpu_decode_profile import pass_labels, pass_weight_bytes

    runner, _ = fake
    for mode, rows, short, verify in (("decode", 4, True, True), ("decode", 16, False, False)):
        # (4 rows: a pass of Plan.b1_rows rows where the plan has it; 16: the bucket's launches)
        bound = runner._bind_pass(mode, rows, rows, False, "greedy", short, verify=verify)
        labels = pass_labels(runner, mode, short, "greedy", verify, rows=rows)
        assert [lb.split(":", 1)[1] for lb in labels] == [b.fn.name for b in bound]
        assert len(pass_weight_bytes(runner, mode, short, "greedy", verify, rows=rows)) == len(labels)
    for short in (True, False):
        bound = runner._bind_pass("decode1", 1, 1, False, "greedy", short)
        labels = pass_labels(runner, "decode1", short, "greedy")
        assert len(labels) == len(bound)
        assert [lb.split(":", 1)[1] for lb in labels] == [b.fn.name for b in bound]
        nbytes = pass_weight_bytes(runner, "decode1", short, "greedy")
        assert len(nbytes) == len(labels)
        head = [n for lb, n in zip(labels, nbytes, strict=True) if lb.startswith("head:")]
        lm = {w.key: w.nbytes for w in runner.plan.weights}.get("lm_head")
        assert head and head[0] == (lm or {w.key: w.nbytes for w in runner.plan.weights}["embed"])


def test_bf16_prefill_binds_the_wgmma_gemm_with_tensor_maps_built_once(fake):
    """The h200 plan's bf16 prefill linears are gemm_wgmma launches; their A / W tensor maps are
    encoded once per (value or weight, box rows) and reused by later passes; a value's map spans
    its whole arena buffer (max_tokens rows), a weight's its rows."""
    runner, drv = fake
    runner.step([StepItem(0, list(range(1, 21)), 0, [0, 1], True, GREEDY)])
    names = [n for n, _, _ in drv.launches]
    assert any(n.startswith("gemm_wgmma") for n in names)
    built = list(drv.tensor_maps)
    assert built and len(set(built)) == len(built)
    runner.step([StepItem(1, list(range(1, 9)), 0, [2], True, GREEDY)])
    assert drv.tensor_maps == built  # the second pass binds the same maps
    weights = {runner._weights[w.key].ptr: w for w in runner.plan.weights if w.key in runner._weights}
    for ptr, rows, cols, row_bytes, _box in built:
        if ptr in weights:
            assert (rows, cols, row_bytes) == (weights[ptr].rows, weights[ptr].cols, 2 * weights[ptr].cols)
        else:
            assert rows == runner.plan.max_tokens and row_bytes % 16 == 0 and cols % 64 == 0


def test_q4_1_gguf_uploads_row_planar_and_decodes_batch_1_without_norm_launches(tmp_path, monkeypatch):
    """A llama q4_1 GGUF on the h200 profile: the runner repacks every matrix to q4_1r at upload (the
    16-byte padded pitch of k = 576: its byte count checked against the plan), a short batch-1 decode
    runs no rmsnorm / silu_mul kernel (q8x_fuse: the q8x GEMVs normalise while staging x; the final
    norm is in the lm_head). A batch-3 decode (bucket 4) runs the same layer launches (decode_graph.b1_rows:
    the bmax-1 GEMVs, a grid row per row) and the bucket's head (its rmsnorm, then the bmax-8 GEMV);
    with b1_rows off it runs the bucket's rmsnorm / silu_mul kernels and bmax-8 GEMVs throughout."""
    from fixtures.checkpoints import Dims, write_random_gguf

    import engine.runner_cuda as rc
    from engine.model import load_model
    from engine.profile import with_tuning

    drv = FakeDriver()
    monkeypatch.setattr(rc, "cuda", drv.module())
    dims = Dims(576, 2, 9, 3, 64, 1536, 512, tie_word_embeddings=True)
    path = write_random_gguf(tmp_path / "tiny_q4_1.gguf", "llama", dims, "q4_1", seed=5)
    builder = fake_builder(tmp_path)
    runner = rc.CudaRunner(load_model(path), num_blocks=64, max_model_len=512, builder=builder)
    assert {w.dtype for w in runner.plan.weights if w.rows > 1} == {"q4_1r"}
    assert sum(drv.h2d) >= sum(w.nbytes for w in runner.plan.weights)
    drv.reset()
    runner.step([StepItem(0, [5], 7, [0], True, GREEDY)])
    one = [n for n, _, _ in drv.launches]
    gemvs = [n for n in one if n.startswith("gemv__")]
    assert gemvs and all("q41r" in n and "q8x1" in n for n in gemvs)  # the lm_head (tied embedding) too
    assert not any(n.startswith(("rmsnorm__", "silu_mul__")) for n in one)
    drv.launches.clear()
    rows3 = [StepItem(i, [5], 7, [2 * i], True, GREEDY) for i in range(3)]
    assert runner.plan.b1_rows >= 4
    runner.step(rows3)
    three = [n for n, _, _ in drv.launches]
    gemvs3 = [n for n in three if n.startswith("gemv__")]
    head = "_n512_"  # (the tied head: vocab 512 rows)
    assert {n for n in gemvs3 if head not in n} == {n for n in gemvs if head not in n}  # the layers: batch 1's
    assert all("_bmax8_" in n for n in gemvs3 if head in n) and all("_bmax1_" in n for n in gemvs if head in n)
    assert "_bmax8_" in gemvs3[-1] and [n for n in three if n.startswith("rmsnorm__")] and "silu_mul__" not in " ".join(three)
    off = rc.CudaRunner(load_model(path), profile=with_tuning(runner.profile, "decode_graph.b1_rows=0"), num_blocks=64,
                        max_model_len=512, builder=builder)  # fmt: skip
    assert off.plan.b1_rows == 0
    drv.launches.clear()
    off.step(rows3)
    wide = [n for n, _, _ in drv.launches]
    assert any(n.startswith("rmsnorm__") for n in wide) and any(n.startswith("silu_mul__") for n in wide)
    assert all("_bmax8_" in n for n in wide if n.startswith("gemv__"))


@pytest.mark.parametrize("on", [False, True])
def test_resident_grid_fits_capped_gemv_grids_to_the_blocks_that_fit(tmp_path, monkeypatch, on):
    """gemv_coop.q8x_resident_grid: the plan marks the capped q8x GEMV launches fit_grid, and the
    runner binds them with grid.x = min(the plan's grid, resident blocks per SM (the driver's
    occupancy query, once per kernel) x SMs); other launches, and every launch without the knob,
    keep the plan's grid (but the mma bucket GEMVs, always fitted)."""
    from fixtures.checkpoints import Dims, write_random_gguf

    import engine.runner_cuda as rc
    from engine.model import load_model
    from engine.profile import get_profile, with_tuning

    drv = FakeDriver()
    drv.sm_count, drv.resident = 2, 3
    monkeypatch.setattr(rc, "cuda", drv.module())
    dims = Dims(576, 2, 9, 3, 64, 1536, 512, tie_word_embeddings=True)
    path = write_random_gguf(tmp_path / "tiny_q4_1.gguf", "llama", dims, "q4_1", seed=5)
    builder = fake_builder(tmp_path)
    prof = with_tuning(get_profile("h200"), f"gemv_coop.q8x_resident_grid={'true' if on else 'false'}")
    runner = rc.CudaRunner(load_model(path), prof, num_blocks=64, max_model_len=512, builder=builder)
    drv.reset()
    launches = {la.spec.entry: la for st in runner.plan.steps for la in st.launches["decode1"]}
    fit = {e for e, la in launches.items() if la.fit_grid}
    assert bool(fit) is on and all(launches[e].spec.params["grid_cap"] for e in fit)
    assert all(  # (the mma bucket GEMVs of gemv_mmq.min_rows rows and more: always)
        la.fit_grid == bool((on or la.spec.params["mma"]) and la.spec.params.get("grid_cap"))
        for st in runner.plan.steps
        for m in ("decode1", "decode")
        for la in st.launches[m]
        if la.spec.template == "gemv"
    )
    seen = 0
    for rows, mode in ((1, "decode1"), (13, "decode")):  # bucket 16 at bmax 8: two row groups (grid.y 2)
        launches = {la.spec.entry: la for st in runner.plan.steps for la in st.launches[mode]}
        drv.launches.clear()
        runner.step([StepItem(i, [5], 7, [2 * i], True, GREEDY) for i in range(rows)])
        bucket = runner._bucket_of[rows]
        for name, grid, _ in drv.launches:
            la = launches.get(name)
            if la is None:
                continue
            want = la.grid_for({"n": bucket})
            if la.fit_grid:  # the resident blocks (3 per SM x 2 SMs), shared by grid.y's row groups
                want = (min(want[0], max(1, 6 // math.prod(want[1:]))), *want[1:])
                seen += want[0] < la.grid_for({"n": bucket})[0]
            assert grid[: len(want)] == want, (name, grid, want)
    assert (seen > 0) is on
    assert len({n for n, _, _ in drv.occupancy}) == len(drv.occupancy)  # one query per kernel


def _q4_k_m_fake(tmp_path, monkeypatch, tune: str):
    """A CudaRunner on the fake driver over a tiny Qwen3 q4_k_m GGUF (q6_k v in layer 0, so q|k
    and v are separate allocations), the h200 profile with MEMRA_TUNE-style ``tune``: (runner,
    driver, dims)."""
    from fixtures.checkpoints import Dims, write_random_gguf

    import engine.runner_cuda as rc
    from engine.model import load_model
    from engine.profile import get_profile, with_tuning

    drv = FakeDriver()
    monkeypatch.setattr(rc, "cuda", drv.module())
    dims = Dims(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        vocab_size=512,
    )
    model = load_model(write_random_gguf(tmp_path / "m.gguf", "qwen3", dims, "q4_k_m", seed=3))
    prof = with_tuning(get_profile("h200"), tune)
    runner = rc.CudaRunner(model, prof, num_blocks=64, max_model_len=512, builder=fake_builder(tmp_path))
    drv.reset()
    return runner, drv, dims


def test_forked_launches_run_on_a_side_stream_between_fork_and_join(tmp_path, monkeypatch):
    """decode_graph.fork_linears on a q4_k_m file (v stored as q6_k apart from q|k): in every decode
    pass, graph and eager, the side stream waits for the main one right before the q|k GEMV, runs the
    v GEMV, and the main stream waits for it before its next launch; nothing else leaves the main
    stream."""
    runner, drv, dims = _q4_k_m_fake(tmp_path, monkeypatch, "decode_graph.pair_linears=false; decode_graph.fork_linears=true")
    main, side = runner.stream.id, runner._side.id
    for graphs in (True, False):
        runner.use_graphs = graphs
        drv.order.clear()
        runner.step([StepItem(0, [5], 7, [0], True, GREEDY)])
        order = drv.order
        sides = [i for i, o in enumerate(order) if o[0] == "launch" and o[1] == side]
        assert len(sides) == (2 if graphs else 1) * dims.num_hidden_layers  # graphs: warm + captured run
        for i in sides:
            assert order[i][2].startswith("gemv__") and "n128_" in order[i][2]  # v: 2 kv heads x 64
            assert order[i - 2] == ("wait", side, main)  # forked before the q|k GEMV ...
            assert order[i - 1][:2] == ("launch", main) and "n384_" in order[i - 1][2]  # (4 + 2) x 64
            assert order[i + 1] == ("wait", main, side)  # ... joined before the next launch
            assert order[i + 2][:2] == ("launch", main)
        assert all(o[1] == main for i, o in enumerate(order) if o[0] == "launch" and i not in sides)


def test_paired_linears_launch_one_gemv_pair_per_layer_at_batch_1(tmp_path, monkeypatch):
    """decode_graph.pair_linears on a q4_k_m file: a batch-1 decode pass, graph and eager, launches
    one gemv_pair kernel per layer on the main stream with PDL (its entry waits first), its grid the
    two parts' blocks, and nothing on the side stream; a batch-2 pass runs the same pair a grid row
    per row (decode_graph.b1_rows: the tiny model's matrices are small), or with b1_rows off keeps
    the bucket's forked v GEMV."""
    tune = "decode_graph.fork_linears=true; decode_graph.pair_linears=true"
    off, drv, _ = _q4_k_m_fake(tmp_path, monkeypatch, tune + "; decode_graph.b1_rows=0")
    assert off.plan.b1_rows == 0
    two = [StepItem(0, [6], 8, [0], True, GREEDY), StepItem(1, [5], 3, [1], True, GREEDY)]
    off.step(two)
    assert any(o[0] == "launch" and o[1] == off._side.id for o in drv.order)
    runner, drv, dims = _q4_k_m_fake(tmp_path, monkeypatch, tune)
    assert runner.plan.b1_rows >= 2
    side = runner._side.id
    pair = next(la for st in runner.plan.steps for la in st.launches["decode1"] if la.spec.template == "gemv_pair")
    for graphs in (True, False):
        runner.use_graphs = graphs
        drv.order.clear()
        drv.launches.clear()
        runner.step([StepItem(0, [5], 7, [0], True, GREEDY)])
        pairs = [(g, b) for n, g, b in drv.launches if n.startswith("gemv_pair__")]
        assert len(pairs) == (2 if graphs else 1) * dims.num_hidden_layers  # graphs: warm + captured run
        want = pair.spec.params["blocks_a"] + pair.spec.params["blocks_b"]
        assert all(g == (want, 1, 1) and b == pair.block for g, b in pairs)
        assert not any(o[0] == "launch" and o[1] == side for o in drv.order)
    assert drv.pdl[pair.spec.entry] is True
    drv.order.clear()
    drv.launches.clear()
    runner.step(two)
    assert not any(o[0] == "launch" and o[1] == side for o in drv.order)
    pairs = [(g, b) for n, g, b in drv.launches if n.startswith("gemv_pair__")]
    assert pairs and all(g == (want, 2, 1) and b == pair.block for g, b in pairs)
