"""CudaRunner's KV memory: the paged cache of the full-attention layers and, for a model with
sliding-window layers, a second pool for those layers with its own block tables and slots
(engine.kv_groups releases its blocks behind the window, so it can be far smaller).

The window pool's size (``window_kv_blocks``): None sizes it automatically
(``kv_groups.auto_window_blocks``: enough that it never runs short under an engine of
``max_running`` sequences and ``prefill_chunk_tokens`` prefill tokens a step, by default the device
profile's), capped at the blocks one pool over every KV layer would get from the same memory (or at
``num_blocks`` when that is fixed), so the full pool never gets fewer blocks than it would without a
window pool; N > 0 takes N blocks; 0 keeps the window layers in the full pool (one pool). A model
without sliding-window layers, or with several windows, has one pool whatever None or 0 says (N > 0
is an error).

Without a window pool every layer's K and V live in one allocation of ``num_blocks + 1`` blocks
(the last one the padding sink), layer by layer, as they always did; the plan's ``window_tables`` /
``window_slots`` inputs (engine.lowering: what a window layer's attention and KV write read) are
then the block tables and slots themselves. With a window pool the window layers' K and V live in
it instead, addressed by each item's ``window_table`` (``StepItem``): the runner fills a second
table block and slot row from it (released entries read as the pool's sink; no kernel reads them).
``KvPools`` is a base class of CudaRunner (engine.runner_cuda), which passes in the engine.cuda
module it drives; must not import CUDA (neither cuda-python nor engine.cuda).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from engine.kv_groups import auto_window_blocks
from engine.types import MemraError, StepItem

log = logging.getLogger("memra.runner_cuda")


def window_layers(plan: Any) -> tuple[int, list[int]]:
    """(window, the layers whose attention has it): the plan's one sliding window, from its attention
    launches' ``window`` param; (0, []) without one. Several windows: a MemraError."""
    by_layer: dict[int, int] = {}
    for st in plan.steps:
        if st.op.op == "attention" and st.layer is not None:
            launches = st.launches.get("decode", ())
            w = int(launches[0].spec.params.get("window", 0)) if launches else 0
            if w:
                by_layer[st.layer] = w
    windows = set(by_layer.values())
    if len(windows) > 1:
        raise MemraError(f"a window KV pool needs one sliding window; the plan has {sorted(windows)}")
    return (windows.pop() if windows else 0), sorted(by_layer)


class KvPools:
    """The KV allocations of CudaRunner (see the module docstring)."""

    def _alloc_kv(
        self,
        cuda: Any,
        max_model_len: int | None,
        kv_blocks: int | None,
        window_blocks: int | None,
        max_running: int | None = None,
        prefill_chunk_tokens: int | None = None,
    ) -> None:
        """Allocate the KV pools (see the module docstring for ``window_blocks``; ``max_running`` and
        ``prefill_chunk_tokens`` are the engine limits an automatic window pool is sized for)."""
        d = self.plan.dims
        per_layer = self.block_size * d["kv_heads"] * d["head_dim"] * 2  # one block of one layer's K (bf16)
        if window_blocks is not None and window_blocks < 0:
            raise MemraError(f"window_kv_blocks must be >= 0 (0: no window pool), got {window_blocks}", param="window_kv_blocks")
        try:
            window, win = window_layers(self.plan) if window_blocks != 0 else (0, [])
        except MemraError:
            if window_blocks is not None:
                raise
            window, win = 0, []  # several windows: one pool by default
        if window_blocks and not win:
            raise MemraError(
                f"window_kv_blocks {window_blocks} (--window-kv-blocks): the model has no sliding-window attention layers",
                param="window_kv_blocks",
            )
        # the layers with attention (a hybrid's linear-attention layers keep no KV)
        kv_layers = sorted({a.layer for st in self.plan.steps for ls in st.launches.values() for la in ls for a in la.args if a.kind == "kv"})
        full = [layer for layer in kv_layers if layer not in win]
        budget = None
        if kv_blocks is None:
            free, _ = self.ctx.mem_info()
            budget = int(free * self.profile.kv_memory_fraction)
        if win and window_blocks is None:
            # never more than the window layers' share: the blocks one pool over every layer would get
            share = int(kv_blocks) if budget is None else budget // (per_layer * 2 * max(1, len(kv_layers)))
            want = auto_window_blocks(
                window,
                self.block_size,
                int(max_running or self.profile.max_running),
                int(prefill_chunk_tokens or self.profile.prefill_chunk_tokens),
            )
            window_blocks = max(1, min(want, share))
        window_blocks = int(window_blocks or 0) if win else 0
        win_bytes = (window_blocks + 1) * per_layer * 2 * len(win) if win else 0
        if budget is not None:
            per_block = per_layer * 2 * max(1, len(full))
            kv_blocks = (budget - win_bytes) // per_block
        assert kv_blocks is not None
        if kv_blocks < 1:
            raise MemraError("not enough free GPU memory for one KV cache block", code="out_of_memory")
        self._kv_layer_bytes = (int(kv_blocks) + 1) * per_layer  # + the padding sink
        self._kv_block_bytes, self._kv_cuda = per_layer, cuda
        self.kv = cuda.alloc(self._kv_layer_bytes * 2 * max(1, len(full)))
        cuda.memset(self.kv.ptr, 0, self.kv.nbytes)
        self._kv_index = {layer: (0, i) for i, layer in enumerate(full)}
        self.kv_window, self.window_kv_blocks, self.kv_win = window, window_blocks, None
        self.kv_full_layers, self.kv_window_layers = full, win  # (benchmarks report each group's bytes)
        if win:
            self._win_layer_bytes = (window_blocks + 1) * per_layer
            self.kv_win = cuda.alloc(win_bytes)
            cuda.memset(self.kv_win.ptr, 0, self.kv_win.nbytes)
            self._kv_index.update({layer: (1, i) for i, layer in enumerate(win)})
            self._win_sink = window_blocks
        self.num_blocks = int(kv_blocks)
        self._sink_block = self.num_blocks  # hidden from the scheduler
        cap = self.num_blocks * self.block_size
        self.max_model_len = min(int(max_model_len or d.get("context", cap)), cap)
        self._table_ld = (self.max_model_len + self.block_size - 1) // self.block_size
        log.info(
            "KV cache: %d blocks of %d tokens for %d layers%s",
            self.num_blocks,
            self.block_size,
            len(full),
            f"; window pool (window {window}): {window_blocks} blocks for {len(win)} layers" if win else "",
        )

    def copy_blocks(self, pairs: Any) -> None:
        """CopyingRunner.copy_blocks (a partial-block prefix hit, engine.partial_blocks): per pair,
        in order on the step stream, one strided copy of the block's K and V in every layer of the
        full pool (``cuda.dtod_rows``: the pool is 2 x layers regions ``_kv_layer_bytes`` apart, a
        block ``per_layer`` bytes at the same offset in each). A window pool's blocks are never
        copied (the engine keeps no partial entries with one)."""
        if self.kv_win is not None:
            raise MemraError("copy_blocks: a runner with a window KV pool does not copy blocks", code="internal_error")
        per, rows = self._kv_block_bytes, 2 * max(1, len(self.kv_full_layers))
        for src, dst in pairs:
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
                raise MemraError(f"copy_blocks: block {src} -> {dst} out of range", code="internal_error")
            base = self.kv.ptr
            self._kv_cuda.dtod_rows(base + dst * per, base + src * per, per, rows, self._kv_layer_bytes, self.stream)

    def _kv_ptr(self, layer: int, ref: str) -> int:
        """The device address of ``layer``'s K (``ref`` "k") or V cache, in its pool."""
        pool, i = self._kv_index[layer]
        idx = 2 * i + (0 if ref == "k" else 1)
        if pool:
            return self.kv_win.ptr + idx * self._win_layer_bytes
        return self.kv.ptr + idx * self._kv_layer_bytes

    # ----- the window pool's inputs (a second table block and slot row in the packed inputs) -----

    def _window_offsets(self, off: int) -> int:
        """Place the window slots and tables at byte ``off`` of the packed inputs (nothing without
        a window pool); returns the end offset. ``_window_views`` makes their views once the block
        is allocated."""
        self._win_off = self._win_end = off
        if not self.window_kv_blocks:
            return off
        self._win_end = (off + self.plan.max_tokens * 4 + 15) // 16 * 16  # the tables' start
        return (self._win_end + self._max_rows * self._table_ld * 4 + 15) // 16 * 16

    def _window_views(self) -> None:
        """The window inputs' host views and their ``_in_off`` names; without a window pool the
        names alias the slots and the block tables."""
        if not self.window_kv_blocks:
            self._in_off["window_slots"] = self._in_off["slots"]
            self._in_off["window_tables"] = self._in_off["block_tables"]
            return
        self._win_slots = self._in_host.view(np.int32, self.plan.max_tokens, self._win_off)
        self._win_tables = self._in_host.view(np.int32, self._max_rows * self._table_ld, self._win_end)
        self._win_tables[:] = self._win_sink
        self._in_off["window_slots"], self._in_off["window_tables"] = self._win_off, self._win_end

    def _upload_window(self, rows: int, htod: Any) -> None:
        """Copy the window slots and the first ``rows`` window tables to the device."""
        if self.window_kv_blocks:
            hi = self._win_end + rows * self._table_ld * 4
            htod(self._in_dev.ptr + self._win_off, self._in_host.bytes[self._win_off : hi], self.stream)

    def _fill_window(self, row: int, slot_at: int, it: StepItem, positions: np.ndarray) -> None:
        """Window table ``row`` and the window slots from ``slot_at`` on, for item ``it``'s
        ``positions`` (no-op without a window pool)."""
        if not self.window_kv_blocks:
            return
        if it.window_table is None:
            raise MemraError(
                f"sequence {it.seq_id}: this runner keeps the window layers' KV in a window pool; the item "
                f"needs a window_table (engine.kv_groups)",
                code="internal_error",
            )
        wt = np.asarray(it.window_table, dtype=np.int64)
        bs, ld, sink = self.block_size, self._table_ld, self._win_sink
        blocks = wt[positions // bs]
        if len(blocks) and (blocks.min() < 0 or blocks.max() >= self.window_kv_blocks):
            raise MemraError(f"sequence {it.seq_id}: window_table {list(wt)} does not hold its positions", code="internal_error")
        self._win_slots[slot_at : slot_at + len(positions)] = blocks * bs + positions % bs
        table = self._win_tables[row * ld : (row + 1) * ld]
        k = min(len(wt), ld)
        table[:k] = np.where((wt[:k] < 0) | (wt[:k] >= self.window_kv_blocks), sink, wt[:k])
        table[k:] = sink

    def _pad_window(self, row: int) -> None:
        """A padding row: its window slot and table at the window pool's sink."""
        if self.window_kv_blocks:
            self._win_slots[row] = self._win_sink * self.block_size
            self._win_tables[row * self._table_ld : (row + 1) * self._table_ld] = self._win_sink
