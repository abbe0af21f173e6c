"""CudaRunner: executes a Plan on one GPU over a paged bf16 KV cache; decode is CUDA-graph replay.

Weights are uploaded as the plan says; one activation arena holds every plan buffer for the largest
step and the KV cache takes ``profile.kv_memory_fraction`` of the memory left. A step runs its
prefill items eagerly (a prefix hit's tail replays a graph captured ahead: engine.runner_warm), then the decode rows
through the graph of the smallest batch bucket that holds them (padded rows write to a sink
block); logit bias, constraint masks and logprobs are computed on the device where the buffers
hold them, else on the host (docs/cuda-runtime.md, "engine/runner_cuda.py").
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine import cuda, env
from engine.compile import KernelBuilder
from engine.ir import ACT_ITEMSIZE, MASKED, PENALTY_CAPACITY, Launch, Plan, kernel_specs
from engine.logit_prep import PrepBlock
from engine.plan import build_plan
from engine.profile import DeviceProfile, arch_number, select
from engine.runner_kv import KvPools
from engine.runner_overlap import OverlapLaunch
from engine.runner_probes import RunnerProbes
from engine.runner_state import StateSlots, state_inputs
from engine.runner_steps import _CLEARED, StepLogic, _decode_mode  # noqa: F401  (tools import _decode_mode here)
from engine.runner_tail import has_tail_attention
from engine.runner_tap import HiddenRows
from engine.runner_weights import WeightLoading
from engine.types import ConfigError, StepItem
from engine.weight_memory import check_fits, plan_weight_bytes

log = logging.getLogger("memra.runner_cuda")

# the packed input block, in order: (name, dtype, rows: "token" (a prefill pass's rows), "row" (a
# decode row / prefill sequence) or "row+1" (sequence boundaries)); block tables come last so a
# step uploads one contiguous prefix; the penalty entries follow them and are uploaded only when used
TMAPS_PER_POOL = 256  # TMA descriptors per device allocation (128 bytes each)
_ROW_INPUTS = (
    ("tokens", np.int32, "token"),
    ("positions", np.int32, "token"),
    ("slots", np.int32, "token"),
    ("seq_starts", np.int32, "row+1"),
    ("temperature", np.float32, "row"),
    ("top_p", np.float32, "row"),
    ("top_k", np.int32, "row"),
    ("min_p", np.float32, "row"),
    ("seeds", np.uint64, "row"),
    ("counters", np.int32, "row"),
    ("presence", np.float32, "row"),
    ("frequency", np.float32, "row"),
    ("repetition", np.float32, "row"),
    ("out_ids", np.int32, "row"),
    *state_inputs(),
)


@dataclass
class _Bound:
    fn: cuda.Function
    grid: tuple[int, ...]
    block: tuple[int, ...]
    smem: int
    args: cuda.KernelArgs
    run: cuda.PreparedLaunch  # the launch configuration built once (PDL attribute when on)
    side: bool = False  # runs on the side stream (a concurrent launch of the plan)
    solo: cuda.PreparedLaunch | None = None  # the same launch on the main stream (tools time it alone)


class CudaRunner(StepLogic, HiddenRows, WeightLoading, StateSlots, KvPools, OverlapLaunch, RunnerProbes):
    """The Runner protocol on a CUDA GPU (``backend == "cuda"``).

    ``model`` is an engine.model.LoadedModel. ``max_model_len`` caps the context (default: the
    model's, limited by the KV cache); ``num_blocks`` fixes the KV block count (tests) instead of
    sizing it from free memory; ``use_graphs=False`` runs decode eagerly (the bit-exact check);
    ``state_slots`` fixes a hybrid model's recurrent-state slots (engine.runner_state).
    A model with sliding-window layers keeps their KV in a window pool addressed by each item's
    ``window_table`` (engine.runner_kv, engine.kv_groups): ``window_kv_blocks`` None sizes it for
    an engine of ``max_running`` sequences and ``prefill_chunk_tokens`` prefill tokens a step
    (default: the profile's), N > 0 takes N blocks, 0 keeps one pool (items then need no
    ``window_table``). ``delta_prefill``: build_plan's (tests and benches compare the forms).
    ``defer_warm_up``: the warm-prefix passes' binds and graph captures are left to the engine
    thread (``background_work``, engine.runner_warm) instead of run here (`memra serve`: ready sooner).
    """

    backend = "cuda"

    def __init__(
        self,
        model: Any,
        profile: DeviceProfile | None = None,
        device: int = 0,
        max_model_len: int | None = None,
        num_blocks: int | None = None,
        use_graphs: bool = True,
        builder: KernelBuilder | None = None,
        state_slots: int | None = None,
        window_kv_blocks: int | None = None,
        max_running: int | None = None,
        prefill_chunk_tokens: int | None = None,
        delta_prefill: str = "",
        defer_warm_up: bool = False,
    ):
        t0 = time.perf_counter()
        self.ctx = cuda.Context(device)
        self._ctx_local = threading.local()  # .current: the context is current on that thread
        self._ctx_local.current = True
        self.profile = profile or select(self.ctx.info)
        self.model = model
        dtypes, m = dict(getattr(model, "tensor_dtypes", {})), model
        self.plan: Plan = build_plan(m.graph, m.dims, m.quant, self.profile, dtypes, m.rope_style, delta_prefill=delta_prefill)
        self.use_graphs = use_graphs
        self._pdl = _pdl_enabled(self.profile, self.ctx.info.compute_capability)
        self._resident: dict[Any, int] = {}  # (spec, block, smem) -> blocks resident on the GPU
        self._pdl_warned: set[str] = set()
        self._launch_configs: dict[tuple, Any] = {}  # see _prepared
        log.info("programmatic dependent launch: %s (profile %s programmatic_launch=%s, MEMRA_PDL=%r, cc %s)",
                 "on" if self._pdl else "off", self.profile.name, self.profile.programmatic_launch,
                 env.MEMRA_PDL.get(), self.ctx.info.cc)  # fmt: skip
        self.stream = cuda.Stream()
        # the plan's concurrent launches (tuning decode_graph.fork_linears) run on a side stream,
        # forked from and joined back into the main one by these events (a graph captures the fork)
        self._side = cuda.Stream()
        self._fork_ev, self._join_ev = cuda.Event(timing=False), cuda.Event(timing=False)
        self.block_size = self.plan.block_size
        self._check_memory()
        t1 = time.perf_counter()
        self._load_kernels(builder)
        t2 = time.perf_counter()
        self._upload_weights(cuda)  # the module-level engine.cuda (tests put a fake driver there)
        # the device holds the weights now: unmap the file so its pages leave the resident set
        # (engine.weights: a later raw() maps it again, e.g. for a reference runner on the model)
        model.weights.close()
        t3 = time.perf_counter()
        self._alloc_arena()
        self._alloc_states(cuda, state_slots)
        self._alloc_kv(cuda, max_model_len, num_blocks, window_kv_blocks, max_running, prefill_chunk_tokens)
        self._alloc_inputs()
        self._alloc_overlap(cuda)  # (engine.runner_overlap: launch / collect)
        self._alloc_scratch()
        log.info(  # where a start's time goes (warm HTTP-ready, issue #34)
            "runner ready in %.2f s: context + plan %.2f s, kernels %.2f s, weights %.2f s, buffers %.2f s",
            time.perf_counter() - t0, t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3,
        )  # fmt: skip
        self._tmaps: dict[tuple, int] = {}  # (source, name, box rows[, rows, cols]) -> descriptor address
        self._tmap_pools: list[cuda.DeviceBuffer] = []
        self._graphs: dict[tuple, tuple[cuda.Graph, list[_Bound]]] = {}
        self._eager: dict[tuple, list[_Bound]] = {}
        self._prefill_bound: dict[tuple, list[_Bound]] = {}  # prefill pass shapes, least recent first
        self._head_inputs: list[tuple[str, int, int]] | None = None
        self._pen_count = 0
        # varlen prefill: the plan's prefill attention reads seq_starts, so one pass may hold
        # several sequences (else each pass is one sequence's chunk)
        self._varlen = any(
            a.kind == "input" and a.ref == "seq_starts"
            for st in self.plan.steps
            for la in st.launches.get("prefill", ())
            for a in la.args
        )
        self._tail_attention = has_tail_attention(self.plan)
        self._warm_up(defer_warm_up)

    # ----------------------------------------------------------------------------- setup

    def _check_memory(self) -> None:
        """Every weight (all experts of a MoE model) + the arena + fixed scratch + one KV block must
        fit in free device memory: else one MemraError (out_of_memory) with bytes needed vs free,
        before anything is allocated (engine.weight_memory)."""
        d = self.plan.dims
        kv_block = self.block_size * d["kv_heads"] * d["head_dim"] * 2 * 2 * d["layers"]
        reserve = self.plan.arena_bytes() + sum(sp.fixed for sp in self.plan.scratch) + kv_block
        free, _ = self.ctx.mem_info()
        what = str(getattr(self.model, "path", None) or self.plan.family)
        check_fits(what, plan_weight_bytes(self.plan, self.model.graph), free, reserve)

    def _load_kernels(self, builder: KernelBuilder | None) -> None:
        builder = builder or KernelBuilder(self.profile.arch)
        stats = builder.build_all(kernel_specs(self.plan))
        log.info("kernels: %s", stats.summary())
        self._modules: list[cuda.Module] = []
        self._fns: dict[Any, cuda.Function] = {}
        for k in stats.kernels:
            mod = cuda.Module(k.cubin, k.spec.entry)
            self._modules.append(mod)
            self._fns[k.spec] = mod.function(k.spec.entry)
        self._init_probes(cuda, self._modules)  # (engine.runner_probes: the MEMRA_TRACE buffer)

    def _alloc_arena(self) -> None:
        self.arena = cuda.alloc(self.plan.arena_bytes())
        cuda.memset(self.arena.ptr, 0, self.arena.nbytes)
        offs = self.plan.buffer_offsets()
        self._value_ptr: dict[str, int] = {}
        self._value_rowbytes: dict[str, int] = {}
        for name, v in self.plan.values.items():
            item = ACT_ITEMSIZE[v.dtype]
            self._value_ptr[name] = self.arena.ptr + offs[v.buffer] + v.offset * item
            self._value_rowbytes[name] = v.ld * item

    def _alloc_inputs(self) -> None:
        self._max_rows = max(self.plan.graph_batch_sizes)
        counts = {"token": self.plan.max_tokens, "row": self._max_rows, "row+1": self._max_rows + 1}
        layout, off = {}, 0
        for name, dt, kind in _ROW_INPUTS:
            rows = counts[kind]
            off = (off + 7) // 8 * 8
            layout[name] = (off, dt, rows)
            off += rows * np.dtype(dt).itemsize
        off = (off + 15) // 16 * 16
        self._tables_off = off
        off += self._max_rows * self._table_ld * 4
        off = (off + 15) // 16 * 16
        off = self._window_offsets(off)
        self._pen_off = off
        off = (off + (4 + 3 * PENALTY_CAPACITY) * 4 + 15) // 16 * 16
        self._prep = PrepBlock(self._max_rows, self.plan.values["logits"].width, off)  # token_mask inputs
        total = off + self._prep.nbytes
        self._in_dev = cuda.alloc(total)
        self._in_host = cuda.PinnedBuffer(total)
        self._in_host.bytes[:] = 0
        self._views = {n: self._in_host.view(dt, rows, o) for n, (o, dt, rows) in layout.items()}
        self._in_off = {n: o for n, (o, _, _) in layout.items()}
        self._in_off.update(block_tables=self._tables_off, pen_entries=self._pen_off)
        self._in_off.update(self._prep.offsets)
        self._prep.bind(self._in_host.bytes)
        self._prep_bytes = 0  # bytes of the last packed token_mask inputs
        self._host_rows: list[int] = []  # rows of the last step sampled on the host (logprobs)
        self._window_views()
        self._tables = self._in_host.view(np.int32, self._max_rows * self._table_ld, self._tables_off)
        # host-side bookkeeping that keeps a decode step's Python short: every block-table row holds
        # the sink block past _table_len[r] entries (so a step rewrites only what changed), rows'
        # sampling fields were last written from _row_sampling[r] (frozen params: identity = same
        # values), and the graph bucket of each row count
        self._tables[:] = self._sink_block
        self._table_len = [0] * self._max_rows
        self._row_sampling: list[Any] = [None] * self._max_rows
        self._bucket_of = [
            next((b for b in self.plan.graph_batch_sizes if b >= n), 0) for n in range(self._max_rows + 1)
        ]
        self._pen = self._in_host.view(np.int32, 4 + 3 * PENALTY_CAPACITY, self._pen_off)

    def _alloc_scratch(self) -> None:
        self._scratch: dict[str, cuda.DeviceBuffer] = {}
        for sp in self.plan.scratch:
            buf = cuda.alloc(sp.nbytes(self.max_model_len))
            if sp.fill == "iota":
                cuda.htod(buf.ptr, np.arange(buf.nbytes // 4, dtype=np.int32))
            elif sp.fill == "zero":
                cuda.htod(buf.ptr, np.zeros(buf.nbytes // 4, dtype=np.int32))
            self._scratch[sp.name] = buf

    # ----------------------------------------------------------------------------- binding

    def _tensor_map(self, source: str, name: str, box_rows: int, *shape: int) -> int:
        """Device address of the TMA descriptor of value / weight / scratch ``name`` in boxes of
        ``box_rows`` x 64 (a scratch buffer holds several matrices: ``shape`` = rows, cols), built
        and uploaded once, then reused by every bind."""
        key = (source, name, box_rows, *shape)
        ptr = self._tmaps.get(key)
        if ptr is not None:
            return ptr
        if source == "value":
            v = self.plan.values[name]
            buf = next(b for b in self.plan.buffers if b.name == v.buffer)
            base, rows, cols = self._value_ptr[name], buf.rows or self.plan.max_tokens, v.width
            row_bytes = self._value_rowbytes[name]
        elif source == "scratch":
            (rows, cols), base = shape, self._scratch[name].ptr
            row_bytes = cols * 2
        else:
            w = next(w for w in self.plan.weights if w.key == name)
            base, rows, cols, row_bytes = self._weights[name].ptr, w.rows, w.cols, w.cols * 2
        desc = cuda.tensor_map_bf16(base, rows, cols, row_bytes, box_rows)
        slot = len(self._tmaps) % TMAPS_PER_POOL
        if slot == 0:
            self._tmap_pools.append(cuda.alloc(TMAPS_PER_POOL * cuda.TENSOR_MAP_BYTES))
        ptr = self._tmap_pools[-1].ptr + slot * cuda.TENSOR_MAP_BYTES
        cuda.htod(ptr, desc)
        self._tmaps[key] = ptr
        return ptr

    def _bind(self, launch: Launch, shape: dict[str, int]) -> _Bound:
        values = [self._resolve(a, shape) for a in launch.args]
        args = cuda.KernelArgs([a.ctype for a in launch.args], values)
        fn, grid = self._fns[launch.spec], launch.grid_for(shape)
        if launch.fit_grid:  # a grid-stride kernel: no more blocks (over all of y, z) than fit at once
            others = math.prod(grid[1:])
            grid = (min(grid[0], max(1, self._resident_grid(fn, launch) // others)), *grid[1:])
        pdl = self._pdl_for(launch.spec)
        run = self._prepared(fn, grid, launch.block, launch.smem, self.stream, pdl)
        if not launch.concurrent:
            return _Bound(fn, grid, launch.block, launch.smem, args, run, solo=run)
        side = self._prepared(fn, grid, launch.block, launch.smem, self._side, pdl)
        return _Bound(fn, grid, launch.block, launch.smem, args, side, side=True, solo=run)

    def _prepared(self, fn: Any, grid: tuple, block: tuple, smem: int, stream: Any, pdl: bool) -> Any:
        """The launch configuration, built once per (kernel, geometry, stream): a prefill of a new
        length rebinds every launch, and most keep their grid (so a warm-prefix hit of a new tail
        length does not pay for hundreds of driver structs)."""
        key = (id(fn), grid, tuple(block), smem, id(stream), pdl)
        run = self._launch_configs.get(key)
        if run is None:
            run = self._launch_configs[key] = cuda.PreparedLaunch(fn, grid, block, smem, stream, pdl)
        return run

    def _resident_grid(self, fn: Any, launch: Launch) -> int:
        """The blocks of ``launch``'s kernel resident on the whole GPU at once (at least one per SM)."""
        key = (launch.spec, launch.block, launch.smem)
        if key not in self._resident:
            per_sm = fn.resident_blocks(launch.block[0], launch.smem)
            self._resident[key] = max(per_sm, 1) * self.ctx.info.sm_count
            log.debug("%s: %d resident blocks per SM", launch.spec.entry, per_sm)
        return self._resident[key]

    def _pdl_for(self, spec: Any) -> bool:
        """PDL for this kernel: on, and its source calls pdl_wait() first (a kernel that does not
        is launched plainly, so it never runs ahead of the kernel before it)."""
        if not self._pdl:
            return False
        if not spec.pdl and spec.template not in self._pdl_warned:
            self._pdl_warned.add(spec.template)  # once per template, not per spec
            log.warning("%s kernels do not call pdl_wait() first: launched without PDL", spec.template)
        return spec.pdl

    def _run(self, bound: list[_Bound]) -> None:
        """Launch a bound pass in order. A side launch runs on the side stream, which forked from
        the main one before the launch ahead of its run (so it waits for what that launch waits
        for, not for it); the main stream joins it back before its next launch."""
        joined = True
        for i, b in enumerate(bound):
            if b.side:
                b.run(b.args)
                joined = False
                continue
            if not joined:
                self._join_ev.record(self._side)
                self.stream.wait(self._join_ev)
                joined = True
            if i + 1 < len(bound) and bound[i + 1].side:  # a run of side launches follows this one
                self._fork_ev.record(self.stream)
                self._side.wait(self._fork_ev)
            b.run(b.args)
        if not joined:
            self._join_ev.record(self._side)
            self.stream.wait(self._join_ev)

    # ----------------------------------------------------------------------------- steps

    def _ensure_context(self) -> None:
        """Make the context current on the calling thread once. A thread-local flag, not a thread id:
        ids are reused once a thread ends, and a new engine thread with an old id had no context."""
        if not getattr(self._ctx_local, "current", False):
            self.ctx.make_current()
            self._ctx_local.current = True

    def _upload_inputs(self, rows: int, kind: str = "") -> None:
        nbytes = self._tables_off + rows * self._table_ld * 4
        _call_htod(self._in_dev.ptr, self._in_host.bytes[:nbytes], self.stream)
        self._upload_window(rows, _call_htod)
        if "penalised" in kind:  # penalised, masked_penalised, masked_penalised_lp
            lo, hi = self._pen_off, self._pen_off + (4 + 3 * self._pen_count) * 4
            _call_htod(self._in_dev.ptr + lo, self._in_host.bytes[lo:hi], self.stream)
        if kind.startswith(MASKED):
            lo, hi = self._prep.offset, self._prep.offset + self._prep_bytes
            _call_htod(self._in_dev.ptr + lo, self._in_host.bytes[lo:hi], self.stream)

    def _ids_to_host(self, rows: int) -> None:
        """Queue the copy of the first ``rows`` sampled ids into the pinned out_ids view."""
        cuda.dtoh(self._views["out_ids"][:rows], self._in_dev.ptr + self._in_off["out_ids"], self.stream)

    def _logprobs_to_host(self) -> None:
        """Copy the logprobs kernel's outputs of the last step into their pinned views (and wait)."""
        lo, hi = self._prep.out_range()
        cuda.dtoh(self._in_host.bytes[lo:hi], self._in_dev.ptr + lo, self.stream)
        self.stream.synchronize()

    def read_logits(self, rows: int) -> np.ndarray:
        """The last pass's logits [rows, vocab] as f32 (rows from 0; a prefill's head is row 0, a prompt
        tail's (engine.runner_tail) last row is row tail - 1)."""
        return self.read_value("logits", rows)

    def read_value(self, name: str, rows: int) -> np.ndarray:
        """Rows 0 .. rows - 1 of plan value ``name`` after the last pass, as f32 [rows, width]."""
        v = self.plan.values[name]
        host = np.empty((rows, v.ld), dtype=np.float32 if v.dtype == "f32" else np.uint16)
        self.stream.synchronize()
        cuda.dtoh(host, self._value_ptr[name])
        if host.dtype == np.uint16:
            host = (host.astype(np.uint32) << 16).view(np.float32)
        return host[:, v.offset : v.offset + v.width].astype(np.float32)

    def _graph(
        self, bucket: int, kind: str, short: bool, io: bool = False, groups: tuple = (), verify: bool = False,
        tail: bool = False,
    ) -> cuda.Graph:
        """The decode graph of a bucket / sampling kind / context class; ``io``: it also copies the
        bucket's pinned inputs to the device first and the sampled ids back last (memcpy nodes that
        read / write the pinned host buffer when the graph runs); ``groups``: a hybrid verify pass's,
        ``verify``: a verify pass's short-context launches (engine.ir.VSHORT), ``tail``: a prompt
        tail's pass past short_context (engine.ir.TAIL attention; its seq_starts filled)."""
        key = (bucket, kind, short, io, *((groups,) if groups else ()), *(("verify",) if verify else ()),
               *(("tail",) if tail else ()))  # fmt: skip
        if key not in self._graphs:
            mode = _decode_mode(bucket, self.plan.wide_rows)
            bound = self._bind_pass(mode, bucket, bucket, False, kind, short, groups=groups, verify=verify, tail=tail)
            with self._states_parked(bucket, kind):  # (a hybrid's warm run must not advance its state)
                if io or self.num_state_slots:
                    self._upload_inputs(bucket, kind)
                self._run(bound)  # warm run outside capture (lazy module loading, smem attributes)
                self.stream.synchronize()
            with cuda.capture(self.stream) as graph:
                if io:
                    self._upload_inputs(bucket, kind)
                self._run(bound)
                if io:
                    self._ids_to_host(bucket)
            self._graphs[key] = (graph, bound)  # the bound args must outlive the graph
        return self._graphs[key][0]

    def _captured(self, bound: list[_Bound]) -> cuda.Graph:
        """A CUDA graph of ``bound``'s launches (the caller ran them once eagerly: lazy loading)."""
        with cuda.capture(self.stream) as graph:
            self._run(bound)
        return graph

    # ----------------------------------------------------------------------------- prefill

    def _run_prefill_pass(self, segs: list[tuple[int, StepItem, int, int]]) -> dict[int, int]:
        """One eager prefill pass over several sequences' chunks, then the head on the last row of
        every chunk that ends its item with ``sample`` set. Returns {item index: sampled id}."""
        self.stream.synchronize()  # the previous pass's H2D must have read the pinned inputs
        v = self._views
        ld = self._table_ld
        n = sum(hi - lo for _, _, lo, hi in segs)
        nseq = len(segs)
        tables = self._tables[: nseq * ld].reshape(nseq, ld)
        tables[:] = self._sink_block
        row, max_q = 0, 0
        heads: list[tuple[int, StepItem, int]] = []  # (item index, item, pass row of its last token)
        for s, (idx, it, lo, hi) in enumerate(segs):
            m = hi - lo
            pos = np.arange(it.start_pos + lo, it.start_pos + hi, dtype=np.int64)
            bt = np.asarray(it.block_table, dtype=np.int64)
            v["tokens"][row : row + m] = np.asarray(it.token_ids[lo:hi], dtype=np.int64)
            v["positions"][row : row + m] = pos
            v["slots"][row : row + m] = bt[pos // self.block_size] * self.block_size + pos % self.block_size
            self._fill_window(s, row, it, pos)
            v["seq_starts"][s] = row
            k = min(len(bt), ld)
            tables[s, :k] = bt[:k]
            self._table_len[s] = k
            self._fill_state_prefill(s, it, lo, hi, row)
            if hi == len(it.token_ids) and it.sample:
                heads.append((idx, it, row + m - 1))
            row += m
            max_q = max(max_q, m)
        v["seq_starts"][nseq] = row
        for r, (_, it, _) in enumerate(heads):
            self._fill_sampling(r, it)
        hitems = [it for _, it, _ in heads]
        kind = self._sampling_kind(hitems) if hitems else "greedy"
        self._upload_inputs(nseq, kind)
        self._run_prefill_layers(n, nseq, max_q)
        self._tap_prefill(segs, n)  # (before the head's gather moves rows)
        if not heads:
            self.stream.synchronize()
            return {}
        for r, (_, _, src) in enumerate(heads):  # gather the head rows to 0..k-1 (src >= r, ascending)
            if src != r:
                for _name, ptr, rowbytes in self._head_input_rows():
                    cuda.dtod(ptr + r * rowbytes, ptr + src * rowbytes, rowbytes, self.stream)
        k = len(heads)
        launch_kind = "sample" if kind == "host" else kind
        self._run(self._head_bound(k, launch_kind))
        ids = self._read_ids(k).tolist()
        ids = self._host_sample(hitems, ids, kind)
        return {idx: tok for (idx, _, _), tok in zip(heads, ids, strict=True)}

    # ----------------------------------------------------------------------------- teardown

    def close(self) -> None:
        """Free every device allocation, graph and module of this runner (idempotent)."""
        self.stream.synchronize()
        self._side.synchronize()
        for graph, _ in self._graphs.values():
            graph.destroy()
        self._graphs.clear()
        self._eager.clear()
        self._prefill_bound.clear()
        for buf in (
            list(self._weights.values()) + list(self._scratch.values()) + self._tmap_pools
            + [self.arena, self.kv, self._in_dev, self._ov_prev]
            + ([self.kv_win] if self.kv_win is not None else [])
            + ([self._trace] if self._trace is not None else [])
        ):
            buf.free()
        self._weights.clear()
        self._tmap_pools.clear()
        self._tmaps.clear()
        self._in_host.free()
        self._ov_out.free()
        self._free_states()
        for mod in self._modules:
            mod.unload()
        self._modules.clear()
        self._fns.clear()


def _pdl_enabled(profile: DeviceProfile, compute_capability: tuple[int, int]) -> bool:
    """Programmatic dependent launch: MEMRA_PDL (1/0) if set, else the profile's
    programmatic_launch; never on a device below compute capability 9.0 or with kernels built for
    an arch below sm_90 (their pdl_wait() is compiled out, so an early launch would race)."""
    raw = env.MEMRA_PDL.get().strip().lower()
    if raw in env.TRUE_WORDS:
        want = True
    elif raw in env.FALSE_WORDS:
        want = False
    elif raw == "":
        want = profile.programmatic_launch
    else:
        raise ConfigError(f"environment variable MEMRA_PDL={raw!r}: expected 1 or 0")
    if want and (tuple(compute_capability) < (9, 0) or arch_number(profile.arch) < 90):
        log.warning(
            "programmatic dependent launch needs sm_90+ (device cc %d.%d, profile %s arch %s): off",
            compute_capability[0],
            compute_capability[1],
            profile.name,
            profile.arch,
        )
        return False
    return want


def _call_htod(ptr: int, host: np.ndarray, stream: cuda.Stream) -> None:
    cuda.htod(ptr, host, stream)
